"""The integrated-gradients quadrature ``rule`` reaches the attribution entry points that wrap
:meth:`~mnemo.layers.NeuralMemory.attribution` or call
:func:`~mnemo.memory.attribution.value_attribution` themselves (helper 46): ``TitansMAG`` and
``TitansMAL`` (one method, ``_MemoryAndWindow.attribution``), ``TitansMAC`` and
``SelfModifyingProjections`` (a nonlinear main memory: ``ttt_linear``, random initial weights).

Measured (float64, ``x ~ N(0, 1)`` of ``[1, 4, 4]``, seed 0, the builds below): relative error of the
contributions ``c_ts`` at 3 steps against midpoint at 256 steps, and against a Richardson
extrapolation of midpoint at 32 and 64 steps (``(4 m₆₄ − m₃₂)/3``, error ``O(1/n⁴)``)::

    entry point   midpoint(3)   gauss_legendre(3)   gauss_legendre(3) vs Richardson   256 vs Richardson
    TitansMAG     2.76e-03      7.69e-06            7.91e-06                          3.83e-07
    TitansMAL     5.41e-04      5.51e-08            2.59e-08                          7.42e-08
    TitansMAC     3.29e-06      4.52e-10            2.32e-14                          4.52e-10
    SMP           4.03e-04      7.84e-08            3.43e-08                          5.53e-08

The reference's own error is ``midpoint(3) · (3/256)²`` (midpoint's error is ``O(1/n²)``; last
column), so Gauss-Legendre's error against it is Gauss-Legendre's own for MAG and, for MAL, MAC and
SMP, mostly the reference's. Each tolerance below is the measured error × 3, rounded up to one
digit; midpoint's error must stay above a third of its measured value and 100× Gauss-Legendre's
(measured: 360× for MAG, over 5000× for the others).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import mnemo.memory.attribution as attribution
from mnemo.layers import SelfModifyingProjections, TitansMAC, TitansMAG, TitansMAL

F64 = torch.float64


def rel(a, b):
    return float((a - b).norm() / b.norm())


def _smp():
    m = SelfModifyingProjections(4, n_heads=1, chunk_size=8, spec="ttt_linear")
    with torch.no_grad():  # zero initial weights (the default) give a nearly linear read
        for w in m.memory_init:
            w.normal_(0, 0.5)
    return m


BUILDS = {
    "mag": lambda: TitansMAG(4, n_heads=1, window=4, persistent_tokens=1),
    "mal": lambda: TitansMAL(4, n_heads=1, window=4, persistent_tokens=1),
    "mac": lambda: TitansMAC(4, n_heads=1, segment=2, persistent_tokens=1),
    "smp": _smp,
}
#: measured relative error at 3 steps against midpoint at 256 steps: (midpoint, Gauss-Legendre)
MEASURED = {
    "mag": (2.76e-3, 7.69e-6),
    "mal": (5.41e-4, 5.51e-8),
    "mac": (3.29e-6, 4.52e-10),
    "smp": (4.03e-4, 7.84e-8),
}
#: tolerance on Gauss-Legendre's error: the measured error × 3, rounded up to one digit
GL_TOL = {"mag": 3e-5, "mal": 2e-7, "mac": 2e-9, "smp": 3e-7}


@functools.cache
def _recorded(name):
    """The layer ``name`` and its hook values on one fresh-stream call (built once per module)."""
    torch.manual_seed(0)
    if name == "smp_exact":  # the default gated delta rule: linear in its values
        m = SelfModifyingProjections(4, n_heads=1, chunk_size=8).double()
    else:
        m = BUILDS[name]().double()
    return m, m.mixing_acts(torch.randn(1, 4, 4, dtype=F64))


def _layer(name):
    """A copy of the layer (its attributes may be changed) and the recorded hook values."""
    m, acts = _recorded(name)
    m = copy.deepcopy(m)
    assert m.mixing_exact == (name == "smp_exact")  # nonlinear reads: the rule matters
    return m, acts


def _rule_of(m):
    """The object whose ``attribution_rule`` is the default (the wrapped memory for MAG/MAL/MAC)."""
    return m if isinstance(m, SelfModifyingProjections) else m.memory


@pytest.mark.parametrize("name", list(BUILDS))
def test_gauss_legendre_is_closer_to_the_fine_midpoint_reference(name):
    m, acts = _layer(name)
    ref = m.attribution(acts, 256).contributions
    mid = m.attribution(acts, 3, rule="midpoint").contributions
    gl = m.attribution(acts, 3, rule="gauss_legendre").contributions
    assert torch.equal(mid, m.attribution(acts, 3).contributions)  # midpoint is the default
    mid_err, gl_err = rel(mid, ref), rel(gl, ref)
    mid_meas, _ = MEASURED[name]
    assert mid_err > mid_meas / 3, (name, mid_err)  # the small-step midpoint result is off
    assert gl_err <= GL_TOL[name], (name, gl_err)
    assert 100 * gl_err < mid_err, (name, gl_err, mid_err)  # the rules differ: the rule was applied


@pytest.mark.parametrize("name", list(BUILDS))
def test_the_rule_reaches_the_quadrature(name, monkeypatch):
    """``rule=`` (and, when it is ``None``, the ``attribution_rule`` attribute of the layer or of
    its memory) and ``steps`` are what :func:`~mnemo.memory.attribution.quadrature_nodes` gets;
    ``mixing`` uses the attribute too."""
    m, acts = _layer(name)

    class Seen(Exception):
        pass

    def record(n, rule):  # the nodes are right (test_ig_quadrature_45): stop before the passes
        raise Seen(n, rule)

    def seen(**kw):
        with pytest.raises(Seen) as e:
            (m.mixing if kw.pop("mixing", False) else m.attribution)(acts, **kw)
        return e.value.args

    monkeypatch.setattr(attribution, "quadrature_nodes", record)
    assert seen(steps=3, rule="gauss_legendre") == (3, "gauss_legendre")
    assert seen(steps=2) == (2, "midpoint")
    owner = _rule_of(m)
    owner.attribution_rule, owner.attribution_steps = "gauss_legendre", 5
    assert seen() == (5, "gauss_legendre")
    assert seen(steps=2, rule="midpoint") == (2, "midpoint")  # an explicit rule wins over the attribute
    assert seen(mixing=True) == (5, "gauss_legendre")


@pytest.mark.parametrize("name", [*BUILDS, "smp_exact"])
@pytest.mark.parametrize("bad", ["trapezoid", "Midpoint", 3, None])
def test_a_bad_rule_names_the_argument(name, bad):
    """A bad ``rule`` (``None`` only as the attribute: as the argument it means the attribute)
    raises the ValueError of :func:`~mnemo.memory.attribution.value_attribution`, also for a memory
    linear in its values (the default gated delta rule of ``SelfModifyingProjections``), whose map
    is exact and takes no quadrature."""
    m, acts = _layer(name)
    want = rf"rule must be 'gauss_legendre' or 'midpoint', got {bad!r}"
    if bad is not None:
        with pytest.raises(ValueError, match=want):
            m.attribution(acts, 2, rule=bad)
    _rule_of(m).attribution_rule = bad
    with pytest.raises(ValueError, match=want):
        m.attribution(acts, 2)
