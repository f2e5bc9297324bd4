"""Third break-it review of the layers: each test failed on the code before its fix."""

from __future__ import annotations

import math

import pytest
import torch

from mnemo.layers.delta import DeltaNet
from mnemo.layers.linear_attention import GatedLinearAttention, MatrixState
from mnemo.layers.state import select_rows

F64 = torch.float64


# --- state.select_rows: a negative int is a row from the end, as t[i] -----------------------------
def test_select_rows_with_a_negative_int_is_the_row_from_the_end():
    """``select_rows(state, -1)`` built ``slice(-1, 0)``: an empty state (zero rows) instead of the
    last row, silently; an int past the batch gave zero rows too instead of an error."""
    mem = torch.arange(3 * 2, dtype=F64).reshape(3, 2, 1, 1)
    conv = torch.arange(3 * 4, dtype=F64).reshape(3, 4, 1)
    s = MatrixState(memory=mem, conv=conv, offset=5)
    for i in (-3, -2, -1, 0, 1, 2):
        r = select_rows(s, i)
        assert torch.equal(r.memory, mem[i][None]) and torch.equal(r.conv, conv[i][None])
        assert r.offset == 5
    for bad in (3, -4):
        with pytest.raises(IndexError, match=rf"rows: expected an int in \[-3, 3\) .* got {bad}"):
            select_rows(s, bad)
    # slices and index tensors as before
    assert torch.equal(select_rows(s, slice(1, None)).memory, mem[1:])
    assert torch.equal(select_rows(s, torch.tensor([2, 0])).conv, conv[[2, 0]])


# --- RetNet's fixed decays in a float64 module are float64's --------------------------------------
def test_float64_retnet_uses_float64_log_decays():
    """RetNet (Sun et al. 2023, §2.2): ``γ_h = 1 − 2^{−5−h}``. A float64 module kept ``log γ`` rounded
    to float32 and cast up (off by up to 1.2e-9 per token: after 1000 tokens the decay
    ``γ^1000`` was off by 1e-6 relative, far above float64 rounding); a cast back down gives the
    float32 module's values again."""
    H = 4
    want = torch.log1p(-(2.0 ** (-5.0 - torch.arange(H, dtype=F64))))
    m = GatedLinearAttention(16, n_heads=H, gate="retnet").double()
    torch.testing.assert_close(m.log_gamma, want, rtol=1e-15, atol=0)
    g = m.log_decay(torch.randn(1, 2, 16, dtype=F64))
    assert g.dtype == F64
    torch.testing.assert_close(g[0, 1], want, rtol=1e-15, atol=0)
    # the decay over 1000 tokens, by hand: (1 − 2^{−5})^1000
    torch.testing.assert_close((1000 * m.log_gamma[0]).exp(), torch.tensor((1 - 2.0**-5) ** 1000, dtype=F64))
    back = m.float()
    ref = GatedLinearAttention(16, n_heads=H, gate="retnet")
    assert back.log_gamma.dtype == torch.float32 and torch.equal(back.log_gamma, ref.log_gamma)


def test_retnet_odd_key_size_names_the_arguments_that_set_it():
    """RetNet has no ``head_dim`` argument, but an odd key size per head (``max(1, int(d_model ·
    expand_k) // n_heads)``) was refused as "rotary embeddings need an even head_dim, got 3"."""
    with pytest.raises(ValueError, match=r"expand_k: .* even key size .* max\(1, int\(12 · 1.0\) // 4\) = 3"):
        GatedLinearAttention(12, n_heads=4, gate="retnet", expand_k=1.0)
    with pytest.raises(ValueError, match=r"expand_k: .* = 1"):
        GatedLinearAttention(12, n_heads=4, gate="gla", rope=True)
    GatedLinearAttention(12, n_heads=4, gate="gla")  # no rotary: any key size
    GatedLinearAttention(16, n_heads=4, gate="retnet", expand_k=0.5)  # 2 per head


# --- DeltaNet's qk_norm_eps is checked like the other epsilons ------------------------------------
@pytest.mark.parametrize("bad", [math.inf, math.nan, True, "1e-6", -1e-6])
def test_deltanet_refuses_a_bad_qk_norm_eps_by_name(bad):
    """The docstring says a non-finite ``qk_norm_eps`` raises ``ValueError`` naming it; ``inf`` was
    accepted (``x · rsqrt(Σx² + inf)``: every query and key silently zero, the layer reads nothing),
    ``True`` too, and a string raised an unnamed ``TypeError``."""
    with pytest.raises(ValueError, match=rf"qk_norm_eps: expected a finite number >= 0 .*got {bad!r}"):
        DeltaNet(16, qk_norm_eps=bad)


def test_deltanet_qk_norm_eps_still_takes_none_zero_and_positive():
    for eps in (None, 0, 0.0, 1e-6):
        assert DeltaNet(16, qk_norm_eps=eps, gated=True).qk_norm_eps == eps


# --- state.cat_rows: states that cannot be joined are named ---------------------------------------
def test_cat_rows_names_caches_of_different_lengths():
    """Joining the states of two attention streams of different lengths raised torch.cat's
    ``RuntimeError`` ("Sizes of tensors must match except in dimension 0"), naming neither the
    state nor the entry, where the docstring promises a ``ValueError`` naming the difference."""
    from mnemo.layers.attention import Attention
    from mnemo.layers.state import cat_rows

    torch.manual_seed(0)
    m = Attention(16, n_heads=2)
    _, a = m(torch.randn(1, 3, 16))
    _, b = m(torch.randn(2, 5, 16))
    with pytest.raises(
        ValueError, match=r"cat_rows: tensor 0 of state 1 has shape \[2, 5, 2, 8\], of state 0 "
    ):
        cat_rows([a, b])
    _, c = m(torch.randn(2, 3, 16))
    joined = cat_rows([a, c])  # same length: joined along the batch
    assert joined.kv.k.shape == (3, 3, 2, 8) and joined.offset == 3
    assert torch.equal(joined.kv.v[1:], c.kv.v)


# --- hooks that only read a value change nothing, also under torch.inference_mode ----------------
def _decode(m, x, state=None):
    outs = []
    for t in range(x.shape[1]):
        y, state = m(x[:, t : t + 1], state)
        outs.append(y)
    return torch.cat(outs, 1), state


def test_a_read_only_hook_on_hook_k_leaves_sink_decoding_unchanged():
    """With attention sinks the cache keeps keys before rotary. While any hook was attached to
    ``hook_k`` (``run_with_cache`` attaches one that only records) the key was rotated and rotated
    back (``rotary.undo``) instead of kept: in bf16 the cache then held keys off by 4e-3 and the
    decoded outputs differed by 8e-3 from the same model without the hook."""
    from mnemo.layers.attention import Attention

    torch.manual_seed(0)
    m = Attention(32, n_heads=2, window=3, n_sink=1).to(torch.bfloat16)
    x = 3 * torch.randn(1, 12, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        y0, s0 = _decode(m, x)
        seen = []
        handle = m.hook_k.register_forward_hook(lambda mod, args, out: seen.append(out))
        y1, s1 = _decode(m, x)
        handle.remove()
        assert len(seen) == 12
        assert torch.equal(y1, y0) and torch.equal(s1.kv.k, s0.kv.k)
        # a hook that edits the key in place still replaces it (kept rotated back to no position)
        m32 = Attention(32, n_heads=2, window=3, n_sink=1).double()
        xd = x.double()
        _, plain = m32(xd)
        handle = m32.hook_k.register_forward_hook(lambda mod, args, out: out.mul_(2.0))
        _, doubled = m32(xd)
        handle.remove()
        torch.testing.assert_close(doubled.kv.k, 2 * plain.kv.k, rtol=1e-12, atol=1e-12)


def test_ssm_hooks_run_under_inference_mode():
    """Mamba (``hook_g``) and Mamba-2 (``hook_B``, ``hook_C``, ``hook_g``) read the version counter of
    the value a hook got, to tell a read from an in-place replacement; under
    ``torch.inference_mode`` (no counters) any attached hook made the forward raise "Inference
    tensors do not track version counter". A read-only hook now gives the plain result there, and
    a replacement still takes effect."""
    from mnemo.layers.ssm import Mamba, Mamba2

    torch.manual_seed(0)
    x = torch.randn(2, 7, 16)
    for m, names in (
        (Mamba(16, d_state=4, chunk_size=4), ("hook_g",)),
        (Mamba2(16, d_state=4, head_dim=8, n_groups=2, chunk_size=4), ("hook_B", "hook_C", "hook_g")),
    ):
        with torch.no_grad():
            ref, ref_state = m(x)
        handles = [getattr(m, n).register_forward_hook(lambda mod, args, out: None) for n in names]
        with torch.inference_mode():
            y, state = m(x)
        for h in handles:
            h.remove()
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(state.ssm, ref_state.ssm, rtol=1e-5, atol=1e-6)
        # a replacement (log decay −5: forget almost at once) takes effect under inference_mode too,
        # as under no_grad (the D skip dominates the output at init: a change of 4e-4 relative)
        handle = m.hook_g.register_forward_hook(lambda mod, args, out: torch.full_like(out, -5.0))
        with torch.no_grad():
            want, _ = m(x)
        with torch.inference_mode():
            y_rep, _ = m(x)
        handle.remove()
        torch.testing.assert_close(y_rep, want, rtol=1e-6, atol=1e-7)
        assert (want - ref).norm() > 1e-4 * ref.norm()
