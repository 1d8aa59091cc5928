"""What every run directory `python run.py` writes holds: summary.json, metrics and eval rows."""

import json

import pandas as pd

SUMMARY_KEYS = {
    "status",
    "algorithm",
    "engine",
    "workers",
    "steps",
    "final_train_loss",
    "val_loss",
    "val_accuracy",
    "mean_staleness",
    "wall_time_s",
}


def check_run_dir(d, steps=None):
    summary = json.loads((d / "summary.json").read_text())
    assert SUMMARY_KEYS <= summary.keys()
    m = pd.read_parquet(d / "metrics.parquet")
    assert {"step", "worker", "worker_step", "staleness", "loss", "time_s"} <= set(m.columns)
    assert len(m) == summary["steps"]
    assert m["step"].tolist() == list(range(1, summary["steps"] + 1))  # each commit once, no gap
    assert m["time_s"].is_monotonic_increasing
    ev = pd.read_parquet(d / "eval.parquet")
    assert {"step", "val_loss", "val_accuracy", "train_loss"} <= set(ev.columns)
    assert ev["step"].iloc[0] == 0 and ev["step"].iloc[-1] == summary["steps"]
    assert not (d / "metrics.parts").exists()
    if steps is not None:
        assert summary["steps"] == steps
    return summary, m, ev
