"""Tests of gem.metrics: part files, crash safety, merging on close, and the Recorder's summaries."""

from __future__ import annotations

import math

import pytest

import gem.metrics as gm
from gem.metrics import PartWriter, Recorder, read_table


def row(step: int, loss: float | None = None, staleness: int = 0, **extra) -> dict:
    return {
        "step": step,
        "worker": step % 3,
        "staleness": staleness,
        "loss": float(step) if loss is None else loss,
        **extra,
    }


def parts(run_dir, name="metrics"):
    return sorted((run_dir / f"{name}.parts").glob("part-*.parquet"))


# ---------------------------------------------------------------------------------------- PartWriter


def test_part_writer_flush_writes_numbered_parts_and_close_merges(tmp_path):
    w = PartWriter(tmp_path, "metrics")
    w.flush()  # nothing buffered: no part, no folder
    assert not (tmp_path / "metrics.parts").exists()
    for i in range(3):
        w.add(row(i))
    w.flush()
    for i in range(3, 5):
        w.add(row(i))
    w.flush()
    assert [p.name for p in parts(tmp_path)] == ["part-000000.parquet", "part-000001.parquet"]
    assert read_table(tmp_path)["step"].tolist() == [0, 1, 2, 3, 4]
    w.add(row(5))
    w.close()
    assert not (tmp_path / "metrics.parts").exists()
    assert (tmp_path / "metrics.parquet").is_file()
    assert read_table(tmp_path)["step"].tolist() == list(range(6))
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*"))


def test_part_writer_close_without_rows_writes_nothing(tmp_path):
    PartWriter(tmp_path, "tensors").close()
    assert list(tmp_path.iterdir()) == []
    assert read_table(tmp_path, "tensors").empty


def test_part_writer_resumes_after_a_crash_and_after_a_close(tmp_path):
    # first attempt: merged once, then crashed with two parts on disk
    w = PartWriter(tmp_path, "metrics")
    for i in range(3):
        w.add(row(i))
    w.close()
    w = PartWriter(tmp_path, "metrics", resume=True)
    for i in range(3, 7):
        w.add(row(i))
        if i % 2 == 0:
            w.flush()
    w.flush()
    assert len(parts(tmp_path)) == 2
    assert read_table(tmp_path)["step"].tolist() == list(range(7))  # merged file first, then the parts
    # second attempt continues the numbering and merges everything, in order
    w = PartWriter(tmp_path, "metrics", resume=True)
    assert w.next_part == 2
    w.add(row(7))
    w.flush()
    assert [p.name for p in parts(tmp_path)][-1] == "part-000002.parquet"
    w.close()
    assert not (tmp_path / "metrics.parts").exists()
    assert read_table(tmp_path)["step"].tolist() == list(range(8))


def test_a_fresh_run_in_a_reused_directory_starts_empty(tmp_path):
    w = PartWriter(tmp_path, "metrics")
    for i in range(3):
        w.add(row(i))
    w.flush()
    w.close()
    w = PartWriter(tmp_path, "metrics")  # not a resume: the earlier rows must not leak in
    w.add(row(0))
    w.close()
    assert read_table(tmp_path)["step"].tolist() == [0]


def test_rows_with_extra_keys_keep_every_column(tmp_path):
    w = PartWriter(tmp_path, "metrics")
    w.add(row(0))
    w.add(row(1, pi=0.5))  # a key the first buffered row lacks
    w.add({**row(2), "staleness": 1.5})  # int in one row, float in another
    w.close()
    df = read_table(tmp_path)
    assert df["pi"].isna().tolist() == [True, False, True]
    assert df["staleness"].tolist()[-1] == 1.5


def test_part_writer_merges_parts_with_different_columns(tmp_path):
    w = PartWriter(tmp_path, "metrics")
    w.add(row(0))
    w.flush()
    w.add(row(1, pi=0.5))
    w.close()
    df = read_table(tmp_path)
    assert df["step"].tolist() == [0, 1]
    assert math.isnan(df["pi"][0]) and df["pi"][1] == 0.5


# ------------------------------------------------------------------------------------------ Recorder


def test_recorder_flushed_rows_survive_a_crash(tmp_path):
    rec = Recorder(tmp_path, flush_every=10, flush_seconds=1e9)
    for i in range(1, 26):
        rec.commit(row(i), tensors=[{"step": i, "tensor": "w", "tensor_index": 0, "pi": 0.1 * i}])
        flushed = (i // 10) * 10
        assert len(read_table(tmp_path)) == flushed  # nothing unflushed is on disk, everything flushed is
    # "crash": no close(); the two flushed parts are readable, the last 5 rows are lost
    assert len(parts(tmp_path)) == 2
    df = read_table(tmp_path)
    assert df["step"].tolist() == list(range(1, 21))
    assert df["loss"].tolist() == [float(i) for i in range(1, 21)]
    assert read_table(tmp_path, "tensors")["step"].tolist() == list(range(1, 21))
    assert not (tmp_path / "metrics.parquet").exists()


def test_recorder_close_merges_everything_in_order(tmp_path):
    rec = Recorder(tmp_path, flush_every=7, flush_seconds=1e9)
    for i in range(1, 26):
        rec.commit(row(i), tensors=[{"step": i, "tensor": "w", "tensor_index": 0}])
    rec.eval({"step": 25, "val_loss": 0.5})
    rec.close()
    for name in ("metrics", "tensors", "eval"):
        assert not (tmp_path / f"{name}.parts").exists()
        assert (tmp_path / f"{name}.parquet").is_file()
    df = read_table(tmp_path)
    assert df["step"].tolist() == list(range(1, 26))  # every row once, in order
    assert df["worker"].tolist() == [i % 3 for i in range(1, 26)]
    assert read_table(tmp_path, "tensors")["step"].tolist() == list(range(1, 26))
    assert read_table(tmp_path, "eval")["val_loss"].tolist() == [0.5]


def test_recorder_flushes_on_time(tmp_path, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(gm.time, "monotonic", lambda: clock[0])
    rec = Recorder(tmp_path, flush_every=1000, flush_seconds=30.0)
    rec.commit(row(1))
    clock[0] += 10
    rec.commit(row(2))
    assert read_table(tmp_path).empty
    clock[0] += 25  # 35 s since the last flush
    rec.commit(row(3))
    assert read_table(tmp_path)["step"].tolist() == [1, 2, 3]
    clock[0] += 5
    rec.commit(row(4))
    assert len(read_table(tmp_path)) == 3


def test_recorder_eval_rows_are_written_immediately(tmp_path):
    rec = Recorder(tmp_path, flush_every=1000, flush_seconds=1e9)
    rec.commit(row(1))
    rec.eval({"step": 1, "val_loss": 2.0, "val_accuracy": 0.1})
    assert read_table(tmp_path, "eval")["val_loss"].tolist() == [2.0]
    assert read_table(tmp_path).empty  # commit rows still wait for their flush
    rec.eval({"step": 2, "val_loss": 1.5, "val_accuracy": 0.3})
    assert read_table(tmp_path, "eval")["step"].tolist() == [1, 2]
    assert rec.last_eval["val_loss"] == 1.5


def test_recorder_final_train_loss_is_mean_of_last_tenth(tmp_path):
    rec = Recorder(tmp_path, flush_every=1000)
    assert math.isnan(rec.final_train_loss)
    losses = [float(i * i) for i in range(50)]
    for i, loss in enumerate(losses):
        rec.commit(row(i + 1, loss=loss))
    # the last 5 of 50: 45², …, 49²
    assert rec.final_train_loss == pytest.approx(sum(x * x for x in range(45, 50)) / 5)
    rec.close()


def test_recorder_final_train_loss_with_few_commits_uses_the_last(tmp_path):
    rec = Recorder(tmp_path, flush_every=1000)
    for i, loss in enumerate([5.0, 4.0, 3.0]):
        rec.commit(row(i + 1, loss=loss))
    assert rec.final_train_loss == 3.0


def test_recorder_mean_staleness_and_commit_count(tmp_path):
    rec = Recorder(tmp_path, flush_every=1000)
    assert math.isnan(rec.mean_staleness)
    for i, tau in enumerate([0, 1, 2, 3, 3, 3]):
        rec.commit(row(i + 1, staleness=tau))
    assert rec.commits == 6
    assert rec.mean_staleness == pytest.approx(12 / 6)


def test_recorder_sink_receives_every_kth_commit_and_all_evals(tmp_path):
    got = []
    rec = Recorder(tmp_path, flush_every=1000, sink=lambda kind, r: got.append((kind, r["step"])), sink_every=3)
    for i in range(1, 8):
        rec.commit(row(i))
    rec.eval({"step": 7, "val_loss": 1.0})
    assert got == [("commit", 3), ("commit", 6), ("eval", 7)]


def test_read_table_of_empty_run_dir(tmp_path):
    assert read_table(tmp_path).empty


def test_recorder_averages_gems_per_commit_median_pi(tmp_path):
    rec = Recorder(tmp_path)
    for step, pi in enumerate([0.0, 0.3, 0.0, 0.5], start=1):
        rec.commit(
            {
                "step": step,
                "worker": 0,
                "worker_step": step,
                "staleness": 1,
                "loss": 1.0,
                "time_s": 0.0,
                "pi_median": pi,
            }
        )
    rec.close()
    assert rec.pi_median == pytest.approx(0.2)
    assert Recorder(tmp_path / "other").pi_median is None  # not GEM: no π in the summary
