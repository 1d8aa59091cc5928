"""Datasets as tensors in memory, and per-worker batch streams.

Each dataset is loaded once into normalised float tensors. Batches are drawn by index from those tensors, and
augmentation (CIFAR's random crop and flip) runs on whole batches, so no per-sample Python or PIL work sits on
the training path (see BENCHMARKS.md for what that buys against a torchvision DataLoader).

Datasets: `digits` (scikit-learn's bundled digits, offline), `mnist` and `cifar10` (torchvision), and
`synthetic` (a learnable task labelled by a fixed random teacher); and any torchvision-style dataset, read into
memory by `from_datasets` (experiments/ instantiates it from the config: Fashion-MNIST, CIFAR-100, a user's own,
or plain tensors from a file through `TensorFile`).

Every dataset has three splits (docs/contract.md, "Splits"): training, validation and test. Workers train on the
training split; the evaluations during a run, and every choice made from them (the tuning protocol's), use the
validation split; the test split is evaluated once, on the final central variable, and reported. A data set that
ships a training file and a test file (MNIST, CIFAR-10, torchvision's others) keeps its test file as the test split
and holds a fixed `val_size` of its training file out for validation (`hold_out`: the same examples for every
seed): full MNIST trains on 55,000 digits, validates on 5,000 and tests on 10,000.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

DATASETS = ("digits", "mnist", "cifar10", "synthetic")

# The usual per-channel statistics; MNIST's are the ones the paper's code (PyTorch's MNIST example) used.
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)

MNIST_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
CIFAR_FILES = (
    "data_batch_1",
    "data_batch_2",
    "data_batch_3",
    "data_batch_4",
    "data_batch_5",
    "test_batch",
    "batches.meta",
)


VAL_SIZE = 5000  # data.val_size: training-file examples held out for validation (MNIST's 55,000 / 5,000 split)


class DatasetMissing(RuntimeError):
    """The dataset's files are not where they should be and could not be downloaded."""


@dataclass
class Dataset:
    name: str
    train_x: torch.Tensor  # (N, C, H, W) float32, normalised
    train_y: torch.Tensor  # (N,) int64
    val_x: torch.Tensor  # the validation split: every evaluation during a run, and every choice made from it
    val_y: torch.Tensor
    num_classes: int = 10
    augment: bool = False  # CIFAR-style random crop (pad 4) and horizontal flip on training batches
    test_x: torch.Tensor | None = None  # the test split: the final central variable only; None: the data has none
    test_y: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.train_x.shape[1:])

    @property
    def has_test(self) -> bool:
        return self.test_y is not None and len(self.test_y) > 0

    def sizes(self) -> str:
        """`55000 train / 5000 val / 10000 test`, as a run prints it."""
        test = f"{len(self.test_y)} test" if self.has_test else "no test split"
        return f"{len(self.train_y)} train / {len(self.val_y)} val / {test}"

    def to(self, device) -> Dataset:
        for k in ("train_x", "train_y", "val_x", "val_y", "test_x", "test_y"):
            if getattr(self, k) is not None:
                setattr(self, k, getattr(self, k).to(device))
        return self

    def for_workers(self) -> Dataset:
        """What a worker needs: the training split. The held-out splits are the coordinator's alone."""
        return dataclasses.replace(
            self, val_x=self.val_x[:0].clone(), val_y=self.val_y[:0].clone(), test_x=None, test_y=None
        )

    def batch(self, idx: torch.Tensor, generator: torch.Generator | None = None):
        """The training batch at `idx`, augmented if the dataset asks for it."""
        x, y = self.train_x[idx], self.train_y[idx]
        if self.augment:
            x = crop_and_flip(x, generator)
        return x, y


def crop_and_flip(x: torch.Tensor, generator: torch.Generator | None = None, pad: int = 4) -> torch.Tensor:
    """Random crop after zero padding, and random horizontal flip, of a whole batch at once."""
    b, c, h, w = x.shape
    padded = F.pad(x, (pad, pad, pad, pad))
    oy = torch.randint(0, 2 * pad + 1, (b,), generator=generator).to(x.device)
    ox = torch.randint(0, 2 * pad + 1, (b,), generator=generator).to(x.device)
    rows = (oy[:, None] + torch.arange(h, device=x.device))[:, None, :, None]  # (b,1,h,1)
    cols = (ox[:, None] + torch.arange(w, device=x.device))[:, None, None, :]  # (b,1,1,w)
    bi = torch.arange(b, device=x.device)[:, None, None, None]
    ci = torch.arange(c, device=x.device)[None, :, None, None]
    out = padded[bi, ci, rows, cols]
    flip = (torch.rand(b, generator=generator) < 0.5).to(x.device)
    return torch.where(flip[:, None, None, None], out.flip(3), out)


class WorkerStream:
    """One worker's own stream of mini-batch indices: a fresh shuffle of the whole training set every epoch.

    The paper gives every worker a full epoch of its own, so n workers each see all N examples per epoch, in
    their own order. A ragged last batch is dropped so that every commit uses exactly `batch_size` examples.
    The stream's state is (epoch, position) plus its generator, so it can be checkpointed and resumed.
    """

    def __init__(self, num_examples: int, batch_size: int, seed: int, worker: int):
        self.n, self.batch_size = num_examples, batch_size
        self.generator = torch.Generator().manual_seed(_stream_seed(seed, worker))
        self.epoch, self.pos = 0, 0
        self.perm = torch.randperm(self.n, generator=self.generator)

    @property
    def batches_per_epoch(self) -> int:
        return self.n // self.batch_size

    def next_indices(self) -> torch.Tensor:
        if self.pos + self.batch_size > self.n:
            self.epoch += 1
            self.pos = 0
            self.perm = torch.randperm(self.n, generator=self.generator)
        idx = self.perm[self.pos : self.pos + self.batch_size]
        self.pos += self.batch_size
        return idx


def _stream_seed(seed: int, worker: int) -> int:
    # A large odd multiplier keeps (seed, worker) pairs from colliding for any realistic seed and n.
    return (seed * 1_000_003 + worker * 7919 + 1) % (2**63)


def held_out(n: int, val_size: int = VAL_SIZE) -> int:
    """How many of a training file's n examples are held out for validation: `val_size`, or a tenth of them where
    the file holds fewer than 10 × val_size (the 5,000-digit MNIST subset of the tests: 500)."""
    return max(1, min(int(val_size), n // 10))


def hold_out(x: torch.Tensor, y: torch.Tensor, val_size: int = VAL_SIZE):
    """(train_x, train_y, val_x, val_y): a fixed `held_out(len(x), val_size)` examples for validation, drawn by a
    generator seeded 0, so that every seed, engine and process validates on the same examples; both parts keep the
    file's order."""
    k = held_out(len(x), val_size)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    val, train = perm[:k].sort().values, perm[k:].sort().values
    return x[train], y[train], x[val], y[val]


# --------------------------------------------------------------------------------------------- loaders


def load_dataset(
    name: str,
    root: str = "data",
    download: bool = False,
    synthetic: dict | None = None,
    shape: tuple[int, int, int] | None = None,
    augment: bool = True,
    val_size: int = VAL_SIZE,
) -> Dataset:
    """Load `name` into memory. `shape` is the model's input shape, used by `digits` and `synthetic`; `val_size`:
    the training-file examples `mnist` and `cifar10` hold out for validation (`hold_out`)."""
    if name == "digits":
        return load_digits(shape or (1, 28, 28))
    if name == "mnist":
        return load_mnist(root, download, val_size)
    if name == "cifar10":
        return load_cifar10(root, download, augment=augment, val_size=val_size)
    if name == "synthetic":
        return make_synthetic(shape=shape or (1, 28, 28), **(synthetic or {}))
    raise ValueError(f"data={name} is not a dataset; choose one of: {', '.join(DATASETS)}")


def load_digits(shape=(1, 28, 28), held: int = 297, val_size: int = 148) -> Dataset:
    """scikit-learn's 1,797 bundled 8×8 digits, upsampled to the model's input size (28×28 for the paper CNN).

    It ships inside scikit-learn, so the default run works offline. A fixed split, the same for every seed, keeps
    297 digits (about one in six) out of training: 148 for validation and 149 for the test split; 1,500 train.
    """
    images, target = _sklearn_digits()
    x = torch.tensor(images, dtype=torch.float32)[:, None] / 16.0  # (N,1,8,8) in [0,1]
    c, h, w = shape
    x = F.interpolate(x, size=(h, w), mode="bilinear", align_corners=False).clamp_(0, 1)
    x = x.expand(-1, c, -1, -1).contiguous()
    x = (x - MNIST_MEAN) / MNIST_STD
    y = torch.tensor(target, dtype=torch.int64)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    tr, va, te = perm[held:], perm[:val_size], perm[val_size:held]
    return Dataset("digits", x[tr], y[tr], x[va], y[va], test_x=x[te], test_y=y[te])


def _sklearn_digits():
    """scikit-learn's digits as its `load_digits` reads them (images (1797, 8, 8) and targets), from the file it
    ships, without importing scikit-learn: that import (scipy.stats and more) takes a second, in every run."""
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    path = os.path.join(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz") if spec else ""
    if not os.path.isfile(path):  # another layout of the package: its own loader
        from sklearn.datasets import load_digits as sk_digits

        d = sk_digits()
        return d.images, d.target
    data = np.loadtxt(path, delimiter=",")
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)


def _load_failed(what: str, folder: str, files, download: bool, error: Exception) -> DatasetMissing:
    if all(os.path.isfile(os.path.join(folder, f)) for f in files):  # present but unreadable: say so
        return DatasetMissing(
            f"data={what}: could not read the files in {folder} "
            f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})"
        )
    return _download_failed(what, folder, files, download)


def _download_failed(what: str, folder: str, files, download: bool) -> DatasetMissing:
    reason, hint = (
        ("download failed", "or run once where the download can reach the internet")
        if download
        else ("data.download=false", "or set data.download=true on a machine with internet")
    )
    return DatasetMissing(f"data={what}: files not found in {folder} ({reason}); put {', '.join(files)} there, {hint}")


def load_mnist(root: str, download: bool = False, val_size: int = VAL_SIZE) -> Dataset:
    """MNIST through torchvision: `<root>/MNIST/raw/` holds the four IDX files. The training file gives the training
    and validation splits (`hold_out`: 55,000 and 5,000 of the full 60,000), the t10k file the test split."""
    from torchvision.datasets import MNIST

    folder = os.path.join(os.path.abspath(root), "MNIST", "raw")
    try:
        train = MNIST(root, train=True, download=download)
        test = MNIST(root, train=False, download=False)
    except Exception as e:  # torchvision raises RuntimeError when missing, URLError etc. when offline
        raise _load_failed("mnist", folder, MNIST_FILES, download, e) from e

    def prep(ds):
        x = ds.data.to(torch.float32).div_(255.0).unsqueeze(1)
        return (x - MNIST_MEAN) / MNIST_STD, ds.targets.to(torch.int64)

    tx, ty, vx, vy = hold_out(*prep(train), val_size)
    ex, ey = prep(test)
    return Dataset("mnist", tx, ty, vx, vy, test_x=ex, test_y=ey)


def _files_only(cls, files):
    """A torchvision CIFAR class that checks that its batch files exist rather than their md5 on every load.

    A download is still verified (torchvision checks the archive's md5 before extracting it). Skipping the per-load
    md5 also lets tests run the real loader on small files written in CIFAR's own format."""

    class FilesOnly(cls):
        def _check_integrity(self) -> bool:
            folder = os.path.join(self.root, self.base_folder)
            return all(os.path.isfile(os.path.join(folder, f)) for f in files)

        def _load_meta(self) -> None:  # torchvision md5-checks the meta file here too; we only need the names
            import pickle

            with open(os.path.join(self.root, self.base_folder, self.meta["filename"]), "rb") as f:
                self.classes = pickle.load(f, encoding="latin1")[self.meta["key"]]
            self.class_to_idx = {c: i for i, c in enumerate(self.classes)}

    FilesOnly.__name__ = cls.__name__
    return FilesOnly


def _cifar_class():
    from torchvision.datasets import CIFAR10

    return _files_only(CIFAR10, CIFAR_FILES)


CIFAR100_FILES = ("train", "test", "meta")


def cifar100(root: str, train: bool = True, download: bool = False, **kwargs):
    """torchvision's CIFAR-100 (`<root>/cifar-100-python/`), checking file presence rather than md5 on load."""
    from torchvision.datasets import CIFAR100

    return _files_only(CIFAR100, CIFAR100_FILES)(root, train=train, download=download, **kwargs)


def load_cifar10(root: str, download: bool = False, augment: bool = True, val_size: int = VAL_SIZE) -> Dataset:
    """CIFAR-10 through torchvision: `<root>/cifar-10-batches-py/` holds the python-pickle batches. The five training
    batches give the training and validation splits (`hold_out`: 45,000 and 5,000), the test batch the test split."""
    cls = _cifar_class()
    folder = os.path.join(os.path.abspath(root), "cifar-10-batches-py")
    try:
        train = cls(root, train=True, download=download)
        test = cls(root, train=False, download=False)
    except Exception as e:
        raise _load_failed("cifar10", folder, CIFAR_FILES, download, e) from e
    mean = torch.tensor(CIFAR_MEAN)[None, :, None, None]
    std = torch.tensor(CIFAR_STD)[None, :, None, None]

    def prep(ds):
        x = torch.from_numpy(np.ascontiguousarray(ds.data)).permute(0, 3, 1, 2).to(torch.float32).div_(255.0)
        return ((x - mean) / std).contiguous(), torch.tensor(ds.targets, dtype=torch.int64)

    tx, ty, vx, vy = hold_out(*prep(train), val_size)
    ex, ey = prep(test)
    return Dataset("cifar10", tx, ty, vx, vy, augment=augment, test_x=ex, test_y=ey)


def make_synthetic(
    shape=(1, 28, 28),
    num_classes: int = 10,
    train_size: int = 5000,
    val_size: int = 1000,
    seed: int = 0,
    task: str = "teacher",
    snr: float = 0.5,
    test_size: int = 1000,
) -> Dataset:
    """A learnable image task of any shape. The same `seed` gives the same data everywhere.

    Images are smooth: Gaussian noise on an 8×8 grid, upsampled to the requested size, so that conv nets have
    spatial structure to exploit. `task`:
    - `teacher`: the label is the argmax of a fixed random linear teacher on that 8×8 grid: exactly learnable,
      but a deep conv net's early layers wash most of it out (a random-init AlexNet keeps 23% probe accuracy);
    - `prototypes`: each class has a fixed random 8×8 template; an image is `snr` × its class's template plus
      the noise. Linearly separable up to the noise, and its information survives conv layers (AlexNet:
      66% probe accuracy at θ₀ for snr 0.3, 100% for snr 1). REPRODUCTION.md (Fig. 7) has the measurements.

    The test split's `test_size` examples are drawn after everything else, so the training and validation splits
    are those a seed gave before the test split existed.
    """
    if task not in SYNTHETIC_TASKS:
        raise ValueError(f"data.synthetic.task={task} is not allowed; choose one of: {', '.join(SYNTHETIC_TASKS)}")
    g = torch.Generator().manual_seed(10_007 + seed)
    c, h, w = shape
    n = train_size + val_size
    if task == "teacher":
        latent = torch.randn(n, c, 8, 8, generator=g)
        teacher = torch.randn(c * 64, num_classes, generator=g)
        y = (latent.flatten(1) @ teacher).argmax(1)
        test_latent = torch.randn(test_size, c, 8, 8, generator=g)
        test_y = (test_latent.flatten(1) @ teacher).argmax(1)
    else:
        prototypes = torch.randn(num_classes, c, 8, 8, generator=g)
        y = torch.randint(0, num_classes, (n,), generator=g)
        latent = snr * prototypes[y] + torch.randn(n, c, 8, 8, generator=g)
        test_y = torch.randint(0, num_classes, (test_size,), generator=g)
        test_latent = snr * prototypes[test_y] + torch.randn(test_size, c, 8, 8, generator=g)
    x = F.interpolate(latent, size=(h, w), mode="bilinear", align_corners=False)
    mean, std = x.mean(), x.std()
    x = (x - mean) / std
    test_x = (F.interpolate(test_latent, size=(h, w), mode="bilinear", align_corners=False) - mean) / std
    return Dataset(
        "synthetic",
        x[:train_size].contiguous(),
        y[:train_size],
        x[train_size:].contiguous(),
        y[train_size:],
        num_classes=num_classes,
        test_x=test_x.contiguous(),
        test_y=test_y,
    )


SYNTHETIC_TASKS = ("teacher", "prototypes")


# ------------------------------------------------------------------------- any torchvision-style dataset


# the usual names of a file's splits, in the order they are looked for
TRAIN_KEYS = (("x", "y"), ("x_train", "y_train"))
VAL_KEYS = (("x_val", "y_val"), ("x_valid", "y_valid"))
TEST_KEYS = (("x_test", "y_test"),)
SPLITS = ("train", "val", "test")


class TensorFile:
    """Plain tensors from a file, as a torchvision-style dataset: `.npz` (numpy) or `.pt` (a dict of tensors).

    `split` picks the part: `train` is `x`, `y` (or `x_train`, `y_train`): (N, ...) inputs and (N,) integer labels;
    `val` is `x_val`/`y_val` (or `x_valid`/`y_valid`), and without them a fixed `val_fraction` of the training
    arrays (the same for every seed), which `train` then leaves out; `test` is `x_test`/`y_test`, and empty when the
    file has none (the run then has no test split: a test split is never carved out of the training arrays, nor
    used for validation). Which arrays serve which split is printed once. `.pt` files are read with
    `weights_only=True`: tensors only, no code runs. `train=True/False` (torchvision's keyword) is `split=train/val`.
    """

    def __init__(self, path: str, split: str = "train", val_fraction: float = 0.1, train: bool | None = None):
        if train is not None:
            split = "train" if train else "val"
        if split not in SPLITS:
            raise ValueError(f"split={split} is not allowed; choose one of: {', '.join(SPLITS)}")
        arrays = _read_arrays(path)
        keys = next((k for k in TRAIN_KEYS if k[0] in arrays and k[1] in arrays), None)
        if keys is None:
            raise ValueError(
                f"{path} has no training arrays (it has: {', '.join(sorted(arrays)) or 'none'}); it "
                "needs x and y (or x_train and y_train), optionally x_val and y_val, and x_test and "
                "y_test"
            )
        val = next((k for k in VAL_KEYS if k[0] in arrays and k[1] in arrays), None)
        test = next((k for k in TEST_KEYS if k[0] in arrays and k[1] in arrays), None)
        x, y = torch.as_tensor(arrays[keys[0]]), torch.as_tensor(arrays[keys[1]])
        if val is None and not 0 < val_fraction < 1:
            raise ValueError(f"val_fraction={val_fraction} must be in (0, 1)")
        if split == "test":
            if test is None:
                x, y = x[:0], y[:0]
            else:
                x, y = torch.as_tensor(arrays[test[0]]), torch.as_tensor(arrays[test[1]])
        elif val is not None:
            if split == "val":
                x, y = torch.as_tensor(arrays[val[0]]), torch.as_tensor(arrays[val[1]])
        else:
            perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
            k = max(1, int(round(len(x) * val_fraction)))
            idx = perm[k:] if split == "train" else perm[:k]
            x, y = x[idx], y[idx]
        if split == "val":
            n = len(arrays[keys[1]])
            where = (
                f"validating on {val[0]}/{val[1]} ({len(y)})"
                if val is not None
                else f"validating on {len(y)} of them (val_fraction {val_fraction}: no x_val/y_val or x_valid/y_valid)"
            )
            tested = (
                f"testing on {test[0]}/{test[1]} ({len(arrays[test[1]])})"
                if test is not None
                else "no test split (no x_test/y_test)"
            )
            print(f"gem: {path}: training on {keys[0]}/{keys[1]} ({n} examples), {where}, {tested}", flush=True)
        if len(x) != len(y):
            raise ValueError(f"{path}: {len(x)} inputs but {len(y)} labels")
        self.data, self.targets, self.transform = x, y, None

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i):
        return self.data[i], int(self.targets[i])


def _read_arrays(path: str) -> dict:
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist")
    if path.endswith(".npz"):
        with np.load(path, allow_pickle=False) as f:
            return {k: f[k] for k in f.files}
    if path.endswith(".pt"):
        obj = torch.load(path, weights_only=True, map_location="cpu")
        if not isinstance(obj, dict):
            raise ValueError(f"{path} holds a {type(obj).__name__}, not a dict of tensors")
        return obj
    raise ValueError(f"{path}: give a .npz or .pt file")


def _as_tensor(item) -> torch.Tensor:
    if isinstance(item, torch.Tensor):
        return item
    if isinstance(item, np.ndarray):
        return torch.from_numpy(item)
    from torchvision.transforms.functional import pil_to_tensor  # a PIL image

    return pil_to_tensor(item)


def _inputs(ds) -> tuple[torch.Tensor, torch.Tensor]:
    """All of a dataset's examples as (inputs, labels). Datasets that hold their examples as `.data` and
    `.targets` and transform nothing (torchvision's MNIST family, CIFAR, TensorFile) are read at once; any
    other dataset item by item."""
    if getattr(ds, "transform", None) is None and hasattr(ds, "data") and hasattr(ds, "targets"):
        x, y = _as_tensor(np.asarray(ds.data) if not isinstance(ds.data, torch.Tensor) else ds.data), ds.targets
        if x.dim() == 4 and x.shape[-1] in (1, 3) and x.shape[1] not in (1, 3):  # N,H,W,C (CIFAR's numpy)
            x = x.permute(0, 3, 1, 2)
    else:
        items = [ds[i] for i in range(len(ds))]
        x = torch.stack([_as_tensor(a) for a, _ in items])
        y = [int(b) for _, b in items]
    x = x.unsqueeze(1) if x.dim() == 3 else x  # N,H,W: one channel
    return x, torch.as_tensor(np.asarray(y), dtype=torch.int64)


def from_datasets(
    name: str, train, val, num_classes: int, augment: bool = False, test=None, val_size: int = VAL_SIZE
) -> Dataset:
    """Torchvision-style datasets (items `(input, label)`; inputs PIL images, arrays or tensors) in memory.

    `val` None: a fixed `val_size` of the training split is held out for validation (`hold_out`). `test` None or
    empty: the data has no test split. Integer inputs (8-bit images) are scaled to [0, 1]; every input is then
    standardised per channel (dimension 1) with the training split's mean and standard deviation, as the built-in
    datasets are.
    """
    tx, ty = _inputs(train)
    if val is None:
        if len(tx) < 2:
            raise ValueError(f"the training split has {len(tx)} example(s), too few to hold out a validation split")
        tx, ty, vx, vy = hold_out(tx, ty, val_size)
    else:
        vx, vy = _inputs(val)
    ex, ey = _inputs(test) if test is not None and len(test) > 0 else (None, None)
    if len(tx) == 0 or len(vx) == 0:
        raise ValueError(f"the {'training' if len(tx) == 0 else 'validation'} split is empty")
    for split, x in (("validation", vx), ("test", ex)):
        if x is not None and tx.shape[1:] != x.shape[1:]:
            raise ValueError(f"training inputs are {tuple(tx.shape[1:])} but {split} inputs {tuple(x.shape[1:])}")
    for split, y in (("training", ty), ("validation", vy), ("test", ey)):
        if y is None:
            continue
        lo, hi = int(y.min()), int(y.max())
        if lo < 0 or hi >= num_classes:
            raise ValueError(
                f"{split} labels run from {lo} to {hi}, outside 0..{num_classes - 1}; set "
                f"data.num_classes to the number of classes"
            )
    scale = 255.0 if not tx.is_floating_point() else 1.0
    tx, vx = tx.to(torch.float32) / scale, vx.to(torch.float32) / scale
    dims = [0] + list(range(2, tx.dim()))
    mean = tx.mean(dim=dims, keepdim=True)
    std = tx.std(dim=dims, keepdim=True).clamp_min(1e-6)
    if augment and tx.dim() != 4:
        raise ValueError("augment=true crops and flips images: it needs (N, C, H, W) inputs")
    if ex is not None:
        ex = ((ex.to(torch.float32) / scale - mean) / std).contiguous()
    return Dataset(
        name,
        ((tx - mean) / std).contiguous(),
        ty,
        ((vx - mean) / std).contiguous(),
        vy,
        num_classes=num_classes,
        augment=augment,
        test_x=ex,
        test_y=ey,
    )


# ------------------------------------------------------------------------ cheap checks before loading


def train_size(name: str, root: str, synthetic_train_size: int = 5000, val_size: int = VAL_SIZE) -> int | None:
    """Training-split size without loading the data, where that is cheap; None when unknown."""
    if name == "digits":
        return 1797 - 297
    if name == "synthetic":
        return synthetic_train_size
    if name == "mnist":
        path = os.path.join(root, "MNIST", "raw", "train-labels-idx1-ubyte")
        if os.path.isfile(path):
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8)[4:8], "big")  # IDX header: magic, then the item count
            return n - held_out(n, val_size)
    return None


def ensure_available(name: str, root: str, download: bool, timeout_s: float = 30.0) -> None:
    """Make sure a file-backed dataset is on disk, downloading it if allowed; else raise DatasetMissing.

    Runs in the parent process before any job starts. A socket timeout bounds the download attempt, so an
    offline machine fails in seconds rather than hanging. The download goes to a temporary folder, and its files
    into `root` only once it has succeeded: a download that fails (the refusal that follows) leaves `root` as it
    was, not even created.
    """
    if name not in ("mnist", "cifar10"):
        return
    inside = os.path.join("MNIST", "raw") if name == "mnist" else "cifar-10-batches-py"
    folder, files = os.path.join(os.path.abspath(root), inside), (MNIST_FILES if name == "mnist" else CIFAR_FILES)
    if all(os.path.isfile(os.path.join(folder, f)) for f in files):
        return
    if not download:
        raise _download_failed(name, folder, files, download=False)
    import shutil
    import socket
    import tempfile

    old = socket.getdefaulttimeout()
    socket.setdefaulttimeout(timeout_s)
    try:
        with tempfile.TemporaryDirectory(prefix="gem-download-") as tmp:
            try:
                (load_mnist if name == "mnist" else load_cifar10)(tmp, download=True)
            except DatasetMissing:  # said of the folder the user named, not of the temporary one
                raise _download_failed(name, folder, files, download=True) from None
            os.makedirs(folder, exist_ok=True)
            for f in os.listdir(os.path.join(tmp, inside)):
                if not os.path.exists(os.path.join(folder, f)):
                    shutil.move(os.path.join(tmp, inside, f), os.path.join(folder, f))
    finally:
        socket.setdefaulttimeout(old)
