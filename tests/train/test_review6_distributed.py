"""Review 6 (distributed and run-state training): a checkpoint manifest naming files outside its
folder is refused, never read; an MoE model's load-balancing loss is the documented mean of per-slice
values (micro-batches, context-parallel slices), checked by hand; rotation and stale-temporary
cleanup never reach through a symbolic link into its target."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from mnemo.models import LanguageModel, ModelConfig
from mnemo.train.aux_losses import MoEBalance
from mnemo.train.checkpoint import (
    CorruptCheckpointError,
    clean_stale_temporaries,
    resolve_checkpoint,
    run_checkpoints,
    save_checkpoint,
    verify_checkpoint,
    write_manifest,
)


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "inner_dotdot"])
def test_a_manifest_naming_files_outside_the_checkpoint_is_refused(tmp_path, kind):
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"not the checkpoint's")
    run = tmp_path / "run"
    ck = run / "ckpt-000001"
    ck.mkdir(parents=True)
    (ck / "config.json").write_text("{}")
    (ck / "sharded").mkdir()
    name = {
        "dotdot": "../../secret.txt",
        "absolute": str(secret),
        "inner_dotdot": "sharded/../../../secret.txt",
    }[kind]
    files = {
        "config.json": {"bytes": 2, "sha256": _sha(b"{}")},
        name: {"bytes": secret.stat().st_size, "sha256": _sha(secret.read_bytes())},
    }
    (ck / "manifest.json").write_text(json.dumps({"format": 1, "files": files}))
    problems = verify_checkpoint(ck)
    assert len(problems) == 1 and "'files' entry" in problems[0] and repr(name) in problems[0], problems
    with pytest.raises(CorruptCheckpointError, match="not a relative path inside the checkpoint"):
        resolve_checkpoint(ck)


def _hand_aux(router_w, h, E, k):
    """``E · Σ_e f_e · P_e`` of tokens ``h [N, d]`` from the router weight, by hand (float64)."""
    s = torch.softmax(h @ router_w.T, dim=-1)
    idx = s.topk(k, dim=-1).indices
    f = torch.stack([(idx == e).sum() for e in range(E)]).double() / (h.shape[0] * k)
    return float(E * (f * s.mean(0)).sum())


@pytest.mark.parametrize("split", ["grad_accum", "context_parallel"])
def test_moe_balance_is_the_mean_of_per_slice_losses_as_documented(split):
    """The documented choice (MoEBalance): per micro-batch (or rank slice) ``E Σ f P``, averaged
    over the step's slices; measurably not the pooled batch's value."""
    torch.manual_seed(0)
    E, k, coef = 4, 2, 0.01
    model = LanguageModel(
        ModelConfig(
            vocab_size=32,
            d_model=16,
            n_layers=1,
            mixer="gla",
            mlp="moe",
            mlp_options={"n_experts": E, "top_k": k, "aux_loss_coef": coef},
        )
    ).double()
    moe = model.moe_layers()[0][1]
    with torch.no_grad():
        moe.router.weight.normal_(0, 1.0)
    seen = []
    moe.register_forward_pre_hook(lambda mod, a: seen.append(a[0].detach().reshape(-1, 16)))
    ids = torch.randint(0, 32, (4, 6))
    if split == "grad_accum":
        slices, bal = [ids[:2], ids[2:]], MoEBalance(grad_accum=2, world=1, context_parallel=False)
    else:  # each rank's forward of its half of T (a mixer without state across the cut: the
        # router's inputs are what the rank sees); gradients are summed over ranks
        slices, bal = [ids[:, :3], ids[:, 3:]], MoEBalance(grad_accum=1, world=2, context_parallel=True)
    terms = []
    for x in slices:
        model(x)
        terms.append(float(bal.collect(model)))
    w = moe.router.weight.detach()
    per_slice = [_hand_aux(w, h, E, k) for h in seen]
    assert sum(terms) == pytest.approx(coef * sum(per_slice) / 2, rel=1e-12)
    pooled = _hand_aux(w, torch.cat(seen), E, k)
    assert abs(sum(per_slice) / 2 - pooled) > 1e-3  # the choice is visible: not the pooled loss


def test_rotation_never_reaches_through_a_linked_checkpoint_into_its_target(tmp_path):
    """A ``ckpt-NNNNNN`` that is a symbolic link to a folder elsewhere (made by hand) is not one of
    the run's checkpoints: rotation neither moves the target's files out nor leaves a stale link,
    and a stale ``.old-ckpt-*`` link is removed itself, its target untouched."""
    ext = tmp_path / "elsewhere" / "ckpt-000001"
    ext.mkdir(parents=True)
    (ext / "config.json").write_text("{}")
    write_manifest(ext)
    (ext / "notes.txt").write_text("mine")
    before = sorted(p.name for p in ext.iterdir())
    run = tmp_path / "run"
    run.mkdir()
    (run / "ckpt-000001").symlink_to(ext)
    (run / ".old-ckpt-000000-1").symlink_to(ext)  # as a crash during a cleanup would leave it

    def write(d):
        (Path(d) / "config.json").write_text("{}")

    for step in (2, 3, 4):
        save_checkpoint(run, step, write, keep=2)
    assert sorted(p.name for p in ext.iterdir()) == before
    assert not (run / "kept").exists()
    assert not list(run.glob(".old-ckpt-*"))
    assert [p.name for p in run_checkpoints(run)] == ["ckpt-000003", "ckpt-000004"]
    (run / ".tmp-ckpt-000009-1").symlink_to(ext)  # a killed write's name, as a link
    assert clean_stale_temporaries(run) == [".tmp-ckpt-000009-1"]
    assert not (run / ".tmp-ckpt-000009-1").is_symlink()
    assert sorted(p.name for p in ext.iterdir()) == before
