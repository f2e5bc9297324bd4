"""Review 5 (distributed and run-state training): context parallelism relays a meta-learned nested
CMS (whose state's size depends on the position in the period) equal to one process; FSDP2's
discard of a failed step's unsynchronised gradients works for real and fails loudly where torch's
private fields it uses are missing."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
from torch import nn

from mnemo.train import TrainConfig, Trainer
from tests.helpers import free_port, join_as_torchrun, spawn

RTOL = 1e-5
STEPS = 3
#: slices of 6 tokens: rank 1 starts mid-period of the slower level (6 mod 4 = 2 kept inputs)
NESTED = {"levels": [{"period": 2}, {"period": 4}], "transfer": "nested"}
METAS = ["unrolled", "first_order"]


def _nested_cfg(meta: str, **kw) -> TrainConfig:
    base = dict(
        model="gated_deltanet",
        model_overrides={
            "d_model": 16,
            "n_layers": 1,
            "mlp": "cms",
            "mlp_options": {**NESTED, "meta": meta},
        },
        seq_len=12,
        batch_size=2,
        steps=STEPS,
        warmup_steps=1,
        sample_tokens=0,
        context_parallel=True,
    )
    base.update(kw)
    return TrainConfig(**base)


def _fsdp_cfg(**kw) -> TrainConfig:
    base = dict(
        model="gated_deltanet",
        model_overrides={"d_model": 16, "n_layers": 1},
        seq_len=8,
        batch_size=4,
        grad_accum=2,
        steps=2,
        warmup_steps=1,
        sample_tokens=0,
        fsdp=True,
    )
    base.update(kw)
    return TrainConfig(**base)


class _Interrupt(Exception):
    pass


def _interrupt_second_micro_batch(tr: Trainer) -> None:
    """Raise entering micro-batch 1 of the next step (micro-batch 0's backward ran without sync)."""
    original = tr.strategy.micro_batch

    def micro_batch(i, n):
        if i == 1:
            tr.strategy.micro_batch = original
            raise _Interrupt
        return original(i, n)

    tr.strategy.micro_batch = micro_batch


def _weights(model) -> dict:
    out = {}
    for n, p in model.state_dict().items():
        out[n] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
    return out


def _worker(rank, world, port, out):
    join_as_torchrun(rank, world, port)
    from mnemo.train.distributed import cleanup

    out = Path(out)
    try:
        for meta in METAS:
            tr = Trainer(_nested_cfg(meta), out / meta, progress=False)
            losses = [tr.train_step() for _ in range(STEPS)]
            torch.save({"losses": losses, "weights": _weights(tr.model)}, out / f"{meta}-rank{rank}.pt")
        # FSDP2: a step interrupted after micro-batch 0's unsynchronised backward, then one whole step
        tr = Trainer(_fsdp_cfg(), out / "fsdp", progress=False)
        _interrupt_second_micro_batch(tr)
        with pytest.raises(_Interrupt):
            tr.train_step()
        loss = tr.train_step()
        torch.save({"loss": loss, "weights": _weights(tr.model)}, out / f"fsdp-rank{rank}.pt")
    finally:
        cleanup()


@pytest.fixture(scope="module")
def spawned(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("review5")
    spawn(_worker, (2, free_port(), str(out)), 2, timeout_s=240, start_method="forkserver")
    return out


@pytest.mark.parametrize("meta", METAS)
def test_context_parallel_relays_a_meta_learned_nested_cms(spawned, meta, tmp_path):
    """A meta-learned nested CMS keeps each slower level's period inputs, ``[B, position mod period,
    2d + 1]``: the relay sized the received state from a one-token dry run (``[B, 1, 2d + 1]``), so
    rank 1 failed ("expected ... shape [2, 2, 33] ... got [2, 1, 33]") and rank 0 hung up. The
    state's sizes now travel with it; losses and weights equal one process's."""
    tr = Trainer(_nested_cfg(meta, context_parallel=False), tmp_path, progress=False)
    want = [tr.train_step() for _ in range(STEPS)]
    ref = _weights(tr.model)
    for rank in range(2):
        got = torch.load(spawned / f"{meta}-rank{rank}.pt")
        assert got["losses"] == pytest.approx(want, rel=RTOL)
        for n, w in ref.items():
            torch.testing.assert_close(got["weights"][n], w, rtol=RTOL, atol=RTOL, msg=f"weights {n}")


def test_fsdp_step_after_an_interrupted_accumulation_equals_one_clean_step(spawned, tmp_path):
    """Micro-batch 0 of the interrupted step left its unsynchronised gradient on FSDP2's unsharded
    parameters; dropped by ``discard_gradients``, the next step equals a single process's first."""
    tr = Trainer(_fsdp_cfg(fsdp=False), tmp_path, progress=False)
    want = tr.train_step()
    ref = _weights(tr.model)
    for rank in range(2):
        got = torch.load(spawned / f"fsdp-rank{rank}.pt")
        assert got["loss"] == pytest.approx(want, rel=RTOL)
        for n, w in ref.items():
            torch.testing.assert_close(got["weights"][n], w, rtol=RTOL, atol=RTOL, msg=f"weights {n}")


# ------------------------------------------------------------------------------------------------
# FSDP2's private fields: present in this torch, detected when missing
# ------------------------------------------------------------------------------------------------


def _fake_fsdp(state) -> nn.Module:
    """An ``nn.Linear`` turned into an ``FSDPModule`` as ``fully_shard`` does (class swap), whose
    FSDP state is ``state``."""
    from torch.distributed.fsdp import FSDPModule

    m = nn.Linear(2, 2)
    m.__class__ = type("FSDPLinear", (FSDPModule, nn.Linear), {"_get_fsdp_state": lambda self: state})
    return m


def _sharded():
    from mnemo.train.strategy import Sharded

    return Sharded.__new__(Sharded)


def test_fsdp_private_fields_exist_in_this_torch():
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    assert hasattr(FSDPModule, "_get_fsdp_state")
    assert "_fsdp_param_groups" in FSDPState().__dict__
    assert "unsharded_accumulated_grad" in FSDPParam.__annotations__
    assert "fsdp_params" in FSDPParamGroup.__init__.__code__.co_names


def test_fsdp_discard_clears_the_unsynchronised_gradients():
    param = types.SimpleNamespace(
        unsharded_accumulated_grad=torch.ones(2),
        _unsharded_param=types.SimpleNamespace(grad=torch.ones(2)),
    )
    state = types.SimpleNamespace(_fsdp_param_groups=[types.SimpleNamespace(fsdp_params=[param])])
    _sharded().discard_gradients(nn.Sequential(_fake_fsdp(state)))
    assert param.unsharded_accumulated_grad is None and param._unsharded_param.grad is None


@pytest.mark.parametrize(
    "state, field",
    [
        (types.SimpleNamespace(), "FSDPState._fsdp_param_groups"),
        (types.SimpleNamespace(_fsdp_param_groups=[types.SimpleNamespace()]), "FSDPParamGroup.fsdp_params"),
        (
            types.SimpleNamespace(
                _fsdp_param_groups=[types.SimpleNamespace(fsdp_params=[types.SimpleNamespace()])]
            ),
            "FSDPParam.unsharded_accumulated_grad",
        ),
    ],
)
def test_fsdp_discard_fails_loudly_where_torch_changed_a_private_field(state, field):
    """Before: every missing field was skipped with ``getattr(..., None)`` or set as a new attribute,
    so a torch release that renamed one kept the failed step's gradients for the next step
    silently."""
    with pytest.raises(RuntimeError, match=rf"Sharded.discard_gradients: torch .* no {field}"):
        _sharded().discard_gradients(nn.Sequential(_fake_fsdp(state)))
