"""Checkpoints that never unpickle: safetensors weights plus a JSON sidecar that rebuilds the model.

``save(model, "out/model", meta)`` writes ``out/model.safetensors`` and ``out/model.json``;
``load("out/model")`` (or the directory, or either file) returns the model and its metadata. A model of
your own (not made by ``pbe.models.create``) is saved the same way and loaded into a module you build:
``load("out/model", model=MyNet())``.
A legacy ``.pt`` state dict is read with ``torch.load(weights_only=True)`` only.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from pbe import models, rundir
from pbe.utils import PBEError, atomic_path, regular_file, toolkit_version, write_json

WEIGHTS, SIDECAR = ".safetensors", ".json"


def _stem(path: str | Path) -> Path:
    path = Path(path)
    if path.is_dir():
        found = sorted(path.glob(f"*{WEIGHTS}"))
        if (path / f"model{WEIGHTS}").exists():
            return path / "model"
        if len(found) == 1:
            return found[0].with_suffix("")
        raise PBEError(f"{path} holds {len(found)} .safetensors files; name the one to load")
    return path.with_suffix("") if path.suffix in (WEIGHTS, SIDECAR) else path


def save(model: nn.Module, path: str | Path, meta: dict | None = None) -> Path:
    """Write weights and sidecar atomically; returns the weights path.

    The sidecar records the architecture (from ``pbe.models.create``) unless `meta` gives one. A module
    that ``pbe.models.create`` did not make (your own) has none: its weights are stored all the same, the
    sidecar names its class, and ``load(path, model=YourNet())`` loads them into a module you build.

    Arguments:
        model: the module whose ``state_dict`` (tensors only) is written.
        path: ``out/model`` (writes ``out/model.safetensors`` and ``out/model.json``), either file, or a folder.
        meta: more entries for the sidecar (JSON-serialisable).
    """
    if not isinstance(model, nn.Module):
        raise PBEError(f"save: the model must be a torch.nn.Module, got a {type(model).__qualname__}")
    stem = _stem(path) if Path(path).suffix in (WEIGHTS, SIDECAR) else Path(path)
    if stem.is_dir():
        stem = stem / "model"
    spec = getattr(model, "pbe_spec", None)
    sidecar = {"format": "pbe-checkpoint-1", "architecture": spec, "toolkit_version": toolkit_version()}
    if spec is None:
        sidecar["module"] = f"{type(model).__module__}.{type(model).__qualname__}"
    sidecar.update(meta or {})
    state = model.state_dict()
    odd = [k for k, v in state.items() if not isinstance(v, torch.Tensor)]
    if odd:
        raise PBEError(f"save: the model's state holds non-tensor entries ({odd[:3]}, from get_extra_state); "
                       "safetensors stores tensors only: keep that state in buffers, or outside the model")
    # copies: tensors that share memory (tied weights) are each written whole
    state = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()}
    with atomic_path(stem.with_suffix(WEIGHTS)) as tmp:
        save_file(state, str(tmp), metadata={"format": "pt"})
    write_json(stem.with_suffix(SIDECAR), sidecar)
    return stem.with_suffix(WEIGHTS)


def read_meta(path: str | Path) -> dict:
    side = _stem(path).with_suffix(SIDECAR)
    if not side.exists():
        raise PBEError(f"sidecar {side} not found; it records the architecture needed to rebuild the model")
    try:
        return json.loads(regular_file(side, "sidecar").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise PBEError(f"sidecar {side} is not valid JSON: {err}") from err


def load(path: str | Path, device="cpu", architecture: dict | None = None,
         model: nn.Module | None = None) -> tuple[nn.Module, dict]:
    """Rebuild a model from its sidecar and load its weights; returns ``(model, meta)``. Never unpickles.

    Arguments:
        path: what ``save`` wrote (``out/model``, either file, or the folder), or a legacy ``.pt`` state dict
            (read with ``torch.load(weights_only=True)``).
        device: where the returned model lives.
        architecture: ``{"name": ..., "num_classes": ..., ...}`` of ``pbe.models.create``, for a legacy ``.pt``
            (or to override the sidecar's).
        model: a module you built, of the saved model's architecture, to load the weights into (in place) instead
            of rebuilding one: for a model that ``pbe.models.create`` did not make. Parameter and buffer names
            and shapes must match; every difference is listed.
    """
    path = Path(path)
    if model is not None and architecture is not None:
        raise PBEError("load: pass model= (a module you built) or architecture= (one of pbe.models), not both")
    if model is not None and not isinstance(model, nn.Module):
        raise PBEError(f"load: model= must be a torch.nn.Module you built, got a {type(model).__qualname__}")
    if path.suffix in (".pt", ".pth"):
        meta = {"architecture": architecture}
        if architecture is None and model is None:
            raise PBEError(f"{path} is a bare state dict; pass architecture={{'name': 'preact_resnet18', "
                           "'num_classes': 10, ...} (CLI: --arch JSON) to rebuild it, or model= a module you built")
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - any failure means an unusable file
            raise PBEError(f"cannot read {path} as a weights-only state dict: {err}") from err
        if isinstance(state, dict) and "state_dict" in state:
            state = state["state_dict"]
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise PBEError(f"{path} holds a {type(state).__qualname__}, not a state dict of tensors")
    else:
        stem = _stem(path)
        rundir.verify(stem.parent)  # a run folder of the CLI: its files must be the ones its manifest lists
        meta = read_meta(stem)
        weights = regular_file(stem.with_suffix(WEIGHTS), "weights")
        try:
            state = load_file(str(weights))
        except (SafetensorError, OSError) as err:
            raise PBEError(f"{weights} is not a readable safetensors file: {err}") from err
        architecture = architecture or meta.get("architecture")
        if not architecture and model is None:
            made = f" (the saved model is a {meta['module']}, not one of pbe.models)" if meta.get("module") else ""
            raise PBEError(f"{stem.with_suffix(SIDECAR)} names no architecture{made}; build the module yourself "
                           "and load the weights into it: pbe.load(path, model=MyNet(...)) (the command line "
                           "rebuilds only models of pbe.models), or pass architecture=")
    if model is not None:
        _fits(model, state, path)
        _finite(state, path)
        model.load_state_dict(state)
        return model.to(device).eval(), meta
    if not isinstance(architecture, dict) or "name" not in architecture or "num_classes" not in architecture:
        raise PBEError(f"the architecture of {path} must be a dict with at least name and num_classes, got "
                       f"{architecture!r}")
    spec = dict(architecture)
    name, classes, channels = spec.pop("name"), spec.pop("num_classes"), spec.pop("in_channels", 3)
    with torch.device("meta"):  # shapes first: a sidecar asking for a huge model allocates nothing
        shapes = {k: tuple(v.shape) for k, v in models.create(name, classes, channels, **spec).state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state.items()}
    if shapes != got:
        wrong = sorted(set(shapes) ^ set(got)) or [k for k in shapes if shapes[k] != got[k]]
        raise PBEError(f"weights in {path} do not fit the architecture {architecture} (first differences: "
                       f"{wrong[:3]}); the sidecar and the weights are of different models")
    _finite(state, path)
    model = models.create(name, classes, channels, **spec)
    model.load_state_dict(state)
    return model.to(device).eval(), meta


def _finite(state: dict, path: Path) -> None:
    bad = [k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        raise PBEError(f"weights in {path} are not finite (NaN or inf in {bad[:3]}); the model is broken, "
                       "retrain or restore it")


def _listed(items: list[str], first: int = 5) -> str:
    return ", ".join(items[:first]) + (f" and {len(items) - first} more" if len(items) > first else "")


def _fits(model: nn.Module, state: dict, path: Path) -> None:
    """Refuse weights whose parameter and buffer names or shapes differ from `model`'s, listing them."""
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state.items()}
    problems = []
    missing, unexpected = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    shapes = [f"{k} {list(got[k])} in the file, {list(want[k])} in the model" for k in want
              if k in got and got[k] != want[k]]
    if missing:
        problems.append(f"missing from the file: {_listed(missing)}")
    if unexpected:
        problems.append(f"not in the model: {_listed(unexpected)}")
    if shapes:
        problems.append(f"other shapes: {_listed(shapes)}")
    if problems:
        raise PBEError(f"the weights in {path} do not fit the {type(model).__qualname__} passed as model=: "
                       f"{'; '.join(problems)}; build it with the architecture and sizes of the saved model")


# ---- nested state (training checkpoints): tensors in safetensors, the rest as JSON in its metadata
_TENSOR, _TUPLE, _PAIRS, _ARRAY = "__tensor__", "__tuple__", "__pairs__", "__ndarray__"


def _encode(obj, tensors: dict, prefix: str):
    if isinstance(obj, torch.Tensor):
        tensors[prefix] = obj.detach().cpu().contiguous()
        return {_TENSOR: prefix}
    if isinstance(obj, np.ndarray):
        tensors[prefix] = torch.from_numpy(np.ascontiguousarray(obj))
        return {_ARRAY: prefix}
    if isinstance(obj, (list, tuple)):
        items = [_encode(v, tensors, f"{prefix}.{i}") for i, v in enumerate(obj)]
        return {_TUPLE: items} if isinstance(obj, tuple) else items
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: _encode(v, tensors, f"{prefix}.{k}") for k, v in obj.items()}
        return {_PAIRS: [[k, _encode(v, tensors, f"{prefix}.{k}")] for k, v in obj.items()]}
    if isinstance(obj, (np.integer, np.floating)):
        return obj.item()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot store {type(obj).__name__} in a state file")


def _decode(obj, tensors: dict):
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if _TENSOR in obj:
            return tensors[obj[_TENSOR]]
        if _ARRAY in obj:
            return tensors[obj[_ARRAY]].numpy()
        if _TUPLE in obj:
            return tuple(_decode(v, tensors) for v in obj[_TUPLE])
        if _PAIRS in obj:
            return {k: _decode(v, tensors) for k, v in obj[_PAIRS]}
        return {k: _decode(v, tensors) for k, v in obj.items()}
    return obj


def save_state(path: str | Path, state: dict) -> None:
    """Write a nested dict of tensors, arrays, numbers and strings to one safetensors file, atomically
    (the non-tensor part travels as JSON in the file's metadata): no pickle, one file, one rename."""
    tensors: dict = {}
    tree = _encode(state, tensors, "s")
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pbe-state-1", "tree": json.dumps(tree)})


def load_state(path: str | Path) -> dict:
    """Read a file written by ``save_state``."""
    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata() or {}
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    except (SafetensorError, OSError) as err:
        raise PBEError(f"{path} is not a readable state file: {err}; delete it to start over") from err
    if meta.get("format") != "pbe-state-1":
        raise PBEError(f"{path} is not a pbe state file (format {meta.get('format')!r}); delete it to start over")
    return _decode(json.loads(meta["tree"]), tensors)
