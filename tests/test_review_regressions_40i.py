"""Regression review 40i of e1c1dc0 (check_paths), a397dd2 (resume: the same path spelled
otherwise), 0a35339 (steer's tensor scale) and 94a241b (short_conv refused unless a bool): each
test fails on the code before its mend."""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers import sweep_project


def test_a_tokenizer_folder_without_a_slash_found_only_under_the_working_directory_is_refused(
    tmp_path, monkeypatch
):
    """e1c1dc0 keeps ``tokenizer: mytok`` as written when the project folder holds no ``mytok``; a
    ``mytok`` under the working directory then passed TrainConfig's check and check_paths (which
    compared the setting with itself), and the runs read the tokenizer from the working directory,
    against the rule the module states (never the working directory). Now refused up front, as a
    data path there is; with ``mytok`` under the project folder, or ``char``, nothing is refused."""
    from mnemo.data import build_tokenizer, save_tokenizer
    from mnemo.sweep.spec import SweepSpec, check_paths

    proj, away = sweep_project(tmp_path)
    (proj / "corpus.txt").write_text("abc " * 100)
    (away / "mytok").mkdir()
    save_tokenizer(build_tokenizer("char", "abc "), away / "mytok")
    f = proj / "sweeps" / "s.yaml"
    f.write_text(
        "name: t\nmetric: val_loss\nbase: {data: corpus.txt, tokenizer: mytok, steps: 1}\nmodels: [gla]\n"
    )
    monkeypatch.chdir(away)
    with pytest.raises(ValueError, match=r"tokenizer 'mytok' is read against the sweep file's project"):
        check_paths(SweepSpec.load(f))
    (proj / "mytok").mkdir()
    save_tokenizer(build_tokenizer("char", "abc "), proj / "mytok")
    check_paths(SweepSpec.load(f))  # under both: the project folder's
    (away / "char").mkdir()
    f.write_text(f.read_text().replace("mytok", "char"))
    check_paths(SweepSpec.load(f))


def test_resume_takes_a_glob_or_a_missing_tokenizer_spelled_absolute_as_no_change(tmp_path, monkeypatch):
    """a397dd2 compares path settings with ``os.path.samefile``, which needs both to exist: a
    ``data`` glob (``corpus/*.txt``, which load_corpus and check_paths take) and a tokenizer path no
    longer on disk (a resumed run reads its tokenizer from the checkpoint) spelled absolute were
    still refused as a change of ``data``/``tokenizer``. The same absolute path is no change."""
    from mnemo.train import TrainConfig
    from mnemo.train.run_folder import resume_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("hello world\n")
    saved = TrainConfig(data="corpus/*.txt", tokenizer="tok/tokenizer.json", steps=2)
    given = TrainConfig(
        data=os.path.abspath("corpus/*.txt"), tokenizer=os.path.abspath("tok/tokenizer.json"), steps=2
    )
    cfg, notes = resume_config(saved, given)
    assert (cfg.data, cfg.tokenizer, notes) == ("corpus/*.txt", "tok/tokenizer.json", [])
    with pytest.raises(ValueError, match="TrainConfig.tokenizer: a resumed run keeps"):
        resume_config(saved, TrainConfig(data="corpus/*.txt", tokenizer="other/tokenizer.json", steps=2))


def _gla():
    from mnemo.models import LanguageModel, build_config

    torch.manual_seed(0)
    return LanguageModel(build_config("gla", vocab_size=23, d_model=16, n_layers=1)).eval()


def test_a_tensor_scale_that_is_not_per_row_is_refused_by_name():
    """0a35339 let any tensor scale through to ``value + s · d``: a ``[B]`` scale (meant per row)
    raised torch's bare "size of tensor a (3) must match ... (16)" from inside the hook, and with
    ``B = d_model`` it silently scaled each channel of the direction instead. Now a ``ValueError``
    naming ``scale``, the value's shape and the per-row form; ``[B, 1, 1]``, ``[1, T, 1]`` and a
    one-value tensor still steer."""
    from mnemo.interp import steer

    m = _gla()
    d = torch.randn(16)
    for B, shape in [(3, (3,)), (16, (16,)), (2, (2, 1)), (2, (2, 1, 1, 1))]:
        ids = torch.randint(0, 23, (B, 6))
        with pytest.raises(ValueError, match=r"scale: shape .* \[B, 1, 1\]"):
            m.run_with_hooks(ids, steer(m, "blocks.0.hook_resid_pre", d, scale=torch.rand(*shape)))
    ids = torch.randint(0, 23, (3, 6))
    one, _ = m.run_with_hooks(ids, steer(m, "blocks.0.hook_resid_pre", d, scale=0.5))
    for shape in [(1,), (1, 1, 1), (3, 1, 1), (1, 6, 1)]:
        s = torch.full(shape, 0.5)
        out, _ = m.run_with_hooks(ids, steer(m, "blocks.0.hook_resid_pre", d, scale=s))
        torch.testing.assert_close(out, one)


@pytest.mark.parametrize("path", ["self_modifying", "self_modifying_projections"])
def test_the_self_modifying_mixers_refuse_a_non_bool_short_conv_as_their_siblings_do(path):
    """94a241b made linear attention, GLA and DeltaNet refuse ``short_conv="False"`` (truthy: it
    built the conv), as NeuralMemory does; the self-modifying mixers (same argument, same
    ``if short_conv`` switch) still built the conv for the string."""
    import importlib
    import inspect

    mod = importlib.import_module(f"mnemo.layers.{path}")
    classes = [
        c
        for _, c in inspect.getmembers(mod, inspect.isclass)
        if c.__module__ == mod.__name__ and "short_conv" in inspect.signature(c.__init__).parameters
    ]
    assert classes
    for cls in classes:
        with pytest.raises(ValueError, match=r"short_conv: expected a bool, got 'False'"):
            cls(d_model=16, n_heads=2, short_conv="False")
