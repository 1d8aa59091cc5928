"""Tests of gem.data: the loaders, augmentation, per-worker streams and the synthetic task."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers.cifar import write_cifar

import gem.data as gd
from gem.data import (
    CIFAR_MEAN,
    CIFAR_STD,
    MNIST_MEAN,
    MNIST_STD,
    DatasetMissing,
    WorkerStream,
    crop_and_flip,
    ensure_available,
    load_cifar10,
    load_digits,
    load_mnist,
    make_synthetic,
    train_size,
)

MNIST_NAMES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
CIFAR_NAMES = (
    "data_batch_1",
    "data_batch_2",
    "data_batch_3",
    "data_batch_4",
    "data_batch_5",
    "test_batch",
    "batches.meta",
)


# ------------------------------------------------------------------------------------------- helpers


def shared_data_root() -> Path:
    """The shared data folder: $GEM_SHARED_DATA if set, else <repo>/../shared/data."""
    env = os.environ.get("GEM_SHARED_DATA")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "data"


def mnist_root_or_skip() -> Path:
    root = shared_data_root()
    raw = root / "MNIST" / "raw"
    missing = [f for f in MNIST_NAMES if not (raw / f).is_file()]
    if missing:
        pytest.skip(
            f"MNIST files not available: {', '.join(missing)} missing from {raw} "
            f"(set GEM_SHARED_DATA to the folder holding MNIST/raw/)"
        )
    return root


def read_idx(path: Path) -> np.ndarray:
    """An IDX file (MNIST's format) parsed independently of torchvision: big-endian header, then uint8."""
    raw = path.read_bytes()
    ndim = raw[3]
    assert raw[2] == 0x08  # unsigned byte
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


@pytest.fixture(scope="module")
def mnist():
    root = mnist_root_or_skip()
    return root, load_mnist(str(root), download=False)


# ------------------------------------------------------------------------------------------- digits


def test_load_digits_shapes_split_sizes_and_labels():
    ds = load_digits()
    assert ds.name == "digits"
    assert ds.train_x.shape == (1500, 1, 28, 28)
    assert ds.val_x.shape == (148, 1, 28, 28) and ds.test_x.shape == (149, 1, 28, 28)
    assert ds.train_x.dtype == torch.float32
    assert ds.train_y.dtype == torch.int64 and ds.val_y.dtype == torch.int64 and ds.test_y.dtype == torch.int64
    assert ds.train_y.shape == (1500,) and ds.val_y.shape == (148,) and ds.test_y.shape == (149,)
    assert ds.sizes() == "1500 train / 148 val / 149 test"
    assert set(ds.train_y.tolist()) == set(range(10))
    assert set(ds.val_y.tolist()) == set(range(10)) and set(ds.test_y.tolist()) == set(range(10))
    assert ds.num_classes == 10 and ds.shape == (1, 28, 28)
    # pixels are [0, 1] intensities normalised with MNIST's statistics
    assert ds.train_x.min().item() == pytest.approx((0 - MNIST_MEAN) / MNIST_STD, abs=1e-5)
    assert ds.train_x.max().item() == pytest.approx((1 - MNIST_MEAN) / MNIST_STD, abs=1e-5)


def test_load_digits_split_is_a_partition_of_all_digits():
    from sklearn.datasets import load_digits as sk_digits

    ds = load_digits()
    counts = sum(torch.bincount(y, minlength=10) for y in (ds.train_y, ds.val_y, ds.test_y))
    assert counts.tolist() == np.bincount(sk_digits().target, minlength=10).tolist()
    # no digit in two splits: the three are disjoint
    rows = {tuple(x.flatten().tolist()[::7]) for x in ds.val_x} & {tuple(x.flatten().tolist()[::7]) for x in ds.test_x}
    assert len(rows) <= 2  # (scikit-learn's digits hold a few identical images)


def test_load_digits_split_is_identical_across_calls():
    a, b = load_digits(), load_digits()
    assert torch.equal(a.train_x, b.train_x) and torch.equal(a.train_y, b.train_y)
    assert torch.equal(a.val_x, b.val_x) and torch.equal(a.val_y, b.val_y)
    # the split does not depend on the global RNG either
    torch.manual_seed(12345)
    c = load_digits()
    assert torch.equal(a.val_y, c.val_y) and torch.equal(a.val_x, c.val_x)


def test_load_digits_other_shape_keeps_the_same_split():
    a = load_digits()
    b = load_digits(shape=(3, 32, 32))
    assert b.train_x.shape == (1500, 3, 32, 32) and b.val_x.shape == (148, 3, 32, 32)
    assert torch.equal(a.train_y, b.train_y) and torch.equal(a.val_y, b.val_y) and torch.equal(a.test_y, b.test_y)
    assert torch.equal(b.train_x[:, 0], b.train_x[:, 2])  # grey images replicated over channels


# -------------------------------------------------------------------------------------------- MNIST


def test_load_mnist_real_files_sizes_dtype_labels(mnist):
    _, ds = mnist
    assert ds.name == "mnist"
    # the subset's 5,000 training digits: a tenth held out for validation; its t10k file is the test split
    assert ds.train_x.shape == (4500, 1, 28, 28)
    assert ds.val_x.shape == (500, 1, 28, 28) and ds.test_x.shape == (1309, 1, 28, 28)
    assert ds.train_x.dtype == torch.float32 and ds.val_x.dtype == torch.float32
    assert ds.train_y.dtype == torch.int64 and ds.val_y.dtype == torch.int64
    assert ds.train_y.shape == (4500,) and ds.val_y.shape == (500,) and ds.test_y.shape == (1309,)
    assert set(ds.train_y.tolist()) == set(range(10))
    assert set(ds.val_y.tolist()) <= set(range(10))
    assert ds.augment is False


def test_load_mnist_real_files_normalisation(mnist):
    _, ds = mnist
    # normalised with MNIST's usual statistics: roughly zero mean and unit variance
    assert abs(ds.train_x.mean().item()) < 0.1
    assert abs(ds.train_x.std().item() - 1.0) < 0.1
    assert abs(ds.val_x.mean().item()) < 0.1
    assert abs(ds.val_x.std().item() - 1.0) < 0.1


def test_load_mnist_matches_the_idx_files_pixel_for_pixel(mnist):
    root, ds = mnist
    raw = root / "MNIST" / "raw"
    from gem.data import hold_out

    for x, y, prefix in ((None, None, "train"), (ds.test_x, ds.test_y, "t10k")):
        images = read_idx(raw / f"{prefix}-images-idx3-ubyte")
        labels = torch.from_numpy(read_idx(raw / f"{prefix}-labels-idx1-ubyte").astype(np.int64))
        expected = (torch.from_numpy(images.astype(np.float32)) / 255.0 - MNIST_MEAN) / MNIST_STD
        if prefix == "train":  # the training file is split: the same rows, the held-out ones apart, in file order
            tx, ty, vx, vy = hold_out(expected, labels)
            torch.testing.assert_close(ds.train_x[:, 0], tx, rtol=0, atol=1e-5)
            torch.testing.assert_close(ds.val_x[:, 0], vx, rtol=0, atol=1e-5)
            assert ds.train_y.tolist() == ty.tolist() and ds.val_y.tolist() == vy.tolist()
            assert len(ty) + len(vy) == len(labels)
        else:
            torch.testing.assert_close(x[:, 0], expected, rtol=0, atol=1e-5)
            assert y.tolist() == labels.tolist()


def test_the_validation_split_is_fixed_and_a_tenth_of_a_small_file():
    from gem.data import held_out, hold_out

    assert held_out(60_000) == 5000 and held_out(50_000) == 5000 and held_out(5000) == 500
    assert held_out(60_000, val_size=1000) == 1000 and held_out(7) == 1
    x = torch.arange(100.0)[:, None]
    y = torch.arange(100)
    torch.manual_seed(1)
    a = hold_out(x, y, val_size=10)
    torch.manual_seed(2)
    b = hold_out(x, y, val_size=10)
    assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))  # the global RNG plays no part
    assert sorted(a[1].tolist() + a[3].tolist()) == list(range(100)) and len(a[3]) == 10


# ------------------------------------------------------------------------------------------ CIFAR-10


def expected_cifar(batches):
    data = np.concatenate([d for d, _ in batches]).reshape(-1, 3, 32, 32)  # (N, channel, row, col)
    labels = [lbl for _, ls in batches for lbl in ls]
    mean = torch.tensor(CIFAR_MEAN)[None, :, None, None]
    std = torch.tensor(CIFAR_STD)[None, :, None, None]
    return (torch.from_numpy(data.astype(np.float32)) / 255.0 - mean) / std, labels


def in_file_order(ds):
    """The training file's examples, training and validation splits put back in the file's order (gem.data.hold_out
    keeps each part in file order, and draws the held-out rows with a generator seeded 0)."""
    from gem.data import held_out

    n = len(ds.train_y) + len(ds.val_y)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    k = held_out(n)
    x = torch.empty((n, *ds.train_x.shape[1:]))
    y = torch.empty(n, dtype=torch.int64)
    x[perm[k:].sort().values], y[perm[k:].sort().values] = ds.train_x, ds.train_y
    x[perm[:k].sort().values], y[perm[:k].sort().values] = ds.val_x, ds.val_y
    return x, y


def check_cifar(ds, written, per_batch=3, test_size=4):
    assert ds.name == "cifar10"
    # the five training batches: a tenth held out for validation (gem.data.held_out); the test batch: the test split
    assert len(ds.train_y) + len(ds.val_y) == 5 * per_batch and len(ds.val_y) == max(1, 5 * per_batch // 10)
    assert ds.test_x.shape == (test_size, 3, 32, 32)
    assert ds.train_x.dtype == torch.float32 and ds.train_y.dtype == torch.int64
    ex, ey = expected_cifar([written[f"data_batch_{i}"] for i in range(1, 6)])
    x, y = in_file_order(ds)
    torch.testing.assert_close(x, ex, rtol=0, atol=1e-5)
    assert y.tolist() == ey
    vx, vy = expected_cifar([written["test_batch"]])
    torch.testing.assert_close(ds.test_x, vx, rtol=0, atol=1e-5)
    assert ds.test_y.tolist() == vy


def plant_known_pixels(tmp_path: Path, written):
    """Make data_batch_2's second image zero but for three known values at asymmetric positions."""
    data, _ = written["data_batch_2"]
    data[1] = 0
    # (channel, row, col) -> value; its byte offset in the image's row of `data` is channel*1024 + row*32 + col
    known = {(0, 5, 7): 255, (1, 9, 2): 128, (2, 30, 1): 17}
    for (c, r, col), v in known.items():
        data[1, c * 1024 + r * 32 + col] = v
    path = tmp_path / "cifar-10-batches-py" / "data_batch_2"
    with open(path, "rb") as f:
        entry = pickle.load(f)
    entry["data"] = data
    with open(path, "wb") as f:
        pickle.dump(entry, f)
    return known


def check_known_pixels(ds, known, per_batch=3):
    img = in_file_order(ds)[0][per_batch + 1]  # second image of the second batch
    for (c, r, col), v in known.items():
        assert img[c, r, col].item() == pytest.approx((v / 255.0 - CIFAR_MEAN[c]) / CIFAR_STD[c], abs=1e-5)
    zero = torch.tensor([(0 - m) / s for m, s in zip(CIFAR_MEAN, CIFAR_STD, strict=True)])[:, None, None]
    mask = torch.ones(3, 32, 32, dtype=torch.bool)
    for c, r, col in known:
        mask[c, r, col] = False
    torch.testing.assert_close(img[mask], zero.expand(3, 32, 32)[mask], rtol=0, atol=1e-5)


def test_load_cifar10_reads_files_in_cifar_layout(tmp_path):
    written = write_cifar(tmp_path)
    known = plant_known_pixels(tmp_path, written)
    ds = load_cifar10(str(tmp_path), download=False)
    check_cifar(ds, written)
    check_known_pixels(ds, known)


# ----------------------------------------------------------------------------------- missing datasets


def assert_names_files_and_folder(excinfo, names, folder: Path):
    msg = str(excinfo.value)
    for name in names:
        assert name in msg
    assert str(folder) in msg


def test_load_mnist_missing_raises_dataset_missing(tmp_path):
    with pytest.raises(DatasetMissing) as excinfo:
        load_mnist(str(tmp_path), download=False)
    assert_names_files_and_folder(excinfo, MNIST_NAMES, tmp_path / "MNIST" / "raw")


def test_ensure_available_mnist_missing_raises(tmp_path):
    with pytest.raises(DatasetMissing) as excinfo:
        ensure_available("mnist", str(tmp_path), False)
    assert_names_files_and_folder(excinfo, MNIST_NAMES, tmp_path / "MNIST" / "raw")


def test_ensure_available_mnist_partial_folder_raises(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for name in MNIST_NAMES[:3]:
        (raw / name).write_bytes(b"")
    with pytest.raises(DatasetMissing) as excinfo:
        ensure_available("mnist", str(tmp_path), False)
    assert_names_files_and_folder(excinfo, MNIST_NAMES, raw)


def test_load_cifar10_missing_raises_dataset_missing(tmp_path):
    with pytest.raises(DatasetMissing) as excinfo:
        load_cifar10(str(tmp_path), download=False)
    assert_names_files_and_folder(excinfo, CIFAR_NAMES, tmp_path / "cifar-10-batches-py")


def test_ensure_available_cifar10_missing_raises(tmp_path):
    with pytest.raises(DatasetMissing) as excinfo:
        ensure_available("cifar10", str(tmp_path), False)
    assert_names_files_and_folder(excinfo, CIFAR_NAMES, tmp_path / "cifar-10-batches-py")


def test_ensure_available_passes_when_present_or_not_file_backed(tmp_path):
    write_cifar(tmp_path)
    ensure_available("cifar10", str(tmp_path), False)  # all files there: no error
    ensure_available("digits", str(tmp_path / "nowhere"), False)
    ensure_available("synthetic", str(tmp_path / "nowhere"), False)


def test_ensure_available_mnist_on_shared_data():
    ensure_available("mnist", str(mnist_root_or_skip()), False)


def test_dataset_missing_is_a_runtime_error():
    assert issubclass(DatasetMissing, RuntimeError)


def test_load_dataset_rejects_unknown_name():
    with pytest.raises(ValueError, match="imagenet"):
        gd.load_dataset("imagenet")


# ------------------------------------------------------------------------------------ crop and flip


def find_windows(img: torch.Tensor, out: torch.Tensor, pad: int) -> list[tuple[int, int, bool]]:
    """All (row offset, col offset, flipped) for which `out` is that window of the zero-padded `img`."""
    c, h, w = img.shape
    padded = torch.zeros(c, h + 2 * pad, w + 2 * pad)
    padded[:, pad : pad + h, pad : pad + w] = img
    found = []
    for oy in range(2 * pad + 1):
        for ox in range(2 * pad + 1):
            window = padded[:, oy : oy + h, ox : ox + w]
            for flipped in (False, True):
                if torch.equal(window.flip(2) if flipped else window, out):
                    found.append((oy, ox, flipped))
    return found


def test_crop_and_flip_keeps_shape_and_dtype():
    x = torch.randn(5, 3, 32, 32)
    out = crop_and_flip(x, torch.Generator().manual_seed(0))
    assert out.shape == x.shape and out.dtype == x.dtype
    out1 = crop_and_flip(torch.randn(4, 1, 28, 28), torch.Generator().manual_seed(0), pad=2)
    assert out1.shape == (4, 1, 28, 28)


def test_crop_and_flip_outputs_are_windows_of_the_padded_input():
    torch.manual_seed(0)
    x = torch.randn(6, 3, 32, 32) + 3.0  # distinct, non-zero pixels: every window is unique
    out = crop_and_flip(x, torch.Generator().manual_seed(1), pad=4)
    for i in range(len(x)):
        assert len(find_windows(x[i], out[i], pad=4)) == 1, f"sample {i} is not a padded window"


def test_crop_and_flip_randomises_offsets_and_flips():
    """Over many samples every offset 0..8 occurs on both axes and about half the images are flipped."""
    pad, n = 4, 600
    x = torch.rand(n, 1, 8, 8) + 1.0  # non-zero, distinct
    out = crop_and_flip(x, torch.Generator().manual_seed(2), pad=pad)
    padded = F.pad(x, (pad, pad, pad, pad))
    offsets = torch.full((n, 3), -1)
    for oy in range(2 * pad + 1):
        for ox in range(2 * pad + 1):
            window = padded[:, :, oy : oy + 8, ox : ox + 8]
            for flipped in (0, 1):
                cand = window.flip(3) if flipped else window
                hit = (cand == out).flatten(1).all(1)
                assert (offsets[hit, 0] == -1).all(), "ambiguous match"
                offsets[hit] = torch.tensor([oy, ox, flipped])
    assert (offsets[:, 0] >= 0).all(), "some outputs are not windows of the padded input"
    assert set(offsets[:, 0].tolist()) == set(range(9))
    assert set(offsets[:, 1].tolist()) == set(range(9))
    assert 0.4 < offsets[:, 2].float().mean().item() < 0.6
    # offsets are drawn per sample, not shared by the batch
    assert len({(a, b) for a, b in offsets[:, :2].tolist()}) > 60


def test_crop_and_flip_is_deterministic_for_a_seeded_generator():
    x = torch.randn(16, 3, 32, 32)
    a = crop_and_flip(x, torch.Generator().manual_seed(7))
    b = crop_and_flip(x, torch.Generator().manual_seed(7))
    c = crop_and_flip(x, torch.Generator().manual_seed(8))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_dataset_batch_augments_only_when_asked():
    x = torch.randn(10, 3, 32, 32) + 3.0
    y = torch.arange(10)
    plain = gd.Dataset("t", x, y, x[:2], y[:2], augment=False)
    idx = torch.tensor([3, 1, 4])
    bx, by = plain.batch(idx, torch.Generator().manual_seed(0))
    assert torch.equal(bx, x[idx]) and torch.equal(by, y[idx])
    aug = gd.Dataset("t", x, y, x[:2], y[:2], augment=True)
    ax, ay = aug.batch(idx, torch.Generator().manual_seed(0))
    assert torch.equal(ay, y[idx])
    assert torch.equal(ax, crop_and_flip(x[idx], torch.Generator().manual_seed(0)))


# ------------------------------------------------------------------------------------- WorkerStream


def take(stream: WorkerStream, k: int) -> list[list[int]]:
    return [stream.next_indices().tolist() for _ in range(k)]


def test_worker_stream_epochs_cover_distinct_indices_and_drop_ragged_batch():
    n, bs = 103, 10
    s = WorkerStream(n, bs, seed=0, worker=0)
    assert s.batches_per_epoch == 10
    for epoch in range(3):
        batches = take(s, 10)
        assert s.epoch == epoch
        assert all(len(b) == bs for b in batches)
        flat = [i for b in batches for i in b]
        assert len(set(flat)) == len(flat) == 100  # no repeats; 3 examples of the ragged batch dropped
        assert all(0 <= i < n for i in flat)
    s.next_indices()
    assert s.epoch == 3


def test_worker_stream_full_epochs_are_permutations():
    s = WorkerStream(64, 8, seed=3, worker=1)
    epochs = [sorted(i for b in take(s, 8) for i in b) for _ in range(3)]
    assert all(e == list(range(64)) for e in epochs)


def test_worker_stream_reshuffles_every_epoch():
    s = WorkerStream(64, 8, seed=3, worker=1)
    first, second = take(s, 8), take(s, 8)
    assert first != second


def test_worker_streams_differ_between_workers_and_repeat_for_same_seed_and_worker():
    a0 = take(WorkerStream(100, 10, seed=5, worker=0), 25)
    a1 = take(WorkerStream(100, 10, seed=5, worker=1), 25)
    b0 = take(WorkerStream(100, 10, seed=5, worker=0), 25)
    c0 = take(WorkerStream(100, 10, seed=6, worker=0), 25)
    assert a0 == b0
    assert a0 != a1
    assert a0 != c0
    assert a0[0] != a1[0]  # already the first batch differs


def test_worker_stream_seeds_do_not_collide():
    seeds = {gd._stream_seed(seed, worker) for seed in range(64) for worker in range(64)}
    assert len(seeds) == 64 * 64


# -------------------------------------------------------------------------------------------- synthetic


@pytest.mark.parametrize("shape", [(3, 32, 32), (1, 28, 28)])
def test_make_synthetic_shapes_and_classes(shape):
    ds = make_synthetic(shape=shape, train_size=600, val_size=200, seed=0)
    assert ds.train_x.shape == (600, *shape) and ds.val_x.shape == (200, *shape)
    assert ds.train_y.shape == (600,) and ds.val_y.shape == (200,)
    assert ds.train_x.dtype == torch.float32 and ds.train_y.dtype == torch.int64
    assert set(ds.train_y.tolist()) == set(range(10))
    assert ds.num_classes == 10 and ds.shape == shape
    assert torch.isfinite(ds.train_x).all()


def test_make_synthetic_num_classes():
    ds = make_synthetic(shape=(1, 16, 16), num_classes=4, train_size=400, val_size=100)
    assert ds.num_classes == 4
    assert set(ds.train_y.tolist()) == set(range(4))


def test_make_synthetic_is_deterministic_for_a_seed():
    a = make_synthetic(shape=(3, 32, 32), train_size=300, val_size=100, seed=1)
    torch.manual_seed(999)  # the global RNG must not matter
    b = make_synthetic(shape=(3, 32, 32), train_size=300, val_size=100, seed=1)
    c = make_synthetic(shape=(3, 32, 32), train_size=300, val_size=100, seed=2)
    assert torch.equal(a.train_x, b.train_x) and torch.equal(a.train_y, b.train_y)
    assert torch.equal(a.val_x, b.val_x) and torch.equal(a.val_y, b.val_y)
    assert not torch.equal(a.train_x, c.train_x)


@pytest.mark.parametrize("shape", [(1, 28, 28), (3, 32, 32)])
def test_make_synthetic_is_learnable_by_logistic_regression(shape):
    ds = make_synthetic(shape=shape, train_size=2000, val_size=500, seed=0)

    def features(x):
        return F.adaptive_avg_pool2d(x, 8).flatten(1)

    xt, xv = features(ds.train_x), features(ds.val_x)
    torch.manual_seed(0)
    lin = torch.nn.Linear(xt.shape[1], 10)
    opt = torch.optim.Adam(lin.parameters(), lr=0.05)
    for _ in range(200):
        opt.zero_grad()
        F.cross_entropy(lin(xt), ds.train_y).backward()
        opt.step()
    with torch.no_grad():
        acc = (lin(xv).argmax(1) == ds.val_y).float().mean().item()
    majority = torch.bincount(ds.val_y).max().item() / len(ds.val_y)
    assert acc > 0.5 and acc > majority + 0.3, f"val accuracy {acc:.3f} (majority class {majority:.3f})"


# ------------------------------------------------------------------------------------------ train_size


def test_train_size_digits_matches_loader():
    assert train_size("digits", "unused") == 1500 == len(load_digits().train_y)


def test_train_size_synthetic():
    assert train_size("synthetic", "unused", synthetic_train_size=1234) == 1234
    assert train_size("synthetic", "unused") == 5000


def test_train_size_mnist_from_idx_header():
    assert train_size("mnist", str(mnist_root_or_skip())) == 4500  # 5,000 in the file, a tenth held out


def test_train_size_unknown_when_not_cheap(tmp_path):
    assert train_size("mnist", str(tmp_path)) is None
    assert train_size("cifar10", str(tmp_path)) is None


def test_make_synthetic_prototypes_are_templates_plus_noise():
    a = make_synthetic(shape=(3, 32, 32), train_size=300, val_size=100, task="prototypes", snr=1.0)
    b = make_synthetic(shape=(3, 32, 32), train_size=300, val_size=100, task="prototypes", snr=1.0)
    assert torch.equal(a.train_x, b.train_x) and torch.equal(a.val_y, b.val_y)
    assert set(a.train_y.tolist()) == set(range(10))
    # images of one class share their template: each is closer to its own class mean than to any other's
    means = torch.stack([a.train_x[a.train_y == k].mean(0) for k in range(10)]).flatten(1)
    nearest = torch.cdist(a.val_x.flatten(1), means).argmin(1)
    assert (nearest == a.val_y).float().mean() > 0.9
    noise = make_synthetic(shape=(3, 32, 32), train_size=300, val_size=100, task="prototypes", snr=0.0)
    means = torch.stack([noise.train_x[noise.train_y == k].mean(0) for k in range(10)]).flatten(1)
    assert (torch.cdist(noise.val_x.flatten(1), means).argmin(1) == noise.val_y).float().mean() < 0.3
    with pytest.raises(ValueError, match="data.synthetic.task=nope is not allowed"):
        make_synthetic(task="nope")


def test_digits_are_read_as_scikit_learn_reads_them():
    """gem reads scikit-learn's digits file itself (importing scikit-learn costs a second in every run)."""
    from sklearn.datasets import load_digits as sk_digits

    from gem.data import _sklearn_digits

    images, target = _sklearn_digits()
    d = sk_digits()
    assert np.array_equal(images, d.images) and images.dtype == d.images.dtype
    assert np.array_equal(target, d.target)


def _torchvision_like(fail: bool):
    """A download as torchvision's makes it: it creates <root>/MNIST/raw first, then fetches (or fails to)."""

    def load(root, download=False, val_size=None):
        raw = Path(root) / "MNIST" / "raw"
        raw.mkdir(parents=True, exist_ok=True)
        if fail:
            raise gd.DatasetMissing("no network")
        for f in gd.MNIST_FILES:
            (raw / f).write_bytes(b"idx")

    return load


def test_a_failed_download_leaves_the_data_root_as_it_was(tmp_path, monkeypatch):
    """A refusal writes nothing: the download created <root>/MNIST/raw (as root, /nonexistent/x/MNIST/raw) before
    it failed, and the refusal left it there. It now names the user's folder and creates nothing."""
    monkeypatch.setattr(gd, "load_mnist", _torchvision_like(fail=True))
    root = tmp_path / "nonexistent" / "x"
    with pytest.raises(DatasetMissing, match=rf"files not found in {root}/MNIST/raw \(download failed\)"):
        ensure_available("mnist", str(root), True)
    assert not (tmp_path / "nonexistent").exists()


def test_a_download_that_succeeds_lands_in_the_data_root(tmp_path, monkeypatch):
    monkeypatch.setattr(gd, "load_mnist", _torchvision_like(fail=False))
    (tmp_path / "MNIST" / "raw").mkdir(parents=True)
    (tmp_path / "MNIST" / "raw" / gd.MNIST_FILES[0]).write_bytes(b"mine")  # a file already there is kept
    ensure_available("mnist", str(tmp_path), True)
    assert sorted(os.listdir(tmp_path / "MNIST" / "raw")) == sorted(gd.MNIST_FILES)
    assert (tmp_path / "MNIST" / "raw" / gd.MNIST_FILES[0]).read_bytes() == b"mine"
