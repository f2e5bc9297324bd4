"""``mnemo bench --suite peers``: our layers next to the PyPI peers, timed in one process.

The peers are benchmark-only comparators (``../shared/bench/install-peers`` installs them without
touching torch); mnemo never depends on them. A peer that is not installed is reported and
skipped. Each row times forward and forward+backward of both implementations on the same input
shape and prints the ratio ``peer time / mnemo time`` (above 1: mnemo is faster).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import write_json
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


def hope_vs_nested_learning(T: int = 1024, dim: int = 256, chunk: int = 64, batch: int = 1, repeats: int = 5):
    """Forward only (no grad): our HOPE block mixer+CMS (self-modifying Titans with chunk ``chunk``
    for both the main and the projection memories,
    3-level CMS 16/64/256) and our self-modifying Titans alone, vs ``nested_learning``'s
    ``SelfModifyingTitans.forward_with_updates`` (its in-context pass; ``forward`` alone applies no
    updates) with the same ``dim`` and chunk sizes."""
    from nested_learning.titan.self_modifying import SelfModifyingTitans as PeerSMT
    from nested_learning.titan.self_modifying import SelfModifyingTitansConfig

    from ..layers import ContinuumMemory, Level, SelfModifyingTitans

    torch.manual_seed(0)
    smt = SelfModifyingTitans(dim, n_heads=4, chunk_size=chunk, proj_chunk_size=chunk)
    cms = ContinuumMemory(dim, [Level(16), Level(64), Level(256)])
    peer = PeerSMT(SelfModifyingTitansConfig(dim=dim, chunk_size_other=chunk, chunk_size_memory=chunk))
    x = torch.randn(batch, T, dim)

    def hope(x):
        y, _ = smt(x)
        h = x + y
        return h + cms(h)[0]

    rows = {}
    with torch.no_grad():

        def peer_fn(x):  # the in-context (self-modifying) pass; plain forward() does no updates
            return peer.forward_with_updates(
                x, peer.init_fast_state(), chunk_size_other=chunk, chunk_size_memory=chunk
            )[0]

        for name, fn in (
            ("mnemo", hope),
            ("mnemo_self_modifying_titans", lambda x: smt(x)[0]),
            ("nested_learning", peer_fn),
        ):
            ms = 1e3 * _time(lambda fn=fn: fn(x), repeats)
            rows[name] = {"fwd_ms": ms, "fwd_bwd_ms": float("nan"), "params": None}
    rows["mnemo"]["params"] = _n_params(smt) + _n_params(cms)
    rows["mnemo_self_modifying_titans"]["params"] = _n_params(smt)
    rows["nested_learning"]["params"] = _n_params(peer)
    return {
        "name": f"HOPE forward (no grad) dim={dim} chunk={chunk} T={T} B={batch}",
        "peer": "nested-learning 0.2.0 SelfModifyingTitans",
        "peer_key": "nested_learning",
        **rows,
    }


def _load_fla_naive(op: str):
    """fla-core's pure-PyTorch reference module ``fla/ops/<op>/naive.py``, loaded by path (``import
    fla.ops`` needs triton)."""
    import importlib.util
    import pathlib

    import fla

    path = pathlib.Path(fla.__file__).parent / "ops" / op / "naive.py"
    spec = importlib.util.spec_from_file_location(f"_fla_naive_{op}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _time_fn_pair(ours, theirs, make, repeats):
    rows = {}
    for name, fn in (("mnemo", ours), ("fla_naive", theirs)):
        x = {n: t.detach().clone().requires_grad_(True) for n, t in make().items()}

        def fwd(fn=fn, x=x):
            with torch.no_grad():
                fn(**x)

        def fwd_bwd(fn=fn, x=x):
            for t in x.values():
                t.grad = None
            fn(**x).sum().backward()

        rows[name] = {
            "fwd_ms": 1e3 * _time(fwd, repeats),
            "fwd_bwd_ms": 1e3 * _time(fwd_bwd, repeats),
            "params": 0,
        }
    return rows


def _fla_delta(T: int, heads: int, dim: int, repeats: int, per_channel: bool) -> dict:
    """Our chunked ``gated_delta_rule`` vs fla-core's naive chunk form: one decay per head
    (``naive_chunk_gated_delta_rule``) or per key channel (Kimi Delta Attention, ``naive_chunk_kda``)."""
    import torch.nn.functional as F

    from ..ops import gated_delta_rule

    op, what = ("kda", "per-channel g (KDA) ") if per_channel else ("gated_delta_rule", "")
    naive = getattr(_load_fla_naive(op), f"naive_chunk_{op}")
    gen = torch.Generator().manual_seed(0)

    def make():
        return {
            "q": torch.randn(1, T, heads, dim, generator=gen),
            "k": F.normalize(torch.randn(1, T, heads, dim, generator=gen), dim=-1),
            "v": torch.randn(1, T, heads, dim, generator=gen),
            "g": F.logsigmoid(torch.randn(1, T, heads, *((dim,) if per_channel else ()), generator=gen) + 3),
            "beta": torch.rand(1, T, heads, generator=gen),
        }

    rows = _time_fn_pair(
        lambda q, k, v, g, beta: gated_delta_rule(q, k, v, g, beta)[0],
        lambda q, k, v, g, beta: naive(q, k, v, g, beta, chunk_size=64)[0],
        make,
        repeats,
    )
    return {
        "name": f"gated_delta_rule {what}chunk, B=1 T={T} H={heads} D={dim}",
        "peer": f"fla-core 0.6.0 naive_chunk_{op} (chunk 64)",
        "peer_key": "fla_naive",
        **rows,
    }


def fla_gated_delta_rule(T: int = 4096, heads: int = 4, dim: int = 64, repeats: int = 3):
    """Our chunked ``gated_delta_rule`` vs fla-core's ``naive_chunk_gated_delta_rule``."""
    return _fla_delta(T, heads, dim, repeats, per_channel=False)


def fla_kda(T: int = 4096, heads: int = 4, dim: int = 64, repeats: int = 3):
    """Our chunked ``gated_delta_rule`` with a per-channel decay (Kimi Delta Attention) vs fla-core's
    ``naive_chunk_kda``."""
    return _fla_delta(T, heads, dim, repeats, per_channel=True)


def fla_simple_gla(T: int = 4096, heads: int = 4, dim: int = 64, repeats: int = 3):
    """Our chunked ``gated_linear_attention`` (one decay per head) vs fla-core's
    ``naive_chunk_simple_gla``."""
    import torch.nn.functional as F

    from ..ops import gated_linear_attention

    naive = _load_fla_naive("simple_gla").naive_chunk_simple_gla
    gen = torch.Generator().manual_seed(0)

    def make():
        return {
            "q": torch.randn(1, T, heads, dim, generator=gen),
            "k": torch.randn(1, T, heads, dim, generator=gen),
            "v": torch.randn(1, T, heads, dim, generator=gen),
            "g": F.logsigmoid(torch.randn(1, T, heads, generator=gen) + 3),
        }

    rows = _time_fn_pair(
        lambda q, k, v, g: gated_linear_attention(q, k, v, g)[0],
        lambda q, k, v, g: naive(q, k, v, g, chunk_size=64)[0],
        make,
        repeats,
    )
    return {
        "name": f"gated linear attention (per-head decay) chunk, B=1 T={T} H={heads} D={dim}",
        "peer": "fla-core 0.6.0 naive_chunk_simple_gla (chunk 64)",
        "peer_key": "fla_naive",
        **rows,
    }


PEERS: dict[str, Callable[..., dict]] = {
    "fla_gated_delta_rule": fla_gated_delta_rule,
    "fla_kda": fla_kda,
    "fla_simple_gla": fla_simple_gla,
    "mamba": mamba_vs_mambapy,
    "titans": titans_vs_titans_pytorch,
    "hope": hope_vs_nested_learning,
}


def main(args) -> int:
    from ..argtypes import match_names

    wanted = match_names("--ops", args.ops, PEERS) if args.ops else list(PEERS)  # names or patterns
    print(f"mnemo bench --suite peers: {torch.get_num_threads()} threads, medians of {args.repeats} runs")
    print("ratio = peer time / this row's time (above 1: faster than the peer)\n")
    results = []
    for key in wanted:
        try:
            r = PEERS[key](repeats=args.repeats)
        except ImportError as e:
            print(f"{key}: skipped, peer not installed ({e.name}); run ../shared/bench/install-peers")
            continue
        results.append(r)
        peer_key = r.get("peer_key") or next(k for k in r if k not in ("name", "peer", "mnemo", "peer_key"))
        p = r[peer_key]
        print(r["name"], "vs", r["peer"])
        print(f"  {'':<30}{'fwd ms':>10}{'fwd+bwd ms':>12}{'params':>11}{'ratio fwd':>11}{'ratio f+b':>11}")
        for label, row in r.items():
            if not isinstance(row, dict):
                continue
            rf = p["fwd_ms"] / row["fwd_ms"]
            rb = p["fwd_bwd_ms"] / row["fwd_bwd_ms"]
            times = f"{row['fwd_ms']:>10.1f}{row['fwd_bwd_ms']:>12.1f}"
            print(f"  {label:<30}{times}{row['params']:>11,}{rf:>11.2f}{rb:>11.2f}")
        print()
    if args.json:
        write_json(args.json, results)
        print(f"wrote {args.json}")
    return 0
