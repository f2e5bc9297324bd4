"""Third break-it review of the memory engine and the Titans layers: configuration values that were
accepted and then computed something else than asked (a string for a flag, ``lp_eps = 0`` below
``p = 2``, a negative ``max_lr``) or failed far from the argument (heads, persistent tokens)."""

from __future__ import annotations

import pytest
import torch

from mnemo.layers import NeuralMemory, TitansMAC, TitansMAG, TitansMAL
from mnemo.memory import MemorySpec, neural_memory, preset
from tests.helpers import assert_close, memory_gates, prefill_then_tokens

D = 16


@pytest.mark.parametrize("field", ["residual", "norm", "decay_per_channel", "decay_first"])
@pytest.mark.parametrize("value", ["False", 0, None])
def test_a_flag_that_is_not_a_bool_is_refused_naming_it(field, value):
    """``residual="False"`` (a config string) was truthy: a residual memory, silently."""
    spec = MemorySpec(architecture="mlp", retention="decay", **{field: value})
    with pytest.raises(ValueError, match=rf"MemorySpec\.{field}: expected a bool, got {value!r}"):
        spec.validate()


def test_lp_objective_with_no_smoothing_below_p_2_is_refused():
    """``|e|^{p−1}`` at ``e = 0`` for ``p < 2`` without the smoothing ``ε`` is ``0 · ∞``: the first
    exact fit (a zero memory writing a zero value) turned the weights into NaN for good."""
    spec = MemorySpec(objective="lp", p=1.5, lp_eps=0.0, chunk_size=2)
    with pytest.raises(
        ValueError, match=r"MemorySpec\.lp_eps: expected a nonzero number .*p = 1\.5.*got 0\.0"
    ):
        spec.validate()
    # p >= 2 has a finite slope at e = 0: no smoothing needed, and the run stays finite
    spec = MemorySpec(objective="lp", p=2.0, lp_eps=0.0, chunk_size=2).validate()
    q = torch.randn(1, 4, 1, 3, dtype=torch.float64)
    v = torch.zeros(1, 4, 1, 3, dtype=torch.float64)
    o, _ = neural_memory(spec, q, q, v, torch.full((1, 4, 1), 0.5, dtype=torch.float64))
    assert torch.isfinite(o).all()


@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(n_heads=0), "n_heads"),
        (dict(head_dim=0), "head_dim"),
        (dict(d_model=2, n_heads=4), "d_model"),
        (dict(persistent_tokens=-1), "persistent_tokens"),
        (dict(persistent_tokens=2.0), "persistent_tokens"),
        (dict(max_lr=-0.5, spec="ttt_linear"), "max_lr"),
        (dict(max_lr=0.0, spec="ttt_linear"), "max_lr"),
    ],
)
def test_neural_memory_refuses_bad_sizes_naming_the_argument(kw, name):
    """``n_heads=0`` raised ZeroDivisionError, ``head_dim=0`` built a memory of zero-width heads,
    ``persistent_tokens=-1`` failed inside ``torch.zeros``, and a negative ``max_lr`` on a spec
    without a clamp made ``θ`` negative (gradient *ascent* on the inner loss), all silently or far
    from the argument."""
    kw = dict(kw)
    d_model = kw.pop("d_model", D)
    with pytest.raises(ValueError, match=rf"^{name}: "):
        NeuralMemory(d_model, **kw)


@pytest.mark.parametrize("cls", [TitansMAC, TitansMAG, TitansMAL])
@pytest.mark.parametrize("persistent", [-1, 1.5])
def test_titans_architectures_name_a_bad_persistent_count(cls, persistent):
    with pytest.raises(ValueError, match=r"^persistent_tokens: expected an int >= 0"):
        cls(D, n_heads=2, persistent_tokens=persistent)


@pytest.mark.parametrize("spec", ["titans", "deltanet", "moneta"])
def test_recurrent_form_runs_under_inference_mode(spec):
    """The token-loop reference takes its inner gradients with autograd, which ``torch.inference_mode``
    switches off: every one-token decoding step of a test-time-trained memory (``T = 1`` runs the
    reference) raised "element 0 of tensors does not require grad" under it."""
    s = preset(spec, chunk_size=4) if spec != "deltanet" else preset(spec)
    B, T, H, K = 2, 5, 2, 4
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)
    kw = memory_gates(s, B, T, H, gen)
    with torch.no_grad():
        ref, ref_state = neural_memory(s, q, k, v, output_final_state=True, mode="recurrent", **kw)
    with torch.inference_mode():
        o, st = neural_memory(s, q, k, v, output_final_state=True, mode="recurrent", **kw)
    assert_close(o, ref, 1e-12, what=f"{spec} under inference_mode")
    for a, b in zip(st.weights, ref_state.weights):
        assert_close(a, b, 1e-12, what=f"{spec} state")
    assert not o.requires_grad and all(not w.requires_grad for w in st.weights)


@pytest.mark.parametrize("cls", ["lmm", "mac"])
def test_token_by_token_decoding_under_inference_mode_equals_the_full_pass(cls):
    torch.manual_seed(0)
    if cls == "lmm":
        m = NeuralMemory(D, n_heads=2, expansion=1.0, chunk_size=3, persistent_tokens=2).double()
    else:
        m = TitansMAC(D, n_heads=2, segment=3, persistent_tokens=2, expansion=1.0).double()
    x = torch.randn(2, 7, D, dtype=torch.float64)
    with torch.no_grad():
        full, _ = m(x)
    with torch.inference_mode():
        got = prefill_then_tokens(m, x, 2)
    assert_close(got, full, 1e-10, what=f"{cls} decoding under inference_mode")


def test_a_state_carried_out_of_inference_mode_decodes_under_no_grad():
    """A prefill under ``torch.inference_mode`` leaves a state of inference tensors; the next
    one-token step under ``torch.no_grad`` (the reference form) raised "Setting requires_grad=True on
    inference tensor outside InferenceMode is not allowed"."""
    torch.manual_seed(0)
    m = NeuralMemory(D, n_heads=2, expansion=1.0, chunk_size=3).double()
    x = torch.randn(2, 6, D, dtype=torch.float64)
    with torch.no_grad():
        full, _ = m(x)
    with torch.inference_mode():
        y1, s = m(x[:, :4])
    with torch.no_grad():
        y2, s = m(x[:, 4:5], s)
        y3, _ = m(x[:, 5:], s)
    assert_close(torch.cat([y1, y2, y3], 1), full, 1e-10, what="decoding after an inference-mode prefill")
