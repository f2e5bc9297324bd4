"""Regression review 38a of the session-38 leftover fixes (842343a … 34efaed): what the fixes broke
or left inconsistent."""

from __future__ import annotations

import warnings

import pytest
import torch


def _top1_warnings(said) -> list[str]:
    return [str(w.message) for w in said if "norm_topk_prob" in str(w.message)]


def test_a_top1_renormalised_moe_warns_when_trained_not_when_built_or_run_for_inference():
    """34efaed warned in ``MoE.__init__``: every build of such a model warned, also an imported
    Qwen3-Next with ``num_experts_per_tok=1`` (transformers' default ``norm_topk_prob=True``, so
    the advice ``norm_topk_prob=False`` would break parity) and every inference load of a trained
    one, where the router's gradient does not matter. It now warns at the first training forward
    with gradients, once per module."""
    from mnemo.layers.moe import MoE

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        m = MoE(8, n_experts=2, top_k=1, expert_hidden=8).double()
        m.eval()
        m(torch.randn(2, 5, 8, dtype=torch.float64))
        m.train()
        with torch.no_grad():
            m(torch.randn(2, 5, 8, dtype=torch.float64))
    assert _top1_warnings(said) == []
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        m(torch.randn(2, 5, 8, dtype=torch.float64))
        m(torch.randn(2, 5, 8, dtype=torch.float64))
    (msg,) = _top1_warnings(said)
    assert "norm_topk_prob=False" in msg
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        MoE(8, n_experts=2, top_k=1, expert_hidden=8, norm_topk_prob=False)(torch.randn(2, 5, 8))
        MoE(8, n_experts=2, top_k=2, expert_hidden=8)(torch.randn(2, 5, 8))
    assert _top1_warnings(said) == []


def test_an_imported_top1_qwen3_next_moe_does_not_warn_on_import():
    transformers = pytest.importorskip("transformers")
    from mnemo.hf.qwen3_next import import_qwen3_next
    from mnemo.models.lm import LanguageModel

    cfg = transformers.Qwen3NextConfig(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=6,
        layer_types=["linear_attention", "full_attention"],
        num_experts=3,
        num_experts_per_tok=1,
        moe_intermediate_size=12,
        shared_expert_intermediate_size=16,
        mlp_only_layers=[],
        decoder_sparse_step=1,
    )
    torch.manual_seed(0)
    hf = transformers.Qwen3NextForCausalLM(cfg).eval()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        config, sd = import_qwen3_next(cfg.to_dict(), hf.state_dict())
        assert config.mlp_options["top_k"] == 1 and config.mlp_options["norm_topk_prob"] is True
        lm = LanguageModel(config)
        lm.load_state_dict(sd, strict=True)
        with torch.no_grad():
            lm.eval()(torch.randint(0, 61, (1, 7)))
    assert _top1_warnings(said) == []


def test_state_patch_takes_numpy_layer_indices_as_it_takes_a_numpy_at():
    """9a08704 let ``at`` be a numpy / 0-d tensor integer; ``layers`` of the same call still
    refused one: ``np.int64(1)`` raised TypeError (not iterable) and ``[np.int64(1)]`` was called
    out of range in a 2-layer model."""
    np = pytest.importorskip("numpy")
    from mnemo.interp.interventions import state_patch
    from mnemo.models import LanguageModel, ModelConfig

    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(vocab_size=17, d_model=16, n_layers=2, mixer="gla")).double().eval()
    src = torch.randint(0, 17, (2, 9), generator=torch.Generator().manual_seed(1))
    tgt = torch.randint(0, 17, (2, 9), generator=torch.Generator().manual_seed(2))
    want, _ = state_patch(model, src, tgt, 4, 1)
    for layers in (np.int64(1), [np.int64(1)], torch.tensor(1), (torch.tensor(1),)):
        got, _ = state_patch(model, src, tgt, np.int64(4), layers)
        assert torch.equal(got, want), layers
    with pytest.raises(ValueError, match="out of range"):
        state_patch(model, src, tgt, 4, [np.int64(2)])
    with pytest.raises(ValueError, match="out of range"):
        state_patch(model, src, tgt, 4, [1.0])
