"""``ModelConfig.mlp_only_layers``: dense SwiGLU layers among the mixture-of-experts ones of a
``mlp="moe"`` model (Qwen2-MoE / Qwen3-MoE's field, DeepSeek-V3's ``first_k_dense_replace``).

Checked: the layer kinds built, the validation by name, the JSON round trip and unchanged defaults,
a hand composition of the dense block, and training (the MoE losses, metrics and balancing bias over
the MoE layers only)."""

from __future__ import annotations

import pytest
import torch

from mnemo.layers.mlp import SwiGLU
from mnemo.layers.moe import MoE
from mnemo.layers.norm import RMSNorm
from mnemo.models import LanguageModel, ModelConfig
from mnemo.train.aux_losses import MoEBalance

MOE = {"n_experts": 4, "top_k": 2, "expert_hidden": 16, "aux_loss_coef": 0.01, "z_loss_coef": 1e-3}


def config(**over) -> ModelConfig:
    base = dict(vocab_size=37, d_model=32, n_layers=4, mlp="moe", mlp_hidden=48, mlp_options=dict(MOE))
    return ModelConfig(**{**base, **over})


def ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 37, (2, 10), generator=torch.Generator().manual_seed(seed))


def test_the_listed_layers_are_dense_swiglu_of_mlp_hidden():
    lm = LanguageModel(config(mlp_only_layers=[2, 0]))
    kinds = [type(b.mlp) for b in lm.blocks]
    assert kinds == [SwiGLU, MoE, SwiGLU, MoE]
    assert lm.blocks[0].mlp.w_in.weight.shape == (2 * 48, 32)  # [gate; up] of mlp_hidden
    assert lm.blocks[1].mlp.hidden == 16  # the experts keep expert_hidden
    assert [i for i, _ in lm.moe_layers()] == [1, 3]
    with torch.device("meta"):  # (the checkpoint readers build models so)
        meta = LanguageModel(config(mlp_only_layers=[0]))
    assert {k: v.shape for k, v in meta.state_dict().items()} == {
        k: v.shape for k, v in LanguageModel(config(mlp_only_layers=[0])).state_dict().items()
    }


@pytest.mark.parametrize(
    "over, said",
    [
        (dict(mlp_only_layers=[4]), r"mlp_only_layers: expected None or a list of layer indices in 0 … 3"),
        (dict(mlp_only_layers=[-1]), r"mlp_only_layers: expected None or a list of layer indices"),
        (dict(mlp_only_layers=[True]), r"mlp_only_layers: expected None or a list of layer indices"),
        (dict(mlp_only_layers=2), r"mlp_only_layers: expected None or a list of layer indices"),
        (dict(mlp_only_layers=[1, 1]), r"mlp_only_layers: expected each layer index once, got \[1, 1\]"),
        (
            dict(mlp="swiglu", mlp_options={}, mlp_only_layers=[0]),
            r"mlp_only_layers: expected None or \[\] for mlp 'swiglu'",
        ),
    ],
)
def test_validated_by_name(over, said):
    with pytest.raises(ValueError, match="ModelConfig." + said):
        config(**over).validate()


def test_json_round_trip_and_defaults_unchanged(tmp_path):
    """Saved and loaded (tuples become lists); an old config without the field loads as ``None``;
    ``None`` and ``[]`` build the same all-MoE model as before, with bit-identical outputs; the
    ``transformers`` wrapper config carries it."""
    from mnemo.hf.modeling import MnemoConfig

    c = config(mlp_only_layers=(0, 3))
    assert c.mlp_only_layers == [0, 3]
    c.save(tmp_path / "c.json")
    assert ModelConfig.load(tmp_path / "c.json") == c
    assert MnemoConfig.from_model_config(c).to_model_config() == c
    old = {k: v for k, v in config().to_dict().items() if k != "mlp_only_layers"}
    assert ModelConfig.from_dict(old).mlp_only_layers is None
    assert config(mlp_only_layers=[]) == config()  # one spelling of "every layer MoE" (review 49g)
    outs = []
    for only in (None, []):
        torch.manual_seed(0)
        lm = LanguageModel(config(mlp_only_layers=only)).eval()
        with torch.no_grad():
            outs.append(lm(ids())[0])
    assert torch.equal(outs[0], outs[1])


def test_the_dense_block_is_a_swiglu_built_alone():
    """Block 0 of a model with ``mlp_only_layers=[0]`` is ``x + mixer(norm(x))`` then ``x +
    SwiGLU(norm(x))`` with a :class:`SwiGLU` built alone and given the same weights."""
    torch.manual_seed(1)
    lm = LanguageModel(config(mlp_only_layers=[0])).double().eval()
    block = lm.blocks[0]
    alone = SwiGLU(32, 48).double()
    alone.load_state_dict(block.mlp.state_dict())
    norm = RMSNorm(32, lm.config.norm_eps).double()
    norm.load_state_dict(block.mlp_norm.state_dict())
    x = torch.randn(2, 10, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got, _ = block(x)
        mixed = x + block.mixer(block.mixer_norm(x))[0]
        want = mixed + alone(norm(mixed))
    assert (got - want).abs().max().item() <= 1e-12


def test_training_counts_the_moe_layers_only():
    """A training step: every parameter gets a gradient (the dense MLP's from the task alone); the
    auxiliary loss is the sum of the MoE layers' losses; the trainer's MoE bookkeeping has one row
    per MoE layer and moves the balancing bias of those layers."""
    torch.manual_seed(3)
    opts = dict(MOE, bias_balancing=True, bias_update_rate=0.1)
    lm = LanguageModel(config(mlp_only_layers=[0, 2], mlp_options=opts)).train()
    balance = MoEBalance(grad_accum=1, world=1, context_parallel=False)
    x = ids(4)
    ce = lm.loss(x[:, :-1], x[:, 1:])
    aux = balance.collect(lm)
    layers = lm.moe_layers()
    assert [i for i, _ in layers] == [1, 3]
    assert torch.allclose(aux, sum(m.loss() for _, m in layers))
    (ce + aux).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in lm.parameters())
    before = [m.expert_bias.clone() for _, m in layers]
    balance.after_step(lm)
    assert all(not torch.equal(b, m.expert_bias) for b, (_, m) in zip(before, layers))
    logged = balance.record()
    assert len(logged["moe_load"]) == 2 and all(len(row) == 4 for row in logged["moe_load"])
