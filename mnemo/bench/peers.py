"""``mnemo bench --suite peers``: our layers next to the PyPI peers, timed in one process.

The peers are benchmark-only comparators (``../shared/bench/install-peers`` installs them without
touching torch); mnemo never depends on them. A peer that is not installed is reported and
skipped. Each row times forward and forward+backward of both implementations on the same input
shape and prints the ratio ``peer time / mnemo time`` (above 1: mnemo is faster).
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch

from .ops import _time


def _fwd_bwd(module: torch.nn.Module, x: torch.Tensor, call: Callable) -> tuple[Callable, Callable]:
    xg = x.detach().clone().requires_grad_(True)

    def fwd():
        with torch.no_grad():
            call(module, x)

    def fwd_bwd():
        module.zero_grad(set_to_none=True)
        xg.grad = None
        call(module, xg).square().mean().backward()

    return fwd, fwd_bwd


def _n_params(m: torch.nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def mamba_vs_mambapy(T: int = 1024, d_model: int = 256, d_state: int = 16, batch: int = 1, repeats: int = 5):
    """Our :class:`~mnemo.layers.Mamba` vs ``mambapy.mamba.MambaBlock`` (its parallel scan)."""
    from mambapy.mamba import MambaBlock, MambaConfig

    from ..layers import Mamba

    torch.manual_seed(0)
    ours = Mamba(d_model, d_state=d_state)
    theirs = MambaBlock(MambaConfig(d_model=d_model, n_layers=1, d_state=d_state, pscan=True))
    x = torch.randn(batch, T, d_model)
    rows = {}
    for name, module, call in (
        ("mnemo", ours, lambda m, x: m(x)[0]),
        ("mambapy", theirs, lambda m, x: m(x)),
    ):
        f, fb = _fwd_bwd(module, x, call)
        rows[name] = {
            "fwd_ms": 1e3 * _time(f, repeats),
            "fwd_bwd_ms": 1e3 * _time(fb, repeats),
            "params": _n_params(module),
        }
    return {
        "name": f"Mamba layer d_model={d_model} d_state={d_state} T={T} B={batch}",
        "peer": "mambapy 1.2.0 MambaBlock (pscan=True)",
        **rows,
    }


def titans_vs_titans_pytorch(
    T: int = 1024, dim: int = 256, heads: int = 4, chunk: int = 64, batch: int = 1, repeats: int = 5
):
    """Our Titans LMM layer (:class:`~mnemo.layers.NeuralMemory`, preset ``titans``: 2-layer MLP
    memory, l2, weight decay, momentum) vs ``titans_pytorch.NeuralMemory`` with the same dims and its
    chunk-anchored mode (``batch_size = chunk_size``)."""
    from titans_pytorch import MemoryMLP
    from titans_pytorch import NeuralMemory as PeerMemory

    from ..layers import NeuralMemory

    dim_head = dim // heads
    torch.manual_seed(0)
    ours = NeuralMemory(dim, n_heads=heads, spec="titans", chunk_size=chunk)
    theirs = PeerMemory(
        dim,
        chunk_size=chunk,
        batch_size=chunk,
        heads=heads,
        dim_head=dim_head,
        model=MemoryMLP(dim_head, depth=2, expansion_factor=4.0),
    )
    x = torch.randn(batch, T, dim)
    rows = {}
    for name, module, call in (
        ("mnemo", ours, lambda m, x: m(x)[0]),
        ("titans_pytorch", theirs, lambda m, x: m(x)[0]),
    ):
        f, fb = _fwd_bwd(module, x, call)
        rows[name] = {
            "fwd_ms": 1e3 * _time(f, repeats),
            "fwd_bwd_ms": 1e3 * _time(fb, repeats),
            "params": _n_params(module),
        }
    return {
        "name": f"Titans LMM dim={dim} heads={heads} chunk={chunk} 2-layer MLP memory T={T} B={batch}",
        "peer": "titans-pytorch 0.5.5 NeuralMemory (batch_size = chunk_size)",
        **rows,
    }


PEERS: dict[str, Callable[..., dict]] = {"mamba": mamba_vs_mambapy, "titans": titans_vs_titans_pytorch}


def main(args) -> int:
    wanted = args.ops.split(",") if args.ops else list(PEERS)
    unknown = set(wanted) - set(PEERS)
    if unknown:
        raise ValueError(f"unknown peer comparison(s) {sorted(unknown)}; choose from {sorted(PEERS)}")
    print(f"mnemo bench --suite peers: {torch.get_num_threads()} threads, medians of {args.repeats} runs")
    print("ratio = peer time / mnemo time (above 1: mnemo is faster)\n")
    results = []
    for key in wanted:
        try:
            r = PEERS[key](repeats=args.repeats)
        except ImportError as e:
            print(f"{key}: skipped, peer not installed ({e.name}); run ../shared/bench/install-peers")
            continue
        results.append(r)
        m, p = r["mnemo"], r[next(k for k in r if k not in ("name", "peer", "mnemo"))]
        print(r["name"], "vs", r["peer"])
        print(f"  {'':<10}{'fwd ms':>10}{'fwd+bwd ms':>12}{'params':>10}")
        for label, row in (("mnemo", m), ("peer", p)):
            print(f"  {label:<10}{row['fwd_ms']:>10.1f}{row['fwd_bwd_ms']:>12.1f}{row['params']:>10,}")
        print(f"  ratio     {p['fwd_ms'] / m['fwd_ms']:>10.2f}{p['fwd_bwd_ms'] / m['fwd_bwd_ms']:>12.2f}\n")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)
        print(f"wrote {args.json}")
    return 0
