"""Models of the paper, any other model by import path, and a flat view of their parameters.

Every engine works on one flat tensor of parameters (the central variable θ, a worker's stale copy `s`,
its momentum `m`, ...). `FlatModel` rebinds a module's parameters and gradients to views of two flat buffers,
so that a forward/backward pass reads θ and writes ∇L without any gather or scatter copy.

Buffers (BatchNorm's running statistics, say) are not part of θ: each worker's model keeps its own, and they never
reach a gradient, since a module in training mode normalises with the batch's own statistics. The central
variable's running statistics are those of θ itself, measured when it is evaluated (gem.engines.core.Evaluator:
`recalibrate`). Averaging workers' statistics instead would mix statistics of stale parameters into θ's, and
sending them with every commit would cost a second message for numbers no gradient reads.
"""

from __future__ import annotations

import importlib
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


class MnistCNN(nn.Module):
    """The paper's MNIST network (Hermans & Louppe 2018, Appendix A).

    conv 1→10 k5, max-pool, conv 10→20 k5 with (2-d) dropout, max-pool, then FC 320→300→200→10 and
    log-softmax. The FC layers are wider than PyTorch's MNIST example on purpose: the authors made the
    computation "more expensive" so that workers spend most of their time computing, as in a real cluster.
    """

    input_shape = (1, 28, 28)
    log_probs = True  # outputs log-probabilities: the default loss is nll (LOSSES)

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 300)
        self.fc2 = nn.Linear(300, 200)
        self.fc3 = nn.Linear(200, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.flatten(1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return F.log_softmax(self.fc3(x), dim=1)


class AlexNetCifar(nn.Module):
    """AlexNet adapted to 32×32 CIFAR-10 inputs.

    Adapted from torchvision's `alexnet` (itself after Krizhevsky 2014, "One weird trick"): the same five
    convolutions with the same widths (64, 192, 384, 256, 256) and three fully connected layers with dropout.
    Two changes make it fit 32×32 images, the same changes the common CIFAR ports of AlexNet make
    (e.g. bearpaw/pytorch-classification's `models/cifar/alexnet.py` shrinks the stem):
    - the 11×11/4 stem and 5×5 second convolution become 3×3/1 convolutions, and each max-pool is 2×2/2, so
      32×32 reaches a 4×4×256 map after three pools (ImageNet's 224×224 reaches 6×6×256);
    - the hidden FC layers are 1024 wide instead of 4096, since the 4×4 map carries 2.25× fewer features.
    The 16 parameter tensors (8 weights, 8 biases) are what the paper's per-tensor π heatmaps show.

    Initialisation: He et al. 2015 (`kaiming_uniform_`, ReLU gain) for the seven hidden layers, zero biases; the
    output layer keeps PyTorch's default. With PyTorch's default everywhere (a 1/√3 gain), this 8-layer ReLU net
    without normalisation shrinks the signal about 2.3× per layer: at θ₀ the logits spread by 0.02, the weight
    gradients are 1e-3 of the weights, and momentum SGD at η = 0.01 stayed at the chance loss for more than 500
    steps even on data a linear probe separates (REPRODUCTION.md, Fig. 7). Krizhevsky et al. used N(0, 0.01)
    with unit biases, which needs their local response normalisation; He's scaling is what keeps a plain ReLU
    stack's signal at unit scale.
    """

    input_shape = (3, 32, 32)
    log_probs = True

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 64, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(64, 192, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(192, 384, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(384, 256, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(256, 256, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Dropout(0.5),
            nn.Linear(256 * 4 * 4, 1024),
            nn.ReLU(inplace=True),
            nn.Dropout(0.5),
            nn.Linear(1024, 1024),
            nn.ReLU(inplace=True),
            nn.Linear(1024, num_classes),
        )
        hidden = [m for m in self.modules() if isinstance(m, (nn.Conv2d, nn.Linear))][:-1]
        for m in hidden:
            nn.init.kaiming_uniform_(m.weight, nonlinearity="relu")
            nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x).flatten(1)
        return F.log_softmax(self.classifier(x), dim=1)


def resnet18_cifar(num_classes: int = 10) -> nn.Module:
    """torchvision's ResNet-18 with the usual CIFAR stem: a 3×3/1 first convolution and no max-pool, so that a
    32×32 image reaches the last stage at 4×4 rather than 1×1 (He et al. 2016, §4.2, do the same for CIFAR). It
    outputs logits (loss=cross_entropy) and has BatchNorm: see this module's docstring for its buffers."""
    from torchvision.models import resnet18

    m = resnet18(num_classes=num_classes)
    m.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    m.maxpool = nn.Identity()
    m.input_shape = (3, 32, 32)
    return m


MODELS = {"mnist_cnn": MnistCNN, "alexnet_cifar": AlexNetCifar, "resnet18_cifar": resnet18_cifar}
LOSSES = ("nll", "cross_entropy")  # nll: the model outputs log-probabilities; cross_entropy: logits


@dataclass(frozen=True)
class ModelSpec:
    """How to build a model in any process: `factory(**kwargs)` must return a `torch.nn.Module`.

    Plain strings and JSON values only, so that a spec travels to spawned processes and over the wire
    (engine=distributed) and is rebuilt there. `factory` is an import path ("package.module.Class"); a Hydra
    config becomes `ModelSpec(name, "hydra.utils.instantiate", {"config": {...}})` (experiments/ does that: this
    package never imports Hydra itself).
    """

    name: str  # what the run directory calls the model
    factory: str
    kwargs: dict = field(default_factory=dict)


def locate(path: str):
    """The object at an import path: "package.module.attr" (or "package.module:attr")."""
    module, _, attr = path.replace(":", ".").rpartition(".")
    if not module:
        raise ValueError(f"{path} is not an import path (package.module.Name)")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{path} cannot be imported ({type(e).__name__}: {e})") from None


def build_model(model: str | ModelSpec, num_classes: int = 10) -> nn.Module:
    """A built-in model by name (with `num_classes` outputs), or the module a ModelSpec builds."""
    if isinstance(model, ModelSpec):
        module = locate(model.factory)(**model.kwargs)
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"model {model.name}: {model.factory} returned a {type(module).__name__}, not a torch.nn.Module"
            )
        return module
    if model not in MODELS:
        raise ValueError(f"model={model} is not a model; choose one of: {', '.join(sorted(MODELS))}")
    return MODELS[model](num_classes=num_classes)


def model_name(model: str | ModelSpec) -> str:
    return model.name if isinstance(model, ModelSpec) else model


def input_shape(model: str | nn.Module) -> tuple[int, ...] | None:
    """The input shape a model declares (`input_shape`, as the built-in ones do); None if it declares none."""
    if isinstance(model, str):
        return tuple(build_model_meta(model).input_shape)
    shape = getattr(model, "input_shape", None)
    return tuple(shape) if shape is not None else None


def build_model_meta(model: str | ModelSpec, num_classes: int = 10) -> nn.Module:
    """The model's structure without allocating or initialising anything (shapes, names, attributes)."""
    with torch.device("meta"):
        return build_model(model, num_classes)


def default_loss(module: nn.Module) -> str:
    """nll for a model that says it outputs log-probabilities (`log_probs = True`), else cross_entropy."""
    return "nll" if getattr(module, "log_probs", False) else "cross_entropy"


PRECISIONS = ("fp32", "bf16")


class FlatModel:
    """A module whose parameters are views of one flat tensor `param`, and gradients views of `grad`.

    `load(x)` copies a flat parameter vector in; `loss_and_grad(x, y)` runs forward and backward and leaves
    ∇L in `grad`. Parameter tensors keep their module order, which is also the order of `tensor_names`
    (used for per-tensor diagnostics such as GEM's π heatmaps).

    `loss`: nll (the model outputs log-probabilities, as the paper's networks do) or cross_entropy (logits).
    `precision`: bf16 runs the forward and backward passes under autocast; the parameters, their gradients and
    everything the algorithms compute stay float32.
    """

    def __init__(
        self, module: nn.Module, device: torch.device | str = "cpu", loss: str = "nll", precision: str = "fp32"
    ):
        if loss not in LOSSES:
            raise ValueError(f"loss={loss} is not allowed; choose one of: {', '.join(LOSSES)}")
        if precision not in PRECISIONS:
            raise ValueError(f"precision={precision} is not allowed; choose one of: {', '.join(PRECISIONS)}")
        self.module = module.to(device)
        self.device = torch.device(device)
        self.loss_fn = F.nll_loss if loss == "nll" else F.cross_entropy
        self.precision = precision
        named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        self.tensor_names = [n for n, _ in named]
        self.numels = [p.numel() for _, p in named]
        total = sum(self.numels)
        self.param = torch.empty(total, device=device)
        self.grad = torch.zeros(total, device=device)
        offset = 0
        self.slices = []
        for (_, p), k in zip(named, self.numels, strict=True):
            view = slice(offset, offset + k)
            self.param[view].copy_(p.data.flatten())
            p.data = self.param[view].view_as(p)
            p.grad = self.grad[view].view_as(p)
            self.slices.append(view)
            offset += k
        self.norms = [
            m for m in self.module.modules() if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats
        ]

    @property
    def layout(self) -> list[tuple[str, slice]]:
        """Each parameter tensor's name and its slice of the flat vector, in order (what per-tensor statistics
        read)."""
        return list(zip(self.tensor_names, self.slices, strict=True))

    @property
    def numel(self) -> int:
        return self.param.numel()

    def load(self, flat: torch.Tensor) -> None:
        if flat.data_ptr() != self.param.data_ptr():
            self.param.copy_(flat, non_blocking=True)

    def _autocast(self):
        if self.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    def loss_and_grad(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Mean loss of the current parameters on (x, y); ∇L is written into `self.grad`."""
        self.module.train()
        self.grad.zero_()
        with self._autocast():
            out = self.module(x)
        loss = self.loss_fn(out.float(), y)
        # autograd accumulates into the existing .grad views in place, so ∇L lands in the flat buffer
        loss.backward()
        return loss.item()

    @torch.no_grad()
    def recalibrate(self, x: torch.Tensor, batch_size: int = 256) -> None:
        """Running statistics of every BatchNorm layer measured afresh for the current parameters: an equally
        weighted average over the batches of `x`, in training-mode normalisation. Other modules stay in eval mode
        (no dropout draws). Nothing to do for a model without such layers."""
        if not self.norms:
            return
        self.module.eval()
        saved = [m.momentum for m in self.norms]
        for m in self.norms:
            m.reset_running_stats()
            m.momentum = None  # None: the cumulative average over the batches seen since the reset
            m.train()
        try:
            for i in range(0, len(x), batch_size):
                self.module(x[i : i + batch_size].to(self.device, non_blocking=True))
        finally:
            for m, momentum in zip(self.norms, saved, strict=True):
                m.momentum = momentum
            self.module.eval()

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1024) -> tuple[float, float]:
        """(mean loss, accuracy) of the current parameters on a whole split, in eval mode and float32."""
        self.module.eval()
        total_loss, correct = 0.0, 0
        for i in range(0, len(x), batch_size):
            xb = x[i : i + batch_size].to(self.device, non_blocking=True)
            yb = y[i : i + batch_size].to(self.device, non_blocking=True)
            out = self.module(xb)
            total_loss += self.loss_fn(out, yb, reduction="sum").item()
            correct += (out.argmax(1) == yb).sum().item()
        n = max(len(x), 1)
        return total_loss / n, correct / n
