import pickle

import numpy as np
import pytest
import torch

from conftest import SHARED, needs_shared
from pbe import data
from pbe.utils import PBEError


def test_digits_is_builtin_uint8_and_split(digits):
    train, test = digits
    assert train.images.dtype == torch.uint8 and train.images.shape[1:] == (1, 8, 8)
    assert len(train) + len(test) == 1797 and len(test) == 360
    assert set(train.labels.tolist()) == set(range(10))
    assert int(train.images.max()) == 255
    again = data.load("digits", split="test")
    assert torch.equal(again.images, test.images)


def test_npz_roundtrip_and_bad_keys(tmp_path):
    imgs = np.random.default_rng(0).integers(0, 256, (20, 5, 6, 3), dtype=np.uint8)
    labels = np.arange(20) % 4
    np.savez(tmp_path / "mine_train.npz", images=imgs, labels=labels)
    ds = data.load(f"npz:{tmp_path}", split="train")
    assert ds.images.shape == (20, 3, 5, 6) and ds.num_classes == 4
    assert torch.equal(ds.images[3].permute(1, 2, 0), torch.from_numpy(imgs[3]))
    np.savez(tmp_path / "bad.npz", x=imgs)
    with pytest.raises(PBEError, match="'images' and 'labels'"):
        data.load(f"npz:{tmp_path / 'bad.npz'}")


def test_imagefolder_decodes_and_caches(tmp_path, monkeypatch):
    from torchvision.io import write_png
    gen = torch.Generator().manual_seed(0)
    originals = {}
    for split in ("train", "test"):
        for cls in ("b_cls", "a_cls"):
            (tmp_path / split / cls).mkdir(parents=True)
            for i in range(3):
                img = torch.randint(0, 256, (3, 4, 4), dtype=torch.uint8, generator=gen)
                write_png(img, str(tmp_path / split / cls / f"{i}.png"))
                originals[(split, cls, i)] = img
    before = set(data.cache_dir().glob("images-*.npy"))  # the session's cache: other tests decode too
    ds = data.load(f"imagefolder:{tmp_path}", split="train")
    assert ds.classes == ["a_cls", "b_cls"] and ds.labels.tolist() == [0, 0, 0, 1, 1, 1]
    assert torch.equal(ds.images[0], originals[("train", "a_cls", 0)])  # PNG is lossless
    assert len(set(data.cache_dir().glob("images-*.npy")) - before) == 1
    monkeypatch.setattr(data, "decode_images", lambda *a, **k: pytest.fail("cache not used"))
    assert torch.equal(data.load(f"imagefolder:{tmp_path}").images, ds.images)


def test_cifar_batches_layout_and_safe_unpickling(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for name, n in [(f"data_batch_{i}", 4) for i in range(1, 6)] + [("test_batch", 3)]:
        with open(folder / name, "wb") as fh:
            pickle.dump({"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), "labels": list(range(n))}, fh)
    train = data.load("cifar10", root=tmp_path)
    assert train.images.shape == (20, 3, 32, 32) and train.classes[0] == "airplane"

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))
    with open(folder / "test_batch", "wb") as fh:
        pickle.dump({"data": Evil(), "labels": [0]}, fh)
    with pytest.raises(PBEError, match="refusing to unpickle"):
        data.load("cifar10", root=tmp_path, split="test")


def test_mnist_idx_layout(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    imgs = np.arange(2 * 28 * 28, dtype=np.uint8).reshape(2, 28, 28)
    (raw / "t10k-images-idx3-ubyte").write_bytes(bytes([0, 0, 8, 3]) + b"".join(
        int(v).to_bytes(4, "big") for v in imgs.shape) + imgs.tobytes())
    (raw / "t10k-labels-idx1-ubyte").write_bytes(bytes([0, 0, 8, 1]) + (2).to_bytes(4, "big") + bytes([7, 3]))
    ds = data.load("mnist", root=tmp_path, split="test")
    assert ds.images.shape == (2, 1, 28, 28) and ds.labels.tolist() == [7, 3]
    assert torch.equal(ds.images[1, 0], torch.from_numpy(imgs[1]))


def test_missing_dataset_says_where_and_how(tmp_path):
    with pytest.raises(PBEError) as err:
        data.load("cifar10", root=tmp_path / "nowhere")
    assert "looked in" in str(err.value) and "--download" in str(err.value)
    with pytest.raises(PBEError, match="unknown dataset"):
        data.load("imagenet", root=tmp_path)


def test_validation_names_the_problem():
    with pytest.raises(PBEError, match="uint8"):
        data.ImageDataset(torch.zeros(2, 3, 4, 4), torch.zeros(2, dtype=torch.long), ["a"])
    with pytest.raises(PBEError, match="channels-first"):
        data.ImageDataset(torch.zeros(2, 4, 4, 3, dtype=torch.uint8), torch.zeros(2, dtype=torch.long), ["a"])
    with pytest.raises(PBEError, match="labels span"):
        data.ImageDataset(torch.zeros(2, 3, 4, 4, dtype=torch.uint8), torch.tensor([0, 5]), ["a", "b"])


def test_random_crop_is_a_shift_and_flip_mirrors():
    x = torch.arange(2 * 1 * 6 * 6, dtype=torch.float32).view(2, 1, 6, 6) + 1
    gen = torch.Generator().manual_seed(1)
    out = data.random_crop(x, 2, gen)
    assert out.shape == x.shape
    for i in range(2):  # every crop equals the padded image at some offset
        padded = torch.nn.functional.pad(x[i], (2, 2, 2, 2))
        assert any(torch.equal(out[i], padded[:, dy:dy + 6, dx:dx + 6]) for dy in range(5) for dx in range(5))
    flipped = data.random_flip(x, torch.Generator().manual_seed(0))
    for i in range(2):
        assert torch.equal(flipped[i], x[i]) or torch.equal(flipped[i], x[i].flip(2))


@needs_shared("cifar10")
def test_shared_cifar10_loads_fully():
    train = data.load("cifar10", root=SHARED / "cifar10")
    test = data.load("cifar10", root=SHARED / "cifar10", split="test")
    assert len(train) == 50000 and len(test) == 10000
    assert torch.bincount(train.labels).tolist() == [5000] * 10
    mean = train.images.float().mean((0, 2, 3)) / 255  # measured in PERF.md: 0.4913 0.4821 0.4465
    assert torch.allclose(mean, torch.tensor([0.4913, 0.4821, 0.4465]), atol=2e-3)


@needs_shared("mnist")
def test_shared_mnist_loads():
    test = data.load("mnist", root=SHARED / "mnist", split="test")
    assert test.images.shape == (10000, 1, 28, 28) and not test.flip
