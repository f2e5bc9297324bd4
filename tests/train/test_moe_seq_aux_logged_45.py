"""The trainer logs DeepSeek-V3's sequence-wise balance loss (``moe_seq_aux_loss``,
:class:`mnemo.train.aux_losses.MoEBalance`; a leftover of session 44)."""

from __future__ import annotations

import json

import pytest
import torch

from mnemo.train import TrainConfig, Trainer
from mnemo.train.aux_losses import MoEBalance


def _tiny_moe(grad_accum: int, seq_coef: float) -> TrainConfig:
    return TrainConfig(
        model="gated_deltanet_attention_moe",
        model_overrides={
            "d_model": 16,
            "n_layers": 2,
            "pattern": ["gated_deltanet", "attention"],
            "mixer_options": {"gated_deltanet": {"n_heads": 2}, "attention": {"n_heads": 2}},
            "mlp_options": {"n_experts": 4, "top_k": 2, "expert_hidden": 8, "seq_aux_loss_coef": seq_coef},
        },
        seq_len=16, batch_size=4, grad_accum=grad_accum, steps=4, eval_interval=2, eval_batches=1,
        warmup_steps=1, sample_tokens=0, seed=3,
    )  # fmt: skip


@pytest.mark.parametrize("grad_accum, seq_coef", [(2, 1e-2), (1, 0.0)])
def test_the_logged_moe_seq_aux_loss_is_the_intervals_mean_over_layers_and_micro_batches(
    tmp_path, grad_accum, seq_coef
):
    """``moe_seq_aux_loss`` (logged whatever ``seq_aux_loss_coef``, as ``moe_z_loss`` is) equals the
    mean of every MoE layer's ``last_seq_aux_loss`` over the logging interval's training micro-batches,
    captured by forward hooks (evaluation forwards, in eval mode, left out)."""
    tr = Trainer(_tiny_moe(grad_accum, seq_coef), tmp_path, progress=False, log=lambda *a: None)
    layers = [m for _, m in tr.model.moe_layers()]
    assert len(layers) == 2
    seen: list[float] = []

    def capture(module, args, output):
        if module.training:
            seen.append(module.last_seq_aux_loss.item())

    for m in layers:
        m.register_forward_hook(capture)
    want = []
    for _ in range(2):  # two logging intervals of 2 steps
        seen.clear()
        tr.fit(until=tr.step + 2)
        assert len(seen) == 2 * grad_accum * len(layers)
        want.append(sum(seen) / len(seen))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4]
    got = [r["moe_seq_aux_loss"] for r in rows]
    assert got == pytest.approx(want, rel=1e-6)
    assert all(v >= 1.0 - 1e-6 for v in got)  # 1 under uniform routing, more otherwise
    assert got[0] != pytest.approx(rows[0]["moe_aux_loss"], rel=1e-9)  # its own column, not L_aux's


def test_moe_balance_resumes_an_interval_checkpointed_before_the_seq_loss_was_logged():
    """A trainer state written before ``L_seq`` was logged (per layer ``[counts, dropped, L_aux, L_z]``,
    no ``seq_n``): the loads and the other losses go on over the whole interval, ``moe_seq_aux_loss``
    covers the steps since the resume; a state written now round-trips whole."""

    class Layer:  # the statistics MoEBalance reads of an MoE layer after its forward
        bias_balancing = False

        def __init__(self, counts, aux, z, seq):
            self.last_counts = torch.tensor(counts)
            self.last_dropped = torch.tensor(0)
            self.last_aux_loss, self.last_z_loss = torch.tensor(aux), torch.tensor(z)
            self.last_seq_aux_loss = torch.tensor(seq)

    class Model:
        def __init__(self, layer):
            self.layer = layer

        def aux_loss(self):
            return torch.tensor(0.0)

        def moe_layers(self):
            return [("blocks.0.mlp", self.layer)]

    old = {"interval": [torch.tensor([3.0, 1.0, 0.0, 2.0, 4.0], dtype=torch.float64)], "interval_n": 2}
    balance = MoEBalance(grad_accum=1, world=1, context_parallel=False)
    balance.load_state_dict(old)
    model = Model(Layer([1, 3], 1.5, 0.5, 1.25))
    balance.collect(model)
    balance.after_step(model)
    state = balance.state_dict()
    record = balance.record()
    assert record["moe_load"] == [[0.5, 0.5]]
    assert record["moe_aux_loss"] == pytest.approx((2.0 + 1.5) / 3)
    assert record["moe_z_loss"] == pytest.approx((4.0 + 0.5) / 3)
    assert record["moe_seq_aux_loss"] == pytest.approx(1.25)  # the resumed step's alone
    again = MoEBalance(grad_accum=1, world=1, context_parallel=False)
    again.load_state_dict(state)
    assert again.record() == record
