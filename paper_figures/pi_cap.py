"""Why GEM's median π rises through the epoch (REPRODUCTION.md, Fig. 3): a check on the proxy itself.

    python -m paper_figures.pi_cap --root ../shared/data/full          # full MNIST, one epoch: about 30 s of CPU

GEM's π for one element is (κ|m| − |θ − s|) / |Δθ|, clamped to [0, π_max]: it reaches π_max = 5 where the proxy's
momentum |m| is large against this step's |Δθ|. The fig1 runs show that share nearly doubling over the epoch. The
reading to check: as the network fits, fewer of a batch's examples still have loss, so an element's gradient comes
and goes from step to step while |m| (μ = 0.9: about ten steps of memory) keeps the last large ones.

This trains sequential momentum SGD (the proxy, no staleness) at the paper's settings (η = 0.05, μ = 0.9, b = 64,
one epoch, the MNIST CNN) and prints, for each fifth of the epoch, the mean over steps of: the share of elements
with |m| > π_max |Δθ| (where π could reach its cap with κ = 1: it leaves out |θ − s|, which only lowers π, so this
is an upper bound on GEM's share at the cap, not GEM's share), the same among the elements whose gradient is not
exactly 0 (where it is, π is at the cap trivially and πΔθ = 0), the share of gradient elements exactly 0, and the
share of the batch's examples whose loss is above 0.01.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.nn.functional as F

from gem.data import DatasetMissing, load_dataset
from gem.models import build_model

PI_MAX = 5.0


def measure(
    data, steps: int | None = None, lr: float = 0.05, momentum: float = 0.9, batch_size: int = 64, seed: int = 0
) -> np.ndarray:
    """Rows (step, training loss, share at the cap, share at the cap among nonzero gradients, share of zero
    gradients, share of examples with loss > 0.01)."""
    torch.manual_seed(seed)
    model = build_model("mnist_cnn", data.num_classes)
    params = list(model.parameters())
    m = [torch.zeros_like(p) for p in params]
    size = sum(p.numel() for p in params)
    order = torch.randperm(len(data.train_x))
    steps = len(order) // batch_size if steps is None else steps
    rows = []
    for step in range(steps):
        idx = order[step * batch_size : (step + 1) * batch_size]
        per_example = F.nll_loss(model(data.train_x[idx]), data.train_y[idx], reduction="none")  # the CNN's log-softmax
        model.zero_grad()
        loss = per_example.mean()
        loss.backward()
        capped = capped_live = zero = 0
        with torch.no_grad():
            for p, mp in zip(params, m, strict=True):
                delta = p.grad.mul(-lr)
                mp.mul_(momentum).add_(delta)
                at_cap, silent = mp.abs() > PI_MAX * delta.abs(), p.grad == 0
                capped += int(at_cap.sum())
                capped_live += int((at_cap & ~silent).sum())
                zero += int(silent.sum())
                p.add_(mp)
        rows.append(
            (
                step,
                loss.item(),
                capped / size,
                capped_live / max(size - zero, 1),
                zero / size,
                (per_example > 0.01).float().mean().item(),
            )
        )
    return np.array(rows)


def table(rows: np.ndarray, parts: int = 5) -> str:
    lines = [
        "| steps | training loss | abs(m) > 5 abs(Δθ) | the same, gradient ≠ 0 | gradient = 0 | "
        "examples with loss > 0.01 |",
        "|---|---|---|---|---|---|",
    ]
    for part in np.array_split(rows, min(parts, len(rows))):
        loss, capped, capped_live, zero, live = part[:, 1:].mean(axis=0)
        lines.append(
            f"| {int(part[0, 0]) + 1}-{int(part[-1, 0]) + 1} | {loss:.3f} | {capped:.2f} | {capped_live:.2f} "
            f"| {zero:.2f} | {live:.2f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m paper_figures.pi_cap", description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="mnist", choices=("mnist", "digits"))
    ap.add_argument("--root", default="../shared/data/full", help="the MNIST folder (data=mnist)")
    ap.add_argument("--steps", type=int, default=None, help="default: one epoch")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        ap.error(f"--steps={args.steps} is not allowed; give a positive number of steps")
    torch.set_num_threads(1)  # a small CNN at b = 64: a second thread gains little, and stalls beside a sweep
    try:
        data = load_dataset(args.data, args.root)
    except DatasetMissing as e:
        ap.exit(2, f"{ap.prog}: error: {e}\n")
    print(f"the proxy (momentum SGD, η = 0.05, μ = 0.9, b = 64) on {args.data}: {len(data.train_x)} training examples")
    print(table(measure(data, args.steps, seed=args.seed)))


if __name__ == "__main__":
    main()
