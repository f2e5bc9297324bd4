"""Third break-it review of the Nested Learning / HOPE area (CMS, task signal, self-modifying
mixers, M3): each test failed on the code before its fix."""

from __future__ import annotations

import pytest
import torch

from mnemo.layers.cms import ContinuumMemory, Level
from mnemo.layers.self_modifying import SelfModifyingTitans
from mnemo.layers.self_modifying_projections import SelfModifyingProjections
from mnemo.models import LanguageModel, build_config
from mnemo.train.m3 import M3, newton_schulz


@pytest.mark.parametrize("coefficients", ["quintic", "cubic"])
@pytest.mark.parametrize(
    ("dtype", "scales"), [(torch.float32, (1e-25, 1e-30, 1e25)), (torch.float64, (1e-170, 1e160))]
)
def test_newton_schulz_is_scale_invariant_for_tiny_and_huge_matrices(coefficients, dtype, scales):
    # NS(c G) = NS(G) for c > 0 (G is normalised first); before the fix the Frobenius norm's sum
    # of squares underflowed to 0 for a tiny G (result NaN) and overflowed for a huge one (zeros)
    g = torch.Generator().manual_seed(0)
    G = torch.randn(2, 4, 6, generator=g, dtype=dtype)
    ref = newton_schulz(G, 5, coefficients)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    for c in scales:
        out = newton_schulz(G * c, 5, coefficients)
        assert torch.isfinite(out).all(), c
        torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


def test_m3_steps_a_parameter_with_a_tiny_gradient_without_nan():
    w = torch.nn.Parameter(torch.ones(3, 5))
    opt = M3([w], lr=1e-2, eps=1e-2)
    w.grad = torch.full((3, 5), 1e-24) * torch.arange(1.0, 16.0).view(3, 5)
    opt.step()
    assert torch.isfinite(w).all()
    # |Δ| = lr |O1| / (√V + ε) with √V ≈ 1e-24: finite, of size ≤ lr / ε · max|O1|
    assert (w - 1).abs().max() < 1.5


@pytest.mark.parametrize("chunk_size", [0, -1, 2.5, True])
def test_self_modifying_projections_refuse_a_bad_chunk_size_naming_it(chunk_size):
    # before: 0 divided by zero at the first forward and -1 looped forever there
    with pytest.raises(ValueError, match=r"chunk_size: expected an int >= 1, got"):
        SelfModifyingProjections(8, 2, chunk_size=chunk_size)


@pytest.mark.parametrize("self_lr", [float("nan"), float("inf"), -0.1, "0.1"])
def test_self_modifying_projections_refuse_a_bad_self_lr_naming_it(self_lr):
    with pytest.raises(ValueError, match=r"self_lr: expected a finite number >= 0"):
        SelfModifyingProjections(8, 2, self_lr=self_lr)


@pytest.mark.parametrize("cls", [SelfModifyingTitans, SelfModifyingProjections])
@pytest.mark.parametrize(
    ("kw", "name"), [({"n_heads": 0}, "n_heads"), ({"d_model": 0}, "d_model"), ({"d_model": 8.0}, "d_model")]
)
def test_self_modifying_mixers_name_a_bad_width_or_head_count(cls, kw, name):
    # before: ZeroDivisionError / a TypeError from torch.randn, naming neither argument
    args = {"d_model": 8, "n_heads": 2, **kw}
    with pytest.raises(ValueError, match=rf"^{name}: expected an int >= 1, got"):
        cls(**args)


def test_a_state_of_the_wrong_type_is_refused_naming_the_state():
    # before: AttributeError ('LevelState' object has no attribute 'levels', … no attribute 'proj')
    x = torch.randn(1, 3, 8)
    cms = ContinuumMemory(8, [Level(2), Level(4)])
    _, cs = cms(x)
    with pytest.raises(ValueError, match=r"^state: expected a CMSState .* got LevelState"):
        cms(x, cs.levels[0])
    for mixer, name in (
        (SelfModifyingTitans(8, 2), "SelfModifyingTitansState"),
        (SelfModifyingProjections(8, 2), "SelfModifyingProjectionsState"),
    ):
        with pytest.raises(ValueError, match=rf"^state: expected a {name} .* got CMSState"):
            mixer(x, cs)


@pytest.mark.parametrize("short_conv", [True, False])
def test_self_modifying_projections_refuse_a_state_of_another_batch_size_naming_it(short_conv):
    # before: a shape error from the conv or the memory, naming neither the state's projections nor
    # the batch size
    m = SelfModifyingProjections(8, 2, chunk_size=2, short_conv=short_conv)
    _, st = m(torch.randn(1, 3, 8))
    with pytest.raises(
        ValueError, match=r"^state\.proj: expected projection weights of shapes \[\[2, 8, 8\]"
    ):
        m(torch.randn(2, 4, 8), st)


@pytest.mark.parametrize("meta", ["unrolled", "first_order"])
def test_run_with_cache_holds_the_whole_call_of_a_meta_learned_nested_cms(meta):
    # the fastest level reads the call one period at a time; before the fix its pieces were not
    # placed in the call, so the cache kept only the last piece (here 1 of 7 tokens), without a warning
    torch.manual_seed(0)
    levels = [{"period": 2}, {"period": 4}]
    opts = {"levels": levels, "transfer": "nested", "meta": meta}
    cfg = build_config(
        "hope_attention_reconstruction", vocab_size=23, d_model=16, n_layers=1, mlp_options=opts
    )
    m = LanguageModel(cfg).double()
    ids = torch.randint(0, 23, (2, 7), generator=torch.Generator().manual_seed(1))
    outs = []
    handle = m.blocks[0].mlp.register_forward_hook(lambda mod, args, out: outs.append(out[0].detach()))
    try:
        logits, cache = m.run_with_cache(ids, ["hook_in", "hook_out", "hook_eta"])
    finally:
        handle.remove()
    for name, width in (("hook_in", 16), ("hook_out", 16), ("hook_eta", 1)):
        assert cache[f"blocks.0.mlp.levels.0.{name}"].shape == (2, 7, width), name
    # nested transfer: the CMS output is the fastest level's read
    torch.testing.assert_close(cache["blocks.0.mlp.levels.0.hook_out"], outs[0], rtol=0, atol=0)
    torch.testing.assert_close(logits, m(ids)[0], rtol=0, atol=1e-12)
