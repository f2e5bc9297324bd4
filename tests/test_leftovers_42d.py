"""Small frictions a new user met (round 42d): each test failed before its mend."""

from __future__ import annotations

import argparse
import warnings

import pytest
import torch


def _help(argv, capsys) -> str:
    from mnemo.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    return " ".join(capsys.readouterr().out.split())


def test_half_lives_under_one_token_are_named_in_the_histogram():
    """The first bin [1, 1.78) also held half-lives under one token, unsaid; the JSON now counts
    them apart (and those past the last edge), and says the end bins hold them."""
    from mnemo.interp.timescales import summarize

    h = summarize(torch.tensor([0.1, 0.5, 1.2, 3.0, 5e7, float("inf")]))["histogram"]
    assert h["counts"][0] == 3 and h["counts"][-1] == 1 and sum(h["counts"]) == 5  # old readers
    assert h["below_first_edge"] == 2 and h["above_last_edge"] == 1
    assert "first bin" in h["note"] and "last bin" in h["note"]
    h = summarize(torch.tensor([1.0, 2.0, 1e7]))["histogram"]  # the edges themselves are inside
    assert (h["below_first_edge"], h["above_last_edge"]) == (0, 0)


def test_continual_help_lists_every_model_name(capsys):
    from mnemo.commands.continual import model_specs

    text = _help(["continual", "--help"], capsys)
    for name in model_specs():
        assert name in text, name
    assert "static-4" in text and "wide-1" in text


def test_bench_ops_takes_glob_patterns_and_refuses_one_matching_nothing():
    from mnemo.argtypes import match_names

    names = ["softmax_attention", "gla_scalar", "gla_channel", "delta_rule", "gated_delta_rule"]
    assert match_names("--ops", "gla*", names) == ["gla_scalar", "gla_channel"]
    assert match_names("--ops", "gla_channel,gla*,delta_rule", names) == [
        "gla_scalar",
        "gla_channel",
        "delta_rule",
    ]
    with pytest.raises(ValueError, match=r"--ops: 'gla' matches no name; known: softmax_attention, gla_sc"):
        match_names("--ops", "gla_*,gla", names)


def test_bench_ops_suite_applies_the_patterns(monkeypatch):
    """The ops suite refused ``gla*``; it now takes it (both GLA forms) and refuses ``gla``."""
    import mnemo.bench.ops as bops
    from mnemo.argtypes import match_names

    assert match_names("--ops", "gla*", [b.name for b in bops._registry()]) == ["gla_scalar", "gla_channel"]

    class Chosen(Exception):
        pass

    def stop(*a, **k):  # the first timing after the ops are chosen: nothing is timed
        raise Chosen

    monkeypatch.setattr(bops, "matmul_peak", stop)
    args = argparse.Namespace(
        lengths="8", dtypes="fp32", ops="gla*", modes="recurrent", heads=1, head_dim=4, batch=1,
        recurrent_max_len=8, repeats=1, device="cpu", json=None,
    )  # fmt: skip
    with pytest.raises(Chosen):
        bops.main(args)
    with pytest.raises(ValueError, match="--ops: 'gla' matches no name; known: softmax_attention"):
        bops.main(argparse.Namespace(**{**vars(args), "ops": "gla"}))


def test_bench_peers_suite_applies_the_patterns():
    import mnemo.bench.peers as bp

    with pytest.raises(ValueError, match=r"--ops: 'nope\*' matches no name; known: "):
        bp.main(argparse.Namespace(ops="nope*", repeats=1))


@pytest.mark.parametrize("key", ["fla_gated_delta_rule", "fla_kda"])
def test_bench_peers_fla_rows_time_both_sides_of_the_same_op(key):
    """The fla-core rows (``naive_chunk_gated_delta_rule``; ``naive_chunk_kda`` for the per-channel
    decay) at a tiny size: both sides timed, named, and the op the row says (per-channel or not)."""
    pytest.importorskip("fla")
    import mnemo.bench.peers as bp

    r = bp.PEERS[key](T=64, heads=1, dim=8, repeats=1)
    assert ("per-channel g (KDA)" in r["name"]) == (key == "fla_kda")
    assert r["peer"].endswith(f"naive_chunk_{'kda' if key == 'fla_kda' else 'gated_delta_rule'} (chunk 64)")
    for side in ("mnemo", "fla_naive"):
        assert r[side]["fwd_ms"] > 0 and r[side]["fwd_bwd_ms"] > 0


def _no_tok_warning(tmp_path, export: bool) -> str:
    from mnemo.hf.convert import _warn_no_tokenizer

    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        _warn_no_tokenizer(tmp_path / "src", tmp_path / "out", export=export)
    return str(w[0].message)


def test_export_tokenizer_warning_says_what_reads_one_and_how_to_give_it(tmp_path):
    msg = _no_tok_warning(tmp_path, export=True)
    assert "holds no tokenizer" in msg and "so " in msg and "has none" in msg
    assert "AutoTokenizer.from_pretrained" in msg  # what a transformers folder is loaded with
    assert "mnemo eval" in msg and "mnemo generate" in msg
    assert "tokenizer.json" in msg and "tokenizer_config.json" in msg
    msg = _no_tok_warning(tmp_path, export=False)  # a mnemo checkpoint: mnemo alone reads it
    assert "AutoTokenizer" not in msg and "tokenizer.json" in msg and "mnemo eval" in msg


def test_convert_and_export_have_their_own_descriptions(capsys):
    conv = _help(["convert", "--help"], capsys)
    exp = _help(["export", "--help"], capsys)
    for text in (conv, exp):
        assert "in and out" not in text
    assert "into a mnemo checkpoint" in conv and "transformers loads" in exp
    assert "transformers loads" not in conv.split("positional arguments")[0]
