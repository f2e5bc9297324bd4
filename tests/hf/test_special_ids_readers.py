"""The checkpoint's special ids as ``mnemo eval`` and the lm-eval adapter read them
(:mod:`mnemo.hf.special_ids`): a converted checkpoint whose tokenizer puts a BOS before a text is
evaluated with that BOS first in each window (the loss equals ``transformers``' own model on the
same windows), one without a BOS reads the windows as they are; the adapter conditions on the
checkpoint's BOS (else its end-of-text id) and puts a BOS before every context by default, as a run
trained with ``--bos`` saw it. Tiny random-weight models built with ``transformers`` itself."""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from mnemo.cli import main  # noqa: E402
from mnemo.data.tokenizer import CharTokenizer, save_tokenizer  # noqa: E402
from mnemo.hf.harness import MnemoLM  # noqa: E402
from mnemo.models import LanguageModel, ModelConfig  # noqa: E402
from tests.hf.test_generate_bos_eos import TEXT, _folder  # noqa: E402


@torch.no_grad()
def _hf_window_loss(hf, ids: list[int], seq_len: int, bos: int | None) -> float:
    """Mean next-token loss of ``transformers``' model over the non-overlapping windows of ``ids``
    (``seq_len`` inputs, the next ``seq_len`` targets), the first input replaced by ``bos``."""
    n = (len(ids) - 1) // seq_len
    total, count = 0.0, 0
    for w in range(n):
        x = torch.tensor(ids[w * seq_len : (w + 1) * seq_len])[None]
        y = torch.tensor(ids[w * seq_len + 1 : (w + 1) * seq_len + 1])
        if bos is not None:
            x[0, 0] = bos
        logits = hf(x).logits[0].float()
        total += torch.nn.functional.cross_entropy(logits, y, reduction="sum").item()
        count += y.numel()
    return total / count


@pytest.mark.parametrize("bos_template", [True, False])
def test_eval_reads_each_window_as_the_release_reads_a_text(tmp_path, capsys, bos_template):
    fast, hf, mn = _folder(tmp_path, bos_template)
    text = " ".join(TEXT[:6])
    data = tmp_path / "eval.txt"
    data.write_text(text, encoding="utf-8")
    ids = fast(text, add_special_tokens=False).input_ids
    seq_len = 8
    capsys.readouterr()
    argv = ["eval", "--checkpoint", str(mn), "--data", str(data), "--full", "--seq-len", str(seq_len)]
    assert main([*argv, "--batch-size", "2", "--max-batches", "all"]) == 0
    got = json.loads(capsys.readouterr().out)
    bos = 0 if bos_template else None
    assert got["bos_id"] == bos
    assert got["tokens"] == (len(ids) - 1) // seq_len * seq_len
    want = _hf_window_loss(hf, ids, seq_len, bos)
    assert got["val_loss"] == pytest.approx(want, rel=1e-5)
    if bos_template:  # the BOS changes the number (the test can tell the two readings apart)
        assert abs(_hf_window_loss(hf, ids, seq_len, None) - want) > 1e-3


def _instances(kind: str, args_list):
    return [Instance(kind, {}, args, i) for i, args in enumerate(args_list)]


@torch.no_grad()
def _hf_logprob(hf, first: list[int], cont: list[int]) -> float:
    whole = torch.tensor(first + cont)[None]
    logp = torch.log_softmax(hf(whole[:, :-1]).logits[0].float(), -1)
    return sum(logp[len(first) - 1 + j, t].item() for j, t in enumerate(cont))


def test_harness_puts_the_release_bos_first_and_stops_at_its_end_id(tmp_path):
    fast, hf, mn = _folder(tmp_path, True)  # BOS <s> = 0 before every text, end id </s> = 1
    lm = MnemoLM(checkpoint=str(mn))
    assert (lm.prefix_token_id, lm.add_bos_token, lm.stop_token_ids, lm.eot_token_id) == (0, True, [1], 1)
    info = lm.get_model_info()  # what lm-eval writes into its results' config
    assert (info["prefix_token_id"], info["add_bos_token"], info["stop_token_ids"]) == (0, True, [1])
    ctx, cont = "the memory", " of the model"
    c = fast(ctx, add_special_tokens=False).input_ids
    whole = fast(ctx + cont, add_special_tokens=False).input_ids
    want = _hf_logprob(hf, [0] + c, whole[len(c) :])
    assert fast(ctx).input_ids[0] == 0  # transformers' tokenizer(text) starts with the BOS too
    (got, _), (empty, _) = lm.loglikelihood(_instances("loglikelihood", [(ctx, cont), ("", cont)]))
    assert got == pytest.approx(want, abs=1e-4)
    cont_ids = fast(cont, add_special_tokens=False).input_ids
    assert empty == pytest.approx(_hf_logprob(hf, [0], cont_ids), abs=1e-4)
    off = MnemoLM(checkpoint=str(mn), add_bos_token="false")  # as lm-eval's add_bos_token=False
    (plain, _), (empty_off, _) = off.loglikelihood(_instances("loglikelihood", [(ctx, cont), ("", cont)]))
    assert plain == pytest.approx(_hf_logprob(hf, c, whole[len(c) :]), abs=1e-4)
    assert empty_off == pytest.approx(empty, abs=1e-6)  # an empty context is conditioned on the BOS alike
    with pytest.raises(ValueError, match=r"add_bos_token: expected true or false, got 'maybe'"):
        MnemoLM(checkpoint=str(mn), add_bos_token="maybe")


def test_harness_without_a_bos_conditions_on_the_end_id(tmp_path):
    """No BOS in the tokenizer's template: the first token is conditioned on the declared
    end-of-text id (lm-eval's rule: BOS, else EOS) and contexts are read as they are."""
    fast, hf, mn = _folder(tmp_path, False)
    lm = MnemoLM(checkpoint=str(mn))
    assert (lm.prefix_token_id, lm.add_bos_token) == (1, False)
    ctx, cont = "the memory", " of the model"
    c = fast(ctx, add_special_tokens=False).input_ids
    whole = fast(ctx + cont, add_special_tokens=False).input_ids
    (got, _), (empty, _) = lm.loglikelihood(_instances("loglikelihood", [(ctx, cont), ("", cont)]))
    assert got == pytest.approx(_hf_logprob(hf, c, whole[len(c) :]), abs=1e-4)
    assert empty == pytest.approx(
        _hf_logprob(hf, [1], fast(cont, add_special_tokens=False).input_ids), abs=1e-4
    )
    forced = MnemoLM(checkpoint=str(mn), add_bos_token=True)  # forced on: the end id goes first
    ((on, _),) = forced.loglikelihood(_instances("loglikelihood", [(ctx, cont)]))
    assert on == pytest.approx(_hf_logprob(hf, [1] + c, whole[len(c) :]), abs=1e-4)


def test_harness_add_bos_token_without_any_id_is_refused():
    tok = CharTokenizer.from_text("abc")
    lm = LanguageModel(ModelConfig(vocab_size=tok.vocab_size, d_model=16, n_layers=1, mixer="gla"))
    plain = MnemoLM(model=lm, tokenizer=tok)
    assert (plain.prefix_token_id, plain.add_bos_token, plain.stop_token_ids) == (None, False, [])
    with pytest.raises(ValueError, match="add_bos_token: this checkpoint declares no BOS"):
        MnemoLM(model=lm, tokenizer=tok, add_bos_token="true")


def _run_with_bos(tmp_path):
    """A char-level GLA checkpoint whose (stand-in) training run read ``a`` first in every window:
    ``(tokenizer, model, folder)``."""
    tok = CharTokenizer.from_text("abcdefgh ")
    torch.manual_seed(0)
    lm = LanguageModel(ModelConfig(vocab_size=tok.vocab_size, d_model=16, n_layers=1, mixer="gla")).eval()
    run = tmp_path / "run"
    lm.save_pretrained(run)
    save_tokenizer(tok, run)
    (run / "train_config.json").write_text(json.dumps({"bos": "a"}))
    return tok, lm, run


def test_harness_reads_a_run_trained_with_bos_with_its_bos_first(tmp_path):
    """A run trained with ``--bos 'a'`` saw ``a`` first in every window: every context starts with
    it (a hand computation on the model itself), and the first token of a document is scored."""
    tok, lm, run = _run_with_bos(tmp_path)
    model = MnemoLM(checkpoint=str(run))
    a = tok.encode("a").tolist()[0]
    assert (model.prefix_token_id, model.add_bos_token) == (a, True)
    ids = tok.encode("abcd").tolist()
    with torch.no_grad():
        logp = torch.log_softmax(lm(torch.tensor(ids[:-1])[None])[0][0], -1)
    ((got, _),) = model.loglikelihood(_instances("loglikelihood", [("bc", "d")]))
    assert got == pytest.approx(logp[2, ids[3]].item(), abs=1e-5)
    (doc,) = model.loglikelihood_rolling(_instances("loglikelihood_rolling", [("bcd",)]))
    assert doc == pytest.approx(sum(logp[j, ids[j + 1]].item() for j in range(3)), abs=1e-5)


def test_harness_rolling_windows_read_the_bos_once(tmp_path):
    """``rolling=window`` with ``add_bos_token``: the first window's context is the BOS already (the
    prefix of lm-eval's rolling windows); it read ``[BOS, BOS, t0 …]``. A document within one
    window now scores as the one-pass ``rolling=state`` does; a later window reads its own context
    after the BOS (a fresh state, as each training window began)."""
    tok, lm, run = _run_with_bos(tmp_path)
    a = tok.encode("a").tolist()[0]
    doc = "bcdhgfe"
    ids = tok.encode(doc).tolist()
    req = _instances("loglikelihood_rolling", [(doc,)])

    @torch.no_grad()
    def score(inp: list[int], targets: list[int]) -> float:
        logp = torch.log_softmax(lm(torch.tensor(inp)[None])[0][0], -1)
        return sum(logp[len(inp) - len(targets) + j, t].item() for j, t in enumerate(targets))

    whole = score([a] + ids[:-1], ids)
    (state,) = MnemoLM(checkpoint=str(run), rolling="state").loglikelihood_rolling(req)
    (one,) = MnemoLM(checkpoint=str(run), rolling="window", max_length=64).loglikelihood_rolling(req)
    assert state == pytest.approx(whole, abs=1e-5) and one == pytest.approx(whole, abs=1e-5)
    # max_length 4: [BOS] → t0…t3, then the last window's context t2 t3 after the BOS → t4…t6
    (two,) = MnemoLM(checkpoint=str(run), rolling="window", max_length=4).loglikelihood_rolling(req)
    want = score([a] + ids[:3], ids[:4]) + score([a] + ids[2:6], ids[4:])
    assert two == pytest.approx(want, abs=1e-5)


def test_a_model_given_in_memory_is_assumed_to_have_no_bos(tmp_path):
    """Nothing about a model in memory says it was trained with a BOS (the same run loaded by
    ``checkpoint=`` reads its train config): the tokenizer's template is not taken for one; the
    tokenizer's end-of-text id conditions the first token; ``add_bos_token=true`` with an explicit
    ``prefix_token_id`` gives the BOS reading."""
    from mnemo.data import load_tokenizer

    fast, hf, mn = _folder(tmp_path, True)
    tok = load_tokenizer(mn)
    lm = LanguageModel.from_pretrained(mn)
    plain = MnemoLM(model=lm, tokenizer=tok)
    assert (plain.prefix_token_id, plain.add_bos_token, plain.stop_token_ids) == (1, False, [1])
    told = MnemoLM(model=lm, tokenizer=tok, prefix_token_id=0, add_bos_token=True)
    ctx, cont = "the memory", " of the model"
    c = fast(ctx, add_special_tokens=False).input_ids
    whole = fast(ctx + cont, add_special_tokens=False).input_ids
    ((got, _),) = told.loglikelihood(_instances("loglikelihood", [(ctx, cont)]))
    assert got == pytest.approx(_hf_logprob(hf, [0] + c, whole[len(c) :]), abs=1e-4)
