"""Regression review of 64a966d (read-only hooks under ``torch.inference_mode`` told by a copy):
``torch.equal`` counts ``NaN != NaN``, so a hook that only read a value holding a NaN counted as a
replacement — the costlier form, with results that differ from the same call under ``no_grad``."""

from __future__ import annotations

import torch

from mnemo.layers.attention import Attention
from mnemo.layers.hooks import before_hook, left_unchanged
from mnemo.layers.ssm import Mamba, Mamba2
from mnemo.ops import finite_checks


def test_left_unchanged_counts_nan_as_itself_under_inference_mode():
    with torch.inference_mode():
        t = torch.tensor([1.0, float("nan"), float("inf"), -float("inf")])
        assert left_unchanged(t, t, before_hook(t))  # only read
        assert left_unchanged(t, t.clone(), before_hook(t))  # an equal copy
        mark = before_hook(t)
        t[0] = 2.0  # edited in place: replaced
        assert not left_unchanged(t, t, mark)
        u = torch.tensor([1.0, float("nan")])
        mark = before_hook(u)
        u[1] = 0.0  # a NaN overwritten: replaced
        assert not left_unchanged(u, u, mark)


def test_read_only_ssm_hooks_on_values_with_nan_under_inference_mode_give_the_no_grad_result():
    """A NaN in one batch row (finite checks off, e.g. while hunting where it comes from with
    ``run_with_cache``): the read-only hook made Mamba / Mamba-2 run the other form, and the clean
    row moved (2e-9 in fp32, 1e-3 in bf16 for Mamba-2) against the same call under ``no_grad``."""
    torch.manual_seed(0)
    for m, names in (
        (Mamba(16, d_state=4, chunk_size=4), ("hook_g",)),
        (Mamba2(16, d_state=4, head_dim=8, n_groups=2, chunk_size=4), ("hook_B", "hook_C", "hook_g")),
    ):
        for dtype in (torch.float32, torch.bfloat16):
            m = m.to(dtype)
            x = torch.randn(2, 37, 16).to(dtype)
            x[0, 5, 3] = float("nan")
            handles = [getattr(m, n).register_forward_hook(lambda mod, args, out: None) for n in names]
            with finite_checks(False):
                with torch.no_grad():
                    want, want_state = m(x)
                with torch.inference_mode():
                    got, got_state = m(x)
            for h in handles:
                h.remove()
            what = f"{type(m).__name__} {dtype}"
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=what)
            torch.testing.assert_close(
                got_state.ssm, want_state.ssm, rtol=0, atol=0, equal_nan=True, msg=what
            )


def test_read_only_hook_k_on_keys_with_nan_keeps_sink_keys_under_inference_mode():
    torch.manual_seed(0)
    m = Attention(32, n_heads=2, window=3, n_sink=1)
    x = 3 * torch.randn(2, 12, 32)
    x[0, 4, 0] = float("nan")

    def decode():
        outs, state = [], None
        for t in range(x.shape[1]):
            y, state = m(x[:, t : t + 1], state)
            outs.append(y)
        return torch.cat(outs, 1), state

    handle = m.hook_k.register_forward_hook(lambda mod, args, out: None)
    with finite_checks(False):
        with torch.no_grad():
            want, want_state = decode()
        with torch.inference_mode():
            got, got_state = decode()
    handle.remove()
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(got_state.kv.k, want_state.kv.k, rtol=0, atol=0, equal_nan=True)
