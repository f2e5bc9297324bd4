"""Sixth break-it review of the hooks and mnemo.interp: the spectrum's serialiser follows the
commands' strict-JSON convention (null + "nonfinite"), and ``burn_in`` reaches every kind of memory
through :func:`memory_spectrum` and ``mnemo probe spectrum``, checked against closed forms."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from mnemo.interp.lyapunov import delta_rule_spectrum, diagonal_spectrum, memory_jvp_spectrum, state_spectrum
from mnemo.interp.spectrum import memory_spectrum, to_json
from mnemo.models import LanguageModel, build_config
from mnemo.train.sinks import loads_record

F64 = torch.float64
ROOT = Path(__file__).resolve().parents[2]


def _model(name, n_layers=1, **kw):
    torch.manual_seed(0)
    cfg = build_config(name, vocab_size=20, d_model=16, n_layers=n_layers, **kw)
    return LanguageModel(cfg).double().eval()


def _ids(T=24, seed=0):
    return torch.randint(0, 20, (1, T), generator=torch.Generator().manual_seed(seed))


# --- part 1a: to_json writes null + "nonfinite", as the probe command's spectrum.json -------------


def test_to_json_writes_null_and_a_nonfinite_map_that_loads_record_restores():
    """A linear attention's exponents are all 0, so its half-lives are ``inf``: the library's
    serialiser writes them as ``null`` with their places under ``"nonfinite"`` (strict JSON, as
    ``mnemo probe spectrum`` and every command write), not as the strings ``"inf"``."""
    result = memory_spectrum(_model("linear_attention"), _ids(T=8))
    record = to_json({"tokens": 8, "layers": result})
    text = json.dumps(record, allow_nan=False)  # strict JSON
    assert '"inf"' not in text
    assert record["layers"]["0"]["half_lives"][0][0] is None
    assert record["nonfinite"]["layers/0/half_lives/0/0"] == "Infinity"
    back = loads_record(text)
    assert back["layers"]["0"]["half_lives"][0][0] == math.inf and "nonfinite" not in back
    assert back["layers"]["0"]["summary"]["median_half_life"] == math.inf


def test_to_json_names_a_value_that_is_not_a_record():
    with pytest.raises(TypeError, match=r"record: expected a dict .*got list"):
        to_json([math.inf])


def test_spectrum_page_reads_the_library_serialiser_and_files_of_before():
    """``scripts/spectrum_page.py``'s table rows are the same for a record written by
    :func:`to_json` (null + "nonfinite", read as ``json.loads`` gives it) and for a file of before
    (``"inf"`` strings)."""
    spec = importlib.util.spec_from_file_location("spectrum_page_r6", ROOT / "scripts" / "spectrum_page.py")
    page = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(page)
    result = memory_spectrum(_model("linear_attention"), _ids(T=8))
    new = json.loads(json.dumps(to_json({"layers": result}), allow_nan=False))

    def old_style(x):  # the serialiser of before: non-finite floats as strings
        if isinstance(x, float):
            return x if math.isfinite(x) else str(x)
        if isinstance(x, dict):
            return {k: old_style(v) for k, v in x.items()}
        if isinstance(x, list):
            return [old_style(v) for v in x]
        return x

    old = json.loads(json.dumps(old_style({"layers": result})))
    assert page.rows("la", new) == page.rows("la", old)
    assert "∞" in page.rows("la", new)[0] or "inf" in page.rows("la", new)[0].lower()


# --- part 1b: burn_in through memory_spectrum, against closed forms -------------------------------


def test_diagonal_spectrum_burn_in_is_the_mean_log_decay_after_the_transient():
    """``g_0 = −5`` (a start-of-text gate that clears the memory), ``g_t = −0.1`` after: the
    estimate over ``T`` is ``(−5 − 0.1 (T − 1)) / T`` — biased by ``−4.9 / T`` — and ``burn_in=1``
    gives the long-run ``−0.1``."""
    T = 10
    g = torch.full((1, T, 2), -0.1, dtype=F64)
    g[:, 0] = -5.0
    assert diagonal_spectrum(g).tolist() == pytest.approx([(-5 - 0.1 * (T - 1)) / T] * 2, rel=1e-12)
    assert diagonal_spectrum(g, burn_in=1).tolist() == pytest.approx([-0.1, -0.1], rel=1e-12)
    for bad in (-1, T, 1.0, True):
        with pytest.raises(ValueError, match=r"burn_in: expected an int number of tokens in \[0, 10\)"):
            diagonal_spectrum(g, burn_in=bad)


def test_state_spectrum_burn_in_skips_whole_periods_of_a_linear_map():
    """``S ← x̄_c S`` per period of 2 tokens (``x̄_c`` the chunk's mean input): a first period of
    gain 100 then gain 0.5: exponents ``(ln 100 + 3 ln 0.5) / 8`` over 4 periods, ``ln 0.5 / 2``
    with ``burn_in=1`` (one period; the divisor the 6 tokens after it)."""
    x = torch.tensor([100.0, 100.0] + [0.5] * 6, dtype=F64)[None, :, None]

    def get(st):
        return [st]

    def put(st, ts):
        return ts[0]

    def step(st, xs):
        return st * xs.mean(1)

    s0 = torch.ones(1, 1, dtype=F64)
    lam, n = state_spectrum(step, s0, x, period=2, get=get, put=put, directions=1)
    assert n == 1 and float(lam[0]) == pytest.approx((math.log(100) + 3 * math.log(0.5)) / 8, rel=1e-8)
    lam, _ = state_spectrum(step, s0, x, period=2, get=get, put=put, directions=1, burn_in=1)
    assert float(lam[0]) == pytest.approx(math.log(0.5) / 2, rel=1e-8)
    with pytest.raises(ValueError, match=r"burn_in: expected an int number of periods .* in \[0, 4\), got 4"):
        state_spectrum(step, s0, x, period=2, get=get, put=put, directions=1, burn_in=4)


@pytest.mark.parametrize("name", ["gla", "mamba2"])
def test_memory_spectrum_burn_in_of_a_diagonal_layer_is_the_gate_mean_after_it(name):
    model, ids = _model(name), _ids(T=24)
    e = memory_spectrum(model, ids, burn_in=5)["0"]
    g = model.run_with_cache(ids, names="hook_g")[1]["blocks.0.mixer.hook_g"].double()
    hand = g[:, 5:].mean(dim=(0, 1))  # by hand: the time average over tokens 5 … 23
    hand = hand[:, None] if hand.ndim == 1 else hand.sort(-1, descending=True).values
    assert torch.allclose(torch.tensor(e["exponents"], dtype=F64), hand, rtol=1e-12, atol=0)
    assert e["summary"]["context"] == 24 - 5  # the tokens measured
    assert memory_spectrum(model, ids, burn_in=5, context=24)["0"]["summary"]["context"] == 24


@pytest.mark.parametrize("preset", ["gated_deltanet", "kda"])  # (kda: a per-channel decay, [B, T, H, K])
def test_memory_spectrum_burn_in_of_a_delta_layer_matches_delta_rule_spectrum(preset):
    model, ids = _model(preset), _ids(T=20)
    e = memory_spectrum(model, ids, burn_in=3)["0"]
    c = model.run_with_cache(ids, names=["hook_k", "hook_beta", "hook_g"])[1]
    b = "blocks.0.mixer."
    want = delta_rule_spectrum(c[b + "hook_k"], c[b + "hook_beta"], c[b + "hook_g"], burn_in=3)
    assert torch.allclose(torch.tensor(e["exponents"], dtype=F64), want, rtol=1e-12, atol=1e-15)
    assert not torch.allclose(torch.tensor(memory_spectrum(model, ids)["0"]["exponents"], dtype=F64), want)


def test_memory_spectrum_burn_in_of_a_test_time_memory_skips_the_chunks_covering_it():
    """``burn_in`` counts tokens at the model level; a memory stepping by inner chunks of ``C``
    skips the whole chunks that cover them (``burn_in=1`` → one chunk), as
    :func:`memory_jvp_spectrum` with ``burn_in=1`` (chunks) on the same hooks. (Titans reads its
    4 persistent tokens first: 12 tokens are a stream of 16, two chunks of 8.)"""
    model = _model("titans_lmm", mixer_options={"neural_memory": {"chunk_size": 8}})
    ids = _ids(T=12)
    mem = model.blocks[0].mixer
    e = memory_spectrum(model, ids, directions=3, burn_in=1)["0"]
    c = model.run_with_cache(ids)[1]
    names = ("hook_q", "hook_k", "hook_v", "hook_theta", "hook_g", "hook_eta", "hook_delta")
    hooks = [c.get("blocks.0.mixer." + h) for h in names]
    assert hooks[0].shape[1] == 16
    state = mem.initial_state(1).memory_state()
    want, _ = memory_jvp_spectrum(mem.spec, state, *hooks, directions=3, burn_in=1)
    assert torch.allclose(torch.tensor(e["exponents"], dtype=F64), want, rtol=1e-10, atol=1e-12)
    assert e["burn_in"] == 8
    full, _ = memory_jvp_spectrum(mem.spec, state, *hooks, directions=3)
    assert not torch.allclose(full, want, rtol=1e-3)  # the first chunk's transient is gone
    # a burn-in that leaves no whole chunk: the layer says why, naming burn_in
    e = memory_spectrum(model, ids, directions=3, burn_in=9)["0"]
    assert e["kind"] == "unsupported" and "burn_in=9" in e["reason"]


@pytest.mark.parametrize("bad", [-1, 24, 2.0, True])
def test_memory_spectrum_burn_in_out_of_range_is_named(bad):
    with pytest.raises(ValueError, match=r"burn_in: expected an int number of tokens in \[0, 24\)"):
        memory_spectrum(_model("gla"), _ids(T=24), burn_in=bad)


def test_probe_spectrum_burn_in_flag_reaches_the_json(tmp_path, capsys, monkeypatch):
    import matplotlib.figure

    from mnemo.cli import main

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda self, path, **kw: Path(path).touch())
    ckpt = tmp_path / "ck"
    _model("gla").float().save_pretrained(ckpt)
    assert main(["probe", "spectrum", "--checkpoint", str(ckpt), "--tokens", "24", "--burn-in", "5"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["burn_in"] == 5 and record["layers"]["0"]["summary"]["context"] == 19
    argv = [
        "probe",
        "spectrum",
        "--checkpoint",
        str(ckpt),
        "--tokens",
        "24",
        "--burn-in",
        "24",
        "--overwrite",
    ]
    assert main(argv) != 0
    assert "--burn-in: expected fewer tokens than --tokens 24 (some must be left to average), got 24" in (
        capsys.readouterr().err
    )


# --- part 2 ---------------------------------------------------------------------------------------


def test_memory_spectrum_of_no_tokens_names_input_ids_not_burn_in_or_context():
    """An empty input has no transition to read: the message names ``input_ids`` (before, the
    context of 0 tokens was blamed; with ``burn_in`` the range ``[0, 0)``)."""
    with pytest.raises(ValueError, match=r"input_ids: expected token ids \[B, T\] with T >= 1.*got \[1, 0\]"):
        memory_spectrum(_model("gla"), torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match=r"input_ids: expected .*got \[5\]"):
        memory_spectrum(_model("gla"), torch.zeros(5, dtype=torch.long))
    with pytest.raises(
        ValueError, match=r"g: expected log decays \[B, T, \*units\] with T >= 1, got shape \[1, 0, 2\]"
    ):
        diagonal_spectrum(torch.zeros(1, 0, 2))
