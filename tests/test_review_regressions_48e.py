"""Review 48e of c69cba8 (attention ``bias="qkv"``, carried source files, ``check_eps`` under
``torch.compile``, ``decay_exp``'s bounds as graph constants) and 00ddbc8 (Mamba ``bcdt_rms_eps``,
Bamba in and out).

* ``check_eps`` returns at once whenever ``torch.compile`` traces, so a call of a public function
  that takes an epsilon (``gated_rms_norm(x, z, w, eps)``) with a bad constant (``-1.0``, NaN) is no
  longer refused under ``torch.compile``: it returned NaN where eager raises ``ValueError``. Only
  the symbolic epsilon of ``dynamic=True`` needed the skip; fixed: under tracing it checks with
  comparisons (``eps >= 0 and eps < inf``, no ``math.isfinite``), which keeps the 47f dynamic GLA
  test at one frame and no graph break.
* Bamba configurations the 48 tests did not try (tied head, 4:1 grouped-query attention, one B/C
  group, three attention layers, 21 tokens past chunks of 8, the export back) and a left-padded
  batch against ``transformers``' own generation: these held, kept as one test.
"""

from __future__ import annotations

import pytest
import torch


def test_a_bad_constant_eps_is_refused_under_torch_compile():
    from mnemo.layers.norm import gated_rms_norm

    x, z, w = torch.randn(2, 8), torch.randn(2, 8), torch.ones(8)
    with pytest.raises(ValueError, match=r"eps: expected a finite number >= 0"):
        gated_rms_norm(x, z, w, -1.0)  # eager: refused
    compiled = torch.compile(lambda x: gated_rms_norm(x, z, w, -1.0), backend="eager")
    try:
        with pytest.raises(ValueError, match=r"eps: expected a finite number >= 0"):
            compiled(x)  # (the reviewed code returned NaN rows)
    finally:
        torch._dynamo.reset()


def test_bamba_configurations_beyond_the_48_tests(tmp_path):
    """Tied head, 4 query heads on 1 key-value head, one B/C group, attention at layers 0, 2 and 4
    of 5: logits equal transformers' on 21 tokens (chunks of 8); the export reloads as the same
    Bamba config with the same logits. Without biases (transformers' own left padding lets the
    biased pads into its state), a left-padded batch decodes greedily as transformers does, and
    the padded row as its prompt alone. Measured (float32, CPU) ≤ 4.2e-6 over 14 such configs."""
    transformers = pytest.importorskip("transformers")
    from mnemo.hf.convert import convert, export_hf
    from mnemo.models import LanguageModel

    V = 61
    cfg = dict(
        vocab_size=V, hidden_size=32, intermediate_size=40, num_hidden_layers=5, num_attention_heads=4,
        num_key_value_heads=1, head_dim=12, attn_layer_indices=[0, 2, 4], mamba_n_heads=4,
        mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8,
        mamba_proj_bias=False, mamba_conv_bias=False, attention_bias=False, tie_word_embeddings=True,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.BambaForCausalLM(transformers.BambaConfig(**cfg)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.2 * torch.randn_like(p))
    hf.save_pretrained(tmp_path / "hf")
    lm = LanguageModel.from_pretrained(tmp_path / "hf").eval()
    assert lm.config.tie_embeddings and lm.config.layer_mixers()[::2] == ["attention"] * 3
    x = torch.randint(0, V, (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(x).logits
        assert (lm(x)[0] - ref).abs().max().item() <= 2e-5
    convert(tmp_path / "hf", tmp_path / "ck")
    export_hf(tmp_path / "ck", tmp_path / "back")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    for k in ("tie_word_embeddings", "num_key_value_heads", "mamba_n_groups", "attn_layer_indices"):
        assert getattr(back.config, k) == getattr(hf.config, k), k
    with torch.no_grad():
        assert (back(x).logits - ref).abs().max().item() <= 2e-5
    g = torch.Generator().manual_seed(3)
    a, b = torch.randint(1, V, (1, 7), generator=g), torch.randint(1, V, (1, 4), generator=g)
    ids = torch.cat([a, torch.cat([torch.zeros(1, 3, dtype=torch.long), b], 1)])
    mask = torch.tensor([[1] * 7, [0, 0, 0, 1, 1, 1, 1]])
    want = hf.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    got = lm.generate(ids, 8, temperature=0, attention_mask=mask)
    assert torch.equal(got, want)
    assert torch.equal(got[1, 3:], lm.generate(b, 8, temperature=0)[0])
