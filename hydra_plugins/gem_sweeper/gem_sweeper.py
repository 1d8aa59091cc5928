"""gem's Hydra sweeper (conf/hydra/sweeper/gem.yaml): Hydra's basic sweeper, plus every job checked before any
of them is launched.

A sweep runs the jobs its command and its experiment's `hydra.sweeper.params` make (every combination, in the
basic sweeper's order), and, beyond the basic sweeper, those of each of its `hydra.sweeper.grids` in turn
(settings only some jobs have, as the tuning experiment's per-algorithm knobs): experiments.config.jobs_of. Before
the first one starts, each is composed and validated into its Spec, its data is found, plan=true prints the plan
and launches nothing, and the sweep's folders are checked (experiments.command.check_sweep); bad input is one line,
exit 2, with nothing written. The Specs go to the jobs that Hydra's launcher runs in this process, so no job's
config is validated twice. A job refused when its turn comes (its line printed; the other jobs go on) ends the sweep,
once the others have run, with one more line and exit code 1 (experiments.command.end_if_refused).

Hydra looks for plugins in the `hydra_plugins` namespace package, which is why this module lives here and not in
experiments/. It finds this one because `python run.py` puts the repository's root on sys.path.
"""

from __future__ import annotations

from pathlib import Path

from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from omegaconf import OmegaConf


class GemSweeper(Sweeper):
    def __init__(
        self,
        max_batch_size: int | None = None,
        params: dict | None = None,
        grids: list | None = None,
        heldout_seeds: str | None = None,
    ) -> None:
        super().__init__()
        self.max_batch_size = max_batch_size  # jobs handed to the launcher at a time (None: all)
        self.params = dict(params or {})  # an experiment's swept keys (hydra.sweeper.params)
        self.grids = list(grids or [])  # and its grids, each swept in turn with the params (hydra.sweeper.grids)
        # a tuning sweep's held-out seeds: a key of the sweeper's config, so accepted here; the plan
        # (experiments.command.heldout_seeds) and analysis.tune (the sweep's multirun.yaml) read it from there
        self.heldout_seeds = heldout_seeds
        self.config = self.hydra_context = self.launcher = None

    def setup(self, *, hydra_context, task_function, config) -> None:
        self.config, self.hydra_context = config, hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    def sweep(self, arguments: list[str]) -> list:
        from experiments import command
        from experiments.config import jobs_of

        jobs = command.refusing(jobs_of, self.params, arguments, self.grids)
        specs = command.refusing(command.check_sweep, self.config, jobs, self._compose)
        command.ready(jobs, specs)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")  # as Hydra's basic sweeper records a sweep
        size = self.max_batch_size or len(jobs)
        returns, refused = [], []
        for start in range(0, len(jobs), size):
            results = self.launcher.launch(jobs[start : start + size], initial_job_idx=start)
            for num, r in enumerate(results, start=start):
                value = r.return_value  # a job that raised ends the sweep with its error, as the basic sweeper does
                if isinstance(value, dict) and value.get("status") == "refused":
                    refused.append(num)
            returns.append(results)
        command.end_if_refused(refused, len(jobs))  # exit code 1 if any was
        return returns

    def _compose(self, overrides: list[str]):
        """A job's config, composed as Hydra's launcher will compose it, without the `hydra` node."""
        from experiments import command

        return command.task_config(self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides)))
