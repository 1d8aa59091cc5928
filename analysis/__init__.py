"""Analysis of run directories: load sweeps into tidy pandas frames (`analysis.load`).

Figures and reports build on these frames.
"""
