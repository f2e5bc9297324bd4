"""Regression review of session 43, area A (the mixers' input dtype check, commit f85aa2b).

* The check read ``proj.weight.dtype`` of the input projection before looking at ``x``: a mixer
  quantised by ``torch.ao.quantization.quantize_dynamic`` (its ``Linear`` has a ``weight()``
  method, int8 weights, float32 input) raised ``AttributeError: 'function' object has no attribute
  'dtype'`` on every call, where it ran before (6 of the 7 checked mixers). A projection without a
  floating ``weight`` tensor is not checked (:func:`mnemo.layers.base.input_dtype`).
* Reading ``proj.weight`` computed a parametrised weight once more per call: a ``spectral_norm``
  input projection ran two power iterations per training forward instead of one (its ``u`` moved
  twice); the check now reads the parametrisation's ``original`` dtype.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn.utils.parametrizations import spectral_norm

from mnemo.layers.registry import MIXERS


@pytest.mark.parametrize("name", ["attention", "linear_attention", "gated_deltanet", "mamba2"])
def test_dynamically_quantised_mixer_runs_and_matches_the_float_layer(name):
    """int8 weights and dynamically int8-quantised activations (8 bits: a relative error of a few
    percent after a few matmuls) give the float layer's output up to that error; a float32 input
    of another dtype than the float layer's is still refused."""
    torch.manual_seed(0)
    kw = {"d_state": 8, "head_dim": 8} if name == "mamba2" else {}
    layer = MIXERS[name](32, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation notice
        quantised = torch.ao.quantization.quantize_dynamic(layer, {torch.nn.Linear}, dtype=torch.qint8)
    x = torch.randn(1, 6, 32)
    with torch.no_grad():
        y, yq = layer(x)[0], quantised(x)[0]
    rel = ((yq - y).norm() / y.norm()).item()
    assert 0 < rel < 0.1, rel  # 0: the int8 path did not run
    with pytest.raises(ValueError, match=r"x: expected dtype torch.float32.*got torch.float64"):
        layer(x.double())


@pytest.mark.parametrize("name", ["attention", "gated_deltanet", "mamba2"])
def test_spectral_norm_projection_runs_one_power_iteration_per_forward(name):
    """A training forward uses the input projection's weight once: ``spectral_norm``'s vector ``u``
    after the layer's forward equals ``u`` after one computation of the weight by the
    parametrisation itself (one power iteration, Miyato et al. 2018), and the weight was computed
    once."""
    torch.manual_seed(0)
    kw = {"d_state": 8, "head_dim": 8} if name == "mamba2" else {}
    layer = MIXERS[name](16, **kw)
    proj = layer.q_proj if name == "attention" else getattr(layer, "qkv_proj", None) or layer.in_proj
    spectral_norm(proj)
    sn = proj.parametrizations.weight[0]
    u0, v0 = sn._u.clone(), sn._v.clone()
    calls = []
    proj.parametrizations.weight.register_forward_hook(lambda *a: calls.append(1))
    layer(torch.randn(1, 3, 16))
    u_layer = sn._u.clone()
    with torch.no_grad():
        sn._u.copy_(u0), sn._v.copy_(v0)
    sn(proj.parametrizations.weight.original)  # one power iteration, by torch's own parametrisation
    assert len(calls) == 1
    assert torch.equal(u_layer, sn._u)
