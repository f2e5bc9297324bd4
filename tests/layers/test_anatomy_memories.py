"""Anatomy of the test-time-trained memories (Titans LMM, MAC / MAG / MAL, CMS, self-modifying
Titans and projections): hook points that the memory update really consumes (a replacement changes
what follows, checked against known answers), typed states whose declared ``state_spec`` is the
state ``forward`` returns, batch-row operations on those states, and the registry."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.utils._pytree as pytree

from mnemo.layers import (
    MIXERS,
    NeuralMemory,
    SelfModifyingProjections,
    SelfModifyingTitans,
    TitansMAC,
    TitansMAG,
    TitansMAL,
)
from mnemo.layers.cms import CMSLevel, ContinuumMemory, Level
from mnemo.layers.hooks import attached, name_hook_points
from mnemo.layers.state import cat_rows, nbytes, select_rows
from mnemo.memory.engine import memory_apply
from mnemo.models import LanguageModel, build_config
from tests.helpers import assert_close

D = 16
TOL = 1e-12


def _x(T, B=2, seed=1, dtype=torch.float64):
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _perturbed(m):
    torch.manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return m


def run(module, x, hooks=(), state=None):
    """``module(x, state)`` with ``(name, fn)`` hooks attached (``fn(value, name)``)."""
    with attached(name_hook_points(module), hooks):
        return module(x, state)


def record(module, x, names, replace=()):
    """``(module(x), {name: value})`` recording the hooks ``names`` (by their module-relative
    names) while the ``replace`` hooks ``(name, fn)`` are attached."""
    seen = {}

    def keep(v, name):
        seen[name] = v

    out = run(module, x, [*replace, *((n, keep) for n in names)])
    return out, seen


def zeros(v, name):
    return torch.zeros_like(v)


def ones(v, name):
    return torch.ones_like(v)


MIXER_CASES = {
    "neural_memory": lambda: NeuralMemory(D, n_heads=2, expansion=2.0, chunk_size=4, persistent_tokens=2),
    "titans_mac": lambda: TitansMAC(D, n_heads=2, expansion=2.0, segment=4, persistent_tokens=2),
    "titans_mag": lambda: TitansMAG(D, n_heads=2, expansion=2.0, window=5, persistent_tokens=2, chunk_size=4),
    "titans_mal": lambda: TitansMAL(D, n_heads=2, expansion=2.0, window=5, persistent_tokens=2, chunk_size=4),
    "self_modifying_titans": lambda: SelfModifyingTitans(D, n_heads=2, chunk_size=4, proj_chunk_size=3),
    "self_modifying_projections": lambda: SelfModifyingProjections(D, n_heads=2, chunk_size=4),
}

HOOKS = {
    "neural_memory": [
        "hook_q", "hook_k", "hook_v", "hook_theta", "hook_g", "hook_eta", "hook_o", "hook_state",
    ],
    "titans_mac": [
        "hook_mem_read", "hook_attn_out", "hook_mem_out", "hook_gate", "hook_state",
        "memory.hook_q", "memory.hook_theta", "memory.hook_o", "memory.hook_state",
        "attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_o",
    ],
    "titans_mag": [
        "hook_attn_out", "hook_mem_out", "hook_gate", "hook_state", "memory.hook_v", "attn.hook_o",
    ],
    "titans_mal": ["hook_attn_out", "hook_mem_out", "hook_state", "memory.hook_g", "attn.hook_k"],
    "self_modifying_titans": [
        "hook_q", "hook_k", "hook_v", "hook_g", "hook_beta", "hook_o", "hook_state",
    ],
    "self_modifying_projections": [
        "hook_q", "hook_k", "hook_v", "hook_beta", "hook_g", "hook_o", "hook_state",
    ],
}  # fmt: skip


@pytest.mark.parametrize("name", list(MIXER_CASES))
def test_registered_with_named_hooks(name):
    m = MIXER_CASES[name]()
    assert MIXERS[name] is type(m)
    points = name_hook_points(m)
    missing = [h for h in HOOKS[name] if h not in points]
    assert not missing, f"{name}: no hook points {missing}; has {sorted(points)}"
    # every mixing hook names a hook point (maps read them: tests/interp/test_ttt_maps.py)
    assert all(h in points or h in dict(m.named_modules()) for h in m.mixing_hooks), m.mixing_hooks


def test_spec_dependent_gate_hooks_exist_only_where_the_gate_does():
    points = name_hook_points(NeuralMemory(D, n_heads=2, spec="moneta"))  # lq retention, GD
    assert "hook_g" in points and "hook_eta" not in points and "hook_delta" not in points
    points = name_hook_points(NeuralMemory(D, n_heads=2, spec="yaad"))  # Huber threshold δ
    assert "hook_delta" in points
    points = name_hook_points(NeuralMemory(D, n_heads=2, spec="ttt_linear"))  # no retention
    assert "hook_g" not in points


# ------------------------------------------------------------------------------------------------
# hooks carry the values the update consumes: recorded values and replacements (known answers)
# ------------------------------------------------------------------------------------------------


def test_neural_memory_hooks_hold_the_engines_inputs_and_theta_zero_freezes_the_memory():
    m = _perturbed(NeuralMemory(D, n_heads=2, expansion=2.0, chunk_size=4, retention="none").double())
    x = _x(7)
    (y, st), seen = record(m, x, ["hook_q", "hook_theta", "hook_o", "hook_state"])
    q, _, _, _, _ = m.qkv(x, None)
    assert torch.equal(seen["hook_q"], q)
    assert seen["hook_theta"].shape == (2, 7, 2) and seen["hook_o"].shape == (2, 7, 2, 8)
    # the hook sees a copy of the state returned (mnemo.layers.hooks.show_state: its anchor may be
    # the initial weights parameter itself, which an edit in place would write)
    a, b = torch.utils._pytree.tree_flatten(seen["hook_state"]), torch.utils._pytree.tree_flatten(st)
    assert a[1] == b[1] and all(
        torch.equal(u, v) if torch.is_tensor(u) else u == v for u, v in zip(a[0], b[0])
    )
    # θ = 0: nothing is written (no retention either), the weights stay the learned initial ones
    (y0, st0), seen0 = record(m, x, ["hook_o"], replace=[("hook_theta", zeros)])
    for w, w_init in zip(st0.weights, m.init_weights):
        assert torch.equal(w, w_init.expand_as(w))
    assert not torch.allclose(y0, y)
    # the read then uses the initial weights for every token
    o, _, _ = memory_apply(m.spec, [w[None] for w in m.init_weights], q.transpose(1, 2))
    assert_close(seen0["hook_o"], o.transpose(1, 2), TOL)


def test_mag_gate_of_one_leaves_the_attention_branch():
    m = _perturbed(MIXER_CASES["titans_mag"]().double())
    x = _x(9)
    y, _ = m(x)
    (y1, _), seen = record(m, x, ["hook_attn_out"], replace=[("hook_gate", ones)])
    assert not torch.allclose(y1, y)
    assert_close(y1, m.o_proj(m.norm_attn(seen["hook_attn_out"])), TOL)


def test_mal_memory_output_feeds_the_attention():
    m = _perturbed(MIXER_CASES["titans_mal"]().double())
    x = _x(9)
    y, _ = m(x)
    y0, _ = run(m, x, [("hook_mem_out", zeros)])
    assert not torch.allclose(y0, y)
    ref, _, _ = m.attn(m.mid_norm(torch.zeros_like(x)), None, 0)  # attention over a zero input
    assert_close(y0, ref, TOL)


def test_mac_hooks_fire_per_segment_and_steer_what_follows():
    m = _perturbed(MIXER_CASES["titans_mac"]().double())
    x = _x(3)  # one segment piece
    y, _ = m(x)
    (y1, st1), seen = record(m, x, ["hook_attn_out"], replace=[("hook_gate", ones)])
    assert_close(y1, m.o_proj(seen["hook_attn_out"]), TOL)  # o = W_o (y ⊙ 1)
    # a silenced read-before changes the attention output, hence the memory write and the output
    (y0, st0), seen0 = record(m, x, ["hook_attn_out"], replace=[("hook_mem_read", zeros)])
    assert not torch.allclose(seen0["hook_attn_out"], seen["hook_attn_out"])
    assert not torch.allclose(st0.memory.weights[0], st1.memory.weights[0])
    # 10 tokens = pieces of 4, 4, 2: each branch hook fires once per piece, in order
    calls = []
    run(m, _x(10), [("hook_mem_out", lambda v, n: calls.append(v.shape[1]))])
    assert calls == [4, 4, 2]


def test_cms_rates_of_zero_freeze_a_level_and_its_read_reaches_the_next():
    torch.manual_seed(0)
    cms = _perturbed(ContinuumMemory(D, [Level(2), Level(3)]).double())
    x = _x(7)
    y, st = cms(x)
    names = ["levels.0.hook_in", "levels.1.hook_in", "levels.0.hook_out", "hook_state", "levels.1.hook_state"]
    (y0, st0), seen = record(cms, x, names, replace=[("levels.0.hook_eta", zeros)])
    lv0 = cms.levels[0]
    for w, p in zip(st0.levels[0].weights, (lv0.W_in, lv0.W_out)):  # η = 0: the steps are zero
        assert_close(w, p.expand_as(w), TOL)
    assert st0.levels[0].updates == 3  # it still "steps" (by zero)
    static = torch.nn.functional.gelu(seen["levels.0.hook_in"] @ lv0.W_in) @ lv0.W_out
    assert_close(seen["levels.0.hook_out"], static, TOL)
    # the hooks see (a copy of: an edit in place goes on, mnemo.layers.hooks.show_state) the state returned
    for shown, returned in ((seen["hook_state"], st0), (seen["levels.1.hook_state"], st0.levels[1])):
        a, b = torch.utils._pytree.tree_flatten(shown), torch.utils._pytree.tree_flatten(returned)
        assert a[1] == b[1] and all(
            torch.equal(u, v) if torch.is_tensor(u) else u == v for u, v in zip(a[0], b[0])
        )
    # sequential transfer: level 1 reads LN(x + level 0's read)
    assert_close(seen["levels.1.hook_in"], cms.norms[1](x + static), TOL)
    assert not torch.allclose(y0, y)
    # replacing a level's read changes the next level's input and the output
    y2, _ = run(cms, x, [("levels.0.hook_out", lambda v, n: 2 * v)])
    assert not torch.allclose(y2, y)


def test_self_modifying_titans_g_zero_beta_zero_keeps_the_main_memory_only():
    m = SelfModifyingTitans(8, n_heads=2, chunk_size=4, proj_chunk_size=3).double()
    with torch.no_grad():
        m.eta_bias.fill_(0.5)
        m.proj_wb.normal_(0, 0.3)
    x = torch.randn(2, 11, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    y, st = m(x)
    (y0, st0), seen = record(m, x, ["hook_q", "hook_o"], replace=[("hook_g", zeros), ("hook_beta", zeros)])
    # α = 1, η = α β = 0: the main memory never changes ...
    assert torch.equal(st0.memory[0][0], m.memory_wa) and torch.equal(st0.memory[1][0], m.memory_wb)
    # ... and reads its initial weights: o = q + gelu(q W_a) W_b
    q = seen["hook_q"]
    assert_close(seen["hook_o"], q + torch.nn.functional.gelu(q @ m.memory_wa[0]) @ m.memory_wb[0], TOL)
    # the projection memories' own steps use the values as generated (documented)
    for a, b in zip(st0.proj, st.proj):
        assert_close(a, b, TOL)
    assert not torch.allclose(y0, y)


def test_self_modifying_projections_write_strength_zero_silences_the_memory():
    m = _perturbed(MIXER_CASES["self_modifying_projections"]().double())
    with torch.no_grad():
        for w in m.memory_init:
            w.zero_()  # the matrix memory starts at zero (as at init)
    x = _x(6)
    y, _ = m(x)
    assert y.abs().max() > 0
    # θ = β = 0: the memory stays zero (whatever its retention), so its read and output are 0
    (y0, st0), seen = record(m, x, ["hook_o"], replace=[("hook_beta", zeros)])
    assert torch.count_nonzero(seen["hook_o"]) == 0 and torch.count_nonzero(y0) == 0
    assert torch.count_nonzero(st0.memory_weights[0]) == 0


# ------------------------------------------------------------------------------------------------
# typed states: the declared spec is the returned state; batch rows split and join
# ------------------------------------------------------------------------------------------------


def _same_structure(real, declared, what):
    leaves_r, spec_r = pytree.tree_flatten(real)
    leaves_d, spec_d = pytree.tree_flatten(declared)
    assert spec_r == spec_d, f"{what}: state structure {spec_r} != declared {spec_d}"
    for a, b in zip(leaves_r, leaves_d):
        if isinstance(a, torch.Tensor):
            assert (a.shape, a.dtype) == (b.shape, b.dtype), (
                f"{what}: {a.shape, a.dtype} != {b.shape, b.dtype}"
            )
        else:
            assert a == b, f"{what}: {a} != {b}"
    assert nbytes(real) == nbytes(declared)


SPEC_CASES = {
    **MIXER_CASES,
    "cms": lambda: ContinuumMemory(D, [Level(2, optimizer="momentum"), Level(3)]),
    "cms_nested": lambda: ContinuumMemory(D, [Level(2), Level(4)], transfer="nested"),
}


@pytest.mark.parametrize("T", [1, 4, 7, 8])
@pytest.mark.parametrize("name", list(SPEC_CASES))
def test_state_spec_is_the_returned_state(name, T):
    m = SPEC_CASES[name]()
    with torch.no_grad():
        _, st = m(torch.randn(3, T, D))
    _same_structure(st, m.state_spec(3, T), f"{name} T={T}")
    assert m.state_size_bytes(3, T) == nbytes(st)
    # float64 models keep float64 fast weights and caches
    m = m.double()
    with torch.no_grad():
        _, st = m(torch.randn(3, T, D, dtype=torch.float64))
    _same_structure(st, m.state_spec(3, T), f"{name} T={T} float64")


@pytest.mark.parametrize("name", list(SPEC_CASES))
def test_rows_of_a_state_continue_like_the_batch(name):
    m = _perturbed(SPEC_CASES[name]().double())
    x, nxt = _x(5, B=3), _x(3, B=3, seed=2)
    _, st = m(x)  # CMS level 1 (period 3 / 4) has stepped at most once; fresh shared weights elsewhere
    y_all, _ = m(nxt, st)
    rows = [select_rows(st, i) for i in range(3)]
    for i in range(3):
        y_i, _ = m(nxt[i : i + 1], rows[i])
        assert_close(y_i, y_all[i : i + 1], TOL, what=f"{name} row {i}")
    joined = cat_rows(rows)
    y_j, _ = m(nxt, joined)
    assert_close(y_j, y_all, TOL)


def test_a_fresh_cms_state_has_a_batch_dimension():
    lv = CMSLevel(D, Level(8))
    st = lv.initial_state(3)
    assert all(w.shape[0] == 3 and w.stride(0) == 0 for w in st.weights)  # expanded, not copied
    assert dataclasses.is_dataclass(st)


# ------------------------------------------------------------------------------------------------
# in a model: full names, run_with_cache, the block state
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["titans_lmm", "titans_mac", "titans_mag", "titans_mal", "hope"])
def test_model_hook_names_and_recorded_state(model):
    torch.manual_seed(0)
    m = LanguageModel(build_config(model, vocab_size=17, d_model=D, n_layers=2)).eval()
    # 20 tokens: past hope's first 16-token memory chunk (reads inside a chunk use its start weights)
    ids = torch.randint(0, 17, (2, 20), generator=torch.Generator().manual_seed(1))
    ref, state = m(ids)
    logits, cache = m.run_with_cache(ids)
    assert torch.equal(logits, ref)
    rec = cache["blocks.1.mixer.hook_state"]
    _same_structure(rec, state[1].mixer, model)
    for a, b in zip(pytree.tree_leaves(rec), pytree.tree_leaves(state[1].mixer)):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b)
    if model == "hope":
        assert "blocks.0.mlp.levels.2.hook_out" in m.hook_points
        # the CMS's own state; the language model then adds the task signal's pending segment
        _same_structure(
            cache["blocks.0.mlp.hook_state"], dataclasses.replace(state[0].mlp, pending=None), "cms"
        )
    if model in ("titans_mac", "titans_mag", "titans_mal"):
        assert "blocks.0.mixer.memory.hook_theta" in m.hook_points
        assert "blocks.0.mixer.hook_mem_out" in m.hook_points
    # a replacement inside the model changes the logits
    out, _ = m.run_with_hooks(ids, [("hook_v", zeros)])
    assert (out - ref).abs().max() > 1e-6


def test_nested_is_a_thin_re_export():
    import mnemo.nested as nested
    from mnemo.layers import cms, self_modifying

    assert nested.ContinuumMemory is cms.ContinuumMemory and nested.CMSState is cms.CMSState
    assert nested.SelfModifyingTitans is self_modifying.SelfModifyingTitans
    assert nested.M3.__name__ == "M3"
    from mnemo.nested.cms import Level as OldLevel  # the old module path still imports

    assert OldLevel is Level
