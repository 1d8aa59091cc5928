"""Small files in CIFAR-10's python layout, for tests that read them as torchvision does."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np


def write_cifar(root: Path, per_batch: int = 3, test_size: int = 4, seed: int = 0):
    """Small files in CIFAR-10's python layout under root/cifar-10-batches-py; returns what was written.

    Each batch is a pickled dict with "data" (uint8 N×3072: the R plane, then G, then B, each 32×32
    row-major), "labels", "batch_label" and "filenames"; batches.meta holds "label_names". The real files are
    Python 2 pickles whose byte-string keys torchvision reads as str (pickle.load(..., encoding="latin1")),
    so str keys here are what torchvision sees.
    """
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    written = {}
    for name, n in [(f"data_batch_{i}", per_batch) for i in range(1, 6)] + [("test_batch", test_size)]:
        data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n).tolist()
        with open(folder / name, "wb") as f:
            pickle.dump(
                {
                    "data": data,
                    "labels": labels,
                    "batch_label": f"{name} of 5",
                    "filenames": [f"{name}_{i}.png" for i in range(n)],
                },
                f,
            )
        written[name] = (data, labels)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump(
            {
                "num_cases_per_batch": per_batch,
                "num_vis": 3072,
                "label_names": [
                    "airplane",
                    "automobile",
                    "bird",
                    "cat",
                    "deer",
                    "dog",
                    "frog",
                    "horse",
                    "ship",
                    "truck",
                ],
            },
            f,
        )
    return written
