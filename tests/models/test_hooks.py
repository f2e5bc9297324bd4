"""Hook points: names follow the module path, run_with_cache records what passed, run_with_hooks
replaces it, and each mixer's implicit attention (``mixing``) reproduces the op's output."""

from __future__ import annotations

import pytest
import torch
from einops import einsum

from mnemo.models import LanguageModel, build_config

MIXING_MODELS = [
    "linear_attention",
    "gla",
    "retnet",
    "transformer",
    "deltanet",
    "gated_deltanet",
    "mamba",
    "mamba_lti",
    "mamba2",
]


def _model(name, **kw):
    torch.manual_seed(0)
    cfg = build_config(name, vocab_size=17, d_model=32, n_layers=2, **kw)
    return LanguageModel(cfg).double().eval()


def _ids(T=12, B=2, seed=1):
    return torch.randint(0, 17, (B, T), generator=torch.Generator().manual_seed(seed))


def test_names_follow_the_module_path():
    m = _model("gla")
    names = set(m.hook_points)
    assert "hook_embed" in names
    for i in range(2):
        for n in ("hook_resid_pre", "hook_mixer_out", "hook_resid_mid", "hook_mlp_out", "hook_resid_post"):
            assert f"blocks.{i}.{n}" in names
        for n in ("hook_q", "hook_k", "hook_v", "hook_g", "hook_o", "hook_state"):
            assert f"blocks.{i}.mixer.{n}" in names
    assert all(p.name == n for n, p in m.hook_points.items())


def test_run_with_cache_records_the_residual_stream_exactly():
    m = _model("gla")
    ids = _ids()
    logits, cache = m.run_with_cache(ids)
    ref, _ = m(ids)
    assert torch.equal(logits, ref)  # recording changes nothing
    # the residual stream adds up: resid_mid = resid_pre + mixer_out, resid_post = mid + mlp_out
    for i in range(2):
        c = lambda n, i=i: cache[f"blocks.{i}.{n}"]  # noqa: E731
        assert torch.equal(c("hook_resid_mid"), c("hook_resid_pre") + c("hook_mixer_out"))
        assert torch.equal(c("hook_resid_post"), c("hook_resid_mid") + c("hook_mlp_out"))
    assert torch.equal(cache["blocks.0.hook_resid_pre"], cache["hook_embed"])
    assert torch.equal(cache["blocks.1.hook_resid_pre"], cache["blocks.0.hook_resid_post"])
    assert torch.equal(cache["hook_embed"], m.embed(ids))
    # the final state hook holds the state forward returns
    _, state = m(ids)
    assert torch.equal(cache["blocks.1.mixer.hook_state"], state[1].mixer.memory)


def test_names_select_by_suffix_list_or_predicate():
    m = _model("gla")
    ids = _ids()
    _, c1 = m.run_with_cache(ids, names="hook_k")
    assert sorted(c1) == ["blocks.0.mixer.hook_k", "blocks.1.mixer.hook_k"]
    _, c2 = m.run_with_cache(ids, names=["blocks.1.mixer.hook_q", "hook_embed"])
    assert sorted(c2) == ["blocks.1.mixer.hook_q", "hook_embed"]
    _, c3 = m.run_with_cache(ids, names=lambda n: n.startswith("blocks.0.mixer"))
    assert all(n.startswith("blocks.0.mixer.") for n in c3) and len(c3) == 6
    with pytest.raises(KeyError, match="no hook point named 'hook_nope'"):
        m.run_with_cache(ids, names="hook_nope")


def test_a_hook_that_returns_a_value_replaces_it_downstream():
    m = _model("gla")
    ids = _ids()
    ref, _ = m(ids)
    # zeroing every value vector of layer 0 silences its mixer: its output is exactly zero
    seen = {}

    def zero(v, name):
        return torch.zeros_like(v)

    def read(y, name):
        seen[name] = y

    logits, _ = m.run_with_hooks(ids, [("blocks.0.mixer.hook_v", zero), ("blocks.0.hook_mixer_out", read)])
    assert torch.count_nonzero(seen["blocks.0.hook_mixer_out"]) == 0
    assert not torch.allclose(logits, ref)
    # the hooks are gone afterwards
    assert torch.equal(m(ids)[0], ref)
    assert not any(p.active for p in m.hook_points.values())


@pytest.mark.parametrize("name", MIXING_MODELS)
def test_mixing_maps_times_values_is_the_ops_output(name):
    m = _model(name)
    ids = _ids(T=13)
    _, cache = m.run_with_cache(ids, names=lambda n: ".mixer.hook_" in n and not n.endswith("hook_state"))
    for i, block in enumerate(m.blocks):
        acts = {h: cache[f"blocks.{i}.mixer.{h}"] for h in block.mixer.mixing_hooks}
        mx = block.mixer.mixing(acts)
        got = einsum(mx.maps, mx.values, "b h t s, b s h v -> b t h v")
        torch.testing.assert_close(got, mx.output, rtol=1e-10, atol=1e-12)
        assert torch.all(mx.maps.triu(1) == 0)  # causal
