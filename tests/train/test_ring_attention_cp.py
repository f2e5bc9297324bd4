"""Two gloo processes: context parallelism with ring attention equals one process (logits, loss and
every parameter gradient, float64) for a transformer with grouped-query heads and a sliding window,
and for hybrids whose recurrent layers relay their states while the attention layers run the ring
(attention first and last, learned positions, activation checkpointing)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mnemo.models import LanguageModel, build_config
from tests.helpers import free_port, spawn

WORLD, T = 2, 12
MODELS = {
    # GQA (4 query heads over 2 key/value heads) and a window of 5 < T / 2
    "gqa_window": dict(mixer_options={"attention": {"n_heads": 4, "n_kv_heads": 2, "window": 5}}),
    "hybrid": dict(layers=["gla", "attention", "gated_deltanet"], n_layers=3),
    "hybrid_learned_ckpt": dict(layers=["attention", "mamba"], pos_embedding="learned", max_position=16),
}


def _model(key):
    torch.manual_seed(0)
    kw = dict(vocab_size=32, d_model=16, n_layers=2)
    kw.update(MODELS[key])
    model = LanguageModel(build_config("transformer", **kw)).double()
    model.activation_checkpointing = key.endswith("ckpt")
    return model


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 32, (2, T), generator=g), torch.randint(0, 32, (2, T), generator=g)


def _worker(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from mnemo.train.distributed import context_parallel_forward

        torch.set_num_threads(1)
        x, y = _data()
        n = T // world
        for key in MODELS:
            model = _model(key).train()
            logits, handle = context_parallel_forward(model, x, rank, world)
            loss = F.cross_entropy(
                logits.flatten(0, 1), y[:, rank * n : (rank + 1) * n].flatten(), reduction="sum"
            )
            handle.backward(loss)
            grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
            torch.save(
                {"logits": logits.detach(), "loss": loss.item(), "grads": grads}, f"{out}/{key}-{rank}.pt"
            )
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    out = tmp_path_factory.mktemp("ring")
    spawn(_worker, (WORLD, free_port(), str(out)), WORLD, start_method="forkserver")
    return out


@pytest.mark.parametrize("key", list(MODELS))
def test_two_processes_equal_one(spawned, key):
    parts = [torch.load(spawned / f"{key}-{r}.pt") for r in range(WORLD)]
    model = _model(key).train()
    x, y = _data()
    logits, _ = model(x)
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
    loss.backward()
    got = torch.cat([p["logits"] for p in parts], 1)
    torch.testing.assert_close(got, logits.detach(), rtol=1e-10, atol=1e-10)
    assert sum(p["loss"] for p in parts) == pytest.approx(loss.item(), rel=1e-12)
    worst = 0.0
    for name, p in model.named_parameters():
        assert any(name in part["grads"] for part in parts), f"no rank computed a gradient of {name}"
        g = sum(part["grads"].get(name, torch.zeros_like(p)) for part in parts)
        torch.testing.assert_close(g, p.grad, rtol=1e-9, atol=1e-11, msg=f"gradient of {name}")
        worst = max(worst, (g - p.grad).abs().max().item())
    print(f"{key}: max |logits diff| {(got - logits).abs().max().item():.1e}, max |grad diff| {worst:.1e}")
