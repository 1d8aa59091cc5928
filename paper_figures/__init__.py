"""Regenerate the paper's figures from sweep outputs: `python -m paper_figures <id> <sweep_dir> [--out DIR]`.

The figure functions live in `paper_figures.figures`; the committed PNGs in `paper_figures/regenerated/` come from
the runs described in REPRODUCTION.md.
"""
