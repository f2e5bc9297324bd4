"""Second review of the Hugging Face interop: meaning checks against transformers' own semantics and
hand computations (``MnemoForCausalLM`` dtypes and generation, the lm-eval adapter's windows)."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

pytest.importorskip("transformers")

from mnemo.hf.modeling import MnemoConfig, MnemoForCausalLM  # noqa: E402
from mnemo.models import LanguageModel, ModelConfig  # noqa: E402
from tests.helpers import tiny_mnemo_for_causal_lm  # noqa: E402


def _mnemo(mixer: str = "mamba2", seed: int = 0, **over) -> MnemoForCausalLM:
    return tiny_mnemo_for_causal_lm(mixer, seed, 40, **over)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["float64", "bfloat16"])
def test_from_pretrained_loads_in_the_stored_dtype(dtype, tmp_path):
    """transformers' default ``dtype="auto"`` (also for ``None``) loads a model in the dtype its
    weights are stored in; a float64 model saved and loaded again was silently rounded to float32."""
    m = _mnemo().to(dtype)
    m.save_pretrained(tmp_path)
    ids = torch.randint(0, 40, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = m(ids).logits
    for kw in ({}, {"dtype": "auto"}, {"torch_dtype": "auto"}):
        back = MnemoForCausalLM.from_pretrained(tmp_path, **kw)
        assert {p.dtype for p in back.parameters()} == {dtype}, kw
        with torch.no_grad():
            assert torch.equal(back(ids).logits, want), kw
    # an explicit dtype still casts
    assert next(MnemoForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).parameters()).dtype == (
        torch.float32
    )


def test_a_float32_checkpoint_still_loads_in_float32(tmp_path):
    m = _mnemo("gla")
    m.save_pretrained(tmp_path)
    back = MnemoForCausalLM.from_pretrained(tmp_path)
    assert {p.dtype for p in back.parameters()} == {torch.float32}


def test_left_padded_generate_without_cache_and_continued_with_the_returned_cache():
    """Left padding with ``use_cache=False`` (every step a fresh left-padded prefill) gives what the
    cache gives and what each prompt alone gives; a second ``generate`` continued from the first
    call's returned cache equals one longer call."""
    m = _mnemo("mamba2", seed=2)
    m.generation_config.eos_token_id = None
    m.generation_config.pad_token_id = 0
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 40, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[1, :1] = 0
    ids = ids.masked_fill(mask == 0, 7)  # the pad id is a real token
    with_cache = m.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    without = m.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, use_cache=False)
    assert torch.equal(with_cache, without)
    for r in range(3):
        alone = m.generate(ids[r, mask[r].bool()][None], max_new_tokens=5, do_sample=False)
        assert torch.equal(with_cache[r, -5:], alone[0, -5:])
    first = m.generate(ids[:1, 3:], max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    more = m.generate(first.sequences, past_key_values=first["cache"], max_new_tokens=3, do_sample=False)
    assert torch.equal(more, m.generate(ids[:1, 3:], max_new_tokens=6, do_sample=False))


def test_loss_honours_num_items_in_batch():
    """``transformers.Trainer`` passes ``num_items_in_batch`` to a forward that takes ``**kwargs`` and
    then does not divide the loss by the gradient-accumulation steps: the model must return the sum
    of the token losses over that count (ignoring it made gradients ``steps`` times too large)."""
    import inspect

    m = _mnemo("gla", seed=4)
    params = inspect.signature(m.forward).parameters.values()
    assert any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params)  # the Trainer's test
    assert not hasattr(m, "accepts_loss_kwargs") or m.accepts_loss_kwargs
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 40, (2, 7), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    with torch.no_grad():
        logp = torch.log_softmax(m(ids).logits.double(), -1)
    nll = [-logp[b, t - 1, labels[b, t]].item() for b in range(2) for t in range(1, 7) if labels[b, t] >= 0]
    assert len(nll) == 10
    with torch.no_grad():
        mean = m(ids, labels=labels).loss
        for n in (10, torch.tensor(23)):  # (a count over all accumulated micro-batches)
            summed = m(ids, labels=labels, num_items_in_batch=n).loss
            assert abs(summed.item() - sum(nll) / int(n)) <= 1e-6
    assert abs(mean.item() - sum(nll) / len(nll)) <= 1e-6


# ------------------------------------------------------------------------- lm-eval adapter


def _harness_model(pos: str):
    pytest.importorskip("lm_eval")
    from mnemo.data.tokenizer import CharTokenizer

    text = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ.,?!:'\n0123456789"
    tok = CharTokenizer.from_text(text)
    torch.manual_seed(0)
    mixer = "attention" if pos == "learned" else "gla"
    cfg = ModelConfig(
        vocab_size=tok.vocab_size, d_model=32, n_layers=2, mixer=mixer, pos_embedding=pos, max_position=64
    )
    return LanguageModel(cfg).eval(), tok


def _logp(lm, inp: list[int], target: list[int]) -> float:
    """Sum of log p(target) at the last ``len(target)`` positions of one pass over ``inp``."""
    with torch.no_grad():
        lp = torch.log_softmax(lm(torch.tensor(inp)[None])[0][0].double(), -1)
    return sum(lp[len(inp) - len(target) + j, t].item() for j, t in enumerate(target))


@pytest.mark.parametrize("pos", ["learned", "none"])
def test_rolling_windows_with_add_bos_token_read_the_prefix_in_every_window(pos):
    """``rolling="window"`` with ``add_bos_token``: every window is read after ``prefix_token_id``.
    With learned positions the windows after the first were ``max_length + 1`` long and cut from
    the left, dropping the prefix (the result was the one without it); now they hold ``max_length``
    tokens, the prefix first. A hand computation of each window from a fresh state."""
    from lm_eval.api.instance import Instance

    from mnemo.hf.harness import MnemoLM

    lm, tok = _harness_model(pos)
    doc = "The quick brown fox."
    t = tok.encode(doc).tolist()
    assert len(t) == 20
    P = 3
    if pos == "learned":  # max_length 8: 7 document tokens after P (each token scored once)
        w = [([P] + t[0:6], t[0:7]), ([P] + t[6:13], t[7:14]), ([P] + t[12:19], t[14:20])]
    else:  # no cut: 8 document tokens after P (the BOS-window rule of test_special_ids_readers)
        w = [([P] + t[0:7], t[0:8]), ([P] + t[7:15], t[8:16]), ([P] + t[11:19], t[16:20])]
    want = sum(_logp(lm, inp, tgt) for inp, tgt in w)
    req = [Instance("loglikelihood_rolling", {}, (doc,), 0)]
    kw = dict(model=lm, tokenizer=tok, rolling="window", max_length=8, prefix_token_id=P)
    got = MnemoLM(**kw, add_bos_token=True).loglikelihood_rolling(req)[0]
    assert abs(got - want) <= 2e-5, (got, want)
    # without add_bos_token: lm-eval's own windows (the prefix before the first token only)
    want = _logp(lm, [P] + t[0:7], t[0:8]) + _logp(lm, t[7:15], t[8:16]) + _logp(lm, t[11:19], t[16:20])
    got = MnemoLM(**kw, add_bos_token=False).loglikelihood_rolling(req)[0]
    assert abs(got - want) <= 2e-5, (got, want)
    # no prefix at all: the first token is not scored
    want = _logp(lm, t[0:7], t[1:8]) + _logp(lm, t[7:15], t[8:16]) + _logp(lm, t[11:19], t[16:20])
    got = MnemoLM(model=lm, tokenizer=tok, rolling="window", max_length=8).loglikelihood_rolling(req)[0]
    assert abs(got - want) <= 2e-5, (got, want)


# --------------------------------------------------------------- review 2 (D): leftovers


def test_transformers5_rope_parameters_with_rope_theta_are_accepted():
    """transformers 5 keeps ``rope_theta`` (and ``partial_rotary_factor``) inside ``rope_parameters``;
    such a mapping was refused as an unknown key. It is plain RoPE (default) or the scaling it names,
    and a base that disagrees with the layer's is refused by name, with both values."""
    from transformers import LlamaConfig, Qwen3NextConfig

    from mnemo.layers import Attention
    from mnemo.layers.rotary import RotaryEmbedding, check_rope_scaling

    assert check_rope_scaling({"rope_type": "default", "rope_theta": 10000.0}) is None
    assert check_rope_scaling(LlamaConfig().rope_parameters) is None
    assert check_rope_scaling(Qwen3NextConfig().rope_parameters) is None
    lin = LlamaConfig(rope_scaling={"rope_type": "linear", "factor": 2.0}).rope_parameters
    assert check_rope_scaling(lin) == {"rope_type": "linear", "factor": 2.0}
    torch.manual_seed(0)
    plain = Attention(16, n_heads=2).double()
    same = Attention(16, n_heads=2, rope_scaling=LlamaConfig().rope_parameters).double()
    same.load_state_dict(plain.state_dict())
    x = torch.randn(1, 7, 16, dtype=torch.float64)
    assert torch.equal(same(x)[0], plain(x)[0])
    rot = RotaryEmbedding(8, rotary_dim=2, scaling=Qwen3NextConfig().rope_parameters)  # 8 · 0.25 = 2
    assert rot.scaling is None
    with pytest.raises(ValueError, match=r"rope_theta'\]: 500000.0 disagrees .* rope_theta = 10000.0"):
        Attention(16, n_heads=2, rope_scaling={"rope_type": "default", "rope_theta": 500000.0})
    with pytest.raises(ValueError, match=r"partial_rotary_factor'\]: 0.25 rotates int\(8 · 0.25\) = 2 .*= 8"):
        RotaryEmbedding(8, scaling={"rope_type": "default", "partial_rotary_factor": 0.25})
    with pytest.raises(
        ValueError, match=r"rope_scaling\['rope_theta'\]: expected a finite number > 0.0, got -1"
    ):
        check_rope_scaling({"rope_type": "default", "rope_theta": -1})


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["float64", "bfloat16"])
def test_language_model_from_pretrained_and_export_keep_the_stored_dtype(dtype, tmp_path):
    """``LanguageModel.from_pretrained`` built a float32 model and loaded the weights into it, so a
    float64 folder came back rounded and ``export_hf`` of it wrote float32 weights. The stored dtype
    is kept (``dtype=`` casts); the export holds the very same values."""
    from safetensors.torch import load_file

    from mnemo.hf.convert import export_hf

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=40, d_model=16, n_layers=2, mixer="mamba2", mlp="none")
    lm = LanguageModel(cfg).to(dtype).eval()
    with torch.no_grad():  # values that float32 cannot hold
        for p in lm.parameters():
            p.add_(torch.full_like(p, 1e-9) if dtype == torch.float64 else torch.zeros_like(p))
    lm.save_pretrained(tmp_path / "ckpt")
    back = LanguageModel.from_pretrained(tmp_path / "ckpt")
    assert {p.dtype for p in back.parameters()} == {dtype}
    for k, v in lm.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    ids = torch.randint(0, 40, (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(back(ids)[0], lm(ids)[0])
    as32 = LanguageModel.from_pretrained(tmp_path / "ckpt", dtype=torch.float32)
    assert {p.dtype for p in as32.parameters()} == {torch.float32}
    assert {
        p.dtype for p in LanguageModel.from_pretrained(tmp_path / "ckpt", dtype="float32").parameters()
    } == {torch.float32}
    with pytest.raises(ValueError, match=r"dtype: expected .*float64.*got 'int8'"):
        LanguageModel.from_pretrained(tmp_path / "ckpt", dtype="int8")
    export_hf(tmp_path / "ckpt", tmp_path / "hf")
    w = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert {v.dtype for v in w.values()} == {dtype}
    assert torch.equal(w["backbone.embeddings.weight"], lm.embed.weight.detach())
    import json

    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == str(dtype).removeprefix(
        "torch."
    )


def test_attention_mask_of_another_rank_or_shape_is_refused_by_name():
    """A 1-D or 4-D ``attention_mask`` (or a 2-D one of another shape than the ids') was silently
    ignored: left padding in it would have entered the state. Refused, naming the expected shape."""
    m = _mnemo("gla", seed=6)
    ids = torch.randint(1, 40, (2, 5), generator=torch.Generator().manual_seed(7))
    for bad in (torch.ones(5, dtype=torch.long), torch.ones(2, 1, 5, 5, dtype=torch.long)):
        with pytest.raises(ValueError, match=r"attention_mask: expected \[B, T\] = \[2, 5\].*got \["):
            m(ids, attention_mask=bad)
    with pytest.raises(ValueError, match=r"attention_mask: expected \[B, T\] = \[2, 5\].*got \[2, 4\]"):
        m(ids, attention_mask=torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"attention_mask: expected \[B, T\] = \[2, 5\].*got \[1, 5\]"):
        m(ids, attention_mask=torch.ones(1, 5, dtype=torch.long))
    # the usual ones still work: all ones, right padding, left padding; and generation with a cache
    with torch.no_grad():
        full = m(ids).logits
        assert torch.equal(m(ids, attention_mask=torch.ones(2, 5, dtype=torch.long)).logits, full)
        mask = torch.ones(2, 5, dtype=torch.long)
        mask[0, :2] = 0
        left = m(ids, attention_mask=mask).logits
        alone = m(ids[:1, 2:]).logits
        assert torch.allclose(left[0, 2:], alone[0], atol=1e-5, rtol=0)
    m.generation_config.pad_token_id = 0
    out = m.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert out.shape == (2, 8)


def test_harness_dtype_does_not_cast_the_callers_model():
    """``MnemoLM(model=lm, dtype="bfloat16")`` cast ``lm`` itself to bf16 (``nn.Module.to`` works in
    place): the caller's model changed under it. The adapter casts a copy; ``lm`` keeps its dtype
    and values, and the adapter scores with the bf16 copy (equal to a bf16 model by hand)."""
    from lm_eval.api.instance import Instance

    from mnemo.hf.harness import MnemoLM

    lm, tok = _harness_model("none")
    before = {k: v.clone() for k, v in lm.state_dict().items()}
    adapter = MnemoLM(model=lm, tokenizer=tok, dtype="bfloat16", prefix_token_id=3)
    assert {p.dtype for p in lm.parameters()} == {torch.float32}
    assert all(torch.equal(v, before[k]) for k, v in lm.state_dict().items())
    assert adapter.model is not lm
    assert {p.dtype for p in adapter.model.parameters()} == {torch.bfloat16}
    t = tok.encode("abc def").tolist()
    req = [Instance("loglikelihood", {}, ("abc", " def"), 0)]
    got = adapter.loglikelihood(req)[0][0]
    import copy

    ref = copy.deepcopy(lm).to(torch.bfloat16).eval()
    with torch.no_grad():
        lp = torch.log_softmax(ref(torch.tensor(t[:-1])[None])[0][0].float(), -1)
    want = sum(lp[j - 1, t[j]].item() for j in range(3, 7))
    assert abs(got - want) <= 1e-6, (got, want)
    # no cast asked (or the same dtype): the model given is the one used, as before
    assert MnemoLM(model=lm, tokenizer=tok).model is lm
    assert MnemoLM(model=lm, tokenizer=tok, dtype="float32").model is lm


def test_generate_with_a_prompt_past_max_position_is_refused_up_front():
    """A prompt longer than the learned positions failed inside the forward (an error about "the
    sequence", from the embedding lookup); both ``generate``s now refuse it before any work, naming
    the prompt's length and ``max_position``; and the HF wrapper also refuses a ``max_new_tokens``
    that runs past it, before decoding (it failed midway)."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=40, d_model=16, n_layers=1, mixer="attention", pos_embedding="learned")
    lm = LanguageModel(dataclasses.replace(cfg, max_position=8)).eval()
    m = MnemoForCausalLM(MnemoConfig.from_model_config(lm.config), model=lm).eval()
    m.generation_config.pad_token_id = 0
    long = torch.randint(1, 40, (1, 12), generator=torch.Generator().manual_seed(2))
    msg = r"prompt of 12 tokens.*max_position = 8"
    with pytest.raises(ValueError, match=msg):
        lm.generate(long, max_new_tokens=2)
    calls = []
    lm.register_forward_hook(lambda *a: calls.append(1))
    with pytest.raises(ValueError, match=msg):
        m.generate(long, max_new_tokens=2, do_sample=False)
    with pytest.raises(ValueError, match=r"prompt of 6 tokens and 4 new ones.*max_position = 8: at most 3"):
        m.generate(long[:, :6], max_new_tokens=4, do_sample=False)
    assert calls == []  # refused before any forward
    out = m.generate(long[:, :6], max_new_tokens=3, do_sample=False)  # fits: 6 + 3 - 1 = 8 positions
    assert torch.equal(out, lm.generate(long[:, :6], max_new_tokens=3, temperature=0))


# ------------------------------------------------------------- transformers' YaRN ("yarn_hf")


class _Float64Torch:
    """``torch`` for a transformers module, with ``float32`` (and ``float``) meaning float64."""

    def __getattr__(self, name):
        return torch.float64 if name in ("float32", "float") else getattr(torch, name)


def _hf_yarn_float64(config):
    """transformers' own ``_compute_yarn_parameters(config)``, computed in float64."""
    from transformers import modeling_rope_utils

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(modeling_rope_utils, "torch", _Float64Torch())
        inv, af = modeling_rope_utils._compute_yarn_parameters(config)
    assert inv.dtype == torch.float64
    return inv, af


_YARN_CASES = {
    "defaults": dict(factor=4.0, original_max_position_embeddings=64),
    "betas_no_truncate": dict(
        factor=8.0, original_max_position_embeddings=128, beta_fast=16, beta_slow=2, truncate=False
    ),
    "mscale": dict(factor=4.0, original_max_position_embeddings=64, mscale=0.707, mscale_all_dim=1.0),
    "attention_factor": dict(factor=2.5, original_max_position_embeddings=96, attention_factor=1.3),
    "factor_1": dict(factor=1.0, original_max_position_embeddings=64),
}


@pytest.mark.parametrize("case", sorted(_YARN_CASES))
@pytest.mark.parametrize("partial", [1.0, 0.5], ids=["full", "partial"])
def test_yarn_hf_frequencies_and_factor_equal_transformers(case, partial):
    """``"yarn_hf"`` reproduces ``transformers``' ``_compute_yarn_parameters`` (run in float64):
    the inverse frequencies to 1e-12 relative and the cos/sin factor to 1e-12; the paper's ``"yarn"``
    gives other frequencies inside the ramp (hence the separate name)."""
    from transformers import LlamaConfig

    from mnemo.layers.rotary import RotaryEmbedding

    p = _YARN_CASES[case]
    head_dim = 32
    rp = {"rope_type": "yarn", "rope_theta": 10000.0, "partial_rotary_factor": partial, **p}
    cfg = LlamaConfig(
        hidden_size=64, num_attention_heads=2, head_dim=head_dim, rope_parameters=dict(rp),
        max_position_embeddings=int(p["factor"] * p["original_max_position_embeddings"]),
    )  # fmt: skip
    want_inv, want_af = _hf_yarn_float64(cfg)
    R = int(head_dim * partial)
    rot = RotaryEmbedding(head_dim, 10000.0, R, scaling={**rp, "rope_type": "yarn_hf"}).double()
    assert rot.inv_freq.dtype == torch.float64 and rot.inv_freq.shape == want_inv.shape
    assert ((rot.inv_freq - want_inv).abs() / want_inv).max().item() <= 1e-12
    assert abs(rot.rotation_factor - want_af) <= 1e-12 and rot.attention_factor == 1.0
    if case == "defaults":  # the paper's ramp (linear in rotations) is another function
        paper = RotaryEmbedding(head_dim, 10000.0, R, scaling={**p, "rope_type": "yarn"}).double()
        assert ((paper.inv_freq - want_inv).abs() / want_inv).max().item() > 1e-3


def test_yarn_hf_refusals_name_the_key():
    from mnemo.layers.rotary import check_rope_scaling

    base = {"factor": 4.0, "original_max_position_embeddings": 64}
    with pytest.raises(
        ValueError, match=r"unknown key\(s\) \['mscale'\] for the paper's YaRN.*rope_type 'yarn_hf'"
    ):
        check_rope_scaling({"rope_type": "yarn", **base, "mscale": 1.0})
    with pytest.raises(ValueError, match=r"rope_scaling\['truncate'\]: expected true or false, got 'no'"):
        check_rope_scaling({"rope_type": "yarn_hf", **base, "truncate": "no"})
    full = check_rope_scaling({"rope_type": "yarn_hf", **base})
    assert full == {
        "rope_type": "yarn_hf", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
        "beta_slow": 1.0, "attention_factor": None, "mscale": None, "mscale_all_dim": None, "truncate": True,
    }  # fmt: skip


def test_yarn_hf_undo_inverts_forward_and_sinks_keep_raw_keys():
    """With the cos/sin factor the rotation is no longer orthogonal: :meth:`undo` inverts
    :meth:`forward` (what the attention uses to keep a hooked key unrotated with sinks)."""
    from mnemo.layers.rotary import RotaryEmbedding

    rot = RotaryEmbedding(
        8,
        rotary_dim=4,
        scaling={"rope_type": "yarn_hf", "factor": 4.0, "original_max_position_embeddings": 16},
    ).double()
    assert rot.rotation_factor == pytest.approx(0.1 * math.log(4.0) + 1, rel=1e-15)
    x = torch.randn(2, 5, 3, 8, dtype=torch.float64)
    y = rot(x, 7)
    assert torch.equal(y[..., 4:], x[..., 4:])  # the pass-through channels are not scaled
    assert torch.allclose(y[..., :4].norm(dim=-1), rot.rotation_factor * x[..., :4].norm(dim=-1), rtol=1e-13)
    assert torch.allclose(rot.undo(y, 7), x, rtol=0, atol=1e-14)


def _qwen3_next_yarn(dtype=torch.float64, **rope):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    rp = {"rope_type": "yarn", "rope_theta": 1000.0, "partial_rotary_factor": 0.5, "factor": 4.0,
          "original_max_position_embeddings": 8, "beta_fast": 4, "beta_slow": 1, **rope}  # fmt: skip
    cfg = Qwen3NextConfig(
        vocab_size=61, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=12, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4, num_experts=0,
        layer_types=["linear_attention", "full_attention"], rope_parameters=rp, tie_word_embeddings=False,
        max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    m = Qwen3NextForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return m.to(dtype)


@contextlib.contextmanager
def _qwen3_next_in_float64(hf):
    """transformers' Qwen3-Next casts its norms, rotary angles and kernels to float32 even in a float64
    model: those casts lifted, and its YaRN table recomputed by its own function in float64."""
    from transformers.models.qwen3_next import modeling_qwen3_next as mq

    orig_float = torch.Tensor.float
    with pytest.MonkeyPatch.context() as mp:
        for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                     "causal_conv1d_update"):  # fmt: skip
            f = getattr(mq, name)
            mp.setattr(mq, name, getattr(f, "__wrapped__", f))
        inv, af = _hf_yarn_float64(hf.config)
        mp.setattr(mq, "torch", _Float64Torch())
        mp.setattr(torch.Tensor, "float", lambda t, *a, **k: t if t.dtype == torch.float64 else orig_float(t))
        rot = hf.model.rotary_emb
        assert rot.attention_scaling == pytest.approx(af, rel=1e-7)
        mp.setattr(rot, "inv_freq", inv)
        mp.setattr(rot, "attention_scaling", af)
        yield


@pytest.mark.parametrize("rope", [{}, {"truncate": False, "attention_factor": 1.2}], ids=["yarn", "options"])
def test_qwen3_next_with_yarn_imports_with_transformers_logits(rope, tmp_path):
    """A Qwen3-Next checkpoint with ``rope_type`` ``"yarn"`` (refused before) loads into mnemo as
    ``"yarn_hf"``: the logits equal transformers' to 1e-10 in float64 at 21 tokens (beyond
    ``original_max_position_embeddings = 8``), full pass and cached decoding; export writes the same
    ``rope_parameters`` back."""
    from mnemo.hf.convert import import_hf
    from mnemo.hf.qwen3_next import export_qwen3_next

    hf = _qwen3_next_yarn(**rope)
    hf.save_pretrained(tmp_path / "hf")
    config, sd, _ = import_hf(tmp_path / "hf")
    scaling = config.mixer_options["attention"]["rope_scaling"]
    assert scaling["rope_type"] == "yarn_hf" and scaling["factor"] == 4.0
    assert scaling["original_max_position_embeddings"] == 8
    lm = LanguageModel(config).double().eval()
    lm.load_state_dict(sd, strict=True)
    ids = torch.randint(0, 61, (2, 21), generator=torch.Generator().manual_seed(3))
    with _qwen3_next_in_float64(hf), torch.no_grad():
        ref = hf(ids).logits
        got, _ = lm(ids)
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        assert err <= 1e-10, err
        out, state = lm(ids[:, :9])
        for t in range(9, 21):  # decoding one token at a time, past L = 8, against the full pass
            out, state = lm(ids[:, t : t + 1], state)
            assert ((out[:, -1] - ref[:, t]).abs().max() / ref.abs().max()).item() <= 1e-10
    # without the YaRN scaling the logits are far off (the test can see the difference)
    plain = LanguageModel(dataclasses.replace(config, mixer_options={
        **config.mixer_options, "attention": {**config.mixer_options["attention"], "rope_scaling": None}
    })).double().eval()  # fmt: skip
    plain.load_state_dict(sd, strict=True)
    with torch.no_grad():
        assert ((plain(ids)[0] - got).abs().max() / got.abs().max()).item() > 1e-3
    hf_cfg, _ = export_qwen3_next(config, sd)
    saved = hf.config.rope_parameters
    for k, v in hf_cfg["rope_parameters"].items():
        if k in saved:
            assert v == saved[k], k
    assert hf_cfg["rope_parameters"]["rope_type"] == "yarn"
    # the export loads in transformers with the same logits
    from transformers import Qwen3NextForCausalLM

    from mnemo.hf.convert import export_hf

    export_hf(lm, tmp_path / "back")
    back = Qwen3NextForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float64).eval()
    with _qwen3_next_in_float64(back), torch.no_grad():
        ref = back(ids).logits
    assert ((got - ref).abs().max() / ref.abs().max()).item() <= 1e-10


def test_yarn_hf_frequencies_by_hand():
    """R = 8, θ = 10⁴, L = 64, s = 4, β = 32 / α = 1: the ramp's ends are the dimensions
    d(32) = 8 ln(64 / 64π) / (2 ln 10⁴) = −0.497 (rounded down, then clamped: 0) and d(1) = 8 ln(64 /
    2π) / (2 ln 10⁴) = 1.008 (rounded up: 2), so γ = 0, 1/2, 1, 1 over the indices 0 … 3 of
    θ = 1, 0.1, 0.01, 0.001: 1, (0.1/4 + 0.1)/2 = 0.0625, 0.0025, 0.00025 (the paper's ramp, linear in
    rotations, would give 0.1 · (1 − γ) / 4 + 0.1 γ with γ = (64 · 0.1 / 2π − 1) / 31 = 5.9e-4 for
    the second)."""
    from mnemo.layers.rotary import yarn_hf_inv_freq

    got = yarn_hf_inv_freq(1e4, 8, 4.0, 64)
    want = torch.tensor([1.0, 0.0625, 0.0025, 0.00025], dtype=torch.float64)
    assert torch.allclose(got, want, rtol=1e-14, atol=0)
    # without rounding the ends: lo = 0 (clamped), hi = 1.008: γ = 0, 0.992, 1, 1
    hi = 8 * math.log(64 / (2 * math.pi)) / (2 * math.log(1e4))
    g = 1 / hi
    want[1] = g * 0.1 / 4 + (1 - g) * 0.1
    assert torch.allclose(yarn_hf_inv_freq(1e4, 8, 4.0, 64, truncate=False), want, rtol=1e-14, atol=0)


def test_yarn_hf_with_sinks_and_a_hook_on_k_streams_as_without():
    """With sinks the cache keeps the keys before rotary; a hook on ``hook_k`` makes the layer
    recover them from the rotated keys. With ``"yarn_hf"`` the rotated channels also carry the cos/sin
    factor, which a plain inverse rotation kept (the cached keys then got it twice): decoding with
    an identity hook on ``hook_k`` equals decoding without, and both equal the full pass."""
    from mnemo.layers import Attention

    scaling = {"rope_type": "yarn_hf", "factor": 4.0, "original_max_position_embeddings": 8}
    torch.manual_seed(0)
    att = Attention(16, n_heads=2, window=4, n_sink=2, rope_scaling=scaling).double().eval()
    x = torch.randn(1, 13, 16, dtype=torch.float64)

    def stream():
        outs, state = [], None
        for t in range(13):
            y, state = att(x[:, t : t + 1], state)
            outs.append(y)
        return torch.cat(outs, 1)

    with torch.no_grad():
        full, _ = att(x)
        plain = stream()
        h = att.hook_k.add(lambda v, name: None)
        try:
            hooked = stream()
        finally:
            h.remove()
    assert torch.allclose(plain, full, rtol=0, atol=1e-12)
    assert torch.allclose(hooked, plain, rtol=0, atol=1e-12)


def test_stored_dtype_is_the_dtype_of_most_weights(tmp_path):
    """A bf16 MoE model keeps its balancing bias in float32 (by design): the stored dtype is the one
    of most elements, so it loads as bf16 with the bias float32 and every value as saved."""
    from mnemo.models.lm import _stored_dtype

    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=40, d_model=16, n_layers=1, mixer="gla", mlp="moe",
        mlp_options={"n_experts": 4, "top_k": 2, "bias_balancing": True},
    )  # fmt: skip
    lm = LanguageModel(cfg).to(torch.bfloat16).eval()
    bias = lm.blocks[0].mlp.expert_bias
    assert bias.dtype == torch.float32
    bias.copy_(torch.tensor([0.1, -0.2, 0.3, 1e-4]))
    lm.save_pretrained(tmp_path)
    assert _stored_dtype(tmp_path / "model.safetensors") == torch.bfloat16
    back = LanguageModel.from_pretrained(tmp_path)
    assert {p.dtype for p in back.parameters()} == {torch.bfloat16}
    assert back.blocks[0].mlp.expert_bias.dtype == torch.float32
    for k, v in lm.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
