"""Real workloads: a user's model and data by `_target_`, the loss, BatchNorm buffers, devices and bf16."""

from __future__ import annotations

import math
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from experiments import instantiate, runner
from experiments.command import preflight
from experiments.config import ConfigError, compose, validate
from gem import data as gdata
from gem import models
from gem.algorithms import gem as gem_algo
from gem.engines import Job, core, sim
from gem.metrics import Recorder, read_table

USER_MODEL = '''
import torch
from torch import nn


class TinyNet(nn.Module):
    """A researcher's own model, outside the package: logits out, BatchNorm inside."""

    def __init__(self, num_classes: int = 10, width: int = 8):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(16 * width, num_classes))

    def forward(self, x):
        return self.body(x)


class Lazy(nn.Module):
    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.LazyLinear(num_classes))

    def forward(self, x):
        return self.body(x)


class Broken(nn.Module):
    def __init__(self, num_classes: int = 10):
        super().__init__()
        raise RuntimeError("this model refuses to be built")
'''

QUIET = ["logger.wandb.mode=disabled", "logger.progress=false"]


@pytest.fixture
def user_models(tmp_path, monkeypatch):
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    (folder / "my_models.py").write_text(USER_MODEL)
    monkeypatch.syspath_prepend(str(folder))  # spawned workers inherit the parent's sys.path
    return folder


def _run(overrides, run_dir):
    return runner.run(compose([*QUIET, *overrides]), run_dir)


# ------------------------------------------------------------------------------------ models by _target_


@pytest.mark.parametrize("engine", ["sim", "process"])
def test_a_user_model_by_target_trains_on_sim_and_process(user_models, tmp_path, engine):
    s = _run(
        [f"engine={engine}", "workers=2", "epochs=2", "model._target_=my_models.TinyNet", "+model.width=4"],
        tmp_path / engine,
    )
    assert s["status"] == "completed", s["reason"]
    assert (s["model"], s["loss"], s["steps"]) == ("my_models.TinyNet", "cross_entropy", 2 * 2 * (1500 // 64))
    assert s["val_loss"] < 0.75 * math.log(10)  # it learns: well below chance


def test_builtin_models_keep_their_names_and_losses():
    for option, loss in (("mnist_cnn", "nll"), ("alexnet_cifar", "nll"), ("resnet18_cifar", "cross_entropy")):
        cfg = compose([f"model={option}", *(["data=synthetic"] if option != "mnist_cnn" else [])])
        checked = validate(cfg)
        assert (instantiate.display_name("model", cfg.model), checked.loss) == (option, loss)
    assert validate(compose(["loss=cross_entropy"])).loss == "cross_entropy"  # = nll on log-probabilities


def test_resnet18_cifar_has_a_cifar_stem():
    m = models.build_model(models.ModelSpec("r", "gem.models.resnet18_cifar", {"num_classes": 7}))
    assert m.conv1.kernel_size == (3, 3) and m.conv1.stride == (1, 1) and isinstance(m.maxpool, nn.Identity)
    assert m(torch.randn(2, 3, 32, 32)).shape == (2, 7)
    assert models.input_shape(m) == (3, 32, 32) and models.default_loss(m) == "cross_entropy"


@pytest.mark.parametrize(
    "overrides, line",
    [
        (["model._target_=my_models.Nope"], "model._target_=my_models.Nope could not be built: "),
        (
            ["model._target_=my_models.Broken"],
            "model._target_=my_models.Broken could not be built: RuntimeError: this model refuses to be built",
        ),
        (
            ["model._target_=my_models.Lazy"],
            "model._target_=my_models.Lazy has lazy parameters (body.1.weight, "
            "body.1.bias): gem needs θ's size when the model is built; give those",
        ),
        (["model._target_=torch.nn.Linear"], "model._target_=torch.nn.Linear could not be built: TypeError: "),
        (
            ["model=resnet18_cifar", "data=mnist"],
            "model=resnet18_cifar expects 3x32x32 inputs but data=mnist gives 1x28x28",
        ),
        (["loss=mse"], "loss=mse is not allowed; choose one of: nll, cross_entropy"),
        (["precision=fp16"], "precision=fp16 is not allowed; choose one of: fp32, bf16"),
        (["data=tensors"], "data.num_classes must be given: add data.num_classes=<value> to the command"),
        (["data=tensors", "data.num_classes=3"], "data.path must be given: add data.path=<value> to the command"),
        (["data._target_=no.such.Dataset"], "data._target_=no.such.Dataset: no.such.Dataset cannot be imported"),
    ],
)
def test_bad_models_and_losses_get_one_line(user_models, overrides, line, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        preflight([*overrides, f"hydra.run.dir={tmp_path / 'never'}"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: " + line) and err.count("\n") == 1, err
    assert not (tmp_path / "never").exists()


def _pairing_data(num_classes=10, shape=(1, 28, 28)):
    x = torch.randn(4, *shape)
    return gdata.Dataset(
        "toy", x, torch.arange(4) % num_classes, x, torch.arange(4) % num_classes, num_classes=num_classes
    )


def test_pairings_the_data_reveals_are_refused_in_one_line(user_models):
    tiny = models.ModelSpec("tiny", "my_models.TinyNet", {"num_classes": 10})
    with pytest.raises(ConfigError, match=r"^loss=nll needs log-probabilities, but model=tiny's outputs are not"):
        instantiate.check_pairing(tiny, "nll", _pairing_data(), 0)
    instantiate.check_pairing(tiny, "cross_entropy", _pairing_data(), 0)
    with pytest.raises(
        ConfigError,
        match=r"^model=tiny has 10 outputs but data=toy has 4 classes; set "
        r"model.num_classes=4",
    ):
        instantiate.check_pairing(tiny, "cross_entropy", _pairing_data(num_classes=4), 0)
    with pytest.raises(ConfigError, match=r"^model=tiny cannot take data=toy's 3x32x32 inputs \(RuntimeError"):
        instantiate.check_pairing(tiny, "cross_entropy", _pairing_data(shape=(3, 32, 32)), 0)
    cnn = models.ModelSpec("mnist_cnn", "gem.models.MnistCNN", {"num_classes": 10})
    instantiate.check_pairing(cnn, "nll", _pairing_data(), 0)


def test_the_loss_is_the_configured_one():
    torch.manual_seed(0)
    x, y = torch.randn(8, 1, 28, 28), torch.arange(8) % 10
    net = models.MnistCNN()
    for loss, fn in (("nll", nn.functional.nll_loss), ("cross_entropy", nn.functional.cross_entropy)):
        flat = models.FlatModel(models.MnistCNN(), loss=loss)
        flat.load(torch.cat([p.detach().flatten() for p in net.parameters()]))
        flat.module.eval()  # no dropout: the reference below is deterministic
        flat.module.train = lambda mode=True, m=flat.module: nn.Module.train(m, False)
        got = flat.loss_and_grad(x, y)
        assert got == pytest.approx(fn(net.eval()(x), y).item(), rel=1e-6)


# ------------------------------------------------------------------------------------------------ data


def _write_idx(path: Path, array: np.ndarray) -> None:
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + b"".join(struct.pack(">I", d) for d in array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def test_fashion_mnist_loads_through_torchvision_from_idx_files(tmp_path):
    raw = tmp_path / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    tx, vx = rng.integers(0, 256, (20, 28, 28)), rng.integers(0, 256, (6, 28, 28))
    ty, vy = np.arange(20) % 10, np.arange(6) % 10
    for prefix, x, y in (("train", tx, ty), ("t10k", vx, vy)):
        _write_idx(raw / f"{prefix}-images-idx3-ubyte", x)
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte", y)
    cfg = compose(["data=fashion_mnist", f"data.root={tmp_path}", "data.download=false"])
    validate(cfg)
    ds = instantiate.load_data(cfg)
    # the training file: 18 to train on, a tenth (2) held out for validation; the t10k file: the test split
    assert (ds.name, ds.shape, ds.num_classes, len(ds.train_y), len(ds.val_y), len(ds.test_y)) == (
        "fashion_mnist",
        (1, 28, 28),
        10,
        18,
        2,
        6,
    )
    kept, held = gdata.hold_out(torch.arange(20), torch.arange(20))[1::2]
    assert torch.equal(ds.train_y, torch.as_tensor(ty)[kept]) and torch.equal(ds.val_y, torch.as_tensor(ty)[held])
    tx = tx[kept.numpy()]
    mean, std = (tx / 255.0).mean(), (tx / 255.0).std(ddof=1)  # per channel, from the training split
    torch.testing.assert_close(ds.train_x[3, 0], torch.as_tensor((tx[3] / 255.0 - mean) / std, dtype=torch.float32))
    torch.testing.assert_close(ds.test_x[5, 0], torch.as_tensor((vx[5] / 255.0 - mean) / std, dtype=torch.float32))


def test_cifar100_loads_from_files_in_cifars_pickle_format(tmp_path):
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    rng = np.random.default_rng(1)
    for name, n in (("train", 12), ("test", 5)):
        entry = {
            "data": rng.integers(0, 256, (n, 3072)).astype(np.uint8),
            "fine_labels": list(range(88, 88 + n)),
            "coarse_labels": [0] * n,
        }
        with open(folder / name, "wb") as f:
            pickle.dump(entry, f)
    with open(folder / "meta", "wb") as f:
        pickle.dump({"fine_label_names": [f"c{i}" for i in range(100)]}, f)
    cfg = compose(["data=cifar100", f"data.root={tmp_path}", "data.download=false", "model=alexnet_cifar"])
    validate(cfg)
    ds = instantiate.load_data(cfg)
    assert (ds.name, ds.shape, ds.num_classes, ds.augment) == ("cifar100", (3, 32, 32), 100, True)
    assert sorted(ds.train_y.tolist() + ds.val_y.tolist()) == list(range(88, 100)) and len(ds.val_y) == 1
    assert ds.test_y.tolist() == list(range(88, 93))


def test_cifar100_missing_is_one_line(tmp_path):
    cfg = compose(["data=cifar100", f"data.root={tmp_path}", "data.download=false", "model=alexnet_cifar"])
    with pytest.raises(gdata.DatasetMissing, match=r"^data._target_=gem.data.cifar100 \(train_kwargs="):
        instantiate.load_data(cfg)


@pytest.mark.parametrize("suffix", [".npz", ".pt"])
def test_plain_tensors_from_a_file(tmp_path, suffix):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(50, 2, 5, 5, generator=g) * 3 + 1, torch.arange(50) % 3
    path = tmp_path / f"mine{suffix}"
    if suffix == ".npz":
        np.savez(path, x=x.numpy(), y=y.numpy())
    else:
        torch.save({"x": x, "y": y}, path)
    train, val = gdata.TensorFile(str(path), train=True), gdata.TensorFile(str(path), train=False)
    assert (len(train), len(val)) == (45, 5)
    assert sorted(train.data[:, 0, 0, 0].tolist() + val.data[:, 0, 0, 0].tolist()) == sorted(x[:, 0, 0, 0].tolist())
    ds = gdata.from_datasets("tensors", train, val, num_classes=3)
    torch.testing.assert_close(ds.train_x.mean(dim=(0, 2, 3)), torch.zeros(2), atol=1e-5, rtol=0)
    torch.testing.assert_close(ds.train_x.std(dim=(0, 2, 3)), torch.ones(2), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="labels run from 0 to 2, outside 0..1; set data.num_classes"):
        gdata.from_datasets("tensors", train, val, num_classes=2)


@pytest.mark.parametrize(
    "keys, train_n, val, test",
    [
        # a test pair is the test split, never validation: validation is then held out of the training arrays
        (
            ("x_train", "y_train", "x_test", "y_test"),
            36,
            "validating on 4 of them (val_fraction 0.1: no x_val/y_val or x_valid/y_valid)",
            "testing on x_test/y_test (8)",
        ),
        (("x", "y", "x_valid", "y_valid"), 40, "validating on x_valid/y_valid (8)", "no test split (no x_test/y_test)"),
        (
            ("x", "y", "x_val", "y_val", "x_test", "y_test"),
            40,
            "validating on x_val/y_val (8)",
            "testing on x_test/y_test (5)",
        ),
    ],
)
def test_a_file_s_splits_are_found_by_their_usual_names_and_named(tmp_path, capsys, keys, train_n, val, test):
    """Every usual name of a held-out split is read, each for what it is (a test pair is never validation data),
    and the line says which arrays serve which split."""
    g = torch.Generator().manual_seed(0)
    train_x, held_x = torch.randn(40, 3, generator=g), torch.randn(8, 3, generator=g) + 100
    arrays = dict(
        zip(
            keys,
            (
                train_x,
                torch.arange(40) % 2,
                held_x,
                torch.arange(8) % 2,
                torch.randn(5, 3, generator=g) - 100,
                torch.arange(5) % 2,
            ),
            strict=False,
        )
    )
    np.savez(tmp_path / "mine.npz", **{k: v.numpy() for k, v in arrays.items()})
    train, val_, test_ = (gdata.TensorFile(str(tmp_path / "mine.npz"), split=s) for s in ("train", "val", "test"))
    assert len(train) == train_n
    if "x_val" in keys or "x_valid" in keys:
        assert torch.equal(val_.data, held_x)
    else:  # held out of the training arrays: no overlap with what train keeps
        assert len(val_) == 4 and not (set(val_.data[:, 0].tolist()) & set(train.data[:, 0].tolist()))
    assert len(test_) == (0 if "x_test" not in keys else len(arrays["x_test"]))
    assert capsys.readouterr().out == (
        f"gem: {tmp_path / 'mine.npz'}: training on {keys[0]}/{keys[1]} (40 examples), {val}, {test}\n"
    )


def test_data_tensors_runs_end_to_end(tmp_path):
    g = torch.Generator().manual_seed(0)
    y = torch.arange(400) % 4
    x = torch.randn(400, 1, 28, 28, generator=g) * 0.5 + y[:, None, None, None].float()  # easy: mean = label
    np.savez(tmp_path / "easy.npz", x=x.numpy(), y=y.numpy())
    s = _run(
        [
            "engine=sim",
            "workers=2",
            "epochs=5",
            "batch_size=32",
            "data=tensors",
            f"data.path={tmp_path / 'easy.npz'}",
            "data.num_classes=4",
        ],
        tmp_path / "run",
    )
    assert s["status"] == "completed" and s["data"] == "tensors" and s["val_accuracy"] > 0.9, s


# ------------------------------------------------------------------------------------- BatchNorm buffers


def _bn_job(data, model="resnet18_cifar", **kw):
    spec = models.ModelSpec(model, f"gem.models.{model}", {"num_classes": data.num_classes})
    return Job(
        algorithm="gem",
        hp=gem_algo.Params(workers=2),
        model=spec,
        data=data,
        workers=2,
        batch_size=8,
        epochs=1,
        seed=0,
        loss="cross_entropy",
        engine={"name": "sim"},
        eval_train_size=16,
        **kw,
    )


def test_resnet18_buffers_are_not_in_theta_and_evaluation_measures_thetas_own_statistics():
    data = gdata.make_synthetic(shape=(3, 32, 32), train_size=32, val_size=8)
    job = _bn_job(data)
    evaluate = core.Evaluator(job, data)
    flat = evaluate.model
    assert flat.numel == sum(p.numel() for p in flat.module.parameters())  # θ: parameters only
    assert len(flat.norms) == 20  # ResNet-18's BatchNorm layers, with running statistics
    theta = flat.param.clone() + 0.01 * torch.randn(flat.numel, generator=torch.Generator().manual_seed(1))
    first = evaluate(theta, 0, 0.0)
    # whatever statistics the evaluator's model held before (a worker's, a previous θ's), θ's own are measured
    for m in flat.norms:
        m.running_mean.normal_()
        m.running_var.uniform_(5, 6)
    again = evaluate(theta, 0, 0.0)
    assert {k: again[k] for k in ("val_loss", "train_loss")} == {k: first[k] for k in ("val_loss", "train_loss")}
    # ... and they are the equally weighted average of the batch statistics on the fixed training subset
    bn1, captured = flat.module.bn1, []
    hook = flat.module.conv1.register_forward_hook(lambda mod, inp, out: captured.append(out.detach()))
    flat.recalibrate(evaluate.train_x, batch_size=8)
    hook.remove()
    assert len(captured) == 2  # 16 examples in batches of 8
    want_mean = torch.stack([c.mean(dim=(0, 2, 3)) for c in captured]).mean(0)
    want_var = torch.stack([c.var(dim=(0, 2, 3), unbiased=True) for c in captured]).mean(0)
    torch.testing.assert_close(bn1.running_mean, want_mean)
    torch.testing.assert_close(bn1.running_var, want_var)
    assert all(m.momentum == 0.1 for m in flat.norms) and not flat.module.training


def test_a_workers_buffers_never_reach_a_gradient():
    data = gdata.make_synthetic(shape=(3, 32, 32), train_size=16, val_size=8)
    flat = core.build_flat_model(_bn_job(data))
    x, y = data.train_x[:8], data.train_y[:8]
    flat.loss_and_grad(x, y)
    g1 = flat.grad.clone()
    for m in flat.norms:
        m.running_mean.normal_()
    flat.loss_and_grad(x, y)
    assert torch.equal(flat.grad, g1)


# --------------------------------------------------------------------------------------------- devices


def test_device_of_spreads_workers_over_gpus_or_pins_them(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    job = _bn_job(gdata.make_synthetic(train_size=8, val_size=4), model="resnet18_cifar")
    spread = Job(**{**job.__dict__, "device": "cuda", "engine": {"name": "process"}})
    assert [str(core.device_of(spread, w)) for w in range(5)] == ["cuda:0", "cuda:1", "cuda:2", "cuda:0", "cuda:1"]
    pinned = Job(**{**job.__dict__, "device": "cuda:2", "engine": {"name": "process"}})
    assert {str(core.device_of(pinned, w)) for w in range(5)} == {"cuda:2"}
    on_sim = Job(**{**job.__dict__, "device": "cuda", "engine": {"name": "sim"}})
    assert {str(core.device_of(on_sim, w)) for w in range(5)} == {"cuda:0"}  # one shared model
    monkeypatch.setenv("LOCAL_RANK", "2")  # a torchrun rank: where the launcher put it (rank 0 is the server)
    assert str(core.device_of(spread, 7)) == "cuda:1"
    assert str(core.device_of(Job(**{**job.__dict__, "device": "cpu"}), 3)) == "cpu"


def test_theta_lives_on_the_workers_gpu_only_when_every_worker_computes_on_that_one(monkeypatch):
    """engine=process: θ on the GPU (shared by CUDA IPC) needs every worker on it; else shared host memory."""
    monkeypatch.setattr(core, "cuda_ipc", lambda: True)  # this machine's platform aside
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    base = _bn_job(gdata.make_synthetic(train_size=8, val_size=4), model="resnet18_cifar")

    def where(device, workers, **engine):
        job = Job(**{**base.__dict__, "device": device, "workers": workers, "engine": {"name": "process", **engine}})
        return str(core.central_device(job))

    assert where("cuda:1", 4) == "cuda:1" and where("cuda", 1) == "cuda:0"
    assert where("cuda", 2) == "cpu"  # the workers spread over the two GPUs
    assert where("cuda:1", 4, theta_on_gpu=False) == "cpu"
    assert where("cpu", 4) == "cpu"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert where("cuda", 4) == "cuda:0"
    monkeypatch.setattr(core, "cuda_ipc", lambda: False)  # WSL2, a Jetson, Windows: no CUDA IPC
    assert where("cuda", 4) == "cpu"
    monkeypatch.undo()
    monkeypatch.setattr(core.sys, "platform", "win32")
    assert not core.cuda_ipc()


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_gpu_request_without_a_gpu_is_one_line(device, capsys, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    for engine in ("process", "distributed", "sim"):
        with pytest.raises(SystemExit):
            preflight([f"device={device}", f"engine={engine}", f"hydra.run.dir={tmp_path / 'never'}"])
        assert capsys.readouterr().err.startswith(f"error: device={device}: no CUDA device is visible on this machine")
    assert not (tmp_path / "never").exists()


def _sim_rows(job, tmp_path):
    rec = Recorder(tmp_path, flush_every=10_000)
    result = sim.run(job, rec)
    rec.close()
    return result, read_table(tmp_path, "metrics")


def test_staged_views_give_the_same_commits_as_the_server_s_own_tensors(monkeypatch, tmp_path):
    """A worker whose device is not the server's (a GPU worker of the process engine) reads copies of θ and the
    server tensors. Forced here on the CPU (the workers say `cpu:0`, the server's tensors are on `cpu`): the
    arithmetic must not change at all."""
    from gem.engines import worker as wmod

    data = gdata.make_synthetic(train_size=256, val_size=32)
    job = Job(
        algorithm="gem",
        hp=gem_algo.Params(workers=3),
        model="mnist_cnn",
        data=data,
        workers=3,
        batch_size=32,
        epochs=1,
        seed=0,
        engine={"name": "sim"},
    )
    _, direct = _sim_rows(job, tmp_path / "direct")
    staged = []
    real = wmod.Worker.staged

    def counted(self, view):
        out = real(self, view)
        staged.append(out is not view and out.theta.data_ptr() != view.theta.data_ptr())
        return out

    monkeypatch.setattr(wmod, "device_of", lambda job, w: torch.device("cpu", 0))
    monkeypatch.setattr(wmod.Worker, "staged", counted)
    _, copied = _sim_rows(job, tmp_path / "staged")
    assert len(staged) == len(direct) and all(staged)
    for col in ("loss", "staleness", "pi_median"):
        assert copied[col].tolist() == direct[col].tolist()


@pytest.mark.slow
def test_a_worker_s_diagnostics_read_its_own_commit_not_the_copy_sent_to_the_server(monkeypatch, tmp_path):
    """A GPU worker sends the server a copy of its commit on the server's device (`to_device`); its diagnostics
    (GEM's central energy: the commit plus `aux`, both on the worker's device) must read the commit as the worker
    rule made it. Reading the copy lost every GEM worker at its first commit on the first GPU run ("Expected all
    tensors to be on the same device"). Forced here on the CPU: the staged view and a copy that moves."""
    import dataclasses

    from gem.engines import worker as wmod

    data = gdata.make_synthetic(train_size=256, val_size=32)
    job = Job(
        algorithm="gem",
        hp=gem_algo.Params(workers=3),
        model="mnist_cnn",
        data=data,
        workers=3,
        batch_size=32,
        epochs=1,
        seed=0,
        engine={"name": "sim"},
    )
    monkeypatch.setattr(gem_algo, "FUSED", False)  # a GPU's path: torch operations, `central` in aux
    _, direct = _sim_rows(job, tmp_path / "direct")
    sent, read_own = [], []

    def to_server(commit, device, pinned=None):  # as a move to another device does: new tensors
        copy = dataclasses.replace(
            commit, delta=commit.delta.clone(), payload={k: v.clone() for k, v in commit.payload.items()}
        )
        sent.append(copy)  # kept alive, so that no later tensor reuses its memory
        return copy

    def diagnostics(commit, layout, hp):
        read_own.append(all(commit.delta.data_ptr() != c.delta.data_ptr() for c in sent))
        return gem_algo.diagnostics(commit, layout, hp)

    monkeypatch.setattr(wmod, "device_of", lambda job, w: torch.device("cpu", 0))
    monkeypatch.setattr(wmod, "to_device", to_server)
    monkeypatch.setattr(gem_algo, "ALGORITHM", dataclasses.replace(gem_algo.ALGORITHM, diagnostics=diagnostics))
    _, moved = _sim_rows(job, tmp_path / "moved")
    assert len(read_own) == len(sent) == len(direct) and all(read_own)
    for col in ("loss", "staleness", "pi_median", "central_energy"):
        assert moved[col].tolist() == direct[col].tolist()


def test_the_forkserver_preloads_torchvision_only_for_a_model_that_uses_it():
    from gem.engines.worker import uses_torchvision

    def job(model):
        return Job(
            algorithm="gem", hp=gem_algo.Params(), model=model, data=None, workers=1, batch_size=1, epochs=1, seed=0
        )

    assert not uses_torchvision(job("mnist_cnn")) and uses_torchvision(job("resnet18_cifar"))
    assert not uses_torchvision(job(models.ModelSpec("mnist_cnn", "gem.models.MnistCNN")))
    assert uses_torchvision(job(models.ModelSpec("resnet18_cifar", "gem.models.resnet18_cifar")))
    assert uses_torchvision(
        job(
            models.ModelSpec(
                "resnet50", "hydra.utils.instantiate", {"config": {"_target_": "torchvision.models.resnet50"}}
            )
        )
    )


def test_to_device_moves_only_what_the_server_reads():
    from gem.algorithms import Commit
    from gem.engines.worker import to_device

    c = Commit(torch.ones(3), payload={"p": torch.zeros(2)}, metrics={"m": 1.0}, aux={"a": torch.ones(1)})
    assert to_device(c, torch.device("cpu")) is c  # already there: no copy
    meta = to_device(c, torch.device("meta"))
    assert meta.delta.device.type == "meta" and meta.payload["p"].device.type == "meta"
    assert meta.aux["a"] is c.aux["a"] and meta.metrics == {"m": 1.0} and meta.pull


# ------------------------------------------------------------------------------------------------ bf16


def test_bf16_computes_in_bf16_and_keeps_float32_parameters_and_gradients():
    torch.manual_seed(0)
    x, y = torch.randn(16, 1, 28, 28), torch.arange(16) % 10
    net = models.MnistCNN().eval()
    fp32 = models.FlatModel(net, loss="nll")
    theta = fp32.param.clone()
    seen = []
    bf16 = models.FlatModel(models.MnistCNN().eval(), loss="nll", precision="bf16")
    bf16.module.fc1.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    bf16.load(theta)
    for f in (fp32, bf16):  # no dropout, so the two see the same function
        f.module.train = lambda mode=True, m=f.module: nn.Module.train(m, False)
    l32, l16 = fp32.loss_and_grad(x, y), bf16.loss_and_grad(x, y)
    assert seen == [torch.bfloat16]
    assert bf16.param.dtype == bf16.grad.dtype == torch.float32
    assert l16 == pytest.approx(l32, rel=0.02)
    cos = torch.nn.functional.cosine_similarity(fp32.grad, bf16.grad, dim=0)
    assert 0.99 < cos < 1.0  # close, and not the same numbers: bf16 really ran


def test_bf16_run_learns_on_sim(tmp_path):
    s = _run(["engine=sim", "workers=2", "epochs=2", "precision=bf16"], tmp_path / "bf16")
    assert s["status"] == "completed" and s["precision"] == "bf16" and s["val_loss"] < 0.75 * math.log(10), s


def test_a_gpu_worker_page_locks_each_host_tensor_it_copies_theta_from_once(monkeypatch, tmp_path):
    """A GPU worker whose θ stays in host memory registers θ and the server's tensors with CUDA (pinned.py) where
    they lie, once in a process (memory page-locked already is left alone): the arithmetic does not change. Forced
    here on the CPU (the workers say `cpu:0`, so they stage; registration is recorded, not made)."""
    from gem.engines import pinned as pmod
    from gem.engines import worker as wmod

    data = gdata.make_synthetic(train_size=256, val_size=32)
    job = Job(
        algorithm="gem",
        hp=gem_algo.Params(workers=3, proxy="global"),
        model="mnist_cnn",
        data=data,
        workers=3,
        batch_size=32,
        epochs=1,
        seed=0,
        engine={"name": "sim"},
    )
    _, direct = _sim_rows(job, tmp_path / "direct")
    calls, made = [], []

    def register(address, size, flags):
        calls.append((address, size, flags))
        return 0

    def pinned_for(device, who):
        made.append(pmod.Pinned(device, who, register=register, unregister=lambda address: 0))
        return made[-1]

    monkeypatch.setattr(wmod, "device_of", lambda job, w: torch.device("cpu", 0))
    monkeypatch.setattr(wmod, "pinned_for", pinned_for)
    monkeypatch.setattr(pmod, "_is_pinned", lambda t: any(t.data_ptr() == a for a, *_ in calls))
    result, pinned_rows = _sim_rows(job, tmp_path / "pinned")
    assert result.status == "completed" and len(made) == 3
    # the sim engine's workers share one server: θ, the global proxy and its count, registered by the first worker
    assert len(calls) == 3 and {f for *_, f in calls} == {pmod.PORTABLE}
    assert sorted(len(p.held) for p in made) == [0, 0, 3]
    for col in ("loss", "staleness", "pi_median"):
        assert pinned_rows[col].tolist() == direct[col].tolist()


def test_page_locked_memory_is_let_go_of_and_a_failure_is_one_line(capsys):
    """What a worker registered it unregisters when its `Pinned` goes, holding the tensors until then; a failure is
    said once, naming the tensor, and the worker copies through pageable memory from then on; the commit's buffers
    are reused."""
    import gc
    import weakref

    from gem.engines import pinned as pmod

    calls, gone = [], []
    p = pmod.Pinned(
        torch.device("cpu"), "worker 7", register=lambda a, n, f: calls.append((a, n, f)) or 0, unregister=gone.append
    )
    theta, proxy = torch.ones(1000), torch.zeros(10)
    p.host({"θ": theta, "proxy": proxy, "empty": torch.empty(0)})
    p.host({"θ": theta})
    assert calls == [(theta.data_ptr(), theta.nbytes, pmod.PORTABLE), (proxy.data_ptr(), proxy.nbytes, pmod.PORTABLE)]
    addresses, still = [theta.data_ptr(), proxy.data_ptr()], weakref.ref(theta)
    del theta, proxy
    gc.collect()
    assert still() is not None and not gone  # held while registered
    del p
    gc.collect()
    assert sorted(gone) == sorted(addresses) and still() is None

    failing = pmod.Pinned(torch.device("cpu"), "worker 7", register=lambda a, n, f: 1)
    failing.host({"proxy": torch.ones(8), "θ": torch.ones(8)})
    failing.host({"m": torch.ones(8)})
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and err[0].startswith(
            "gem: worker 7: the host memory of proxy could not be page-locked (cudaHostRegister: error 1"
        )
        and failing.failed
    )
    assert not failing.held

    a = failing.out("delta", torch.ones(5))
    assert failing.out("delta", torch.zeros(5)) is a and failing.out("delta", torch.zeros(6)) is not a
    assert failing.out("payload.m", torch.zeros(6)) is not failing.out("delta", torch.zeros(6))
