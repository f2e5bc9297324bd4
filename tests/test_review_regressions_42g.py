"""Regressions of ad8db2d (a checkpointed block recomputes on the backend its forward chose) and
a0803d5 (a run checkpointed before the TTT memory's inner-norm scale and shift resumes)."""

from __future__ import annotations

import warnings

import pytest
import torch

from mnemo import ops
from mnemo.models import LanguageModel, ModelConfig, build_config
from mnemo.ops import _native, dispatch


def test_context_parallel_recompute_runs_on_the_forwards_backend(monkeypatch):
    """ad8db2d gave the model's own checkpoint calls a ``context_fn`` re-entering the forward's
    backend, but not the sibling calls of :func:`context_parallel_forward` (its relay and ring
    blocks): a CP run forced to ``torch`` recomputed on ``auto`` (native on a CPU) in the backward.
    Shown with one rank (no process group: a recurrent model only relays to nobody)."""
    from mnemo.train.distributed import context_parallel_forward

    monkeypatch.delenv("MNEMO_BACKEND", raising=False)
    torch.manual_seed(0)
    m = LanguageModel(ModelConfig(vocab_size=23, d_model=16, n_layers=2, mixer="gla")).train()
    ids = torch.randint(0, 23, (1, 12))
    with ops.use_backend("torch"):
        logits, handle = context_parallel_forward(m, ids, 0, 1)
    handle.backward(logits.pow(2).mean())
    ref = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    m.activation_checkpointing = True
    dispatch.reset_dispatch_log()
    with ops.use_backend("torch"):
        logits, handle = context_parallel_forward(m, ids, 0, 1)
    handle.backward(logits.pow(2).mean())  # outside the block: the recompute must stay on torch
    # 2 blocks x (a one-token dry run + the forward) + 2 recomputes, all forced torch
    assert dispatch.dispatch_log() == {("gated_linear_attention", "torch", "forced"): 6}
    for p, r in zip(m.parameters(), ref):
        torch.testing.assert_close(p.grad, r, rtol=1e-6, atol=1e-7)
    assert dispatch.current_backend() == "auto" and _native._suppressed.depth == 0


def _ttt(**options):
    opts = {"neural_memory": {"n_heads": 2, "spec": "ttt_linear", "chunk_size": 4, **options}}
    return LanguageModel(build_config("ttt_linear", vocab_size=12, d_model=8, n_layers=1, mixer_options=opts))


@pytest.mark.parametrize("manifest", [True, False])
def test_a_sharded_ttt_checkpoint_from_before_the_inner_norm_affine_names_the_option(tmp_path, manifest):
    """a0803d5 let a single-file run from before γ, β resume (fresh optimizer state, a warning
    naming ``inner_norm_affine: false``); its DCP twin still failed with DCP's bare "Missing key
    ... inner_norm_weight" (without a manifest even called the checkpoint damaged). Now the
    message names the option to set, and it is a misfit (RuntimeError), not damage."""
    import torch.distributed.checkpoint as dcp

    from mnemo.train.checkpoint import CorruptCheckpointError, write_manifest
    from mnemo.train.sharded import SHARDED_DIR, load_sharded

    ckpt = tmp_path / "ckpt-000001"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (no process group: intended)
        dcp.save({"model": _ttt(inner_norm_affine=False).state_dict()}, checkpoint_id=str(ckpt / SHARDED_DIR))
    if manifest:
        write_manifest(ckpt)
    with pytest.raises(RuntimeError, match=r"inner_norm_weight.*inner_norm_affine: false") as info:
        load_sharded(ckpt, _ttt())
    assert not isinstance(info.value, CorruptCheckpointError)
    load_sharded(ckpt, _ttt(inner_norm_affine=False))  # the option named loads it
