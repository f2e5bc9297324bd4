"""Interventions against independent computations: head ablation recomputed by hand, patching that
must reproduce the clean or the corrupted run exactly, state patching against running the
concatenated prompt (or the blocks by hand), steering by a known vector, and the errors."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

from mnemo.interp.interventions import (
    ablate,
    ablate_channel,
    ablate_head,
    ablate_state,
    ablate_write,
    activation_patching,
    compose,
    induction_ablation,
    logit_difference,
    mean_activations,
    next_token_loss,
    patch,
    patching_figure,
    state_patch,
    steer,
)
from mnemo.models import LanguageModel, build_config

V = 17


def _model(name, n_layers=2, **kw):
    torch.manual_seed(0)
    cfg = build_config(name, vocab_size=V, d_model=32, n_layers=n_layers, **kw)
    return LanguageModel(cfg).double().eval()


def _ids(T=12, B=2, seed=1):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def _record(store: dict):
    def fn(value, name):
        store[name] = value

    return fn


def _finish(m, x, start: int):
    """Blocks ``start …`` and the head on the residual stream ``x`` (no state)."""
    for b in m.blocks[start:]:
        x, _ = b(x)
    return m.lm_head(m.norm(x))


# ------------------------------------------------------------------------------------------ ablation


@torch.no_grad()
def test_zero_ablating_a_head_equals_zeroing_its_rows_of_the_output_projection():
    m, ids, h = _model("transformer"), _ids(), 1
    got, _ = m.run_with_hooks(ids, ablate_head(m, 0, h))
    # by hand 1: the recorded head outputs with head h zeroed, through o_proj and the rest
    _, cache = m.run_with_cache(ids, names=["blocks.0.mixer.hook_o", "blocks.0.hook_resid_pre"])
    o = cache["blocks.0.mixer.hook_o"].clone()
    o[:, :, h] = 0
    blk = m.blocks[0]
    x = cache["blocks.0.hook_resid_pre"] + blk.mixer.o_proj(o.flatten(2))
    x = x + blk.mlp(blk.mlp_norm(x))
    torch.testing.assert_close(got, _finish(m, x, 1), rtol=0, atol=1e-10)
    # by hand 2: a copy of the model whose o_proj ignores head h's input rows
    m2 = copy.deepcopy(m)
    D = m2.blocks[0].mixer.head_dim
    m2.blocks[0].mixer.o_proj.weight[:, h * D : (h + 1) * D] = 0
    torch.testing.assert_close(got, m2(ids)[0], rtol=0, atol=1e-10)
    assert not torch.allclose(got, m(ids)[0])


@torch.no_grad()
def test_mean_ablation_uses_the_reference_mean_and_leaves_other_heads():
    m, ids, ref = _model("gla"), _ids(), _ids(B=4, seed=7)
    name = "blocks.1.mixer.hook_o"
    means = mean_activations(m, ref, name)
    _, cache = m.run_with_cache(ref, names=name)
    torch.testing.assert_close(means[name], cache[name].mean((0, 1), keepdim=True))
    seen: dict = {}
    _, clean = m.run_with_cache(ids, names=name)
    m.run_with_hooks(
        ids, compose(ablate_head(m, 1, [0, 2], how="mean", means=means), [(name, _record(seen))])
    )
    got = seen[name]
    for h in (0, 2):
        torch.testing.assert_close(got[:, :, h], means[name][:, :, h].expand_as(got[:, :, h]))
    for h in (1, 3):
        assert torch.equal(got[:, :, h], clean[name][:, :, h])
    # without means: the run's own mean over batch and positions
    m.run_with_hooks(ids, compose(ablate_head(m, 1, 3, how="mean"), [(name, _record(seen))]))
    own = clean[name][:, :, 3].mean((0, 1))
    torch.testing.assert_close(seen[name][:, :, 3], own.expand_as(seen[name][:, :, 3]))


@torch.no_grad()
def test_channel_ablation_and_mamba_channels_as_heads():
    m, ids = _model("mamba"), _ids()
    name = "blocks.0.mixer.hook_o"  # [B, T, D]: channels are the heads of Mamba's maps
    seen: dict = {}
    m.run_with_hooks(ids, compose(ablate_head(m, 0, [3, 5]), [(name, _record(seen))]))
    assert seen[name][..., [3, 5]].abs().max() == 0 and seen[name][..., 4].abs().max() > 0
    r = "blocks.1.hook_resid_pre"
    m.run_with_hooks(ids, compose(ablate_channel(m, r, 7, positions=slice(0, 4)), [(r, _record(seen))]))
    assert seen[r][:, :4, 7].abs().max() == 0 and seen[r][:, 4:, 7].abs().min() > 0


@torch.no_grad()
def test_ablating_writes():
    m, ids = _model("gated_deltanet"), _ids()
    o = "blocks.0.mixer.hook_o"
    seen: dict = {}
    # no write anywhere (beta = 0): the memory stays empty and every read is zero
    m.run_with_hooks(ids, compose(ablate_write(m, 0, None, hook="hook_beta"), [(o, _record(seen))]))
    assert seen[o].abs().max() == 0
    # zero v from position 5 on: earlier logits unchanged, later ones changed
    base = m(ids)[0]
    got, _ = m.run_with_hooks(ids, ablate_write(m, 0, range(5, 12)))
    assert torch.equal(got[:, :5], base[:, :5])
    assert (got[:, 5:] - base[:, 5:]).abs().amax((0, 2)).min() > 0


@pytest.mark.parametrize("name", ["gla", "transformer"])
@torch.no_grad()
def test_ablating_a_state_acts_on_the_continuation(name):
    m, ids = _model(name), _ids()
    _, st = m.run_with_hooks(ids[:, :6], ablate_state(m, 0))
    _, plain = m(ids[:, :6])
    if name == "gla":
        assert st[0].mixer.memory.abs().max() == 0 and st[1].mixer.memory.abs().max() > 0
        hand = list(plain)
        hand[0] = dataclasses.replace(
            plain[0],
            mixer=dataclasses.replace(plain[0].mixer, memory=torch.zeros_like(plain[0].mixer.memory)),
        )
    else:  # a KV cache: keys and values zeroed
        assert st[0].mixer.kv.k.abs().max() == 0 and st[0].mixer.kv.v.abs().max() == 0
        kv = plain[0].mixer.kv
        hand = list(plain)
        hand[0] = dataclasses.replace(
            plain[0], mixer=dataclasses.replace(plain[0].mixer, kv=type(kv)(kv.k * 0, kv.v * 0))
        )
    torch.testing.assert_close(m(ids[:, 6:], st)[0], m(ids[:, 6:], hand)[0], rtol=0, atol=1e-12)
    # mean over the batch rows
    _, mean_st = m.run_with_hooks(ids[:, :6], ablate_state(m, 1, how="mean"))
    t = mean_st[1].mixer.memory if name == "gla" else mean_st[1].mixer.kv.v
    assert torch.allclose(t[0], t[1])


# ------------------------------------------------------------------------------------------ patching


@torch.no_grad()
def test_patching_everything_gives_clean_and_nothing_gives_corrupted_exactly():
    m = _model("gla")
    clean, corrupted = _ids(seed=1), _ids(seed=2)
    clean_logits, cache = m.run_with_cache(clean, names=["blocks.0.hook_resid_pre", "blocks.1.mixer.hook_o"])
    corrupted_logits, _ = m(corrupted)
    every = torch.arange(clean.shape[1])
    got, _ = m.run_with_hooks(corrupted, patch(m, cache, "blocks.0.hook_resid_pre", positions=every))
    assert torch.equal(got, clean_logits)
    got, _ = m.run_with_hooks(corrupted, patch(m, cache, "blocks.0.hook_resid_pre", positions=[]))
    assert torch.equal(got, corrupted_logits)
    got, _ = m.run_with_hooks(corrupted, patch(m, cache, "blocks.1.mixer.hook_o", heads=[]))
    assert torch.equal(got, corrupted_logits)


@torch.no_grad()
def test_activation_patching_per_layer_position_and_head():
    m = _model("transformer")
    clean, corrupted = _ids(seed=1), _ids(seed=2)
    metric = logit_difference(clean[:, -1], corrupted[:, -1], position=-2)
    res = activation_patching(m, clean, corrupted, metric, "hook_resid_pre", per="layer")
    assert res.values.shape == (2,)
    torch.testing.assert_close(res.values, torch.full((2,), res.clean, dtype=torch.float64), rtol=0, atol=0)
    torch.testing.assert_close(res.restored, torch.ones(2, dtype=res.values.dtype))
    # the last residual stream, per position: only position T-2 (the metric's) matters
    res = activation_patching(m, clean, corrupted, metric, "blocks.1.hook_resid_post", per="position")
    T = clean.shape[1]
    assert res.values.shape == (1, T) and res.values[0, T - 2] == res.clean
    others = torch.cat([res.values[0, : T - 2], res.values[0, T - 1 :]])
    assert torch.all(others == res.corrupted)
    # per head of the last layer's hook_o, against the recomputation by hand
    res = activation_patching(m, clean, corrupted, metric, "blocks.1.mixer.hook_o", per="head")
    _, c = m.run_with_cache(clean, names="blocks.1.mixer.hook_o")
    _, k = m.run_with_cache(corrupted, names=["blocks.1.mixer.hook_o", "blocks.1.hook_resid_pre"])
    blk = m.blocks[1]
    for h in range(4):
        o = k["blocks.1.mixer.hook_o"].clone()
        o[:, :, h] = c["blocks.1.mixer.hook_o"][:, :, h]
        x = k["blocks.1.hook_resid_pre"] + blk.mixer.o_proj(o.flatten(2))
        x = x + blk.mlp(blk.mlp_norm(x))
        torch.testing.assert_close(res.values[0, h], metric(_finish(m, x, 2)), rtol=1e-6, atol=1e-6)
    # head x position: one value per pair; the figure draws
    res = activation_patching(
        m, clean[:, :5], corrupted[:, :5], next_token_loss(clean[:, :5]), per="head_position"
    )
    assert res.values.shape == (2, 4, 5) and torch.isfinite(res.values).all()
    fig = patching_figure(res, "test")
    assert fig.axes
    import matplotlib.pyplot as plt

    plt.close(fig)


# ------------------------------------------------------------------------------------ state patching


@pytest.mark.parametrize("name", ["gla", "mamba", "transformer"])
@torch.no_grad()
def test_state_patch_equals_the_prefix_state_by_hand(name):
    m = _model(name)
    A, B, t = _ids(T=14, seed=3), _ids(T=14, seed=4), 6
    # every layer: the same as running A's prefix followed by B's continuation
    got, _ = state_patch(m, A, B, t)
    whole, _ = m(torch.cat([A[:, :t], B[:, t:]], 1))
    torch.testing.assert_close(got, whole[:, t:], rtol=1e-9, atol=1e-9)
    # layer 0 only: blocks by hand, layer 0 from A's prefix state, layer 1 from B's
    got, _ = state_patch(m, A, B, t, layers=[0])
    _, sa = m(A[:, :t])
    _, sb = m(B[:, :t])
    x = m.embed(B[:, t:])
    x, _ = m.blocks[0](x, sa[0])
    x, _ = m.blocks[1](x, sb[1])
    torch.testing.assert_close(got, m.lm_head(m.norm(x)), rtol=1e-9, atol=1e-9)
    assert not torch.allclose(got, m(B)[0][:, t:])
    # one source row for every target row
    got1, _ = state_patch(m, A[:1], B, t)
    whole, _ = m(torch.cat([A[:1, :t].expand(2, t), B[:, t:]], 1))
    torch.testing.assert_close(got1, whole[:, t:], rtol=1e-9, atol=1e-9)


def test_state_patch_errors():
    m = _model("gla")
    A = _ids()
    with pytest.raises(ValueError, match="at"):
        state_patch(m, A, A, 12)
    with pytest.raises(ValueError, match="layers"):
        state_patch(m, A, A, 3, layers=[2])
    with pytest.raises(ValueError, match="source_ids"):
        state_patch(m, _ids(B=3), A, 3)


# ------------------------------------------------------------------------------------------ steering


@torch.no_grad()
def test_steering_adds_exactly_the_direction():
    m, ids = _model("gla"), _ids()
    base = m(ids)[0]
    assert torch.equal(m.run_with_hooks(ids, steer(m, "blocks.0.hook_resid_post", torch.zeros(32)))[0], base)
    d = torch.randn(32, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    seen: dict = {}
    _, clean = m.run_with_cache(ids, names="blocks.0.hook_resid_post")
    r = "blocks.1.hook_resid_pre"
    m.run_with_hooks(ids, compose(steer(m, "blocks.0.hook_resid_post", d, scale=2.5), [(r, _record(seen))]))
    assert torch.equal(seen[r], clean["blocks.0.hook_resid_post"] + 2.5 * d)
    # only some positions
    m.run_with_hooks(
        ids, compose(steer(m, "blocks.0.hook_resid_post", d, positions=[0, 3]), [(r, _record(seen))])
    )
    diff = seen[r] - clean["blocks.0.hook_resid_post"]
    assert torch.allclose(diff[:, [0, 3]], d.expand(2, 2, 32)) and diff[:, [1, 2, 4]].abs().max() == 0
    with pytest.raises(ValueError, match="direction"):
        m.run_with_hooks(ids, steer(m, "blocks.0.hook_resid_post", torch.zeros(31)))


# ---------------------------------------------------------------------------------------------- errors


def test_errors_name_what_is_wrong():
    m, ids = _model("transformer"), _ids()
    with pytest.raises(KeyError, match="hook_o"):
        ablate(m, "hook_nope")
    with pytest.raises(KeyError, match="hook_o"):
        ablate_head(m, 0, 0, hook="hook_nope")
    with pytest.raises(ValueError, match="layer"):
        ablate_head(m, 2, 0)
    with pytest.raises(ValueError, match=r"head 4 out of range: blocks\.0\.mixer\.hook_o has 4 heads"):
        m.run_with_hooks(ids, ablate_head(m, 0, 4))
    with pytest.raises(ValueError, match="how"):
        ablate_head(m, 0, 0, how="noise")
    with pytest.raises(KeyError, match="clean_cache"):
        patch(m, {}, "blocks.0.mixer.hook_o")
    with pytest.raises(ValueError, match="per"):
        activation_patching(m, ids, ids, next_token_loss(ids), per="channel")


# ------------------------------------------------------------------------------- induction ablation


def test_induction_ablation_and_the_command(tmp_path, capsys):
    m = _model("transformer")
    res = induction_ablation(m, 2, draws=3, length=8, batch=4, how="zero")
    assert len(res["top_k"]["heads"]) == 2 and len(res["random"]["heads"]) == 3
    top = [tuple(h[:2]) for h in res["top_k"]["heads"]]
    assert res["top_k"]["heads"][0][2] >= res["top_k"]["heads"][1][2]
    assert all(tuple(h[:2]) not in top for draw in res["random"]["heads"] for h in draw)  # "rest"
    assert len(res["random"]["icl_score"]["values"]) == 3
    for key in ("icl_score", "repeat_loss", "first_half_loss", "gain"):
        assert isinstance(res["baseline"][key], float)
    with pytest.raises(ValueError, match="k"):
        induction_ablation(m, 9, draws=1, length=8, batch=2)

    from mnemo.cli import main

    m.float().save_pretrained(tmp_path / "ckpt")
    out = tmp_path / "ablate.json"
    args = ["probe", "ablate", "--checkpoint", str(tmp_path / "ckpt"), "--top-induction", "1"]
    assert main([*args, "--draws", "2", "--length", "8", "--batch", "2", "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert json.loads(out.read_text()) == printed and printed["k"] == 1 and printed["how"] == "mean"


def test_induction_ablation_says_when_the_control_cannot_come_from_the_rest():
    """K above half the heads: the random heads come from all heads, with a warning and
    ``random_from: all`` in the result; K = every head (the control would be the same heads) is
    refused."""
    from mnemo.interp.interventions import _heads_of
    from mnemo.interp.probe import circuit_scores

    m = _model("transformer")
    n = len(_heads_of(m, circuit_scores(m, 8, 2, 0)))
    assert n >= 3
    with pytest.raises(ValueError, match=rf"k: expected an int in 1 … {n - 1} \(fewer than the {n} heads"):
        induction_ablation(m, n, draws=1, length=8, batch=2)
    with pytest.warns(UserWarning, match=rf"only 1 head\(s\) lie outside the top {n - 1}"):
        res = induction_ablation(m, n - 1, draws=2, length=8, batch=2)
    assert res["random_from"] == "all"
    drawn = {tuple(h[:2]) for draw in res["random"]["heads"] for h in draw}
    assert drawn & {tuple(h[:2]) for h in res["top_k"]["heads"]}  # from all heads: top ones included


def test_induction_ablation_gives_no_ratio_of_near_zero_gains():
    """Below ``min_gain`` nats of baseline in-context gain the fraction removed would be noise over
    noise (an untrained model gave -3000%): it is null, with a note and a warning; above it, it is
    ``1 - gain_after / gain_before`` of the reported gains."""
    m = _model("transformer")
    with pytest.warns(UserWarning, match="baseline in-context gain is .* nats"):
        res = induction_ablation(m, 1, draws=2, length=8, batch=4, min_gain=1e9)
    assert res["top_k"]["gain_removed"] is None and res["random"]["gain_removed"]["values"] == [None, None]
    assert "no gain to remove" in res["note"]
    json.dumps(res, allow_nan=False)  # strict JSON: no NaN anywhere
    res = induction_ablation(m, 1, draws=2, length=8, batch=4, min_gain=0.0)
    g0 = res["baseline"]["gain"]
    assert res["top_k"]["gain_removed"] == pytest.approx(1 - res["top_k"]["gain"] / g0)
    assert "note" not in res
