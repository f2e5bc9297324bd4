"""Regression review of session 43's leftovers C (``mnemo convert --from-dcp`` locks ``OUT``).

1. ``consolidate_checkpoint`` now creates ``OUT`` (``mkdir(parents=True)``) before anything is
   checked, and its docstring says "a failed consolidation leaves no folder it created"; but only
   ``OUT`` itself was removed on failure: ``OUT=a/b/c`` with a missing ``SRC`` left ``a/`` and
   ``a/b/`` behind (before the change nothing was created: the source was resolved first).
2. It claims to treat ``OUT`` as ``mnemo train`` does, but a checkpoint's own folder (which
   ``mnemo train`` refuses) took the consolidated run inside it, hidden behind the outer weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.train import test_review7_distributed as _review7

sharded_run = _review7.sharded_run  # (the fixture: a run whose checkpoint holds DCP shards)


def _files(out: Path) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}


def test_a_failed_consolidation_leaves_none_of_the_nested_folders_it_created(tmp_path):
    """``OUT = tmp/a/b/c`` (none exists) and a ``SRC`` that does not exist: the FileNotFoundError
    of the source, and ``tmp`` holds what it held before (nothing). Before: ``a`` and ``a/b``
    were left. A folder that existed before (``tmp``) stays."""
    from mnemo.train.sharded import consolidate_checkpoint

    (tmp_path / "keep").mkdir()  # an existing empty folder beside: untouched
    with pytest.raises(FileNotFoundError):
        consolidate_checkpoint(tmp_path / "nosuch", tmp_path / "a" / "b" / "c")
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == ["keep"]
    # an existing (empty) OUT and its parents are left as they were
    out = tmp_path / "keep"
    with pytest.raises(FileNotFoundError):
        consolidate_checkpoint(tmp_path / "nosuch", out)
    assert out.is_dir() and list(out.iterdir()) == []


def test_a_failed_consolidation_into_a_relative_nested_out_removes_what_it_made(tmp_path, monkeypatch):
    """The same with a relative ``OUT`` (``x/y``, as typed on the command line): nothing left."""
    from mnemo.train.sharded import consolidate_checkpoint

    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError):
        consolidate_checkpoint(Path("nosuch"), "x/y")
    assert list(tmp_path.iterdir()) == []


def test_consolidating_into_a_checkpoints_own_folder_is_refused(sharded_run, tmp_path):
    """``OUT`` = a single-file checkpoint's folder (``config.json``, ``model.safetensors``: here the
    first consolidation's ``ckpt-000001``): ``mnemo train`` refuses such a folder, and the
    consolidated run written inside it is hidden behind it (resolving ``OUT`` finds the outer
    weights: ``mnemo eval OUT`` would read another checkpoint than the one just written). Now a
    ValueError naming ``OUT`` and what it holds, nothing written. Before: ``OUT/ckpt-000001`` and
    ``OUT/latest`` were written inside the checkpoint."""
    from mnemo.train.sharded import consolidate_checkpoint

    run, _ = sharded_run
    first = consolidate_checkpoint(run, tmp_path / "one")
    before = _files(first)
    with pytest.raises(ValueError) as e:
        consolidate_checkpoint(run, first)
    msg = " ".join(str(e.value).split())
    assert str(first) in msg and "holds a checkpoint" in msg and "model.safetensors" in msg, msg
    assert _files(first) == before
