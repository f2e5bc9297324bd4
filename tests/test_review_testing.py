"""Break-it review of :mod:`mnemo.testing`: checks that passed when the property failed, false
failures on valid specs, and bad arguments accepted silently."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mnemo.layers import MIXERS
from mnemo.layers.linear_attention import GatedLinearAttention
from mnemo.ops import gated_delta_rule, gated_linear_attention, ssd
from mnemo.testing import OpSpec, check_empty, get_spec, run_contract, verify
from mnemo.testing import mixers as MX
from mnemo.testing.device_probe import host_reads


def test_verify_checks_pattern_matching_nothing_is_an_error_not_an_empty_pass():
    # "from*" (a typo of "forms*") used to run nothing and return an empty report that passed
    with pytest.raises(ValueError, match=r"'from\*' matches no check.*forms"):
        verify(gated_linear_attention, "gla_scalar", quick=True, checks="from*")
    report = verify(gated_linear_attention, "gla_scalar", quick=True, checks=["forms"])
    assert report and report.passed


def test_verify_modes_given_as_one_string_is_one_mode():
    # modes="chunk" used to become five modes 'c', 'h', 'u', 'n', 'k' (each a failed row)
    report = verify(gated_linear_attention, "gla_scalar", quick=True, modes="chunk", checks="forms")
    assert [r.check for r in report] == ["forms[chunk]"] and report.passed
    assert get_spec("gla_scalar").with_op(gated_linear_attention, modes="chunk").modes == ("chunk",)
    with pytest.raises(ValueError, match="modes"):
        dataclasses.replace(get_spec("gla_scalar"), modes=())


def _gdr_doubles_state_when_empty(q, k, v, g, beta, *, initial_state=None, **kw):
    """Planted bug: for T = 0 the op scales the given state in place and returns it."""
    o, s = gated_delta_rule(q, k, v, g, beta, initial_state=initial_state, **kw)
    if q.shape[1] == 0 and initial_state is not None:
        return o, initial_state.mul_(2.0)
    return o, s


def test_check_empty_catches_a_state_changed_in_place():
    # the check compared the returned state with the (same, modified) tensor it passed in
    r = check_empty(get_spec("gated_delta_rule").with_op(_gdr_doubles_state_when_empty), "chunk")
    assert not r.passed, r
    assert check_empty(get_spec("gated_delta_rule"), "chunk").passed


def _gdr_no_final_state(q, k, v, g, beta, *, output_final_state=False, **kw):
    o, _ = gated_delta_rule(q, k, v, g, beta, output_final_state=False, **kw)
    return o, None


def test_spec_without_final_state_runs_varlen_and_gradcheck():
    # varlen compared the (absent) final states and gradcheck passed None as an output: false FAILs
    spec = dataclasses.replace(
        get_spec("gated_delta_rule").with_op(_gdr_no_final_state),
        supports=frozenset({"initial_state", "varlen", "grad"}),
    )
    report = run_contract(spec, quick=True, checks=["varlen*", "gradcheck"])
    assert {r.check for r in report} >= {"gradcheck", "varlen[chunk]", "varlen+S0[chunk]"}
    assert report.passed, report.table()


def test_gradcheck_of_an_op_without_initial_state_does_not_pass_one():
    def no_initial_state(q, k, v, g, *, initial_state=None, **kw):
        if initial_state is not None:
            raise TypeError("this op takes no initial_state")
        return gated_linear_attention(q, k, v, g, **kw)

    spec = get_spec("gla_scalar").with_op(no_initial_state, supports=frozenset({"final_state", "grad"}))
    report = run_contract(spec, quick=True, checks="gradcheck")
    assert [r.check for r in report] == ["gradcheck"] and report.passed, report.table()


class _NanWhenCarried(GatedLinearAttention):
    """Planted bug: the output is NaN whenever a state is carried in."""

    def forward(self, x, state=None, *args, **kwargs):
        y, s = super().forward(x, state, *args, **kwargs)
        return (y * float("nan") if state is not None else y), s


class _NanStateWhenCarried(GatedLinearAttention):
    """Planted bug: the returned state is NaN whenever a state is carried in."""

    def forward(self, x, state=None, *args, **kwargs):
        y, s = super().forward(x, state, *args, **kwargs)
        if state is not None:
            s = dataclasses.replace(s, memory=s.memory * float("nan"))
        return y, s


def test_mixer_split_fails_on_nan_output_or_state(monkeypatch):
    # max(0.0, nan) is 0.0: a NaN error was swallowed and the check passed
    monkeypatch.setitem(MIXERS, "_nan_out", _NanWhenCarried)
    monkeypatch.setitem(MIXERS, "_nan_state", _NanStateWhenCarried)
    r = MX.check_split("_nan_out", 16, {"n_heads": 2})
    assert not r.passed, r
    r = MX.check_split("_nan_state", 16, {"n_heads": 2})
    assert not r.passed, r
    assert MX.check_split("gla", 16, {"n_heads": 2}).passed


def test_host_reads_answers_a_meta_copy_into_a_host_tensor_with_zeros():
    m = torch.randn(3, 4, device="meta")
    dst = torch.full((3, 4), 5.0)
    with host_reads(answer_meta=True) as r:
        dst.copy_(m)
    assert r.syncs == 1 and torch.equal(dst, torch.zeros(3, 4))


def test_opspec_modes_string_normalised():
    spec = OpSpec(
        "x", get_spec("gla_scalar").make, call=lambda *a, **k: None, state_shape=lambda *a: a, modes="chunk"
    )
    assert spec.modes == ("chunk",) and spec.fast_modes == ("chunk",)


class _TwiceTheGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        return a.clone()

    @staticmethod
    def backward(ctx, grad):
        return 2 * grad


def _ssd_wrong_dA_in_chunk(x, dt, A, B, C, **kw):
    """Planted bug: the chunk form's gradient w.r.t. ``A`` is twice the true one."""
    if kw.get("mode") == "chunk":
        A = _TwiceTheGradient.apply(A)
    return ssd(x, dt, A, B, C, **kw)


def test_grad_check_covers_the_per_op_parameters_of_ssd():
    # A, D and dt_bias were made inside `arguments`, never leaves: a wrong dA passed every check
    report = verify(_ssd_wrong_dA_in_chunk, "ssd", quick=True, checks="grad*")
    rows = {r.check: r for r in report}
    assert not rows["grad[chunk]"].passed and "d/dA" in rows["grad[chunk]"].message, report.table()
    assert rows["grad[parallel]"].passed
    assert {"A", "D", "dt_bias"} <= set(get_spec("ssd").grad_inputs)
    assert {"A", "D", "delta_bias"} <= set(get_spec("selective_scan_grouped_gated").grad_inputs)


def test_check_mixer_of_an_unregistered_name_raises_instead_of_seven_failed_rows():
    with pytest.raises(KeyError, match=r"'glaa' is not registered.*'gla'"):
        MX.check_mixer("glaa")


def _gla_off_without_final_state(q, k, v, g, *, output_final_state=False, **kw):
    """Planted bug: the chunk form's output is 1 % off when no final state is asked for."""
    o, s = gated_linear_attention(q, k, v, g, output_final_state=output_final_state, **kw)
    if not output_final_state and kw.get("mode") == "chunk":
        o = o * 1.01
    return o, s


def test_forms_check_covers_the_call_without_a_final_state():
    # every check called the op with output_final_state=True: the training call was never compared
    report = verify(_gla_off_without_final_state, "gla_scalar", quick=True, checks="forms*")
    rows = {r.check: r for r in report}
    assert not rows["forms[chunk]"].passed and "output_final_state=False" in rows["forms[chunk]"].message
    assert rows["forms[parallel]"].passed


def test_third_party_available_and_version_refuse_an_unknown_package():
    # available("mamba") answered whether fla-core was installed, whatever the package
    from mnemo.testing import third_party

    for fn in (third_party.available, third_party.version, third_party.third_party_specs):
        with pytest.raises(ValueError, match="unknown third-party package 'mamba'; known: fla"):
            fn("mamba")


def _gdr_clobbers_initial_state(q, k, v, g, beta, *, initial_state=None, **kw):
    """Planted bug: the op reuses the caller's initial state as scratch space (zeroed after use)."""
    out = gated_delta_rule(q, k, v, g, beta, initial_state=initial_state, **kw)
    if initial_state is not None:
        initial_state.zero_()
    return out


def test_forms_check_catches_an_op_that_writes_into_its_initial_state():
    # with one mode the reference ran first, so a caller's state zeroed by the op went unseen
    report = verify(
        _gdr_clobbers_initial_state, "gated_delta_rule", quick=True, modes="chunk", checks="forms*"
    )
    rows = {r.check: r for r in report}
    assert rows["forms[chunk]"].passed
    bad = rows["forms+S0[chunk]"]
    assert not bad.passed and "modified initial_state in place" in bad.message, report.table()
