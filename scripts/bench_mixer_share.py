"""How much of a training step is the sequence mixer's core, and what that allows against a peer.

    python scripts/bench_mixer_share.py                 # T=1024, B=8, 3 interleaved rounds
    python scripts/bench_mixer_share.py --shape 4096x2 --rounds 3
    python scripts/bench_mixer_share.py --tune-malloc   # as under the `mnemo` command

For the two rows of ``mnemo bench --suite models`` with a ``transformers`` peer whose training ratio
is below the issue's 3x target (``mamba2`` vs ``Mamba2ForCausalLM``, ``qwen3_next_equiv`` vs
``Qwen3NextForCausalLM``), this times, interleaved in one process, at the suite's shared size
(6 layers, d_model 256, vocab 256):

- ``full``: mnemo's training step (forward, loss, backward, AdamW), as the suite times it;
- ``rest``: the same step with the mixer's core op (``ssd_chunk`` for Mamba-2, the chunked gated
  delta rule for the Gated DeltaNet layers) replaced by a stand-in that costs a few elementwise
  ops but keeps every input in the autograd graph (so every projection's backward still runs).
  What remains -- embeddings, projections, short convolutions, norms, gates, MLPs, softmax
  attention, the head, the loss, the optimizer -- is mostly the same layers as the peer's, run
  with the same PyTorch kernels (mnemo's own short convolution and gated norms included);
- ``peer``: the ``transformers`` model with the same weights.

It prints the core's share of mnemo's step and ``peer / rest``: the largest training ratio mnemo
could reach against the peer if its mixer core took no time at all (Amdahl's bound).
"""

from __future__ import annotations

import argparse
import contextlib

import torch

import mnemo.layers.delta as delta_layer
import mnemo.layers.ssm as ssm_layer
from mnemo.argtypes import positive_int  # (a count or size of 0 or less is refused by name)
from mnemo.bench.model_peers import peer_transformers_mamba2, peer_transformers_qwen3_next
from mnemo.bench.models import (
    Size,
    _median,
    interleaved,
    mnemo_entry,
    parse_shapes,
    train_step,
)


def _free_gated_delta_rule(q, k, v, g, beta, initial_state=None, output_final_state=True, **_):
    """A stand-in for ``gated_delta_rule``: ``o = beta * v`` plus zero-weighted uses of q, k, g."""
    keep = (q * k).sum(-1, keepdim=True) + g[..., None]
    o = v * beta[..., None] + 0.0 * keep
    B, _, H, K = k.shape
    S = torch.zeros(B, H, K, v.shape[-1], dtype=v.dtype, device=v.device)
    return o, S


def _free_ssd_chunk(Cg, Bg, v, g, initial_state, chunk_size):
    """A stand-in for ``run_ssd_chunk``: ``o = v`` plus zero-weighted uses of C, B and g."""
    keep = (Cg * Bg).sum((-1, -2))[..., None, None] + g[..., None]
    o = v + 0.0 * keep
    B, _, H, P = v.shape
    return o, torch.zeros(B, H, Cg.shape[-1], P, dtype=v.dtype, device=v.device)


def _free_ssd(x, dt, A, B, C, initial_state=None, output_final_state=False, chunk_size=None, **_):
    """A stand-in for ``mnemo.ops.ssd`` (the Mamba-2 layer's call when no hook replaced ``g``): the
    same inputs :func:`_free_ssd_chunk` gets from the layer's other path."""
    return _free_ssd_chunk(C, B, x * dt[..., None], dt * A, initial_state, chunk_size)


@contextlib.contextmanager
def _mixer_core_free():
    saved = delta_layer.gated_delta_rule, ssm_layer.run_ssd_chunk, ssm_layer.ssd
    delta_layer.gated_delta_rule, ssm_layer.run_ssd_chunk = _free_gated_delta_rule, _free_ssd_chunk
    ssm_layer.ssd = _free_ssd
    try:
        yield
    finally:
        delta_layer.gated_delta_rule, ssm_layer.run_ssd_chunk, ssm_layer.ssd = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="1024x8", help="TxB of the training batch (default 1024x8)")
    ap.add_argument("--rounds", type=positive_int, default=3, help="interleaved timed rounds (default 3)")
    ap.add_argument(
        "--tune-malloc",
        action="store_true",
        help="call mnemo.runtime.tune_malloc() first, as the `mnemo` command does (for every row)",
    )
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds: expected at least 1, got {args.rounds}")
    if args.tune_malloc:
        from mnemo.runtime import tune_malloc

        tune_malloc()
    try:
        shapes = parse_shapes(args.shape)
    except ValueError as e:
        ap.error(str(e).replace("--model-shapes", "--shape"))
    if len(shapes) != 1:
        ap.error(f"--shape: expected one TxB such as 1024x8, got {args.shape!r}")
    ((T, B),) = shapes
    size = Size(d_model=256, n_layers=6)
    ours_m2 = mnemo_entry("mamba2", size=size)
    peer_m2 = peer_transformers_mamba2(size, lambda row: ours_m2)[0]
    ours_q3, peer_q3 = peer_transformers_qwen3_next(size, None)
    pairs = {"mamba2": (ours_m2, peer_m2), "qwen3_next_equiv": (ours_q3, peer_q3)}

    tasks = {}
    for name, (ours, peer) in pairs.items():
        full = train_step(ours, T, B)

        def rest(step=full):
            with _mixer_core_free():
                step()

        tasks[(name, "full")] = full
        tasks[(name, "rest")] = rest
        tasks[(name, "peer")] = train_step(peer, T, B)
    print(
        f"training step at T={T} B={B}, {size.n_layers} layers, d_model {size.d_model}, "
        f"{torch.get_num_threads()} threads, {args.rounds} interleaved rounds (medians), "
        f"malloc {'tuned' if args.tune_malloc else 'default'} ...",
        flush=True,
    )
    times = interleaved(tasks, repeats=args.rounds)
    med = {k: _median(v) * 1e3 for k, v in times.items()}
    head = f"{'mnemo row':<18}{'full ms':>10}{'rest ms':>10}{'core share':>12}{'peer ms':>10}"
    print(head + f"{'peer/full':>11}{'peer/rest (bound)':>19}")
    for name in pairs:
        f, r, p = med[(name, "full")], med[(name, "rest")], med[(name, "peer")]
        print(f"{name:<18}{f:>10.1f}{r:>10.1f}{(f - r) / f:>12.1%}{p:>10.1f}{p / f:>11.2f}{p / r:>19.2f}")
    print("rest: the step with the mixer core replaced by a near-free stand-in; peer/rest: the largest")
    print("training ratio against the peer that a zero-cost mixer core would give (Amdahl's bound)")


if __name__ == "__main__":
    main()
