"""Seventh review of the Nested Learning area (CMS, self-modifying Titans / projections, the task
signal, M3): dtype errors that name the argument, and hand computations from the paper's equations."""

import pytest
import torch

from mnemo.layers.cms import ContinuumMemory
from mnemo.layers.self_modifying import SelfModifyingTitans
from mnemo.layers.self_modifying_projections import SelfModifyingProjections

D = 8

NL_MIXERS = {
    "cms_sequential": lambda: ContinuumMemory(D, levels=[{"period": 2}, {"period": 4}]),
    "cms_nested": lambda: ContinuumMemory(D, levels=[{"period": 2}, {"period": 4}], transfer="nested"),
    "self_modifying_titans": lambda: SelfModifyingTitans(d_model=D, n_heads=2),
    "self_modifying_projections": lambda: SelfModifyingProjections(d_model=D, n_heads=2),
}


@pytest.mark.parametrize("name", sorted(NL_MIXERS))
@pytest.mark.parametrize(
    "param_dtype,x_dtype", [(torch.float64, torch.float32), (torch.float32, torch.float64)]
)
def test_a_mismatched_input_dtype_is_named_with_expected_and_received(name, param_dtype, x_dtype):
    """A float32 input into a float64 NL mixer (and the reverse) raised torch's unnamed "expected m1
    and m2 to have the same dtype" from deep inside a matmul; now a ValueError names ``x``, the
    parameters' dtype and the input's."""
    m = NL_MIXERS[name]().to(param_dtype)
    x = torch.randn(1, 3, D, dtype=x_dtype)
    with pytest.raises(ValueError, match=rf"x: expected dtype {param_dtype}.*got {x_dtype}"):
        m(x)
    if isinstance(m, SelfModifyingTitans):
        with pytest.raises(ValueError, match=rf"x: expected dtype {param_dtype}.*got {x_dtype}"):
            m.log_decay(x)


@pytest.mark.parametrize("name", sorted(NL_MIXERS))
def test_autocast_mixed_dtypes_still_run(name):
    """The check leaves autocast alone: a bf16 input into a float32 mixer under CPU autocast runs."""
    torch.manual_seed(0)
    m = NL_MIXERS[name]()
    x = torch.randn(1, 3, D).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)[0]
    assert y.shape == (1, 3, D) and torch.isfinite(y.float()).all()


def _rel_change_error(s16, s32, m) -> float:
    worst = 0.0
    for lv, a, b in zip(m.levels, s16.levels, s32.levels):
        for w0, u, v in zip((lv.W_in, lv.W_out), a.weights, b.weights):
            d16, d32 = u.float() - w0, v - w0
            worst = max(worst, ((d16 - d32).norm() / d32.norm()).item())
    return worst


@pytest.mark.parametrize("optimizer", ["gd", "momentum"])
def test_cms_fast_weights_accumulate_in_float32_under_bf16_autocast(optimizer):
    """DESIGN §3: computation accumulates in fp32 even for bf16 inputs. Under bf16 autocast the
    levels' steps (``baddbmm``) ran in bf16 and returned bf16 fast weights (``"gd"``) and gradient
    sums, so every later small step was rounded against bf16 weights: the learned change of the
    weights over 32 tokens was 150 % off the fp32 run's (``lr=0.2``; 6-11 % at ``lr=1`` over 256
    tokens). Now the state stays float32 and the change is within 2 % (what is left is the bf16
    reads' rounding)."""
    torch.manual_seed(0)
    lv = {"optimizer": optimizer, "lr": 0.2}
    m = ContinuumMemory(16, levels=[{"period": 1, **lv}, {"period": 4, **lv}])
    x = torch.randn(1, 32, 16)
    with torch.no_grad():
        _, s32 = m(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, s16 = m(x[:, :13])
            _, s16 = m(x[:, 13:], s16)  # a carried state: its float32 buffers go on in float32
    for lv in s16.levels:
        for t in (*lv.weights, *lv.grad, *(lv.momentum or ())):
            assert t.dtype == torch.float32
    assert _rel_change_error(s16, s32, m) < 0.02


def test_task_levels_and_projection_sums_stay_float32_under_bf16_autocast():
    """The same for the task signal's steps (``absorb``, the factored steps' ``settle``) in a HOPE
    model, and for :class:`SelfModifyingProjectionsState` ``.r``, documented float32 (it was bf16)."""
    from mnemo.models import LanguageModel, build_config

    torch.manual_seed(0)
    cfg = build_config(
        "hope_attention",
        vocab_size=16,
        d_model=8,
        n_layers=1,
        mixer_options={"attention": {"n_heads": 2}},
        mlp_options={"levels": [{"period": 2, "objective": "task"}, {"period": 4, "objective": "task"}]},
    )
    model = LanguageModel(cfg)
    ids = torch.randint(0, 16, (1, 11), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, state = model(ids)
    levels = state[0].mlp.levels
    assert [lv.updates for lv in levels] == [5, 2]  # 5 segments of 2 had their next token
    for lv in levels:
        for t in (*lv.weights, *lv.grad):
            assert t.dtype == torch.float32
    m = SelfModifyingProjections(d_model=D, n_heads=2, chunk_size=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, s = m(torch.randn(1, 6, D))
    assert s.r.dtype == torch.float32
