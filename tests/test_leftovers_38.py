"""Leftovers of session 37's reviews, mended in session 38 (each test failed before its fix)."""

from __future__ import annotations

import gzip
import json
import math

import pytest


def _strict_json(text: str):
    """``text`` parsed as RFC 8259 JSON (a bare NaN/Infinity token raises)."""

    def refuse(token):
        raise ValueError(f"non-standard JSON token {token}")

    return json.loads(text, parse_constant=refuse)


# -- corpora: a compressed copy beside its original ---------------------------------------------


def test_a_folder_holding_a_text_file_and_its_compressed_copy_is_refused_by_name(tmp_path):
    from mnemo.data import load_corpus

    (tmp_path / "a.txt").write_text("hello world\n")
    with gzip.open(tmp_path / "a.txt.gz", "wt") as fh:
        fh.write("hello world\n")
    with pytest.raises(ValueError, match=r"a\.txt'.*a\.txt\.gz'.*same file with and without compression"):
        load_corpus(str(tmp_path))
    with pytest.raises(ValueError, match="same file with and without compression"):
        load_corpus(str(tmp_path / "a.*"))
    # the file named by itself is read, once
    assert load_corpus(str(tmp_path / "a.txt.gz")).text == "hello world\n"


def test_two_distinct_files_are_not_twins(tmp_path):
    from mnemo.data import load_corpus

    (tmp_path / "a.txt").write_text("one\n")
    (tmp_path / "A.txt").write_text("two\n")  # another file on a case-sensitive file system
    with gzip.open(tmp_path / "b.txt.gz", "wt") as fh:
        fh.write("three\n")
    docs = load_corpus(str(tmp_path)).documents
    if (tmp_path / "A.txt").read_text() == "two\n" and (tmp_path / "a.txt").read_text() == "one\n":
        assert sorted(docs) == ["one\n", "three\n", "two\n"]


# -- the sweep database: a read that waited in vain ---------------------------------------------


@pytest.mark.parametrize("read", ["rows", "meta", "sweeps", "finished_ids"])
def test_a_read_of_a_locked_sweep_database_raises_timeout_error_naming_it(tmp_path, monkeypatch, read):
    import mnemo.sweep.db as dbmod
    from mnemo.sweep.db import SweepDB
    from tests.helpers import locked_sweep_db

    path = tmp_path / "s.sqlite"
    monkeypatch.setattr(dbmod, "BUSY_TIMEOUT_S", 0.05)  # (before the connection is made)
    db = SweepDB(path)
    args = ("s",) if read in ("rows", "meta") else ()
    try:
        with locked_sweep_db(path, monkeypatch):
            with pytest.raises(TimeoutError, match=r"s\.sqlite stayed locked by another process"):
                getattr(db, read)(*args)
    finally:
        db.close()


# -- strict JSON where a value can be non-finite ------------------------------------------------


def test_the_reports_summary_json_is_strict_and_the_state_plot_redraws_from_it(tmp_path, monkeypatch):
    """``SWEEP.json`` was written with ``json.dumps`` (a non-finite value as a bare ``NaN``); a
    non-finite statistic (here planted in every cell) is now ``null`` plus the ``"nonfinite"`` map,
    and :func:`replot_state_from_summary` reads it back as the float."""
    import mnemo.sweep.report as report
    import mnemo.sweep.runner as runner_mod
    from mnemo.sweep import SweepSpec, run_sweep, write_report
    from mnemo.train.sinks import loads_record
    from tests.tasks.test_sweep_seeds import BASE, _fake_run_one

    acc = {(1e-3, s): v for s, v in enumerate([0.9, 0.6, 0.7, 0.8])}
    monkeypatch.setattr(runner_mod, "run_one", _fake_run_one(acc, []))
    real = report.cell_stats

    def planted(*a, **k):
        return [{**c, "planted": math.nan} for c in real(*a, **k)]

    monkeypatch.setattr(report, "cell_stats", planted)
    d = {"name": "one", "base": BASE, "models": ["gla"], "grid": {"lr": [1e-3]}, "seeds": 4}
    run_sweep(SweepSpec.from_dict(d), tmp_path / "db.sqlite", tmp_path / "runs", progress=False, log=print)
    write_report(tmp_path / "db.sqlite", tmp_path / "rep", plots=False)
    summary_path = tmp_path / "rep" / "one.json"
    text = summary_path.read_text()
    strict = _strict_json(text)
    assert strict["cells"][0]["planted"] is None
    assert strict["nonfinite"] == {"cells/0/planted": "NaN"}
    back = loads_record(text)
    assert math.isnan(back["cells"][0]["planted"]) and back["cells"][0]["mean"] == pytest.approx(0.75)
    pytest.importorskip("matplotlib")
    replot_state = report.replot_state_from_summary(summary_path, tmp_path / "again.png")
    assert replot_state.stat().st_size > 0


def test_verify_json_is_strict_when_an_error_is_nan(tmp_path):
    from mnemo.commands.verify import _write_json

    out = tmp_path / "v.json"
    _write_json(str(out), [{"name": "x", "max_rel_err": float("nan"), "passed": False}])
    assert _strict_json(out.read_text()) == [
        {"name": "x", "max_rel_err": None, "passed": False, "nonfinite": {"max_rel_err": "NaN"}}  # (review 7)
    ]


def test_decode_suite_names_its_units_mib():
    import inspect

    import mnemo.bench.decode as decode

    src = inspect.getsource(decode.main)
    assert "peak RSS MiB" in src and "state MiB" in src and " MB'" not in src


# -- model configuration: the neural-memory mixers' spec options --------------------------------


@pytest.mark.parametrize("mixer", ["neural_memory", "titans_mac", "titans_mag", "titans_mal"])
def test_an_unknown_neural_memory_option_is_refused_by_build_config(mixer):
    """The neural-memory mixers take ``**spec_overrides``; an unknown key passed ``build_config``
    and failed only when the model was built (deep in ``MemorySpec.replace``)."""
    from mnemo.models import build_config

    with pytest.raises(ValueError, match=rf"mixer_options\['{mixer}'\].*chunk_size.*got 'bogus'"):
        build_config("transformer", vocab_size=16, mixer_options={mixer: {"bogus": 1}})


def test_memory_spec_fields_and_constructor_options_still_pass():
    from mnemo.models import LanguageModel, build_config

    cfg = build_config(
        "transformer",
        vocab_size=16,
        d_model=16,
        n_layers=1,
        mixer="neural_memory",
        mixer_options={"neural_memory": {"chunk_size": 4, "objective": "huber", "short_conv": False}},
    )
    mixer = LanguageModel(cfg).blocks[0].mixer
    assert mixer.spec.chunk_size == 4 and mixer.spec.objective == "huber" and mixer.conv is None


# -- HF export: Qwen3-Next with transformers' YaRN ----------------------------------------------


def test_an_exported_qwen3_next_yarn_config_states_its_post_yarn_context(tmp_path):
    """The export wrote no ``max_position_embeddings``: transformers took its default 32768, which
    with ``original_max_position_embeddings = 8`` implies factor 4096 against the explicit 4 (a
    warning at every load). Now it is factor × the training context."""
    pytest.importorskip("transformers")
    import logging

    from transformers import Qwen3NextConfig
    from transformers.utils import logging as hf_logging

    from mnemo.hf.convert import import_hf
    from mnemo.hf.qwen3_next import export_qwen3_next
    from tests.hf.test_review2_interop import _qwen3_next_yarn

    hf = _qwen3_next_yarn()
    hf.save_pretrained(tmp_path / "hf")
    config, sd, _ = import_hf(tmp_path / "hf")
    hf_cfg, _ = export_qwen3_next(config, sd)
    rp = hf_cfg["rope_parameters"]
    assert rp["factor"] == 4.0 and rp["original_max_position_embeddings"] == 8
    assert hf_cfg["max_position_embeddings"] == 32

    said = []

    class Keep(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())

    logger = hf_logging.get_logger("transformers")
    handler = Keep()
    logger.addHandler(handler)
    try:
        Qwen3NextConfig(**{k: v for k, v in hf_cfg.items() if k not in ("architectures", "model_type")})
        Qwen3NextConfig(
            **{
                k: v
                for k, v in hf_cfg.items()
                if k not in ("architectures", "model_type", "max_position_embeddings")
            }
        )
    finally:
        logger.removeHandler(handler)
    # the second construction (the old export) warns; the first does not
    assert len([m for m in said if "does not match the ratio" in m]) == 1, said


# -- the lm-eval adapter keeps a float64 model's scores in float64 ------------------------------


def test_lm_eval_adapter_scores_a_float64_model_in_float64():
    """``logits.float()`` rounded a float64 model's logits to float32 before ``log_softmax``: the
    sums differed from the float64 computation by ~1e-6 nats. They now agree to ~1e-12."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from mnemo.hf.harness import MnemoLM
    from tests.hf.test_harness import _model

    lm, tok = _model("gla", seed=1)
    lm = lm.double()
    context, continuation = "hello there", " world, again and again."
    ctx, whole = tok.encode(context).tolist(), tok.encode(context + continuation).tolist()
    import torch

    with torch.no_grad():
        logits, _ = lm(torch.tensor(whole[:-1])[None])
    assert logits.dtype == torch.float64
    logp = torch.log_softmax(logits[0], -1)[len(ctx) - 1 :]
    want = logp.gather(-1, torch.tensor(whole[len(ctx) :])[:, None]).sum().item()
    req = [Instance("loglikelihood", {}, (context, continuation), 0)]
    got = MnemoLM(model=lm, tokenizer=tok).loglikelihood(req)[0][0]
    assert abs(got - want) <= 1e-12 * max(1.0, abs(want)), (got, want)
    rolling = [Instance("loglikelihood_rolling", {}, (context + continuation,), 0)]
    got_r = MnemoLM(model=lm, tokenizer=tok, rolling="state", max_length=8).loglikelihood_rolling(rolling)[0]
    with torch.no_grad():
        full, _ = lm(torch.tensor(whole[:-1])[None])
    want_r = torch.log_softmax(full[0], -1).gather(-1, torch.tensor(whole[1:])[:, None]).sum().item()
    assert abs(got_r - want_r) <= 1e-10 * max(1.0, abs(want_r)), (got_r, want_r)


# -- interpretability: integer types, checks before work, float64 kept --------------------------


def test_state_patch_takes_a_numpy_or_tensor_integer_position():
    np = pytest.importorskip("numpy")
    import torch

    from mnemo.interp.interventions import state_patch
    from tests.interp.test_interventions import _ids, _model

    m = _model("gla")
    A, B = _ids(T=10, seed=3), _ids(T=10, seed=4)
    want, _ = state_patch(m, A, B, 4)
    for at in (np.int64(4), torch.tensor(4)):
        got, _ = state_patch(m, A, B, at)
        assert torch.equal(got, want)
    for bad in (True, 4.0, np.float64(4.0), 0, 10):
        with pytest.raises(ValueError, match="at: expected an int"):
            state_patch(m, A, B, bad)


def test_induction_ablation_refuses_a_bad_k_before_scoring(monkeypatch):
    import mnemo.interp.probe as probe
    from mnemo.interp.interventions import induction_ablation
    from tests.interp.test_interventions import _model

    m = _model("transformer")

    def boom(*a, **k):
        raise AssertionError("scored before k was checked")

    monkeypatch.setattr(probe, "circuit_scores", boom)
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="k: expected an int"):
            induction_ablation(m, bad, draws=1, length=8, batch=2)


def test_timescales_keep_a_float64_models_gates_in_float64():
    """The half-lives of a float64 model were computed from its gates cast to float32 (rounded,
    relative error ~1e-8); now they are ``ln 2 / |g|`` of the float64 gates exactly."""
    import math

    import torch

    from mnemo.interp.timescales import timescales
    from tests.interp.test_interventions import _ids, _model

    m = _model("gla", n_layers=1)
    ids = _ids(T=9)
    _, cache = m.run_with_cache(ids, names=["blocks.0.mixer.hook_g"])
    g = cache["blocks.0.mixer.hook_g"]
    assert g.dtype == torch.float64
    hl = (-math.log(2) / g.clamp(max=0.0)).flatten().double()
    out = timescales(m, ids)["0"]["half_life"]
    assert out["min"] == hl.min().item() and out["max"] == hl.max().item()


# -- MoE: top-1 with renormalised weights --------------------------------------------------------


def test_moe_top1_with_renormalised_weights_warns_and_its_router_gets_no_task_gradient():
    """Seen by review 38-L: with ``top_k=1`` and the default ``norm_topk_prob=True`` every routing
    weight is 1, so the task loss gives the router nothing (Switch's top-1 scales by the
    probability). The first training forward says so (review 38a: not the constructor); the gradient
    below shows why."""
    import warnings

    import torch

    from mnemo.layers.moe import MoE

    def router_grad(**kw):
        torch.manual_seed(0)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            m = MoE(8, n_experts=2, top_k=1, expert_hidden=8, aux_loss_coef=0.0, **kw).double()
            y = m(torch.randn(2, 5, 8, dtype=torch.float64))  # (the training forward warns)
        (y[0] if isinstance(y, tuple) else y).pow(2).sum().backward()
        return m.router.weight.grad.abs().max().item(), [str(w.message) for w in said]

    g_norm, said = router_grad()
    assert len(said) == 1 and "norm_topk_prob=False" in said[0]
    g_plain, said = router_grad(norm_topk_prob=False)
    assert said == []
    # (the experts' outputs are small at init: compare the two, ~4e-14 against ~9e-8 here)
    assert g_plain > 0 and g_norm <= 1e-5 * g_plain, (g_norm, g_plain)


# -- --help states the defaults of continual and the circuit probes (seen by review 38-U) ----------


@pytest.mark.parametrize("path", [("continual",), ("probe", "circuits"), ("probe", "ablate")])
def test_help_states_every_default_a_user_would_otherwise_run_blind(path):
    """``mnemo continual --help`` hid ``--experiment all``, ``--seeds 3``, ``--workers 2`` and
    ``--out runs/continual`` (a bare call starts every experiment); the circuit probes hid
    ``--length``, ``--seed`` and ``--how``. Each option with a default other than off/None now
    names it in its help, as the value the parser uses."""
    import argparse

    from mnemo.cli import build_parser

    parser = build_parser()
    for name in path:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    checked = 0
    for action in parser._actions:
        off = action.default is None or action.default is False or action.default == []
        if not action.option_strings or off or action.default == argparse.SUPPRESS:
            continue
        assert action.help and f"default {action.default}" in action.help.replace("default:", "default"), (
            action.option_strings,
            action.help,
            action.default,
        )
        checked += 1
    assert checked >= 3


# -- mnemo generate shows its progress on a terminal (seen by review 38-U) ------------------------


def test_generate_shows_a_bar_of_new_tokens_on_a_terminal_and_keeps_stdout_the_text(
    tmp_path, capsys, monkeypatch
):
    """A long ``mnemo generate`` printed nothing until its end; a bar of new tokens is now drawn on
    stderr when it is a terminal, and stdout holds the text alone, as before (the same text as
    :func:`~mnemo.train.generate_text` gives)."""
    import random
    import sys

    from mnemo.cli import main
    from tests.helpers import fast_train_flags
    from tests.test_review_newuser import _Terminal

    data = tmp_path / "corpus.txt"
    rng = random.Random(1)
    data.write_text("".join(rng.choice("abcdefgh \n") for _ in range(2000)))
    out = tmp_path / "run"
    assert main(["train", "--data", str(data), "--out", str(out), *fast_train_flags(seq_len=16)]) == 0
    capsys.readouterr()
    argv = ["generate", "--checkpoint", str(out), "--prompt", "ab", "--max-new-tokens", "12"]
    assert main(argv) == 0
    plain = capsys.readouterr()
    assert plain.err == ""  # not a terminal: no bar
    err = _Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    assert main(argv) == 0
    assert capsys.readouterr().out == plain.out  # the same text, alone on stdout
    assert "generate:" in err.getvalue() and "0/12 " in err.getvalue()
