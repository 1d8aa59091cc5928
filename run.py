"""Entry point: `python run.py [overrides]` for one run, `python run.py -m [sweep]` for a sweep.

It only dispatches (experiments/command.py says how a command flows): refusals Hydra cannot make in one line,
then Hydra, whose callback and sweeper check every job before any runs, and whose task function runs them.
Under torchrun (engine=distributed), the ranks other than 0 are workers: they take their job from rank 0 and
never compose a config or write a run directory.

Everything happens inside the `__main__` guard, imports included: each worker process imports this file again,
as its parent's main module, and needs none of it (Hydra, pandas, W&B: a tenth of a second and some megabytes
in each of a hundred workers).
"""

import sys

if __name__ == "__main__":
    import atexit

    import hydra

    from experiments import command, runner

    @hydra.main(config_path="conf", config_name="config", version_base="1.3")
    def main(cfg):
        return command.main(cfg)

    if runner.launched_worker():
        sys.exit(runner.work())
    command.precheck(sys.argv[1:])
    atexit.register(command.end_helpers)  # no child left behind when the command returns
    main()
