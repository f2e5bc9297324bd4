"""lm-evaluation-harness adapter (mnemo/hf/harness.py) and ``mnemo harness``: log-likelihoods,
rolling (perplexity) log-likelihoods and greedy generation against mnemo's own computation.
Everything offline: the tasks are YAML files over local JSONL written into tmp_path."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from mnemo.cli import main  # noqa: E402
from mnemo.data.tokenizer import CharTokenizer, save_tokenizer  # noqa: E402
from mnemo.hf.harness import MnemoLM  # noqa: E402
from mnemo.models import LanguageModel, ModelConfig  # noqa: E402

TEXT = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ.,?!:'\n0123456789"
TOL = 1e-4  # nats; both sides are float32 sums of the same log_softmax values (measured: <= 2e-6
# for one pass, 7e-5 on a 225-token document scored in 16-token chunks)


def close(got: float, want: float) -> bool:
    return abs(got - want) <= TOL + 1e-6 * abs(want)


MC_DOCS = [
    {"question": f"Q{i}: what comes after {c}?", "choices": ["a b", "c d", "the end."], "answer": i % 3}
    for i, c in enumerate("abcdef")
]
PPL_DOCS = [{"text": "The quick brown fox jumps over the lazy dog. " * (i + 1)} for i in range(3)]


def _model(mixer: str = "gla", seed: int = 0):
    tok = CharTokenizer.from_text(TEXT)
    torch.manual_seed(seed)
    lm = LanguageModel(ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=2, mixer=mixer)).eval()
    return lm, tok


@torch.no_grad()
def direct_loglikelihood(lm, tok, context: str, continuation: str) -> tuple[float, bool]:
    """Sum of log_softmax of the continuation tokens, computed directly with LanguageModel (a
    context's trailing whitespace belongs to the continuation: lm-eval's rule for every model)."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    ctx = tok.encode(context).tolist()
    whole = tok.encode(context + continuation).tolist()
    if len(whole) < 2:  # one token and nothing before it: nothing to score
        return 0.0, True
    logits, _ = lm(torch.tensor(whole[:-1])[None])
    logp = torch.log_softmax(logits[0].float(), -1)
    cont = whole[len(ctx) :]
    if ctx:
        lp, tgt = logp[len(ctx) - 1 :], torch.tensor(cont)
    else:  # no context, no begin-of-text token: the first token is not scored
        lp, tgt = logp, torch.tensor(cont[1:])
    return lp.gather(-1, tgt[:, None]).sum().item(), bool((lp.argmax(-1) == tgt).all())


def direct_rolling(lm, tok, text: str) -> float:
    return direct_loglikelihood(lm, tok, "", text)[0]


def _write_tasks(root):
    tasks = root / "tasks"
    tasks.mkdir()
    cache = root / "datasets_cache"
    (tasks / "mc.jsonl").write_text("\n".join(json.dumps(d) for d in MC_DOCS))
    (tasks / "ppl.jsonl").write_text("\n".join(json.dumps(d) for d in PPL_DOCS))
    common = (
        "dataset_path: json\ndataset_kwargs:\n  cache_dir: {cache}\n"
        "  data_files:\n    test: {data}\ntest_split: test\n"
    )
    (tasks / "mc.yaml").write_text(
        "task: mnemo_test_mc\n"
        + common.format(cache=cache, data=tasks / "mc.jsonl")
        + "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    (tasks / "ppl.yaml").write_text(
        "task: mnemo_test_ppl\n"
        + common.format(cache=cache, data=tasks / "ppl.jsonl")
        + "output_type: loglikelihood_rolling\n"
        'doc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n"
    )
    return tasks


def test_mnemo_harness_command_matches_direct_computation(tmp_path, capsys):
    lm, tok = _model("gla")
    ckpt = tmp_path / "ckpt"
    lm.save_pretrained(ckpt)
    save_tokenizer(tok, ckpt)
    tasks = _write_tasks(tmp_path)
    out = tmp_path / "results.json"
    argv = ["harness", "--checkpoint", str(ckpt), "--tasks", "mnemo_test_mc,mnemo_test_ppl"]
    argv += ["--include-path", str(tasks), "--batch-size", "4", "--out", str(out), "--log-samples"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "mnemo_test_mc" in printed and "word_perplexity" in printed and f"wrote {out}" in printed
    res = json.loads(out.read_text())
    # the ids the texts were read with are in the results file (no BOS: the end-of-text id conditions)
    cfg = res["config"]
    assert cfg["prefix_token_id"] == tok.eot_id and cfg["add_bos_token"] is False
    assert cfg["stop_token_ids"] == ([] if tok.eot_id is None else [tok.eot_id]) and cfg["rolling"] == "state"
    assert cfg["model_num_parameters"] == sum(p.numel() for p in lm.parameters())

    diffs = []
    mc = res["samples"]["mnemo_test_mc"]
    assert len(mc) == len(MC_DOCS)
    correct = 0
    for s in mc:
        lls = []
        for (context, continuation), resp in zip(s["arguments"], s["resps"]):
            got, greedy = resp[0]
            want, want_greedy = direct_loglikelihood(lm, tok, context, continuation)
            diffs.append((got, want))
            assert greedy == want_greedy
            lls.append(want)
        correct += int(max(range(len(lls)), key=lls.__getitem__) == s["target"])
    assert res["results"]["mnemo_test_mc"]["acc,none"] == pytest.approx(correct / len(MC_DOCS))

    ppl = res["samples"]["mnemo_test_ppl"]
    total_ll, words = 0.0, 0
    for s in ppl:
        text = s["arguments"][0][0]
        want = direct_rolling(lm, tok, text)
        diffs.append((s["resps"][0][0], want))
        total_ll += want
        words += s["word_perplexity"][1]  # lm-eval's word count (re.split on whitespace)
    assert all(close(g, w) for g, w in diffs), max(abs(g - w) for g, w in diffs)
    word_ppl = res["results"]["mnemo_test_ppl"]["word_perplexity,none"]
    assert word_ppl == pytest.approx(math.exp(-total_ll / words), rel=1e-4)


@pytest.mark.parametrize("mixer", ["gla", "attention", "mamba"])
def test_loglikelihood_batched_equals_direct(mixer):
    lm, tok = _model(mixer, seed=1)
    pairs = [("Q: what is 1+1? A:", " 2"), ("hello", " world."), ("x", "yz"), ("", "abc"), ("Ab ", "cd")]
    want = [direct_loglikelihood(lm, tok, *p) for p in pairs]
    reqs = [Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)]
    for bs in (1, 3, 8):  # right padding and batch order change nothing
        got = MnemoLM(model=lm, tokenizer=tok, batch_size=bs).loglikelihood(reqs)
        assert all(close(g[0], w[0]) for g, w in zip(got, want))
        assert [g[1] for g in got] == [w[1] for w in want]


@pytest.mark.parametrize("mixer", ["gla", "attention", "mamba"])
def test_rolling_state_chunks_equal_one_pass(mixer):
    lm, tok = _model(mixer, seed=2)
    docs = ["The quick brown fox jumps over the lazy dog. " * 2, "a", "Hi!"]
    reqs = [Instance("loglikelihood_rolling", {}, (d,), i) for i, d in enumerate(docs)]
    want = [direct_rolling(lm, tok, d) for d in docs]
    for max_length in (7, 64, 2048):  # chunks of max_length tokens with the state carried
        got = MnemoLM(model=lm, tokenizer=tok, max_length=max_length).loglikelihood_rolling(reqs)
        assert all(close(g, w) for g, w in zip(got, want))
    # windows as long as the document: one window, the same number
    got = MnemoLM(model=lm, tokenizer=tok, rolling="window", max_length=2048).loglikelihood_rolling(reqs)
    assert all(close(g, w) for g, w in zip(got, want))
    # short disjoint windows: each from a fresh state, every token scored once
    short = MnemoLM(model=lm, tokenizer=tok, rolling="window", max_length=8).loglikelihood_rolling(reqs[:1])
    assert math.isfinite(short[0]) and short[0] < 0


def test_prefix_token_scores_the_first_token():
    lm, tok = _model("gla", seed=3)
    doc = "Hello there."
    got = MnemoLM(model=lm, tokenizer=tok, prefix_token_id=0).loglikelihood_rolling(
        [Instance("loglikelihood_rolling", {}, (doc,), 0)]
    )[0]
    ids = torch.cat([torch.zeros(1, dtype=torch.long), tok.encode(doc)])
    with torch.no_grad():
        logp = torch.log_softmax(lm(ids[None, :-1])[0][0], -1)
    assert close(got, logp.gather(-1, ids[1:, None]).sum().item())


def test_generate_until_is_greedy_and_stops():
    lm, tok = _model("gla", seed=4)
    prompts = ["KING: ", "Once upon a ", "abc"]
    kw = {"until": ["\n"], "max_gen_toks": 20, "do_sample": False}
    reqs = [Instance("generate_until", {}, (p, dict(kw)), i) for i, p in enumerate(prompts)]
    got = MnemoLM(model=lm, tokenizer=tok, batch_size=2).generate_until(reqs)
    for p, g in zip(prompts, got):
        ids = tok.encode(p)[None]
        full = tok.decode(lm.generate(ids, 20, temperature=0)[0, ids.shape[1] :])
        assert g == full.split("\n")[0]
    # a stop string that appears in the greedy output cuts it there
    first = tok.decode(lm.generate(tok.encode(prompts[0])[None], 20, temperature=0)[0, len(prompts[0]) :])
    stop = first[3:5]
    if stop:
        r = Instance("generate_until", {}, (prompts[0], {"until": [stop], "max_gen_toks": 20}), 0)
        assert MnemoLM(model=lm, tokenizer=tok).generate_until([r])[0] == first.split(stop)[0]


def test_harness_command_errors(tmp_path, capsys):
    lm, tok = _model("gla")
    lm.save_pretrained(tmp_path / "ckpt")
    save_tokenizer(tok, tmp_path / "ckpt")
    tasks = _write_tasks(tmp_path)
    argv = ["harness", "--checkpoint", str(tmp_path / "ckpt"), "--include-path", str(tasks)]
    assert main([*argv, "--tasks", "mnemo_test_mc", "--batch-size", "0"]) == 2
    assert "--batch-size" in capsys.readouterr().err
    assert main(["harness", "--checkpoint", str(tmp_path / "nope"), "--tasks", "x"]) == 2
    assert "argument --checkpoint: expected a run or checkpoint folder" in capsys.readouterr().err
    # --model-args items are key=value options the mnemo model reads; ids are checked up front
    for bad, said in (
        ("max_length", "expected key=value items separated by commas, got 'max_length'"),
        ("foo=1", "unknown option 'foo'"),
        ("rolling=state,rolling=window", "'rolling' is given twice"),
        ("prefix_token_id=999999", "prefix_token_id: expected an id in 0 … "),
        ("max_gen_toks=0", "max_gen_toks: expected a positive int, got '0'"),
    ):
        assert main([*argv, "--tasks", "mnemo_test_mc", "--model-args", bad]) == 2
        assert said in capsys.readouterr().err


def test_generate_until_samples_within_the_tasks_top_k_and_top_p():
    """A task that samples (``do_sample``, ``temperature > 0``) with ``top_k=1`` or a tiny ``top_p``
    gets the greedy text (a nucleus or top-k of the likeliest token alone); without them it samples
    (the same prompt gives another text for some seed of the process-wide generator)."""
    lm, tok = _model()
    model = MnemoLM(model=lm, tokenizer=tok)

    def gen(**kw):
        args = ("The quick", {"until": [], "max_gen_toks": 12, **kw})
        return model.generate_until([Instance("generate_until", {}, args, 0)])[0]

    greedy = gen()
    assert gen(do_sample=True, temperature=1.0, top_k=1) == greedy
    assert gen(do_sample=True, temperature=1.0, top_p=1e-9) == greedy
    torch.manual_seed(0)
    assert any(gen(do_sample=True, temperature=1.0) != greedy for _ in range(5))
