"""What a hook may do and what it is told: replacements are checked where hooks run (shape, dtype,
device; a state record leaf by leaf), in-place edits take effect, backward hooks fire, hooks run in
activation checkpointing's recomputation, and a call read in pieces is recorded whole."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mnemo.interp import ablate_head, steer
from mnemo.layers.hooks import HookPoint
from mnemo.models import LanguageModel, build_config
from tests.helpers import tiny_titans_mac

V = 17


def _model(name, n_layers=1, **kw):
    torch.manual_seed(0)
    return LanguageModel(build_config(name, vocab_size=V, d_model=32, n_layers=n_layers, **kw)).eval()


def _ids(T=9, B=2, seed=1):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------- replacements


@pytest.mark.parametrize(
    "name,fn,expected",
    [
        ("blocks.0.mixer.hook_pattern", lambda v, n: v[:1], r"\[2, 4, 9, 9\]"),  # would broadcast
        ("blocks.0.mixer.hook_pattern", lambda v, n: v[:, :1], r"\[2, 4, 9, 9\]"),
        ("blocks.0.mixer.hook_o", lambda v, n: v[:1], r"\[2, 9, 4, 8\]"),
        ("blocks.1.hook_resid_post", lambda v, n: v[:1], r"\[2, 9, 32\]"),  # logits [1, 9, V] before
        ("hook_embed", lambda v, n: v[:, :1], r"\[2, 9, 32\]"),  # logits [2, 1, V] before
        ("blocks.0.mixer.hook_q", lambda v, n: v[:1], r"\[2, 9, 4, 8\]"),  # was blamed on k
        ("blocks.0.mixer.hook_v", lambda v, n: v.double(), r"torch.float32"),  # dtype
    ],
)
def test_a_replacement_of_another_shape_or_dtype_is_refused_naming_the_hook(name, fn, expected):
    m = _model("transformer", n_layers=2)
    with pytest.raises(ValueError, match=rf"^{name}: a hook returned a replacement .*{expected}"):
        m.run_with_hooks(_ids(), [(name, fn)])
    assert not any(p.hooked for p in m.hook_points.values())  # removed after the error


def test_a_state_replacement_must_keep_the_records_type_and_leaf_shapes():
    m = _model("transformer")
    name = "blocks.0.mixer.hook_state"
    with pytest.raises(ValueError, match=rf"^{name}: a hook returned a Tensor; it must be a KVCache"):
        m.run_with_hooks(_ids(), [(name, lambda v, n: torch.zeros(3))])
    with pytest.raises(
        ValueError, match=rf"^{name}: a hook returned a KVCache whose leaf 0 is \[2, 1, 4, 8\]"
    ):
        m.run_with_hooks(_ids(), [(name, lambda v, n: v._replace(k=v.k[:, :1]))])
    # the same record with new tensors of its shapes is a replacement: the next hook sees it
    seen = {}
    hooks = [
        (name, lambda v, n: v._replace(k=torch.zeros_like(v.k))),
        (name, lambda v, n: seen.setdefault(n, v)),
    ]
    logits, _ = m.run_with_hooks(_ids(), hooks)
    assert logits.shape == (2, 9, V) and torch.count_nonzero(seen[name].k) == 0


def test_mamba2_gate_of_the_wrong_shape_is_named_at_its_hook():
    m = _model("mamba2")
    with pytest.raises(ValueError, match=r"^blocks\.0\.mixer\.hook_g: .*\[2, 9, 2\]"):
        m.run_with_hooks(_ids(), [("blocks.0.mixer.hook_g", lambda v, n: v[..., :1])])


def test_a_correct_replacement_and_an_in_place_edit_pass_unchecked_values_through():
    m = _model("transformer")
    ids = _ids()
    ref, _ = m(ids)

    def double_in_place(v, n):
        v.mul_(2.0)
        return v  # the same tensor: an edit in place, no check needed

    with torch.no_grad():
        a, _ = m.run_with_hooks(ids, [("blocks.0.mixer.hook_o", double_in_place)])
        b, _ = m.run_with_hooks(ids, [("blocks.0.mixer.hook_o", lambda v, n: v * 2.0)])
    assert torch.equal(a, b) and not torch.allclose(a, ref)


# ------------------------------------------------------------------------------------- in place


def test_an_in_place_edit_of_mambas_log_decay_takes_effect():
    """Mamba (S6) builds ``hook_g = Δ A`` only for the hook; a hook that zeroes it in place (no
    forgetting) must change the scan as returning zeros does, and the read is then the plain sum
    ``o_t = Σ_n C_tn Σ_{s ≤ t} Δ_s u_s B_sn`` (a hand loop over the recorded inputs)."""
    m = _model("mamba").double()
    ids = _ids()
    seen = {}

    def record(v, n):
        seen[n] = v.clone()

    hooks = [(f"blocks.0.mixer.{h}", record) for h in ("hook_v", "hook_dt", "hook_B", "hook_C", "hook_o")]
    with torch.no_grad():
        m.run_with_hooks(ids, hooks)
        o_plain = seen["blocks.0.mixer.hook_o"]
        m.run_with_hooks(ids, [("blocks.0.mixer.hook_g", lambda v, n: v.mul_(0))] + hooks)
        o_in_place = seen["blocks.0.mixer.hook_o"]
        m.run_with_hooks(ids, [("blocks.0.mixer.hook_g", lambda v, n: torch.zeros_like(v))] + hooks)
        o_returned = seen["blocks.0.mixer.hook_o"]
    u, dt, Bm, Cm = (seen[f"blocks.0.mixer.{h}"] for h in ("hook_v", "hook_dt", "hook_B", "hook_C"))
    h = torch.zeros(u.shape[0], u.shape[2], Bm.shape[-1], dtype=torch.float64)  # [B, D, N]
    hand = []
    for t in range(u.shape[1]):
        h = h + (dt[:, t] * u[:, t])[..., None] * Bm[:, t, None, :]
        hand.append((h * Cm[:, t, None, :]).sum(-1))
    hand = torch.stack(hand, 1)
    torch.testing.assert_close(o_in_place, hand, rtol=1e-9, atol=1e-12)
    assert torch.equal(o_in_place, o_returned)
    assert (o_in_place - o_plain).norm() > 0.1 * o_plain.norm()


# ------------------------------------------------------------------------------------- backward


def test_a_backward_hook_on_a_hook_point_fires_with_the_values_gradient():
    m = _model("transformer")
    ids = _ids()
    point = m.hook_points["blocks.0.hook_resid_post"]
    got = []
    handle = point.register_full_backward_hook(lambda mod, gin, gout: got.append(gout[0].clone()))
    assert point.hooked
    logits, cache = m.run_with_cache(ids, names="blocks.0.hook_resid_post", detach=False)
    (grad,) = torch.autograd.grad(logits.square().sum(), cache["blocks.0.hook_resid_post"], retain_graph=True)
    logits.square().sum().backward()
    assert len(got) == 1  # the backward through the point
    torch.testing.assert_close(got[0], grad)
    handle.remove()
    assert not point.hooked and not point._forward_pre_hooks  # back on the fast path
    m.zero_grad()
    m(ids)[0].sum().backward()
    assert len(got) == 1


def test_a_hook_point_with_nothing_attached_is_the_identity_without_a_module_call(monkeypatch):
    point = HookPoint()
    x = torch.randn(3)
    calls = []
    monkeypatch.setattr(torch.nn.Module, "_call_impl", lambda *a, **k: calls.append(1))
    assert point(x) is x and calls == []


# ------------------------------------------------------------------------ activation checkpointing


@pytest.mark.parametrize("which", ["steer", "ablate_head"])
def test_hooks_run_in_the_recomputation_of_activation_checkpointing(which):
    """With checkpointing on, the backward recomputes each block: the hooks attached at the forward
    run there too, so the gradients equal those of the hooked forward without checkpointing (and
    differ from the unhooked ones); before, steering gave other gradients and ablation raised."""
    m = _model("transformer", n_layers=2).double().train()
    ids = _ids()
    torch.manual_seed(3)
    hooks = (
        steer(m, "blocks.0.hook_resid_post", torch.randn(32, dtype=torch.float64) * 3)
        if which == "steer"
        else ablate_head(m, 1, [0, 1, 2])
    )

    def grads(checkpointing, hooks):
        m.activation_checkpointing = checkpointing
        m.zero_grad()
        logits, _ = m.run_with_hooks(ids, hooks)
        logits.pow(2).mean().backward()
        return logits.detach(), torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])

    l_plain, g_plain = grads(False, hooks)
    l_ckpt, g_ckpt = grads(True, hooks)
    _, g_unhooked = grads(False, [])
    torch.testing.assert_close(l_ckpt, l_plain, rtol=0, atol=0)
    torch.testing.assert_close(g_ckpt, g_plain, rtol=1e-12, atol=1e-14)
    assert (g_plain - g_unhooked).norm() > 1e-3 * g_unhooked.norm()
    assert not any(p.hooked for p in m.hook_points.values())


# ------------------------------------------------------------------------------------ arguments


@pytest.mark.parametrize(
    "hooks,match",
    [
        ({"hook_q": lambda v, n: None}, r"hooks: expected a list of \(name, fn\) pairs, got a dict"),
        (("hook_q", lambda v, n: None), r"hooks: expected a list of \(name, fn\) pairs, got the pair itself"),
        ([("hook_q", 3)], r"hooks\[0\]: expected a \(name, fn\) pair with a callable fn, got a int as fn"),
        (["hook_q"], r"hooks\[0\]: expected a \(name, fn\) pair"),
    ],
)
def test_run_with_hooks_names_a_hooks_argument_that_is_not_pairs(hooks, match):
    m = _model("transformer")
    with pytest.raises(ValueError, match=match):
        m.run_with_hooks(_ids(), hooks)


# ------------------------------------------------------------------------- a call read in pieces


def test_run_with_cache_joins_titans_mac_segments_into_the_memorys_one_call():
    """MAC fires its hooks once per segment (4 tokens here, 11 tokens read): the cache holds every
    hook over the whole call, and the memory's hooks joined over the segments are those of the
    memory run once over the joined attention outputs (its chunks are the segments) — so its map
    covers the call."""
    m = tiny_titans_mac(V).double()
    mixer = m.blocks[0].mixer
    mixer.memory.attribution_steps = 2
    ids = _ids(T=11)
    with torch.no_grad():
        logits, cache = m.run_with_cache(ids)
        ref, _ = m(ids)
        one = mixer.memory.mixing_acts(cache["blocks.0.mixer.hook_attn_out"])
    assert torch.equal(logits, ref)
    assert cache["blocks.0.mixer.attn.hook_v"].shape == (2, 11, 2, 8)
    assert cache["blocks.0.mixer.hook_state"].offset == 11
    for h in ("hook_q", "hook_k", "hook_v", "hook_theta", "hook_g"):
        assert torch.equal(cache[f"blocks.0.mixer.memory.{h}"], one[h]), h
    from mnemo.interp import capture_maps

    maps = capture_maps(m, ids)[0]
    assert maps.shape == (2, 2, 11, 11)
    torch.testing.assert_close(maps, mixer.memory.mixing(one).maps, rtol=0, atol=0)


def test_the_mac_memory_within_task_segments_is_placed_in_the_call():
    """MAC segments of 4 inside task segments of 8 (21 tokens): each memory firing is placed in the
    call (the MAC segment's offset within the task segment's), so the memory hooks are joined over
    the call and equal the mixer's own one pass over the block's recorded input."""
    m = tiny_titans_mac(V, mlp="cms", mlp_options={"levels": [{"period": 8, "objective": "task"}]})
    assert m.task_segment == 8
    with torch.no_grad():
        _, cache = m.run_with_cache(_ids(21), names=["mixer.memory.hook_k", "blocks.0.hook_resid_pre"])
        mixer, seen = m.blocks[0].mixer, []
        handle = mixer.memory.hook_k.register_forward_hook(lambda mod, args, out: seen.append(out))
        mixer(m.blocks[0].mixer_norm(cache["blocks.0.hook_resid_pre"]))
        handle.remove()
    assert [s.shape[1] for s in seen] == [4, 4, 4, 4, 4, 1]
    assert cache["blocks.0.mixer.memory.hook_k"].shape[1] == 21
    torch.testing.assert_close(cache["blocks.0.mixer.memory.hook_k"], torch.cat(seen, 1), rtol=0, atol=0)


def test_a_recording_skips_a_segment_run_again_for_its_signal():
    """Streaming a task-signal model: the second call's first segment began in the first call and
    is run again (from its start) to take its signal; the cache holds what the call read, joined
    over its 18 tokens, equal to the rows of one pass over the whole stream."""
    m = _model("hope_attention")
    ids = _ids(T=29)
    with torch.no_grad():
        _, full = m.run_with_cache(ids, names="hook_pattern")
        _, st = m(ids[:, :11])
        _, second = m.run_with_cache(ids[:, 11:], state=st, names="hook_pattern")
    P, P2 = full["blocks.0.mixer.hook_pattern"], second["blocks.0.mixer.hook_pattern"]
    assert P2.shape == (2, 4, 18, 29)  # keys: the cached 11 and the call's 18
    torch.testing.assert_close(P2, P[:, :, 11:], rtol=1e-5, atol=1e-6)


def test_a_dataclass_state_is_checked_leaf_by_leaf():
    """A Titans memory state: a copy passes; a leaf of another type (the offset) is named."""
    m = _model("titans_lmm")

    def same(v, n):
        return dataclasses.replace(v)

    logits, _ = m.run_with_hooks(_ids(), [("blocks.0.mixer.hook_state", same)])
    assert torch.equal(logits, m(_ids())[0])
    with pytest.raises(
        ValueError, match="blocks.0.mixer.hook_state: a hook returned a NeuralMemoryState whose leaf"
    ):
        m.run_with_hooks(
            _ids(),
            [("blocks.0.mixer.hook_state", lambda v, n: dataclasses.replace(v, offset=float(v.offset)))],
        )
