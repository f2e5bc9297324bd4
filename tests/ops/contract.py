"""The equivalence contract of DESIGN.md §4, written once for every recurrent op.

An :class:`OpSpec` says how to draw inputs and call one op; ``tests/ops/test_contract.py``
runs every check below for every registered spec. Tolerances: float64 relative RMS ``1e-10``;
float32 at realistic sizes ``2e-5`` (outputs) — stated in each check.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tests.helpers import assert_close

F64_TOL = 1e-10


@dataclass
class OpSpec:
    """How to exercise one op.

    make(B, T, H, K, V, dtype, gen) -> dict of per-token tensors (time is dim 1), including
        everything the op needs; tensors named in ``grad_inputs`` get gradients checked.
    call(inputs, *, mode, initial_state, output_final_state, cu_seqlens, chunk_size) -> (o, S)
    state_shape(N, H, K, V) -> the state shape.
    """

    name: str
    make: Callable
    call: Callable
    state_shape: Callable
    modes: tuple[str, ...] = ("recurrent", "chunk", "parallel")
    chunk_size: int = 16
    grad_inputs: tuple[str, ...] = ("q", "k", "v")
    dims: tuple[int, int, int, int] = (2, 3, 8, 6)  # B, H, K, V for float64 checks
    big_dims: tuple[int, int, int, int, int] = (1, 2, 256, 32, 32)  # B, H, T, K, V for float32
    f32_tol: float = 2e-5
    extra: dict = field(default_factory=dict)

    def inputs(self, T, dtype=torch.float64, seed=0, B=None, dims=None):
        Bd, H, K, V = dims or self.dims
        gen = torch.Generator().manual_seed(seed)
        return self.make(B or Bd, T, H, K, V, dtype, gen)

    def state(self, N, dtype=torch.float64, seed=1, dims=None):
        _, H, K, V = dims or self.dims
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(self.state_shape(N, H, K, V), generator=gen, dtype=dtype)

    def run(self, inputs, mode, initial_state=None, cu_seqlens=None, chunk_size=None):
        return self.call(
            inputs,
            mode=mode,
            initial_state=initial_state,
            output_final_state=True,
            cu_seqlens=cu_seqlens,
            chunk_size=chunk_size or self.chunk_size,
        )


def _slice(inputs: dict, a: int, b: int) -> dict:
    return {n: t[:, a:b] for n, t in inputs.items()}


def _cat(parts: list[dict]) -> dict:
    return {n: torch.cat([p[n] for p in parts], dim=1) for n in parts[0]}


# ------------------------------------------------------------------------------------------------


def check_forms_agree(spec: OpSpec, T: int, with_state: bool):
    """§4.1: every form equals the recurrent reference (outputs and final states), float64."""
    x = spec.inputs(T)
    B = next(iter(x.values())).shape[0]
    S0 = spec.state(B) if with_state else None
    o_ref, s_ref = spec.run(x, "recurrent", S0)
    for mode in spec.modes:
        if mode == "recurrent":
            continue
        o, s = spec.run(x, mode, S0)
        assert_close(o, o_ref, F64_TOL, what=f"{spec.name} {mode} output T={T}")
        assert_close(s, s_ref, F64_TOL, what=f"{spec.name} {mode} final state T={T}")


def check_split(spec: OpSpec, T: int, a: int, mode: str):
    """§4.2: x[:, :a] then x[:, a:] with the carried state equals one run on x."""
    x = spec.inputs(T)
    B = next(iter(x.values())).shape[0]
    S0 = spec.state(B)
    o_full, s_full = spec.run(x, mode, S0)
    o1, s1 = spec.run(_slice(x, 0, a), mode, S0)
    o2, s2 = spec.run(_slice(x, a, T), mode, s1)
    assert_close(torch.cat([o1, o2], 1), o_full, F64_TOL, what=f"{spec.name} split@{a} {mode} output")
    assert_close(s2, s_full, F64_TOL, what=f"{spec.name} split@{a} {mode} state")


def check_token_steps_after_prefill(spec: OpSpec, T: int, prefill: int, mode: str):
    """§4.2 with 1-token steps: prefill with ``mode``, then decode token by token (recurrent)."""
    x = spec.inputs(T)
    o_full, s_full = spec.run(x, mode)
    outs = []
    o, s = spec.run(_slice(x, 0, prefill), mode)
    outs.append(o)
    for t in range(prefill, T):
        o, s = spec.run(_slice(x, t, t + 1), "recurrent", s)
        outs.append(o)
    assert_close(torch.cat(outs, 1), o_full, F64_TOL, what=f"{spec.name} decode after prefill {prefill}")
    assert_close(s, s_full, F64_TOL, what=f"{spec.name} decode state")


def _loss_grads(spec: OpSpec, x: dict, S0: torch.Tensor, mode: str):
    x = {n: t.detach().clone().requires_grad_(n in spec.grad_inputs) for n, t in x.items()}
    S0 = S0.detach().clone().requires_grad_(True)
    o, s = spec.run(x, mode, S0)
    gen = torch.Generator().manual_seed(7)
    wo = torch.randn(o.shape, generator=gen, dtype=o.dtype)
    ws = torch.randn(s.shape, generator=gen, dtype=s.dtype)
    ((o * wo).sum() + (s * ws).sum()).backward()
    grads = {n: x[n].grad for n in spec.grad_inputs}
    grads["initial_state"] = S0.grad
    return grads


def check_gradients_agree(spec: OpSpec, T: int):
    """§4.3: gradients of o and final_state w.r.t. every input and the initial state agree."""
    x = spec.inputs(T)
    B = next(iter(x.values())).shape[0]
    S0 = spec.state(B)
    ref = _loss_grads(spec, x, S0, "recurrent")
    for mode in spec.modes:
        if mode == "recurrent":
            continue
        got = _loss_grads(spec, x, S0, mode)
        for n, g in ref.items():
            assert g is not None, f"{spec.name}: no gradient reached {n}"
            assert_close(got[n], g, F64_TOL, what=f"{spec.name} {mode} d/d{n}")


def check_gradcheck_reference(spec: OpSpec):
    """§4.3: torch.autograd.gradcheck of the reference (float64, tiny sizes)."""
    x = spec.inputs(5, dims=(1, 2, 3, 2))
    S0 = spec.state(1, dims=(1, 2, 3, 2))
    names = list(spec.grad_inputs)

    def f(*args):
        xi = dict(x)
        xi.update(dict(zip(names, args[:-1])))
        o, s = spec.run(xi, "recurrent", args[-1])
        return o, s

    args = [x[n].detach().clone().requires_grad_(True) for n in names] + [S0.requires_grad_(True)]
    assert torch.autograd.gradcheck(f, tuple(args), eps=1e-6, atol=1e-6)


def check_varlen(spec: OpSpec, lengths: list[int], mode: str, with_state: bool):
    """§4.4: packed sequences (cu_seqlens) equal running each sequence alone."""
    seqs = [spec.inputs(L, B=1, seed=10 + i) for i, L in enumerate(lengths)]
    N = len(lengths)
    S0 = spec.state(N) if with_state else None
    packed = _cat(seqs)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32)
    o, s = spec.run(packed, mode, S0, cu_seqlens=cu)
    outs, states = [], []
    for i, xi in enumerate(seqs):
        oi, si = spec.run(xi, mode, S0[i : i + 1] if S0 is not None else None)
        outs.append(oi)
        states.append(si)
    assert_close(o, torch.cat(outs, 1), F64_TOL, what=f"{spec.name} varlen {mode} output")
    assert_close(s, torch.cat(states, 0), F64_TOL, what=f"{spec.name} varlen {mode} states")


def check_float32_realistic(spec: OpSpec, mode: str):
    """float32 at a realistic size: the fast form matches the float64 reference."""
    B, H, T, K, V = spec.big_dims
    x = spec.inputs(T, dtype=torch.float32, dims=(B, H, K, V))
    S0 = spec.state(B, dtype=torch.float32, dims=(B, H, K, V))
    o_ref, s_ref = spec.run({n: t.double() for n, t in x.items()}, "recurrent", S0.double())
    o, s = spec.run(x, mode, S0, chunk_size=64)
    assert o.dtype == torch.float32
    assert_close(o, o_ref, spec.f32_tol, what=f"{spec.name} float32 {mode} output")
    assert_close(s, s_ref, spec.f32_tol, what=f"{spec.name} float32 {mode} state")


def check_empty(spec: OpSpec, mode: str):
    """T = 0 returns an empty output and passes the initial state through."""
    x = spec.inputs(0)
    B = next(iter(x.values())).shape[0]
    S0 = spec.state(B)
    o, s = spec.run(x, mode, S0)
    assert o.shape[1] == 0
    assert torch.equal(s, S0)
