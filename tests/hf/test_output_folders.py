"""Where ``mnemo convert`` and ``mnemo export`` write, and how: never into a training run's folder or
checkpoint (``force`` or not); the whole folder at once (a failed write leaves ``OUT`` as it was,
and the command says so in one line); with ``--force`` a checkpoint folder is replaced whole, so no
file of its previous content (a stale ``tokenizer.json``) survives. Tiny random-weight models built
with transformers itself."""

from __future__ import annotations

import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mnemo.cli import main  # noqa: E402
from mnemo.hf.convert import convert, export_hf  # noqa: E402
from mnemo.models import LanguageModel  # noqa: E402
from mnemo.train import resolve_checkpoint, verify_checkpoint  # noqa: E402

VOCAB = 256  # embedding and head of 16 KiB each: the weights file is far larger than config.json


def _mamba2(folder, seed: int, **over) -> transformers.Mamba2ForCausalLM:
    torch.manual_seed(seed)
    cfg = transformers.Mamba2Config(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, state_size=4, num_heads=8, head_dim=4,
        n_groups=2, chunk_size=8, **over,
    )  # fmt: skip
    model = transformers.Mamba2ForCausalLM(cfg).eval()
    model.save_pretrained(folder)
    return model


def _tree(root) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _leftovers(folder) -> list[str]:
    """Temporary siblings of ``folder`` that a write left behind (hidden ``.NAME.*`` folders)."""
    return sorted(p.name for p in folder.parent.iterdir() if p.name.startswith(f".{folder.name}."))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny trained Mamba-2 run (one checkpoint, with its manifest and trainer state)."""
    out = tmp_path_factory.mktemp("runs") / "run"
    argv = ["train", "--model", "mamba2", "--d-model", "16", "--n-layers", "1", "--seq-len", "16"]
    argv += ["--batch-size", "2", "--steps", "2", "--eval-interval", "2", "--eval-batches", "1"]
    assert main([*argv, "--sample-tokens", "0", "--no-progress", "--out", str(out)]) == 0
    return out


def test_nothing_is_written_into_a_training_run(run, tmp_path, capsys):
    """Review r2: ``export_hf(..., force=True)`` into ``RUN/ckpt-N`` replaced the checkpoint and the
    run no longer loaded. Refused now, as convert refuses it, for the run's folder, a checkpoint, a
    folder inside one and a checkpoint copied under another name (it holds trainer_state.pt and
    manifest.json); the run stays intact and usable."""
    mine = tmp_path / "mine"
    shutil.copytree(run, mine)
    ckpt = resolve_checkpoint(mine)
    renamed = tmp_path / "renamed"
    shutil.copytree(ckpt, renamed)
    _mamba2(tmp_path / "hf", 0)
    with pytest.warns(UserWarning, match="holds no tokenizer"):
        convert(tmp_path / "hf", tmp_path / "mn")
    before = _tree(mine), _tree(renamed)
    for out in (ckpt, mine, ckpt / "sub", renamed):
        with pytest.raises(ValueError, match="training run") as e:
            export_hf(tmp_path / "mn", out, force=True)
        assert str(out) in str(e.value) and "pick another folder" in str(e.value)
        with pytest.raises(ValueError, match="training run"):
            convert(tmp_path / "hf", out, force=True)
    assert (_tree(mine), _tree(renamed)) == before
    assert verify_checkpoint(ckpt) == [] and resolve_checkpoint(mine) == ckpt
    assert main(["generate", "--checkpoint", str(mine), "--prompt", "KING:", "--max-new-tokens", "3"]) == 0
    capsys.readouterr()
    # the commands refuse it too, in one line
    assert main(["export", str(tmp_path / "mn"), str(renamed), "--force"]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1 and "belongs to a training run (it holds trainer_state.pt, manifest.json)" in err
    )


def test_a_failed_write_leaves_out_as_it_was(tmp_path, capsys):
    """Review r3: under a file size limit the weights write failed after config.json was replaced,
    leaving A's config with B's weights, which loaded silently (and a 22-line traceback). Now OUT
    keeps B whole, the command says why in one line (exit status 2), nothing is left beside it; the
    same for export; and with room to write, OUT becomes A's whole."""
    resource = pytest.importorskip("resource")
    a = _mamba2(tmp_path / "A_hf", 0)
    _mamba2(tmp_path / "B_hf", 5, time_step_limit=(0.01, 0.05))
    for src in ("A_hf", "B_hf"):
        (tmp_path / src / "tokenizer.json").write_text("{}")
    mix, ex = tmp_path / "mix", tmp_path / "ex"
    convert(tmp_path / "B_hf", mix)
    export_hf(mix, ex)
    before, before_ex = _tree(mix), _tree(ex)
    limit = 8192
    assert (mix / "config.json").stat().st_size < limit < (mix / "model.safetensors").stat().st_size
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if hard != resource.RLIM_INFINITY and hard < limit:
        pytest.skip(f"the hard file size limit ({hard} bytes) is below the test's {limit}")
    capsys.readouterr()
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        code = main(["convert", str(tmp_path / "A_hf"), str(mix), "--force"])
        with pytest.raises(OSError, match=f"writing {ex} failed .*; {ex} was left as it was"):
            export_hf(mix, ex, force=True)
        with pytest.raises(OSError, match="was not created"):
            export_hf(mix, tmp_path / "new")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"mnemo convert: error: writing {mix} failed (") and "was left as it was" in err
    assert "Traceback" not in err
    assert _tree(mix) == before and _tree(ex) == before_ex and not (tmp_path / "new").exists()
    assert _leftovers(mix) == [] and _leftovers(ex) == [] and _leftovers(tmp_path / "new") == []
    # with room to write: A's model, whole
    assert main(["convert", str(tmp_path / "A_hf"), str(mix), "--force"]) == 0
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(LanguageModel.from_pretrained(mix)(ids)[0], a(ids).logits, atol=1e-5)


def test_force_replaces_a_checkpoint_folder_whole(tmp_path, monkeypatch):
    """Review defect 8: ``convert --force`` kept the folder's old tokenizer.json while warning that
    there was none. ``--force`` now replaces the folder whole; a non-empty folder that is not a
    checkpoint (no config.json) is refused even with ``--force``, its files kept. An empty folder
    (the current one, say) is filled in place, not replaced; the current folder is not replaced."""
    _mamba2(tmp_path / "with_tok", 0)
    (tmp_path / "with_tok" / "tokenizer.json").write_text("{}")
    _mamba2(tmp_path / "without", 1)
    out = tmp_path / "ck"
    convert(tmp_path / "with_tok", out)
    assert (out / "tokenizer.json").is_file()
    with pytest.raises(ValueError, match="is not empty"):
        convert(tmp_path / "without", out)
    with pytest.warns(UserWarning, match="holds no tokenizer"):
        convert(tmp_path / "without", out, force=True)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "hf_config_carried.json",
        "model.safetensors",
    ]
    assert _leftovers(out) == []
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("keep me")
    with pytest.raises(
        ValueError, match="holds todo.txt but no config.json, so it is not a checkpoint folder"
    ):
        convert(tmp_path / "without", notes, force=True)
    with pytest.raises(ValueError, match="not a checkpoint folder"):
        export_hf(out, notes, force=True)
    assert _tree(notes) == {"todo.txt": b"keep me"}
    here = tmp_path / "here"
    here.mkdir()
    inode = here.stat().st_ino
    monkeypatch.chdir(here)
    convert(tmp_path / "with_tok", ".")
    assert here.stat().st_ino == inode and (here / "tokenizer.json").is_file()
    assert LanguageModel.from_pretrained(".") is not None and _leftovers(here) == []
    with pytest.raises(ValueError, match="is the current folder or holds it"):
        convert(tmp_path / "without", ".", force=True)
    assert (here / "tokenizer.json").is_file()


def test_a_mount_point_out_is_written_and_replaced_in_place(tmp_path, monkeypatch):
    """Review of b1c98af: OUT a mount point (a volume) — no rename crosses its boundary, so the
    sibling staging failed with EXDEV. Simulated here: ``os.path.ismount`` says OUT is one and
    ``os.rename`` refuses any move between inside and outside OUT. An empty mount point is filled,
    a checkpoint on one is replaced in place with ``force`` (no file of the old content stays, no
    temporary folder is left inside or beside it), and a failed write leaves the old content."""
    import errno
    import os

    import mnemo.hf.convert as hc

    out = tmp_path / "vol"
    out.mkdir()
    real_rename, real_ismount = os.rename, os.path.ismount

    def inside(p) -> bool:
        p = os.path.abspath(p)
        return p == str(out) or p.startswith(str(out) + os.sep)

    def rename(a, b):
        if inside(a) != inside(b) or os.path.abspath(a) == str(out):
            raise OSError(errno.EXDEV, "Invalid cross-device link", str(a))
        return real_rename(a, b)

    monkeypatch.setattr(hc.os, "rename", rename)
    monkeypatch.setattr(hc.os.path, "ismount", lambda p: os.path.abspath(p) == str(out) or real_ismount(p))
    a = _mamba2(tmp_path / "A_hf", 0)
    (tmp_path / "A_hf" / "tokenizer.json").write_text("{}")
    b = _mamba2(tmp_path / "B_hf", 1)
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(0))

    def logits():
        with torch.no_grad():
            return LanguageModel.from_pretrained(out)(ids)[0]

    convert(tmp_path / "A_hf", out)
    assert torch.allclose(logits(), a(ids).logits, atol=1e-5) and (out / "tokenizer.json").is_file()
    before = _tree(out)

    def broken(model_self, d, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(LanguageModel, "save_pretrained", broken)
        with pytest.raises(OSError, match="was left as it was"):
            convert(tmp_path / "B_hf", out, force=True)
    assert _tree(out) == before and [p.name for p in out.iterdir() if p.name.startswith(".")] == []
    convert(tmp_path / "B_hf", out, force=True)
    assert torch.allclose(logits(), b(ids).logits, atol=1e-5)
    assert not (out / "tokenizer.json").exists()  # replaced whole
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == [] and _leftovers(out) == []


def test_a_failed_rollback_on_a_mount_point_keeps_the_old_content(tmp_path, monkeypatch):
    """A forced replace of a checkpoint on a mount point where the new ``config.json``'s move fails
    and then the first rename of the rollback fails too: the old content goes back whole (a new
    entry of the same name is moved out of its way), nothing is deleted that did not go back."""
    import errno
    import os

    import mnemo.hf.convert as hc

    out = tmp_path / "vol"
    out.mkdir()
    real_rename, real_ismount = os.rename, os.path.ismount
    monkeypatch.setattr(hc.os.path, "ismount", lambda p: os.path.abspath(p) == str(out) or real_ismount(p))
    _mamba2(tmp_path / "A_hf", 0)
    _mamba2(tmp_path / "B_hf", 1)
    convert(tmp_path / "A_hf", out)
    before = _tree(out)
    failed = []

    def rename(a, b):
        a, b = os.fspath(a), os.fspath(b)
        if not failed and os.path.basename(b) == "config.json" and os.path.dirname(b) == str(out):
            failed.append("config")
            raise OSError(errno.EIO, "injected", a)
        if failed == ["config"] and os.path.dirname(a) == str(out) and ".mnemo.partial" in b:
            failed.append("rollback")
            raise OSError(errno.EIO, "injected in the rollback", a)
        return real_rename(a, b)

    monkeypatch.setattr(hc.os, "rename", rename)
    with pytest.raises(OSError, match="was left as it was"):
        convert(tmp_path / "B_hf", out, force=True)
    assert failed == ["config", "rollback"]
    assert _tree(out) == before and [p.name for p in out.iterdir() if p.name.startswith(".")] == []
