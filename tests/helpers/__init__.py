"""What the test modules share.

- paths: ROOT, the checkout, and SHARED_DATA, where real MNIST digits live beside it.
- warm_run: `python run.py <args>` started from a server that has imported torch once (`run_py`, `Popen`).
- procs: the processes a run starts, as /proc shows them; a stranger on a run's port; processes frozen for the
  process engine's turn.
- netns: hosts on one machine, network namespaces joined by veth links (needs root and iproute2); also a script,
  `python tests/helpers/netns.py`, that measures TCP transfers between two namespaces.
"""
