"""Entry point: `python run.py [overrides]` for one run, `python run.py -m [sweep]` for a sweep.

It only validates the command (one clear line on bad input, before anything starts) and hands Hydra's
composed config to experiments.runner. Under torchrun (engine=distributed), the ranks other than 0 are
workers: they take their job from rank 0 and never compose a config or write a run directory.

Everything happens inside the `__main__` guard, imports included: each worker process imports this file again,
as its parent's main module, and needs none of it (Hydra, pandas, W&B: a tenth of a second and some megabytes
in each of a hundred workers).
"""

import sys

if __name__ == "__main__":
    import hydra

    from experiments import runner
    from experiments.config import preflight

    @hydra.main(config_path="conf", config_name="config", version_base="1.3")
    def main(cfg):
        return runner.main(cfg)

    if runner.launched_worker():
        sys.exit(runner.work())
    sys.argv[1:] = preflight(sys.argv[1:])
    main()
