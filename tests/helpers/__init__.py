"""What the test modules share; a test module imports these, never another test module (tests/test_layers.py).

- paths: ROOT, the checkout, and SHARED_DATA, where real MNIST digits live beside it.
- warm_run: `python run.py <args>` started from a server that has imported torch once (`run_py`, `Popen`).
- commands: `run_py` (warm, or a fresh interpreter where a test gives subprocess's arguments), `refused_line` (what
  run.py's preflight refuses), `snapshot` (a folder's files, to see that a refusal touched nothing).
- rundir: `check_run_dir`, the parts every run directory has.
- engines: a small `job` on synthetic data and `run` on an engine; `Killed` and `StoppingRecorder`, recorders'
  faults (a killed coordinator, a stopped worker).
- cifar: `write_cifar`, small files in CIFAR-10's python layout.
- procs: the processes a run starts, as /proc shows them; a stranger on a run's port; processes frozen for the
  process engine's turn.
- netns: hosts on one machine, network namespaces joined by veth links (needs root and iproute2); also a script,
  `python tests/helpers/netns.py`, that measures TCP transfers between two namespaces.
"""
