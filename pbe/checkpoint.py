"""Checkpoints that never unpickle: safetensors weights plus a JSON sidecar that rebuilds the model.

``save(model, "out/model", meta)`` writes ``out/model.safetensors`` and ``out/model.json``;
``load("out/model")`` (or the directory, or either file) returns the model and its metadata.
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

    The sidecar records the architecture (from ``pbe.models.create``) unless `meta` gives one.
    """
    stem = _stem(path) if Path(path).suffix in (WEIGHTS, SIDECAR) else Path(path)
    if stem.is_dir():
        stem = stem / "model"
    spec = getattr(model, "pbe_spec", None)
    sidecar = {"format": "pbe-checkpoint-1", "architecture": spec, "toolkit_version": toolkit_version()}
    sidecar.update(meta or {})
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
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


def load(path: str | Path, device="cpu", architecture: dict | None = None) -> tuple[nn.Module, dict]:
    """Rebuild a model from its sidecar and load its weights; returns ``(model, meta)``.

    For a legacy ``.pt`` state dict pass ``architecture={"name": ..., "num_classes": ..., ...}``.
    """
    path = Path(path)
    if path.suffix in (".pt", ".pth"):
        meta = {"architecture": architecture}
        if architecture is None:
            raise PBEError(f"{path} is a bare state dict; pass architecture={{'name': 'preact_resnet18', "
                           "'num_classes': 10, ...} (CLI: --arch JSON) to rebuild it")
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - any failure means an unusable file
            raise PBEError(f"cannot read {path} as a weights-only state dict: {err}") from err
        if isinstance(state, dict) and "state_dict" in state:
            state = state["state_dict"]
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
        if not architecture:
            raise PBEError(f"{stem.with_suffix(SIDECAR)} names no architecture; pass architecture=")
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
    bad = [k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        raise PBEError(f"weights in {path} are not finite (NaN or inf in {bad[:3]}); the model is broken, "
                       "retrain or restore it")
    model = models.create(name, classes, channels, **spec)
    model.load_state_dict(state)
    return model.to(device).eval(), meta


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
