"""Datasets as one uint8 tensor in memory, a loader registry, and batched augmentation.

`load(name, root, split)` returns an `ImageDataset`: images uint8 (N, C, H, W), labels int64 (N,).
Nothing is downloaded unless the caller opts in (`download` argument, `--download` flag). Decoded image
trees are cached as `.npy` under `$PBE_CACHE` (default `~/.cache/pbe`), keyed by a hash of the source
files, so a second load is fast.
"""
from __future__ import annotations

import gzip
import hashlib
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from pbe.registry import Registry
from pbe.utils import PBEError, atomic_path, regular_file

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp")
CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


@dataclass
class ImageDataset:
    """Images uint8 (N, C, H, W) in [0, 255] and int64 labels, held in memory."""

    images: torch.Tensor
    labels: torch.Tensor
    classes: list[str]
    name: str = "dataset"
    flip: bool = True  # horizontal flip is a valid augmentation for this data
    source: str = ""

    def __post_init__(self) -> None:
        validate(self)

    @classmethod
    def from_tensors(cls, images, labels, classes: list[str] | int | None = None, *, name: str = "tensors",
                     flip: bool = True) -> "ImageDataset":
        """An ImageDataset from your own tensors (or NumPy arrays), e.g. those of a ``TensorDataset``:
        ``ImageDataset.from_tensors(*tensor_dataset.tensors, classes=10)``.

        Arguments:
            images: (N, C, H, W) with C 1 or 3 (or (N, H, W) grey), uint8 in [0, 255] or float in [0, 1]
                (floats are rounded to uint8); not standardised: a model that normalises its inputs
                outside needs ``pbe.models.Normalize`` in front (see there).
            labels: N integer class ids.
            classes: the class names, or their number (names "0", "1", ...); default: 0 to the largest label.
            name: what messages and reports call the data.
            flip: whether a horizontal flip is a valid augmentation (False for digits, text, traffic signs).
        """
        x = torch.as_tensor(np.asarray(images) if not isinstance(images, torch.Tensor) else images)
        y = torch.as_tensor(np.asarray(labels) if not isinstance(labels, torch.Tensor) else labels)
        x, y = x.detach().cpu(), y.detach().cpu()
        if x.dim() == 3:
            x = x[:, None]
        if x.dim() != 4:
            raise PBEError(f"{name}: images must be (N, C, H, W) (or (N, H, W) grey), got shape {tuple(x.shape)}")
        if x.shape[1] not in (1, 3) and x.shape[3] in (1, 3):
            raise PBEError(f"{name}: images of shape {tuple(x.shape)} look channels-last (N, H, W, C); pass "
                           "images.permute(0, 3, 1, 2) (NumPy: images.transpose(0, 3, 1, 2))")
        if x.is_floating_point():
            if not bool(torch.isfinite(x).all()):
                raise PBEError(f"{name}: images hold NaN or inf")
            lo, hi = (float(x.min()), float(x.max())) if x.numel() else (0.0, 0.0)
            if lo < 0 or hi > 1:
                hint = ("they look like 0-255 values: divide them by 255" if lo >= 0 and hi <= 255 else
                        "they look standardised: undo the normalisation (x * std + mean) and put it inside the "
                        "model with pbe.models.Normalize")
                raise PBEError(f"{name}: float images must be in [0, 1], got values in [{lo:.3g}, {hi:.3g}]; {hint}")
            x = x.mul(255).round().to(torch.uint8)
        elif x.dtype != torch.uint8:
            raise PBEError(f"{name}: images must be uint8 in [0, 255] or float in [0, 1], got {x.dtype}")
        if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool or y.dim() != 1:
            raise PBEError(f"{name}: labels must be a 1-D tensor of integer class ids, got {y.dtype} "
                           f"{tuple(y.shape)}")
        y = y.to(torch.int64)
        if len(y) != len(x):
            raise PBEError(f"{name}: {len(x)} images but {len(y)} labels")
        if classes is None:
            classes = int(y.max()) + 1 if len(y) else 0
        if isinstance(classes, int) and not isinstance(classes, bool):
            classes = [str(i) for i in range(classes)]
        if isinstance(classes, (str, bytes, bool)) or not hasattr(classes, "__iter__"):
            raise PBEError(f"{name}: classes must be a list of class names or their number, got {classes!r}")
        return cls(x.contiguous(), y, [str(c) for c in classes], name, flip=flip, source="tensors")

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return tuple(self.images.shape[1:])  # type: ignore[return-value]

    def subset(self, indices) -> "ImageDataset":
        idx = torch.as_tensor(indices, dtype=torch.long)
        return ImageDataset(self.images[idx], self.labels[idx], self.classes, self.name, self.flip, self.source)

    def floats(self) -> torch.Tensor:
        """All images as float32 in [0, 1]."""
        return self.images.float().div_(255)

    def summary(self) -> dict:
        counts = torch.bincount(self.labels, minlength=self.num_classes).tolist()
        return {"name": self.name, "size": len(self), "shape": list(self.image_shape),
                "classes": self.classes, "per_class": counts, "source": self.source}


def validate(ds: ImageDataset) -> None:
    """Check types, shapes and label range; say what does not fit."""
    x, y = ds.images, ds.labels
    if not isinstance(x, torch.Tensor) or x.dtype != torch.uint8 or x.dim() != 4:
        raise PBEError(f"{ds.name}: images must be a uint8 tensor (N, C, H, W), got "
                       f"{getattr(x, 'dtype', type(x))} with shape {tuple(getattr(x, 'shape', ()))}")
    if x.shape[1] not in (1, 3):
        raise PBEError(f"{ds.name}: expected 1 or 3 channels in dimension 1, got shape {tuple(x.shape)}; "
                       "images must be channels-first (N, C, H, W)")
    if not isinstance(y, torch.Tensor) or y.dtype != torch.int64 or y.shape != (x.shape[0],):
        raise PBEError(f"{ds.name}: labels must be int64 of shape ({x.shape[0]},), got "
                       f"{getattr(y, 'dtype', type(y))} {tuple(getattr(y, 'shape', ()))}")
    if len(ds.classes) < 2:
        raise PBEError(f"{ds.name}: {len(ds.classes)} class; a classifier (and a backdoor target) needs at least 2")
    if len(y) and (int(y.min()) < 0 or int(y.max()) >= len(ds.classes)):
        raise PBEError(f"{ds.name}: labels span [{int(y.min())}, {int(y.max())}] but there are "
                       f"{len(ds.classes)} classes")


# ---------------------------------------------------------------- registry
Loader = Callable[..., ImageDataset]
DATASETS: Registry[Loader] = Registry("dataset")
PATH_SCHEMES = ("imagefolder:<path>", "npz:<path>")


def register(name: str) -> Callable[[Loader], Loader]:
    """Decorator: ``@register("mydata")`` on ``loader(root, split, download=False, **kw) -> ImageDataset``."""
    return DATASETS.register(name)


def available() -> list[str]:
    return DATASETS.available() + list(PATH_SCHEMES)


def load(name: str, root: str | os.PathLike | None = None, split: str = "train",
         download: bool = False, **kwargs) -> ImageDataset:
    """Load a dataset by registry name, e.g. ``load("cifar10", root="data/cifar10", split="test")``."""
    if split not in ("train", "test"):
        raise PBEError(f"split must be 'train' or 'test', got {split!r}")
    if name.startswith("imagefolder:"):
        return load_imagefolder(name.split(":", 1)[1], split, **kwargs)
    if name.startswith("npz:"):
        return load_npz_dir(name.split(":", 1)[1], split, **kwargs)
    if name not in DATASETS:
        raise PBEError(f"unknown dataset {name!r}; available: {', '.join(available())}")
    if name != "digits" and root is None:
        raise PBEError(f"dataset {name!r} needs a root folder (--data-root); 'digits' needs none")
    return DATASETS.get(name)(root=None if root is None else Path(root), split=split, download=download, **kwargs)


def _missing(name: str, looked: list[Path], how: str) -> PBEError:
    where = "\n  ".join(str(p) for p in looked)
    return PBEError(f"{name} not found; looked in:\n  {where}\n{how}")


# ---------------------------------------------------------------- digits (built in)
@register("digits")
def load_digits(root=None, split="train", download=False, test_fraction: float = 0.2) -> ImageDataset:
    """scikit-learn's 8x8 digits (1,797 images, values 0..16) scaled to uint8; fixed stratified split."""
    from sklearn.datasets import load_digits as sk_digits
    from sklearn.model_selection import train_test_split

    d = sk_digits()
    images = np.round(d.images * (255.0 / 16.0)).astype(np.uint8)[:, None]
    idx_train, idx_test = train_test_split(np.arange(len(d.target)), test_size=test_fraction,
                                           random_state=0, stratify=d.target)
    idx = idx_train if split == "train" else idx_test
    return ImageDataset(torch.from_numpy(images[idx]), torch.from_numpy(d.target[idx].astype(np.int64)),
                        [str(i) for i in range(10)], "digits", flip=False, source="sklearn.datasets.load_digits")


# ---------------------------------------------------------------- cifar10
class _ArrayUnpickler(pickle.Unpickler):
    """Unpickler that only rebuilds plain containers and NumPy arrays (CIFAR batches need no more)."""

    ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
               ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "scalar"),
               ("numpy._core.multiarray", "scalar"), ("_codecs", "encode")}

    def find_class(self, module, name):
        if (module, name) not in self.ALLOWED:
            raise PBEError(f"refusing to unpickle {module}.{name}: a CIFAR batch holds only arrays")
        return super().find_class(module, name)


@register("cifar10")
def load_cifar10(root: Path, split="train", download=False) -> ImageDataset:
    """torchvision's ``cifar-10-batches-py`` layout, or an ImageFolder tree (train/, test/)."""
    candidates = [root / "cifar-10-batches-py", root]
    for c in candidates:
        if (c / "data_batch_1").exists():
            return _cifar_batches(c, split)
    if (root / split).is_dir():
        ds = load_imagefolder(root, split, expected_classes=10)
        ds.name = "cifar10"
        return ds
    if download:
        import torchvision
        torchvision.datasets.CIFAR10(str(root), train=split == "train", download=download)
        return _cifar_batches(root / "cifar-10-batches-py", split)
    raise _missing("CIFAR-10", candidates + [root / split],
                   "Get it with `pbe data --dataset cifar10 --data-root DIR --download` (torchvision), "
                   "or point --data-root at an ImageFolder tree with train/<class>/ and test/<class>/.")


def _cifar_batches(folder: Path, split: str) -> ImageDataset:
    files = [f"data_batch_{i}" for i in range(1, 6)] if split == "train" else ["test_batch"]
    xs, ys = [], []
    for f in files:
        with open(folder / f, "rb") as fh:
            entry = _ArrayUnpickler(fh, encoding="latin1").load()
        xs.append(np.asarray(entry["data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
        ys.append(np.asarray(entry.get("labels", entry.get("fine_labels")), dtype=np.int64))
    return ImageDataset(torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys)),
                        CIFAR10_CLASSES, "cifar10", source=str(folder))


# ---------------------------------------------------------------- mnist
def _read_idx(path: Path) -> np.ndarray:
    raw = gzip.open(path).read() if path.suffix == ".gz" else path.read_bytes()
    ndim = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


@register("mnist")
def load_mnist(root: Path, split="train", download=False) -> ImageDataset:
    """``mnist_{train,test}.npz`` (keys images, labels) or torchvision's ``MNIST/raw`` IDX files."""
    npz = root / f"mnist_{split}.npz"
    if npz.exists():
        ds = _npz(npz, [str(i) for i in range(10)], "mnist")
        ds.flip = False
        return ds
    prefix = "train" if split == "train" else "t10k"
    for raw in (root / "MNIST" / "raw", root / "raw", root):
        for suffix in ("", ".gz"):
            img, lab = raw / f"{prefix}-images-idx3-ubyte{suffix}", raw / f"{prefix}-labels-idx1-ubyte{suffix}"
            if img.exists() and lab.exists():
                x = torch.from_numpy(_read_idx(img).copy())[:, None]
                y = torch.from_numpy(_read_idx(lab).astype(np.int64))
                return ImageDataset(x, y, [str(i) for i in range(10)], "mnist", flip=False, source=str(raw))
    if download:
        import torchvision
        torchvision.datasets.MNIST(str(root), train=split == "train", download=download)
        return load_mnist(root, split)
    raise _missing("MNIST", [npz, root / "MNIST" / "raw"],
                   "Get it with `pbe data --dataset mnist --data-root DIR --download` (torchvision).")


# ---------------------------------------------------------------- gtsrb
@register("gtsrb")
def load_gtsrb(root: Path, split="train", download=False, image_size: int = 32) -> ImageDataset:
    """``gtsrb32_{train,test}.npz`` or torchvision's GTSRB layout (resized to image_size)."""
    classes = [str(i) for i in range(43)]
    npz = root / f"gtsrb32_{split}.npz"
    if npz.exists():
        ds = _npz(npz, classes, "gtsrb")
        ds.flip = False  # traffic signs are not mirror-symmetric
        return ds
    root = root.resolve()
    base = root / "gtsrb" / "GTSRB" if (root / "gtsrb").exists() else root / "GTSRB"
    if split == "train" and (base / "Training").is_dir():
        files = sorted((base / "Training").glob("*/*.ppm"))
        labels = [int(p.parent.name) for p in files]
    elif split == "test" and (base / "Final_Test" / "Images").is_dir():
        csv = next((base.parent).glob("GT-final_test.csv"), None) or next(base.rglob("GT-final_test.csv"), None)
        if csv is None:
            raise PBEError(f"GTSRB test labels GT-final_test.csv not found under {base.parent}")
        rows = [r.split(";") for r in csv.read_text().splitlines()[1:] if r]
        files = [base / "Final_Test" / "Images" / r[0] for r in rows]
        labels = [int(r[-1]) for r in rows]
    elif download:
        import torchvision
        torchvision.datasets.GTSRB(str(root), split=split, download=download)
        return load_gtsrb(root, split, image_size=image_size)
    else:
        raise _missing("GTSRB", [npz, base / "Training", base / "Final_Test"],
                       "Get it with `pbe data --dataset gtsrb --data-root DIR --download` (torchvision), "
                       "or provide gtsrb32_train.npz / gtsrb32_test.npz (keys images, labels).")
    x = _cached_decode(files, image_size)
    ds = ImageDataset(x, torch.tensor(labels, dtype=torch.int64), classes, "gtsrb", flip=False, source=str(base))
    return ds


# ---------------------------------------------------------------- user data
# The class list of a user dataset comes from one place for both splits (the training split's, or
# the npz's own `classes`), so that a label id means the same class in training and in testing.
def _npz_arrays(path: Path) -> tuple[np.ndarray, np.ndarray, list[str] | None]:
    try:
        with np.load(regular_file(path, "npz dataset"), allow_pickle=False) as f:
            if "images" not in f or "labels" not in f:
                raise PBEError(f"{path}: an npz dataset needs the keys 'images' and 'labels', found {sorted(f.keys())}")
            images, labels = f["images"], f["labels"]
            classes = [str(c) for c in f["classes"].tolist()] if "classes" in f else None
    except (ValueError, OSError, EOFError) as err:  # zip errors, object arrays (pickles are refused)
        raise PBEError(f"{path} is not a readable npz of plain arrays ({err})") from err
    if labels.dtype.kind not in "iu" or labels.ndim != 1:
        raise PBEError(f"{path}: labels must be a 1-D integer array (class ids), got {labels.dtype} {labels.shape}")
    if len(labels) == 0:
        raise PBEError(f"{path} holds no images")
    return images, labels, classes


def _npz(path: Path, classes: list[str] | None, name: str) -> ImageDataset:
    images, labels, own = _npz_arrays(path)
    if images.dtype != np.uint8:
        raise PBEError(f"{path}: images must be uint8 in [0, 255], got {images.dtype}")
    if images.ndim == 3:
        images = images[..., None]
    if images.ndim != 4 or images.shape[-1] not in (1, 3) or images.shape[0] != len(labels):
        raise PBEError(f"{path}: images must be (N, H, W, C) with C in (1, 3) and N = {len(labels)} labels, "
                       f"got {images.shape}")
    classes = own or classes or [str(i) for i in range(int(labels.max()) + 1)]
    x = torch.from_numpy(np.ascontiguousarray(images.transpose(0, 3, 1, 2)))
    return ImageDataset(x, torch.from_numpy(labels.astype(np.int64)), classes, name, source=str(path))


def _npz_file(p: Path, split: str) -> Path:
    if p.is_dir():
        found = sorted(p.glob(f"*{split}*.npz"))
        if len(found) != 1:
            raise PBEError(f"expected exactly one '*{split}*.npz' in {p}, found {[f.name for f in found]}")
        return found[0]
    return p


def load_npz_dir(path: str | os.PathLike, split: str = "train") -> ImageDataset:
    """``npz:<path>``: a file, or a folder holding ``*{split}*.npz``, with keys images (N,H,W,C), labels
    (integer class ids) and optionally classes (their names). Without `classes`, the class list is
    ``0 .. max label`` of the training file, for both splits."""
    p = Path(path)
    classes = None
    if p.is_dir() and split == "test":
        _, train_labels, classes = _npz_arrays(_npz_file(p, "train"))
        classes = classes or [str(i) for i in range(int(train_labels.max()) + 1)]
    return _npz(_npz_file(p, split), classes, f"npz:{path}")


def _class_folders(folder: Path) -> list[str]:
    return sorted(d.name for d in folder.iterdir() if d.is_dir() and not d.name.startswith("."))


def load_imagefolder(path: str | os.PathLike, split: str = "train", image_size: int | None = None,
                     expected_classes: int | None = None) -> ImageDataset:
    """``imagefolder:<path>``: ``path/train/<class>/*`` and ``path/test/<class>/*``.

    The training split's class folders, in sorted order, are the label ids of both splits; a test split
    with a class the training split lacks, or without one of its classes, and an empty class folder,
    are errors. Decoding is batched and cached; a file that does not decode is named.
    """
    root = Path(path).resolve()
    if not (root / "train").is_dir() or not (root / "test").is_dir():
        raise PBEError(f"image folder {root} needs the subfolders train/<class>/ and test/<class>/ (found "
                       f"{_class_folders(root) if root.is_dir() else 'no folder'}); a single folder would be "
                       "tested on its own training images")
    classes = _class_folders(root / "train")
    if len(classes) < 2:
        raise PBEError(f"{root / 'train'} holds {len(classes)} class folder(s); a classifier needs at least 2")
    if expected_classes is not None and len(classes) != expected_classes:
        raise PBEError(f"{root / 'train'} has {len(classes)} class folders, expected {expected_classes}: {classes}")
    folder = root / split
    here = _class_folders(folder)
    if here != classes:
        raise PBEError(f"{folder} has the class folders {here}, the training split {classes}: the label ids "
                       "would shift between the splits; give both splits the same class folders")
    files, labels = [], []
    for k, c in enumerate(classes):
        fs = sorted(f for f in (folder / c).iterdir() if f.suffix.lower() in IMAGE_SUFFIXES)
        if not fs:
            raise PBEError(f"class folder {folder / c} holds no images ({', '.join(IMAGE_SUFFIXES)})")
        files += fs
        labels += [k] * len(fs)
    x = _cached_decode(files, image_size)
    return ImageDataset(x, torch.tensor(labels, dtype=torch.int64), classes, f"imagefolder:{path}",
                        source=str(folder))


# ---------------------------------------------------------------- decoding and cache
def cache_dir() -> Path:
    return Path(os.environ.get("PBE_CACHE", Path.home() / ".cache" / "pbe"))


def _source_key(files: list[Path], image_size: int | None) -> str:
    """Hash of the (absolute) paths, sizes and modification times, so a changed source re-decodes."""
    h = hashlib.sha256(f"v1 size={image_size}".encode())
    for f in files:
        st = f.stat()
        h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:24]


def _cached_decode(files: list[Path], image_size: int | None) -> torch.Tensor:
    key = _source_key(files, image_size)
    cached = cache_dir() / f"images-{key}.npy"
    if cached.exists():
        try:
            return torch.from_numpy(np.load(cached, allow_pickle=False))
        except (ValueError, OSError):
            cached.unlink()  # a damaged cache is rebuilt, never trusted
    x = decode_images(files, image_size)
    try:
        with atomic_path(cached) as tmp:
            with open(tmp, "wb") as fh:
                np.save(fh, x.numpy(), allow_pickle=False)
    except OSError:
        pass  # a read-only home still loads, only slower
    return x


def decode_images(files: list[Path], image_size: int | None = None, chunk: int = 4096) -> torch.Tensor:
    """Decode image files to uint8 (N, C, H, W); JPEGs go through batched ``decode_jpeg``."""
    import warnings

    import torchvision.transforms.functional as TF
    with warnings.catch_warnings():  # torchvision 0.29 flags its image codecs as deprecated
        warnings.simplefilter("ignore", DeprecationWarning)
        import torchvision.io as tio
        return _decode(files, image_size, chunk, tio, TF)


def _decode(files, image_size, chunk, tio, TF) -> torch.Tensor:
    out: list[torch.Tensor] = []
    for start in range(0, len(files), chunk):
        part = files[start:start + chunk]
        imgs = None
        if all(f.suffix.lower() in (".jpg", ".jpeg") for f in part):
            try:
                imgs = tio.decode_jpeg([tio.read_file(str(regular_file(f, "image"))) for f in part],
                                       mode=tio.ImageReadMode.UNCHANGED)
            except RuntimeError:  # one bad file fails the batch: decode one by one to name it
                imgs = None
        if imgs is None:
            imgs = [_decode_one(f) for f in part]
        for im in imgs:
            if image_size is not None and tuple(im.shape[1:]) != (image_size, image_size):
                im = TF.resize(im, [image_size, image_size], antialias=True)
            out.append(im)
    shapes = {tuple(t.shape) for t in out}
    if len({s[0] for s in shapes}) > 1:  # mixed grey and colour: promote grey
        out = [t.expand(3, -1, -1) if t.shape[0] == 1 else t for t in out]
        shapes = {tuple(t.shape) for t in out}
    if len(shapes) != 1:
        raise PBEError(f"images have different sizes {sorted(shapes)[:3]}...; pass image_size=N to resize them")
    return torch.stack(out).contiguous()


def _decode_one(f: Path) -> torch.Tensor:
    import torchvision.io as tio
    regular_file(f, "image")
    try:
        if f.suffix.lower() in (".ppm", ".bmp"):
            from PIL import Image
            with Image.open(f) as im:
                arr = np.asarray(im.convert("RGB"))
            return torch.from_numpy(arr.copy()).permute(2, 0, 1)
        return tio.decode_image(tio.read_file(str(f)), mode=tio.ImageReadMode.UNCHANGED)
    except (RuntimeError, OSError, ValueError) as err:  # PIL's UnidentifiedImageError is an OSError
        raise PBEError(f"image {f} cannot be decoded ({str(err).splitlines()[0][:120]}); repair or remove it") from err


# ---------------------------------------------------------------- batched augmentation
def random_crop(x: torch.Tensor, padding: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Random crop of every image after zero padding, as two gathers (no per-image loop)."""
    if padding <= 0:
        return x
    n, c, h, w = x.shape
    padded = torch.nn.functional.pad(x, (padding,) * 4)
    dy = torch.randint(0, 2 * padding + 1, (n,), generator=generator).to(x.device)
    dx = torch.randint(0, 2 * padding + 1, (n,), generator=generator).to(x.device)
    rows = dy[:, None] + torch.arange(h, device=x.device)
    cols = dx[:, None] + torch.arange(w, device=x.device)
    padded = padded.gather(2, rows[:, None, :, None].expand(n, c, h, w + 2 * padding))
    return padded.gather(3, cols[:, None, None, :].expand(n, c, h, w))


def random_flip(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    flip = (torch.rand(x.shape[0], generator=generator) < 0.5).to(x.device)
    return torch.where(flip[:, None, None, None], x.flip(3), x)


def augment(x: torch.Tensor, padding: int = 4, flip: bool = True,
            generator: torch.Generator | None = None) -> torch.Tensor:
    """Standard CIFAR-style augmentation on a whole batch."""
    x = random_crop(x, padding, generator)
    return random_flip(x, generator) if flip else x
