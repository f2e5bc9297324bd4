"""Regression review of 3712255 (HF interop review 2): ``LanguageModel.from_pretrained`` keeping the
stored dtype, as seen by its callers, and transformers' YaRN (``"yarn_hf"``) through decoding and a
saved config."""

from __future__ import annotations

import json

import pytest
import torch

from mnemo.cli import main
from mnemo.data.tokenizer import CharTokenizer, save_tokenizer
from mnemo.models import LanguageModel, ModelConfig

TEXT = "the quick brown fox jumps over the lazy dog, then naps in the warm sun. " * 12


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64], ids=["bfloat16", "float64"])
def test_eval_of_a_folder_saved_in_another_dtype_computes_in_float32_as_its_precision_says(
    dtype, tmp_path, capsys
):
    """``from_pretrained`` now keeps the stored dtype; ``mnemo eval`` reports ``"precision": "fp32"``
    (``--precision fp32``: no autocast, float32 weights, as training measured it) and must compute
    so: a bf16 folder was evaluated in bf16 (the loss off by ~1e-5 relative), a float64 one in
    float64, both under the label fp32."""
    tok = CharTokenizer.from_text(TEXT)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=64, n_layers=2, mixer="gla")
    lm = LanguageModel(cfg).to(dtype).eval()
    lm.save_pretrained(tmp_path / "m")
    save_tokenizer(tok, tmp_path / "m")
    data = tmp_path / "t.txt"
    data.write_text(TEXT, encoding="utf-8")
    argv = ["eval", "--checkpoint", str(tmp_path / "m"), "--data", str(data), "--full", "--seq-len", "16"]
    capsys.readouterr()
    assert main([*argv, "--precision", "fp32", "--max-batches", "all"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["precision"] == "fp32"
    # by hand: the stored weights in float32, windows of 16 tokens and their next tokens
    ref = lm.float()
    ids = torch.tensor(tok.encode(TEXT))
    n = (len(ids) - 1) // 16
    total = 0.0
    with torch.no_grad():
        for w in range(n):
            x, y = ids[w * 16 : (w + 1) * 16][None], ids[w * 16 + 1 : (w + 1) * 16 + 1]
            total += torch.nn.functional.cross_entropy(ref(x)[0][0], y, reduction="sum").item()
    assert got["tokens"] == n * 16
    assert got["val_loss"] == pytest.approx(total / (n * 16), rel=1e-7, abs=0)


_YARN_HF = {"rope_type": "yarn_hf", "factor": 4.0, "original_max_position_embeddings": 8, "beta_fast": 4}


@pytest.mark.parametrize(
    "opts",
    [{}, {"window": 5}, {"n_kv_heads": 1, "rotary_dim": 4}, {"window": 4, "n_sink": 2}],
    ids=["plain", "window", "gqa-partial", "sinks"],
)
def test_yarn_hf_token_by_token_equals_the_full_pass_and_survives_save_load(opts, tmp_path):
    """``"yarn_hf"`` scales the rotated channels of q and k (not the logits): cached decoding, one
    token at a time past ``original_max_position_embeddings``, equals the full pass (float64,
    1e-12), and the config written by ``save_pretrained`` builds the same model back."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=40, d_model=16, n_layers=2, mixer="attention",
        mixer_options={"attention": {"n_heads": 2, "rope_scaling": _YARN_HF, **opts}},
    )  # fmt: skip
    lm = LanguageModel(cfg).double().eval()
    ids = torch.randint(0, 40, (2, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full, _ = lm(ids)
        out, state = lm(ids[:, :5])
        assert torch.allclose(out, full[:, :5], rtol=0, atol=1e-12)
        for t in range(5, 23):
            out, state = lm(ids[:, t : t + 1], state)
            assert torch.allclose(out[:, 0], full[:, t], rtol=0, atol=1e-12), t
    lm.save_pretrained(tmp_path / "m")
    back = LanguageModel.from_pretrained(tmp_path / "m")
    assert next(back.parameters()).dtype == torch.float64
    rot = next(m.rotary for m in back.modules() if getattr(m, "rotary", None) is not None)
    assert rot.scaling["rope_type"] == "yarn_hf" and rot.rotation_factor != 1.0
    with torch.no_grad():
        assert torch.equal(back(ids)[0], full)
