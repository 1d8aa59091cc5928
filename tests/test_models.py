"""Tests of gem.models (the paper's networks, FlatModel) and of sequential SGD through the sim engine."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gem.algorithms import sgd
from gem.data import WorkerStream, make_synthetic
from gem.engines import Job, core, sim
from gem.engines.worker import dropout_seed
from gem.metrics import Recorder, read_table
from gem.models import AlexNetCifar, FlatModel, MnistCNN, build_model, input_shape


def flat_grads(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in module.parameters()])


def flat_params(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()])


# ---------------------------------------------------------------------------------------- mnist_cnn


def test_mnist_cnn_architecture_matches_appendix_a():
    m = build_model("mnist_cnn")
    assert isinstance(m, MnistCNN)
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    assert shapes == {
        "conv1.weight": (10, 1, 5, 5),
        "conv1.bias": (10,),
        "conv2.weight": (20, 10, 5, 5),
        "conv2.bias": (20,),
        "fc1.weight": (300, 320),
        "fc1.bias": (300,),
        "fc2.weight": (200, 300),
        "fc2.bias": (200,),
        "fc3.weight": (10, 200),
        "fc3.bias": (10,),
    }
    assert sum(p.numel() for p in m.parameters()) == 163_790
    assert input_shape("mnist_cnn") == (1, 28, 28)


def test_mnist_cnn_outputs_log_probabilities():
    torch.manual_seed(0)
    m = build_model("mnist_cnn").eval()
    out = m(torch.randn(7, 1, 28, 28))
    assert out.shape == (7, 10)
    assert (out <= 0).all()
    torch.testing.assert_close(out.exp().sum(1), torch.ones(7))
    m.train()  # dropout active: still log-probabilities
    torch.testing.assert_close(m(torch.randn(3, 1, 28, 28)).exp().sum(1), torch.ones(3))


def test_mnist_cnn_dropout_only_in_train_mode():
    torch.manual_seed(0)
    m = build_model("mnist_cnn")
    x = torch.randn(4, 1, 28, 28)
    m.eval()
    assert torch.equal(m(x), m(x))
    m.train()
    torch.manual_seed(1)
    a = m(x)
    torch.manual_seed(2)
    b = m(x)
    assert not torch.allclose(a, b)


def test_build_model_rejects_unknown_name():
    with pytest.raises(ValueError, match="resnet"):
        build_model("resnet")


def test_num_classes_sets_the_output_width():
    assert build_model("mnist_cnn", num_classes=4).fc3.weight.shape == (4, 200)


# ------------------------------------------------------------------------------------ alexnet_cifar


def test_alexnet_cifar_shapes_and_log_probabilities():
    torch.manual_seed(0)
    m = build_model("alexnet_cifar").eval()
    assert isinstance(m, AlexNetCifar)
    assert input_shape("alexnet_cifar") == (3, 32, 32)
    params = list(m.parameters())
    assert len(params) == 16
    assert sum(p.dim() > 1 for p in params) == 8  # 8 weights, 8 biases
    with torch.no_grad():
        out = m(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 10)
    torch.testing.assert_close(out.exp().sum(1), torch.ones(2))


# ---------------------------------------------------------------------------------------- FlatModel


@pytest.fixture
def flat_and_reference():
    torch.manual_seed(0)
    module = MnistCNN()
    reference = copy.deepcopy(module)
    return FlatModel(module), reference


def test_flat_model_keeps_the_initial_weights_in_module_order(flat_and_reference):
    flat, ref = flat_and_reference
    assert flat.numel == 163_790
    assert flat.tensor_names == [n for n, _ in ref.named_parameters()]
    assert flat.numels == [p.numel() for p in ref.parameters()]
    assert torch.equal(flat.param, flat_params(ref))


def test_flat_model_param_buffer_is_shared_with_the_module(flat_and_reference):
    flat, _ = flat_and_reference
    m = flat.module
    flat.param[0] = 123.0
    assert m.conv1.weight[0, 0, 0, 0].item() == 123.0
    flat.param[-1] = -7.0
    assert m.fc3.bias[-1].item() == -7.0
    with torch.no_grad():
        m.fc1.weight[2, 3] = 42.0
    offset = flat.slices[flat.tensor_names.index("fc1.weight")].start
    assert flat.param[offset + 2 * 320 + 3].item() == 42.0
    new = torch.randn(flat.numel)
    flat.load(new)
    assert torch.equal(flat_params(m), new)
    for p, s in zip(m.parameters(), flat.slices, strict=True):
        assert p.data_ptr() == flat.param[s].data_ptr()
        assert p.grad is not None and p.grad.data_ptr() == flat.grad[s].data_ptr()


def test_flat_model_grad_matches_an_ordinary_copy(flat_and_reference):
    flat, ref = flat_and_reference
    torch.manual_seed(1)
    x, y = torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,))
    flat.module.eval()  # loss_and_grad must switch to train mode itself (dropout on)
    for step in range(2):
        if step == 1:  # also after loading other parameters
            new = flat.param + 0.01 * torch.randn(flat.numel)
            flat.load(new)
            torch.nn.utils.vector_to_parameters(new.clone(), ref.parameters())
        torch.manual_seed(100 + step)
        loss = flat.loss_and_grad(x, y)
        ref.train()
        ref.zero_grad()
        torch.manual_seed(100 + step)
        ref_loss = F.nll_loss(ref(x), y)
        ref_loss.backward()
        assert loss == pytest.approx(ref_loss.item(), rel=1e-6)
        torch.testing.assert_close(flat.grad, flat_grads(ref), rtol=1e-5, atol=1e-7)
        assert flat.grad.abs().sum() > 0
        for p, s in zip(flat.module.parameters(), flat.slices, strict=True):  # the module's .grad views see it too
            assert torch.equal(p.grad.flatten(), flat.grad[s])


def test_flat_model_grad_does_not_accumulate(flat_and_reference):
    flat, _ = flat_and_reference
    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    torch.manual_seed(5)
    flat.loss_and_grad(x, y)
    first = flat.grad.clone()
    torch.manual_seed(5)
    flat.loss_and_grad(x, y)
    assert torch.equal(flat.grad, first)
    torch.manual_seed(6)  # another dropout mask gives another gradient: train mode is on
    flat.loss_and_grad(x, y)
    assert not torch.allclose(flat.grad, first)


def test_flat_model_evaluate_matches_manual_eval_mode(flat_and_reference):
    flat, ref = flat_and_reference
    torch.manual_seed(3)
    x, y = torch.randn(50, 1, 28, 28), torch.randint(0, 10, (50,))
    loss, acc = flat.evaluate(x, y, batch_size=16)  # batches of 16, 16, 16, 2
    ref.eval()
    with torch.no_grad():
        out = ref(x)
    assert loss == pytest.approx(F.nll_loss(out, y).item(), rel=1e-5)
    assert acc == pytest.approx((out.argmax(1) == y).float().mean().item())


# ------------------------------------------------------------- sim engine, sgd == torch.optim.SGD


def test_sim_sgd_one_worker_equals_torch_sgd_with_momentum(tmp_path, monkeypatch):
    seed, bs, lr, mu = 3, 32, 0.05, 0.9
    data = make_synthetic(shape=(1, 28, 28), train_size=256, val_size=32, seed=0)
    job = Job(
        algorithm="sgd",
        hp=sgd.Params(lr=lr, momentum=mu),
        model="mnist_cnn",
        data=data,
        workers=1,
        batch_size=bs,
        epochs=1,
        seed=seed,
        eval_every=10**9,
        eval_train_size=32,
    )

    seen = []
    original = core.Evaluator.__call__

    def capture(self, theta, step, t0, **extra):
        seen.append((step, theta.clone()))
        return original(self, theta, step, t0, **extra)

    monkeypatch.setattr(core.Evaluator, "__call__", capture)
    recorder = Recorder(tmp_path)
    result = sim.run(job, recorder)
    recorder.close()
    steps = 256 // bs
    assert result.status == "completed" and result.steps == steps
    assert [s for s, _ in seen] == [0, steps]  # evaluated at the start and once at the end
    final = seen[-1][1]

    # The reference: same init (the engine seeds then builds), the worker's own dropout stream (seeded by
    # (seed, worker) and drawn from nothing else), and the worker's own batch stream.
    torch.manual_seed(seed)
    ref = build_model("mnist_cnn")
    init = flat_params(ref).clone()
    torch.testing.assert_close(seen[0][1], init, rtol=0, atol=0)
    torch.manual_seed(dropout_seed(seed, 0))
    opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=mu)
    stream = WorkerStream(len(data.train_y), bs, seed, 0)
    ref.train()
    losses = []
    for _ in range(steps):
        idx = stream.next_indices()
        opt.zero_grad()
        loss = F.nll_loss(ref(data.train_x[idx]), data.train_y[idx])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert not torch.allclose(final, init)  # it did train
    torch.testing.assert_close(final, flat_params(ref), rtol=0, atol=1e-5)

    metrics = read_table(tmp_path)
    assert metrics["step"].tolist() == list(range(1, steps + 1))
    assert (metrics["staleness"] == 0).all() and (metrics["worker"] == 0).all()
    assert metrics["loss"].tolist() == pytest.approx(losses, rel=1e-4)


def test_alexnet_hidden_layers_are_he_initialised_and_the_output_layer_is_default():
    torch.manual_seed(0)
    m = AlexNetCifar()
    layers = [x for x in m.modules() if isinstance(x, (torch.nn.Conv2d, torch.nn.Linear))]
    for layer in layers[:-1]:  # kaiming_uniform_(relu): U(±√(6 / fan_in)), std √(2 / fan_in); zero biases
        fan_in = layer.weight[0].numel()
        assert layer.weight.std().item() == pytest.approx((2 / fan_in) ** 0.5, rel=0.05)
        assert not layer.bias.any()
    out = layers[-1]  # PyTorch's default: U(±1/√fan_in), std 1/√(3 fan_in)
    assert out.weight.std().item() == pytest.approx((1 / (3 * 1024)) ** 0.5, rel=0.05) and out.bias.any()


def test_a_flat_model_config_is_built_without_hydra_and_a_nested_one_through_it():
    """Worker processes build their model from its spec: a `_target_` with plain keyword arguments is called
    directly (no Hydra import in each of 100 workers); anything Hydra would treat differently still goes
    through `hydra.utils.instantiate`. Both build the same module."""
    from experiments.config import compose
    from experiments.instantiate import model_spec
    from gem.models import ModelSpec

    flat = model_spec(compose(["model=mnist_cnn"]))
    assert (flat.factory, flat.kwargs) == ("gem.models.MnistCNN", {"num_classes": 10})
    nested = model_spec(compose(["model=mnist_cnn", "+model.extra={a: 1}"]))
    assert nested.factory == "hydra.utils.instantiate"
    torch.manual_seed(0)
    a = build_model(flat)
    torch.manual_seed(0)
    b = build_model(
        ModelSpec(
            "mnist_cnn", "hydra.utils.instantiate", {"config": {"_target_": "gem.models.MnistCNN", "num_classes": 10}}
        )
    )
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


# ----------------------------------------------------------------------------- a newcomer's own model


class PlainNet(nn.Module):
    """As a newcomer writes a model: a constructor without arguments."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(28 * 28, self.outputs)

    outputs = 10

    def forward(self, x):
        return self.fc(x.flatten(1))


class SevenNet(PlainNet):
    outputs = 7


def test_num_classes_is_passed_only_to_a_constructor_that_takes_it():
    """The model group's default num_classes (${data.num_classes}) is left out for a constructor without it; a
    value the user sets is passed, and a constructor that cannot take it says so."""
    from experiments.config import ConfigError, checked, compose
    from experiments.instantiate import model_spec

    plain = compose([f"model._target_={__name__}.PlainNet"])
    assert model_spec(plain).kwargs == {} and checked(plain)
    assert model_spec(compose(["model=mnist_cnn"])).kwargs == {"num_classes": 10}
    with pytest.raises(ConfigError, match=r"PlainNet could not be built: TypeError: .*num_classes"):
        checked(compose([f"model._target_={__name__}.PlainNet", "model.num_classes=10"]))


def test_the_class_count_hint_names_only_keys_the_model_has(tmp_path):
    from experiments.api import Refused, run

    with pytest.raises(Refused) as e:
        run(f"model._target_={__name__}.SevenNet", f"hydra.run.dir={tmp_path / 'run'}")
    assert str(e.value) == (
        f"model={__name__}.SevenNet has 7 outputs but data=digits has 10 classes; give the model "
        "10 outputs (its constructor takes no num_classes), or set data.num_classes if the data "
        "has 7 classes"
    )
    assert not (tmp_path / "run").exists()
    with pytest.raises(Refused, match=r"; set model.num_classes=10, or set data.num_classes"):
        run("model=mnist_cnn", "model.num_classes=7", f"hydra.run.dir={tmp_path / 'run2'}")
