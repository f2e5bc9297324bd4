"""Second review of the Hugging Face interop: meaning checks against transformers' own semantics and
hand computations (``MnemoForCausalLM`` dtypes and generation, the lm-eval adapter's windows)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

pytest.importorskip("transformers")

from mnemo.hf.modeling import MnemoConfig, MnemoForCausalLM  # noqa: E402
from mnemo.models import LanguageModel, ModelConfig  # noqa: E402


def _mnemo(mixer: str = "mamba2", seed: int = 0, **over) -> MnemoForCausalLM:
    torch.manual_seed(seed)
    lm = LanguageModel(ModelConfig(vocab_size=40, d_model=16, n_layers=2, mixer=mixer, **over)).eval()
    return MnemoForCausalLM(MnemoConfig.from_model_config(lm.config), model=lm).eval()


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
