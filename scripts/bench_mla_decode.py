"""One-token decoding of multi-head latent attention against softmax attention, after a prefill.

    python scripts/bench_mla_decode.py [--d-model 512] [--n-heads 8] [--contexts 1024,8192]
                                       [--rounds 5] [--steps 20] [--threads 1]

Per context length ``S``: the median time of one decode step (``T = 1`` from the state of an
``S``-token prefill) of :class:`~mnemo.layers.MultiHeadLatentAttention` (default options: ``d_c =
4 d_h``, ``d_h^R = d_h / 2``) and of :class:`~mnemo.layers.Attention` with the same ``d_model`` and
heads, timed interleaved in ``--rounds`` rounds of ``--steps`` steps each (the CPU's speed drifts:
compare the ratio, not the times across runs), and each layer's cache in bytes
(``state_size_bytes``). Float32, batch 1, no gradients.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mnemo.layers import Attention, MultiHeadLatentAttention


def _step_ms(layer, state, x, steps: int) -> float:
    with torch.no_grad():
        layer(x, state)  # warm
        t = time.perf_counter()
        for _ in range(steps):
            layer(x, state)
        return (time.perf_counter() - t) / steps * 1e3


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--n-heads", type=int, default=8)
    ap.add_argument("--contexts", default="1024,8192", help="comma-separated prefill lengths")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    layers = {
        "mla": MultiHeadLatentAttention(args.d_model, n_heads=args.n_heads).eval(),
        "attention": Attention(args.d_model, n_heads=args.n_heads).eval(),
    }
    m = layers["mla"]
    print(
        f"d_model {args.d_model}, {args.n_heads} heads, mla d_c {m.kv_lora_rank} d_h^R {m.qk_rope_head_dim}, "
        f"{args.threads} thread(s), medians of {args.rounds} interleaved rounds of {args.steps} steps"
    )
    print(f"{'S':>7} {'mla ms':>8} {'attn ms':>8} {'attn/mla':>9} {'mla cache MB':>13} {'attn cache MB':>14}")
    for S in (int(s) for s in args.contexts.split(",")):
        prompt = torch.randn(1, S, args.d_model)
        x = torch.randn(1, 1, args.d_model)
        states = {}
        with torch.no_grad():
            for name, layer in layers.items():
                states[name] = layer(prompt)[1]
        times = {name: [] for name in layers}
        for _ in range(args.rounds):
            for name, layer in layers.items():
                times[name].append(_step_ms(layer, states[name], x, args.steps))
        t_mla, t_att = (statistics.median(times[n]) for n in ("mla", "attention"))
        mb = {n: layers[n].state_size_bytes(1, S) / 1e6 for n in layers}
        print(
            f"{S:>7} {t_mla:>8.2f} {t_att:>8.2f} {t_att / t_mla:>9.2f} "
            f"{mb['mla']:>13.1f} {mb['attention']:>14.1f}"
        )


if __name__ == "__main__":
    main()
