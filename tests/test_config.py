"""Configs compose, and every bad input gets one clear line (naming the key and what is allowed) before
anything starts."""

import subprocess
import sys

import pytest
from helpers import warm_run
from helpers.commands import refused_line
from helpers.paths import ROOT
from omegaconf import OmegaConf

from experiments.command import preflight
from experiments.config import ConfigError, check_job, compose, expand, options, validate


def test_default_config_composes_and_validates():
    cfg = compose([])
    for key in (
        "algorithm",
        "engine",
        "model",
        "data",
        "logger",
        "workers",
        "lr",
        "momentum",
        "batch_size",
        "epochs",
        "seed",
        "device",
        "resume",
    ):
        assert key in cfg, key
    assert cfg.data.name == "digits" and cfg.model._target_ == "gem.models.MnistCNN"
    assert (cfg.lr, cfg.momentum, cfg.batch_size) == (0.05, 0.9, 64)  # the paper's MNIST settings
    validate(cfg)


@pytest.mark.parametrize(
    "group", ["algorithm", "engine", "model", "data", "logger", pytest.param("experiment", marks=pytest.mark.slow)]
)
def test_every_group_option_composes(group, monkeypatch):
    from gem.engines import memory

    monkeypatch.setattr(memory, "available", lambda: 2**50)  # fig2's 100 processes need a bigger machine than CI
    for option in options(group):
        overrides = [f"{group}={option}"]
        if group == "model" and option in ("alexnet_cifar", "resnet18_cifar"):
            overrides.append("data=synthetic")
        if group == "data" and option in ("cifar10", "cifar100"):
            overrides.append("model=alexnet_cifar")
        if group == "data" and option == "tensors":  # its file and classes are the user's to give
            overrides += ["data.path=x.npz", "data.num_classes=3"]
        cfg = compose(overrides)
        validate(cfg)


BAD = [
    (["algorithm=foo"], "algorithm=foo is not an option; choose one of: "),
    (["engine=warp"], "engine=warp is not an option; choose one of: "),
    (["model=resnet"], "model=resnet is not an option; choose one of: alexnet_cifar, mnist_cnn, resnet18_cifar"),
    (
        ["data=imagenet"],
        "data=imagenet is not an option; choose one of: cifar10, cifar100, digits, fashion_mnist, "
        "mnist, synthetic, tensors",
    ),
    (["workers=0"], "workers=0 is not allowed; workers must be an integer >= 1"),
    (["workers=two"], "workers=two is not allowed; workers must be of type int"),
    (["lr=0"], "lr=0.0 is not allowed; lr must be a finite number > 0"),
    (["lr=-0.1"], "lr=-0.1 is not allowed; lr must be a finite number > 0"),
    (["lr=inf"], "lr=inf is not allowed; lr must be a finite number > 0"),
    (["algorithm=sgd,sgd"], "algorithm=sgd,sgd is a sweep; add -m (--multirun)"),
    (
        ["experiment=fig99"],
        "experiment=fig99 is not an option; choose one of: baselines, baselines_delay, baselines_delay_quick, "
        "baselines_quick, dylu, dylu_quick, fig1, ",
    ),
    (
        ["engine=sim", "engine.straggler_fraction=0"],
        "engine.straggler_fraction=0.0 is not allowed; it must be a number in (0, 1]",
    ),
    (["logger.flush_seconds=-1"], "logger.flush_seconds=-1.0 is not allowed; it must be a number > 0"),
    (["data=synthetic", "data.synthetic.train_size=-5"], "data.synthetic.train_size=-5 is not allowed"),
    (["lr=abc"], "lr=abc is not allowed; lr must be of type float"),
    (["batch_size=0"], "batch_size=0 is not allowed; batch_size must be an integer >= 1"),
    (["batch_size=2000"], "batch_size=2000 is larger than a worker's shard: data=digits has 1500 training"),
    (["epochs=0"], "epochs=0.0 is not allowed; epochs must be a finite number > 0"),
    (["momentum=1.0"], "momentum=1.0 is not allowed; momentum must be a number in [0, 1)"),
    (["foo=1"], "foo is not a config key; top-level keys are: algorithm, engine"),
    (["algorithm=sgd", "algorithm.kapa=2"], "algorithm.kapa is not a key of algorithm=sgd; its keys are: name"),
    (["algorithm.kapa=2"], "algorithm.kapa is not a key of algorithm=gem; its keys are: name, kappa, pi_max"),
    (["algorithm.kappa=0"], "algorithm.kappa=0.0 is not allowed; kappa must be a number > 0"),
    (["algorithm.proxy=both"], "algorithm.proxy=both is not allowed; proxy must be one of: local, global"),
    (["algorithm=easgd", "algorithm.alpha=2"], "algorithm.alpha=2.0 is not allowed; alpha must be a number in (0, 1]"),
    (["algorithm=agn", "algorithm.window=0"], "algorithm.window=0 is not allowed; window must be an integer >= 1"),
    (["engine.checkpoint_every=-1"], "engine.checkpoint_every=-1 is not allowed; it must be an integer >= 0"),
    (
        ["engine=distributed", "engine.port=70000"],
        "engine.port=70000 is not allowed; it must be an integer in [0, 65535]",
    ),
    (
        ["engine=distributed", "engine.timeout_s=0"],
        "engine.timeout_s=0.0 is not allowed; it must be a number of seconds > 0",
    ),
    (
        ["engine=distributed", "engine.host=0.0.0.0", "engine.staleness=x"],
        "engine.staleness is not a key of engine=distributed; its keys are: name, host, allow_remote, port, "
        "shared_memory, full_duplex, servers, theta_on_gpu, timeout_s",
    ),
    (
        ["engine=distributed", "engine.servers=2", "algorithm=ssgd"],
        "engine.servers=2 is not allowed with algorithm=ssgd, whose workers wait at a barrier of the server's clock",
    ),
    (["logger.wandb.mode=loud"], "logger.wandb.mode=loud is not allowed; choose one of: offline, online, disabled"),
    (["logger.tensorboard=maybe"], "logger.tensorboard: Value 'maybe' is not a valid bool"),
    (["engine.staleness=fast"], "engine.staleness is not a key of engine=process; its keys are: name, "),
    (["engine=sim", "engine.staleness=fast"], "engine.staleness=fast is not allowed; choose one of: round_robin"),
    (["engine=sim", "engine.cycle_cv=-1"], "engine.cycle_cv=-1.0 is not allowed; it must be a number in [0, 10]"),
    (
        ["engine=sim", "engine.staleness=trace"],
        "engine.staleness=trace needs engine.trace=<the run directory of a process or distributed run>",
    ),
    (
        ["engine=sim", "engine.trace=/no/run"],
        "engine.trace is set but engine.staleness=gamma; add engine.staleness=trace to replay it",
    ),
    (
        ["engine=sim", "engine.staleness=trace", "engine.trace=/no/run"],
        "engine.trace=/no/run is not a run directory (no summary.json)",
    ),
    # a model whose module Python cannot find: the fix is where Python looks (was a hint about config keys)
    (
        ["model._target_=no_such_module_xyz.Net"],
        "model._target_=no_such_module_xyz.Net could not be built: ModuleNotFoundError: No module named "
        "'no_such_module_xyz' (Python cannot import it from here: put the folder that holds the module on PYTHONPATH",
    ),
    (["device=tpu"], "device=tpu is not allowed; use cpu, cuda (workers spread over the visible GPUs) or cuda:N"),
    (["model=alexnet_cifar", "data=digits", "data=mnist"], "model=alexnet_cifar expects 3x32x32 inputs but data=mnist"),
    (
        ["seed=99999999999999999999"],
        "seed=99999999999999999999 is not allowed; seed must be an integer from 0 to 4294967295 (2^32 - 1)",
    ),  # was a 30-line traceback and an empty run directory
    (["seed=-1"], "seed=-1 is not allowed"),
    (
        ["hydra.run.dir="],
        "hydra.run.dir='' is not allowed: it would write the run's files into the current directory",
    ),  # the checkout root, say
    (["-m", "seed=0,1", "hydra.sweep.dir=."], "hydra.sweep.dir='.' is not allowed"),
    # validation that is the test split (or the training split) would leak into every choice made on it
    (
        ["data._target_=torchvision.datasets.MNIST", "+data.val_kwargs={train: false}"],
        "data.val_kwargs={'train': False} is not allowed; it loads the same split as data.test_kwargs",
    ),
    (
        ["data._target_=torchvision.datasets.MNIST", "+data.val_kwargs={train: true}"],
        "data.val_kwargs={'train': True} is not allowed; it loads the same split as data.train_kwargs",
    ),
    # every job of a sweep is long enough, checked before the first starts
    (
        ["-m", "epochs=1,0.0001", "engine=sim"],
        "epochs=0.0001 (23 mini-batches of 64 per epoch of data=digits) gives "
        "each worker 0 gradient step(s); it needs at least one",
    ),
]


@pytest.mark.parametrize("overrides,line", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_input_gets_one_clear_line(overrides, line, capsys):
    with pytest.raises(SystemExit) as e:
        preflight(overrides)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, f"expected exactly one line, got:\n{err}"
    assert err.startswith("error: " + line), err


def test_bad_value_inside_a_sweep_is_caught_before_any_job(capsys):
    with pytest.raises(SystemExit):
        preflight(["-m", "lr=0.1,-1", "workers=1,2"])
    assert capsys.readouterr().err.startswith("error: lr=-1.0 is not allowed")


def test_missing_dataset_offline_names_files_and_folder(tmp_path, capsys):
    with pytest.raises(SystemExit):
        preflight(["data=mnist", f"data.root={tmp_path}", "data.download=false"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert str(tmp_path / "MNIST" / "raw") in err and "train-images-idx3-ubyte" in err


def test_cuda_requested_without_cuda(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit):
        preflight(["device=cuda"])
    assert "device=cuda: no CUDA device is visible" in capsys.readouterr().err


def test_good_input_passes_and_sweeps_expand(tmp_path):
    preflight(["workers=1", "lr=0.01", f"hydra.run.dir={tmp_path / 'run'}"])  # returns without exiting
    jobs = expand(["algorithm=sgd", "lr=0.1,0.01", "seed=0,1,2"], multirun=True)
    assert len(jobs) == 6
    with pytest.raises(ConfigError):
        check_job(["workers=-3"])


@pytest.mark.slow  # over 3 s in the fast tier (2026-11-29)
def test_a_sweeps_jobs_composed_from_their_group_choices_are_hydras_whole_compositions():
    """check_sweep composes each group choice once and sets each job's values on a copy (config._composed_from):
    the configs are those Hydra composes job by job, and a job the shortcut cannot make is composed whole, with
    Hydra's own result or error."""
    from experiments.config import composed

    jobs = [j for name in ("tune", "fig3_cv", "baselines_delay") for j in expand([f"experiment={name}"], True)[::15]]
    jobs += [
        ["algorithm=gem", "+algorithm.extra=1"],  # an addition, and a deletion: composed whole
        ["algorithm=gem", "~algorithm.kappa"],
        ["lr=0.1", "++lr=0.2"],  # Hydra applies ++ after the value before it: 0.2
        ["algorithm=gem", "algorithm.kappa=3", "++algorithm={kappa:5}"],
        ["engine=sim", "engine.staleness=stragglers", "workers=7", "lr=0.2", "logger.wandb.mode=disabled"],
        ["model=alexnet_cifar", "data=synthetic", "data.synthetic.train_size=100", "seed=3"],
    ]
    bases: dict = {}
    for job in jobs:
        fast = OmegaConf.to_container(composed(job, bases=bases), resolve=False)
        assert fast == OmegaConf.to_container(composed(job), resolve=False), job
    from experiments.schema import GROUPS

    # each group choice composed once (a job with an addition or a deletion is composed whole, and adds none)
    choices = {tuple(o for o in job if o.split("=")[0] in GROUPS) for job in jobs if not any(o[0] in "+~" for o in job)}
    assert set(bases) == choices and len(bases) < len(jobs) / 2
    for job, line in [
        (["algorithm=gem", "workers=abc"], "workers"),  # a wrong type
        (["algorithm=downpour", "algorithm.kappa=2"], "algorithm.kappa is not a key of algorithm=downpour"),
        (["algorithm.extra=1", "+algorithm={extra:2}"], "algorithm.extra is not a key of algorithm=gem"),
    ]:
        with pytest.raises(ConfigError) as fast:
            composed(job, bases=bases)
        with pytest.raises(ConfigError) as whole:
            composed(job)
        assert str(fast.value) == str(whole.value) and line in str(fast.value)


def test_a_config_dir_whose_experiment_the_repository_shadows_is_refused(tmp_path, capsys):
    # Hydra takes conf/'s experiment/tune_heldout.yaml over --config-dir's: that ran the wrong held-out stage
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "tune_heldout.yaml").write_text("# @package _global_\nworkers: 7\n")
    for argv in (
        ["-m", "--config-dir", str(tmp_path), "experiment=tune_heldout"],
        ["--cfg", "job", "-cd", str(tmp_path), "experiment=tune_heldout"],
        ["-m", f"--config-dir={tmp_path}", "experiment=fig1,tune_heldout"],  # one of a sweep's
        ["-m", "-cd", str(tmp_path), "experiment=choice(tune_heldout)", "workers=2"],
        ["-cd", str(tmp_path), "experiment@_global_='tune_heldout'"],
    ):
        with pytest.raises(SystemExit) as e:
            preflight(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(
            f"error: experiment=tune_heldout: both --config-dir {tmp_path} and the repository's conf/ hold "
            "experiment/tune_heldout.yaml, and Hydra would take the repository's"
        ), err
    (tmp_path / "experiment" / "tune_heldout.yaml").rename(tmp_path / "experiment" / "mine_heldout.yaml")
    preflight(["--cfg", "job", "--config-dir", str(tmp_path), "experiment=mine_heldout"])  # left to Hydra


def test_help_and_cfg_flags_are_left_to_hydra():
    preflight(["--help"])
    preflight(["--cfg", "job"])


@pytest.mark.slow  # real `python run.py` processes: 5 s
def test_real_command_prints_one_line_and_exits_2(tmp_path):
    p = subprocess.run(
        [sys.executable, str(ROOT / "run.py"), "lr=-1"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 2
    assert p.stderr.strip() == "error: lr=-1.0 is not allowed; lr must be a finite number > 0"
    assert p.stdout == ""
    assert list(tmp_path.iterdir()) == [], "bad input must not create a run directory"
    # the tests' run.py forked from a warm interpreter (tests/helpers/warm_run.py) answers exactly as a fresh one
    warm = warm_run.run_py("lr=-1", cwd=tmp_path, script=str(ROOT / "run.py"))
    assert (warm.returncode, warm.stdout, warm.stderr) == (p.returncode, p.stdout, p.stderr)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["sim", "process", "distributed"])
def test_an_engine_yaml_holds_its_options_defaults(name):
    """conf/engine/<name>.yaml is what a user reads and edits; gem.engines.options is where each default is written:
    they must agree, key for key (checkpoint_every is the run's schedule, a key of the group only)."""
    import dataclasses

    from omegaconf import OmegaConf

    from experiments.schema import CONF_DIR
    from gem.engines.options import options_class

    node = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "engine" / f"{name}.yaml"))
    assert isinstance(node.pop("checkpoint_every"), int)
    assert node == dataclasses.asdict(options_class(name)())


def test_an_experiments_sim_settings_do_not_refuse_another_engine():
    """fig1 sets engine.staleness and engine.cycle_cv for the simulator; run on engine=process they do not apply,
    and are not refused (a key no engine has still is)."""
    from experiments.config import check_job
    from gem.engines.options import ProcessOptions

    _, spec = check_job(["experiment=fig1_quick", "engine=process", "workers=2"])
    assert spec.engine == ProcessOptions()


def test_data_tensors_names_its_own_keys(tmp_path, capsys, monkeypatch):
    """data=tensors with a bad data.val_fraction or data.path said `data._target_=gem.data.TensorFile
    (train_kwargs={'split': 'train'}) could not be loaded: ValueError: val_fraction=2 must be in (0, 1)`: a key the
    command did not name, and one it did under another name. Each is now refused by its key."""
    import numpy as np

    monkeypatch.chdir(tmp_path)
    np.savez("t.npz", x=np.zeros((20, 1, 28, 28), dtype="float32"), y=np.zeros(20, dtype="int64"))
    common = ["data=tensors", "data.num_classes=2", "engine=sim"]
    line = f"data.path=no.npz: no such file (from {tmp_path}); give the path of your .npz or .pt file"
    assert refused_line(capsys, *common, "data.path=no.npz") == f"error: {line}"
    for extra, line in (
        (
            ["data.path=t.npz", "data.val_fraction=2"],
            "data.val_fraction=2 is not allowed; it must be a number in (0, 1): the share of the training arrays "
            "held out for validation when the file has none",
        ),
        (["data.path=t.txt"], "data.path=t.txt is not allowed; data=tensors reads a .npz or .pt file"),
    ):
        with pytest.raises(ConfigError) as e:
            check_job([*common, *extra])
        assert str(e.value) == line
    check_job([*common, "data.path=t.npz"])  # the file as given


def test_synthetic_classes_are_set_by_the_key_that_draws_them():
    """data=synthetic data.num_classes=5 said `set data.synthetic.num_classes`, without the value; the line gives
    the override to type, and that override alone is the run asked for."""
    with pytest.raises(ConfigError) as e:
        check_job(["data=synthetic", "data.num_classes=5", "engine=sim"])
    assert str(e.value) == (
        "data.num_classes=5 but data.synthetic.num_classes=10; data=synthetic draws its classes by "
        "data.synthetic.num_classes: set data.synthetic.num_classes=5 instead (data.num_classes follows it)"
    )
    _, spec = check_job(["data=synthetic", "data.synthetic.num_classes=5", "engine=sim"])
    assert spec.data.num_classes == 5


def test_a_model_that_does_not_take_the_data_names_those_that_do():
    """model=mnist_cnn data=cifar10 said `pick a matching model`, without a name: the line names the built-in
    models that take the data's inputs, and the first of them passes."""
    with pytest.raises(ConfigError) as e:
        check_job(["data=cifar10", "engine=sim"])
    assert str(e.value) == (
        "model=mnist_cnn expects 1x28x28 inputs but data=cifar10 gives 3x32x32; pick a model that takes 3x32x32 "
        "(model=alexnet_cifar, model=resnet18_cifar)"
    )
    check_job(["data=cifar10", "model=alexnet_cifar", "engine=sim"])


@pytest.mark.parametrize(
    "override, line",
    [
        # `budget.foo` listed the top-level keys, and `+budget.foo` was ignored: both now list budget's
        (
            "budget.foo=1",
            "budget.foo is not a config key; the keys of budget are: budget.worker_steps, budget.commits, "
            "budget.seconds, budget.sim_time",
        ),
        (
            "+budget.foo=1",
            "budget.foo is not a config key; the keys of budget are: budget.worker_steps, budget.commits, "
            "budget.seconds, budget.sim_time",
        ),
        # a key inside a nested node listed the group's keys
        (
            "logger.wandb.foo=1",
            "logger.wandb.foo is not a key of logger.wandb; its keys are: mode, project, entity, group, log_every",
        ),
        (
            "+logger.wandb.foo=1",
            "logger.wandb.foo is not a key of logger.wandb; its keys are: mode, project, entity, group, log_every",
        ),
        # a model's own constructor argument is added with +model.<arg> (docs/contract.md): the line says so
        (
            "model.width=64",
            "model.width is not a key of model; its keys are: _target_, num_classes (+model.width=<value> adds "
            "it: an argument width of the model's own constructor)",
        ),
    ],
)
def test_an_unknown_nested_key_lists_the_keys_beside_it(override, line, capsys):
    with pytest.raises(SystemExit) as e:
        preflight(["engine=sim", override])
    assert e.value.code == 2 and capsys.readouterr().err == f"error: {line}\n"


def test_compose_works_inside_a_running_hydra_and_leaves_it_as_it_was():
    """A sweep that explains why it cannot compose a job composes again from inside Hydra's app: that must give
    the config (and so the job's real one-line reason), not "GlobalHydra is already initialized"."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from experiments.config import CONF_DIR, compose

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(["algorithm=ringmaster"])
        assert cfg.algorithm.name == "ringmaster"
        assert GlobalHydra.instance().is_initialized()  # the running app's, put back
        assert hydra_compose("config", overrides=["algorithm=rennala"]).algorithm.name == "rennala"


def test_a_sweep_composes_an_experiment_that_only_its_config_dir_holds():
    from experiments.config import composed

    # conf/ has no such experiment: composed as `python run.py` composes (conf/ alone), the line of its options
    with pytest.raises(ConfigError, match="experiment=x_heldout is not an option; choose one of: baselines, "):
        composed(["experiment=x_heldout"])
    # a sweep composes with Hydra's own loader, which also searches --config-dir (where analysis.tune writes the
    # held-out stage): there it composes, and only where that loader fails too is it refused, with the same line
    assert composed(["experiment=x_heldout"], lambda overrides: overrides) == ["experiment=x_heldout"]

    def nowhere(overrides):
        raise RuntimeError("In 'config': Could not find 'experiment/x_heldout'")

    with pytest.raises(ConfigError, match="experiment=x_heldout is not an option; choose one of: baselines, "):
        composed(["experiment=x_heldout"], nowhere)
