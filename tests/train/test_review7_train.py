"""Seventh review of the training area: the Student-t quantile's far tail, the one t-quantile of
the continual command, the memory estimate under bf16, and the compile suppression helper."""

from __future__ import annotations

import math

import pytest
import torch

from mnemo.sweep.stats import t_quantile


def test_t_quantile_solves_a_tiny_tail_directly():
    # 1 − 1e-300 rounds to 1.0: the quantile was refused with "p must be in (0, 1), got 1.0"
    # df = 3 (A&S 26.7.3): P(T > t) = ½ − (θ + sin θ cos θ) / π → 2√3 / (π t³) as t → ∞, so
    # t ≈ (2√3 / (π p))^{1/3}, and the next term of the expansion is O(t⁻⁵): relative 1e-200
    for p in (1e-300, 1e-100):
        assert t_quantile(p, 3) == pytest.approx(-math.cbrt(2 * math.sqrt(3) / (math.pi * p)), rel=1e-14)
    # df = 4: P(T > t) = ½ − ½ sin θ (1 + ½ cos² θ) → 3 / t⁴ (the 1/t⁶ term is 1e-100 relative here)
    assert t_quantile(1e-200, 4) == pytest.approx(-((3 / 1e-200) ** 0.25), rel=1e-14)
    # df = 2 in closed form, and the smallest float
    assert t_quantile(1e-300, 2) == pytest.approx(-1 / math.sqrt(2e-300), rel=1e-15)
    assert math.isfinite(t_quantile(5e-324, 7)) and t_quantile(5e-324, 7) < -1e40
    # a moderate tail against the same expansion is no worse than before: t_{1e-10, 3}
    t = -t_quantile(1e-10, 3)
    theta = math.atan(t / math.sqrt(3))
    assert 0.5 - (theta + math.sin(theta) * math.cos(theta)) / math.pi == pytest.approx(1e-10, rel=1e-12)


def test_t_quantile_table_values_and_symmetry():
    for df, want in (
        (1, 12.7062047361747),
        (2, 4.30265272974946),
        (30, 2.04227245630124),
        (5, 2.57058183563631),
    ):
        assert t_quantile(0.975, df) == pytest.approx(want, rel=1e-13)
    for df in (1, 2, 3, 6, 11):
        for p in (2.0**-20, 0.0625, 0.125, 0.375):  # 1 − (1 − p) is exactly p for these
            assert 1.0 - (1.0 - p) == p
            assert t_quantile(p, df) == -t_quantile(1.0 - p, df)


def test_continual_uses_the_exact_t_quantile():
    # it held a table rounded to 3 decimals (t_{0.975, 2} = 4.303, 1.6e-4 off) and a Cornish–Fisher
    # tail beyond df = 30, apart from mnemo.sweep.stats.t_quantile
    from mnemo.commands.continual import mean_ci95, t_quantile_975

    for df in (1, 2, 7, 30, 31, 120):
        assert t_quantile_975(df) == t_quantile(0.975, df)
    r = mean_ci95([1.0, 2.0, 3.0])  # s = 1
    assert r["ci95"] == pytest.approx(4.302652729749462 / math.sqrt(3), rel=1e-14)
    with pytest.raises(ValueError, match="df must be an int >= 1, got 0"):
        t_quantile_975(0)


def _saved_bytes(model, ids, precision):
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t

    ctx = (
        torch.autocast("cpu", torch.bfloat16) if precision == "bf16" else torch.autocast("cpu", enabled=False)
    )
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx:
        model(ids)
    return sum(n for k, n in seen.items() if k not in params)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_activation_bound_holds_under_bf16(checkpointing):
    # the bound counts fp32 activations; under bf16 autocast the residual stream stays fp32 and the
    # matmuls' bf16 copies come on top, so the tensors really kept for the backward exceed it
    from mnemo.models import LanguageModel, build_config
    from mnemo.train.memory_estimate import estimate_memory

    torch.manual_seed(0)
    B, T, V, D = 2, 32, 17, 32
    model = LanguageModel(build_config("transformer", vocab_size=V, d_model=D, n_layers=2))
    model.activation_checkpointing = checkpointing
    ids = torch.randint(0, V, (B, T))
    bound = estimate_memory(
        n_params=0,
        vocab_size=V,
        d_model=D,
        n_layers=2,
        batch_size=B,
        micro_rows=B,
        seq_len=T,
        activation_checkpointing=checkpointing,
    ).activations
    assert bound == 2 * (1 if checkpointing else 5) * B * T * D * 4
    for precision in ("fp32", "bf16"):
        assert _saved_bytes(model, ids, precision) >= bound, precision


def test_a_suppressed_block_in_a_compiled_function_compiles_once():
    # the thread-local depth was created on the first __enter__, so dynamo guarded on its absence
    # and compiled every function that opens a block a second time on its second call
    import threading

    from torch._dynamo.utils import counters

    from mnemo.ops import _native

    def f(x):
        with _native.suppressed():
            return x * 2 + (0.0 if _native.enabled() else 1.0)

    torch._dynamo.reset()
    counters.clear()
    cf = torch.compile(f, backend="eager")
    x = torch.arange(4.0)
    for _ in range(3):
        assert torch.equal(cf(x), x * 2 + 1)
    out = []
    th = threading.Thread(target=lambda: out.append(cf(x)))
    th.start()
    th.join()
    assert torch.equal(out[0], x * 2 + 1)
    assert counters["stats"]["unique_graphs"] == 1
    assert _native._suppressed.depth == 0
    torch._dynamo.reset()


def test_mean_interval_takes_every_confidence_below_one():
    # 0.5 + c/2 rounded to 1.0 for c = 1 − 2⁻⁵³, and t_quantile refused "p ... got 1.0", an argument
    # the caller never passed; df = 2 in closed form: t = (1 − 2q) / √(2q(1 − q)) with q = 2⁻⁵⁴
    from mnemo.sweep.stats import mean_interval

    c = 1.0 - 2.0**-53
    q = 2.0**-54
    r = mean_interval([1.0, 2.0, 3.0], confidence=c)  # std = 1
    assert r["half_width"] == pytest.approx(
        (1 - 2 * q) / math.sqrt(2 * q * (1 - q)) / math.sqrt(3), rel=1e-15
    )
    tiny = mean_interval([1.0, 2.0, 3.0], confidence=1e-300)
    assert tiny["half_width"] == 0.0 and math.copysign(1.0, tiny["half_width"]) == 1.0
    assert mean_interval([1.0, 2.0, 3.0])["half_width"] == pytest.approx(
        4.302652729749462 / math.sqrt(3), rel=1e-15
    )


def test_continual_mean_ci95_of_equal_seeds_is_exact():
    # sum(good) / n and deviations from that rounded mean: three seeds at 0.99 read
    # 0.9899999999999999 ± 3.4e-16 in the continual tables
    from mnemo.commands.continual import mean_ci95

    r = mean_ci95([0.99, 0.99, 0.99])
    assert r["mean"] == 0.99 and r["ci95"] == 0.0
    r = mean_ci95([1.0, float("inf"), 2.0, 3.0])
    assert r["mean"] == 2.0 and r["dropped"] == 1 and r["n"] == 3
    assert r["ci95"] == pytest.approx(4.302652729749462 / math.sqrt(3), rel=1e-15)
