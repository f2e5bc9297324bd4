"""Review 2 of sweeps, corpora and metrics logging: numeric grid axes in numeric order, strict JSON
for non-finite metrics, compressed text corpora, Parquet files without rows, concurrent writers
of one sweep database."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import math
import sqlite3
import threading
import warnings
from types import SimpleNamespace

import pytest

from mnemo.data.corpus import load_corpus
from mnemo.sweep.db import SweepDB
from mnemo.sweep.report import cell_stats, judge_claims, markdown_table, plot_accuracy_vs_state, write_report
from mnemo.sweep.runner import _curve
from mnemo.train.sinks import MetricsFile, dumps_record, loads_record
from tests.helpers import locked_sweep_db


def _strict_loads(text: str):
    """json.loads as a strict reader (jq, JavaScript): the tokens NaN / Infinity are refused."""

    def refuse(token):
        raise ValueError(f"not strict JSON: bare {token}")

    return json.loads(text, parse_constant=refuse)


def _row(label, pairs, acc, seed=0, *, lengths=None, state=100):
    m = {"val_acc": acc, "val_loss": 1.0 - acc}
    m.update({f"val_acc@{L}": v for L, v in (lengths or {}).items()})
    return {
        "run_id": f"{label}-{pairs}-{seed}",
        "label": label,
        "model": label,
        "cell": {"label": label, "task_options.num_pairs": pairs},
        "tuned": {"lr": 0.01},
        "seed": seed,
        "config": {"seq_len": 16, "lr": 0.01, "seed": seed, "steps": 10},
        "status": "done",
        "metrics": m,
        "state_size_bytes": state,
        "n_params": 10,
        "wall_time_s": 1.0,
    }


# ---- (1) numeric axes sort numerically -------------------------------------------------------------


def test_markdown_table_orders_a_numeric_axis_by_value():
    rows = [_row("m", 128, 0.5), _row("m", 8, 0.9), _row("m", 64, 0.7)]
    table = markdown_table(rows).splitlines()[2:]
    assert [line.split("|")[2].strip() for line in table] == ["8", "64", "128"]


def test_markdown_table_keeps_a_string_axis_alphabetical():
    rows = [_row("m", "b", 0.5), _row("m", "a", 0.9), _row("m", "c", 0.7)]
    table = markdown_table(rows).splitlines()[2:]
    assert [line.split("|")[2].strip() for line in table] == ["a", "b", "c"]


def test_plot_panels_order_a_numeric_axis_by_value(tmp_path):
    rows = [_row("m", 128, 0.5), _row("m", 8, 0.9), _row("m", 64, 0.7)]
    _, fig = plot_accuracy_vs_state(rows, tmp_path / "s.png", return_figure=True)
    try:
        titles = [ax.get_title() for ax in fig.axes]
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    assert titles == ["num_pairs=8", "num_pairs=64", "num_pairs=128"]


def test_claims_are_listed_in_numeric_axis_order():
    rows = [_row(lab, p, 0.5 + 0.1 * s, s) for p in (128, 16, 32) for lab in ("a", "b") for s in range(3)]
    cells = cell_stats(rows)
    judged = judge_claims([{"name": "a vs b", "better": "a", "than": "b"}], cells, "val_acc", 0.99)
    assert [j["cell"]["task_options.num_pairs"] for j in judged] == [16, 32, 128]


# ---- (2) metrics.jsonl and the sweep database hold strict JSON ---------------------------------------


def test_metrics_file_is_strict_json_and_reads_back_non_finite(tmp_path):
    sink = MetricsFile(tmp_path)
    sink.log({"step": 1, "train_loss": 2.0, "val_loss": math.nan, "val_acc": 0.5})
    sink.log({"step": 2, "train_loss": 1.0, "val_loss": math.inf, "score": -math.inf, "val_acc": 0.75})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    strict = [_strict_loads(line) for line in lines]
    assert strict[0]["val_loss"] is None and strict[0]["nonfinite"] == {"val_loss": "NaN"}
    assert strict[1]["nonfinite"] == {"val_loss": "Infinity", "score": "-Infinity"}
    back = [loads_record(line) for line in lines]
    assert math.isnan(back[0]["val_loss"]) and "nonfinite" not in back[0]
    assert back[1]["val_loss"] == math.inf and back[1]["score"] == -math.inf and back[1]["val_acc"] == 0.75
    curve = _curve(tmp_path / "metrics.jsonl")  # the sweep's reader of the curve
    assert math.isnan(curve[0]["val_loss"]) and curve[1]["val_loss"] == math.inf


def test_records_round_trip_nested_non_finite_values_and_old_bare_nan():
    rec = {"step": 3, "curve": [{"v": 1.0}, {"v": math.nan}], "a/b": {"c~d": -math.inf}, "s": None}
    line = dumps_record(rec)
    _strict_loads(line)
    back = loads_record(line)
    assert back["curve"][0] == {"v": 1.0} and math.isnan(back["curve"][1]["v"])
    assert back["a/b"] == {"c~d": -math.inf} and back["s"] is None and set(back) == set(rec)
    old = loads_record('{"step": 1, "val_loss": NaN}')  # a file written before the change
    assert math.isnan(old["val_loss"])


def _run(run_id, **kw):
    return SimpleNamespace(
        run_id=run_id, label="m", config={"model": "m"}, cell={"label": "m"}, tuned={}, seed=0, **kw
    )


def test_sweep_database_stores_strict_json_metrics(tmp_path):
    path = tmp_path / "s.sqlite"
    with SweepDB(path) as db:
        db.record("s", _run("r1"), {"status": "done", "metrics": {"val_acc": 0.5, "val_loss": math.inf}})
        (raw,) = db.conn.execute("SELECT metrics FROM runs").fetchone()
        (row,) = db.rows("s")
    assert _strict_loads(raw)["val_loss"] is None
    assert row["metrics"]["val_loss"] == math.inf and row["metrics"]["val_acc"] == 0.5


def test_report_leaves_a_nan_accuracy_at_a_length_out_of_the_mean_and_json(tmp_path):
    rows = [_row("m", 8, 0.9, s, lengths={64: v}) for s, v in enumerate([0.5, math.nan, 0.7])]
    (cell,) = cell_stats(rows)
    assert cell["lengths"][64]["n"] == 2 and cell["lengths"][64]["mean"] == pytest.approx(0.6, abs=1e-12)
    assert cell["at_length"][64]["seeds"] == [0, 2]
    path = tmp_path / "s.sqlite"
    with SweepDB(path) as db:
        for r in rows:
            db.record("s", SimpleNamespace(**r), r)
    out = write_report(path, tmp_path / "rep", plots=False)
    _strict_loads((tmp_path / "rep" / "s.json").read_text())
    assert out["s"]["cells"][0]["lengths"][64]["n"] == 2


# ---- (3) compressed text corpora ---------------------------------------------------------------------


@pytest.mark.parametrize("suffix,mod", [(".gz", gzip), (".bz2", bz2), (".xz", lzma)])
def test_compressed_text_file_reads_as_its_text(tmp_path, suffix, mod):
    p = tmp_path / f"a.txt{suffix}"
    with mod.open(p, "wb") as fh:
        fh.write("\ufeffhello\r\nworld\rend".encode())
    assert load_corpus(str(p)).documents == ["hello\nworld\nend"]
    (tmp_path / "b.txt").write_text("plain")
    assert load_corpus(str(tmp_path)).documents == ["hello\nworld\nend", "plain"]  # a folder too


def test_compressed_text_refusals_name_the_file(tmp_path):
    bad = tmp_path / "a.txt.gz"
    bad.write_bytes(b"not gzip at all")
    with pytest.raises(ValueError, match=r"a\.txt\.gz.*not a valid \.gz file"):
        load_corpus(str(bad))
    zst = tmp_path / "b.txt.zst"
    zst.write_bytes(b"\x28\xb5\x2f\xfd")
    with pytest.raises(ValueError, match=r"b\.txt\.zst.*\.zst compressed text is not supported.*\.gz"):
        load_corpus(str(zst))
    empty = tmp_path / "e.txt.gz"
    with gzip.open(empty, "wb"):
        pass
    with pytest.raises(ValueError, match="is empty"):
        load_corpus(str(empty))


# ---- (4) a Parquet file without rows -----------------------------------------------------------------


def test_parquet_file_without_rows_is_skipped_by_name(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pytest.importorskip("datasets")
    pq.write_table(pa.table({"text": ["hello world", "abc"]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "b.parquet")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        docs = load_corpus(str(tmp_path)).documents
    assert docs == ["hello world", "abc"]
    assert any("b.parquet" in str(w.message) and "no rows" in str(w.message) for w in caught)
    with pytest.raises(ValueError, match=r"b\.parquet' is empty"):
        load_corpus(str(tmp_path / "b.parquet"))


# ---- (5) concurrent writers of one sweep database ----------------------------------------------------


def test_two_writers_on_one_database_both_record_everything(tmp_path):
    path, errors = tmp_path / "s.sqlite", []

    def writer(i):
        try:
            with SweepDB(path) as db:
                for j in range(40):
                    db.record("s", _run(f"{i}-{j}"), {"status": "done", "metrics": {"val_acc": j / 40}})
                    db.set_meta("s", {"writer": i})
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    with SweepDB(path) as db:
        assert len(db.rows("s")) == 80


def test_a_writer_waits_for_another_process_lock(tmp_path):
    path = tmp_path / "s.sqlite"
    SweepDB(path).close()
    holder = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    release = threading.Timer(0.3, lambda: holder.execute("COMMIT"))
    release.start()
    try:
        with SweepDB(path) as db:  # waits for the lock rather than failing
            db.record("s", _run("r"), {"status": "done", "metrics": {"val_acc": 1.0}})
            assert [r["run_id"] for r in db.rows("s")] == ["r"]
    finally:
        release.join()
        holder.close()


def test_a_database_locked_too_long_is_said_to_be_locked_not_foreign(tmp_path, monkeypatch):
    path = tmp_path / "s.sqlite"
    with locked_sweep_db(path, monkeypatch):
        with pytest.raises(TimeoutError, match=r"s\.sqlite stayed locked by another process"):
            SweepDB(path)


def test_compressed_jsonl_errors_name_the_bad_line_not_utf8(tmp_path):
    pytest.importorskip("datasets")
    bad = tmp_path / "a.jsonl.gz"
    with gzip.open(bad, "wt") as fh:
        fh.write(json.dumps({"text": "hi"}) + "\n{bad\n")
    with pytest.raises(ValueError, match=r"a\.jsonl\.gz line 2: not JSON"):
        load_corpus(str(bad))
    empty = tmp_path / "e.jsonl.gz"
    with gzip.open(empty, "wb"):
        pass
    with pytest.raises(ValueError, match=r"e\.jsonl\.gz' is empty"):
        load_corpus(str(empty))
    junk = tmp_path / "j" / "z.jsonl.gz"
    junk.parent.mkdir()
    junk.write_bytes(b"garbage")
    with pytest.raises(ValueError, match=r"z\.jsonl\.gz: not a valid \.gz file"):
        load_corpus(str(junk))
