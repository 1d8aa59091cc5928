"""gem: Gradient Energy Matching and asynchronous SGD baselines (Hermans & Louppe 2018).

The library imports no Hydra: `experiments/` turns a resolved config into the objects defined here.
"""

__version__ = "0.1.0"
