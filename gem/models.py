"""Models of the paper, and a flat view of their parameters.

Every engine works on one flat tensor of parameters (the central variable θ, a worker's stale copy `s`,
its momentum `m`, ...). `FlatModel` rebinds a module's parameters and gradients to views of two flat buffers,
so that a forward/backward pass reads θ and writes ∇L without any gather or scatter copy.
"""

from __future__ import annotations

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
    """

    input_shape = (3, 32, 32)

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 64, kernel_size=3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(64, 192, kernel_size=3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(192, 384, kernel_size=3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(384, 256, kernel_size=3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(256, 256, kernel_size=3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Dropout(0.5), nn.Linear(256 * 4 * 4, 1024), nn.ReLU(inplace=True),
            nn.Dropout(0.5), nn.Linear(1024, 1024), nn.ReLU(inplace=True),
            nn.Linear(1024, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x).flatten(1)
        return F.log_softmax(self.classifier(x), dim=1)


MODELS = {"mnist_cnn": MnistCNN, "alexnet_cifar": AlexNetCifar}


def build_model(name: str, num_classes: int = 10) -> nn.Module:
    if name not in MODELS:
        raise ValueError(f"model={name} is not a model; choose one of: {', '.join(sorted(MODELS))}")
    return MODELS[name](num_classes=num_classes)


def input_shape(name: str) -> tuple[int, int, int]:
    return MODELS[name].input_shape


class FlatModel:
    """A module whose parameters are views of one flat tensor `param`, and gradients views of `grad`.

    `load(x)` copies a flat parameter vector in; `loss_and_grad(x, y)` runs forward and backward and leaves
    ∇L in `grad`. Parameter tensors keep their module order, which is also the order of `tensor_names`
    (used for per-tensor diagnostics such as GEM's π heatmaps).
    """

    def __init__(self, module: nn.Module, device: torch.device | str = "cpu"):
        self.module = module.to(device)
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

    @property
    def numel(self) -> int:
        return self.param.numel()

    def load(self, flat: torch.Tensor) -> None:
        if flat.data_ptr() != self.param.data_ptr():
            self.param.copy_(flat)

    def loss_and_grad(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Mean NLL loss of the current parameters on (x, y); ∇L is written into `self.grad`."""
        self.module.train()
        self.grad.zero_()
        loss = F.nll_loss(self.module(x), y)
        # autograd accumulates into the existing .grad views in place, so ∇L lands in the flat buffer
        loss.backward()
        return loss.item()

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1024) -> tuple[float, float]:
        """(mean loss, accuracy) of the current parameters on a whole split, in eval mode."""
        self.module.eval()
        total_loss, correct = 0.0, 0
        for i in range(0, len(x), batch_size):
            out = self.module(x[i:i + batch_size])
            total_loss += F.nll_loss(out, y[i:i + batch_size], reduction="sum").item()
            correct += (out.argmax(1) == y[i:i + batch_size]).sum().item()
        n = max(len(x), 1)
        return total_loss / n, correct / n
