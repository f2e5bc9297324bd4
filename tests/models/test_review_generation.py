"""Generation under hostile use: arguments named before any work, learned positions checked up
front, the training mode restored after a failed or interrupted generation, sampling that means
what it says, and greedy batches equal to the argmax of a full pass for every model."""

from __future__ import annotations

import math

import pytest
import torch

from mnemo.models import LanguageModel, ModelConfig, build_config, model_names
from mnemo.models.lm import sample_next


def _tiny(name="gla", **kw):
    torch.manual_seed(0)
    return LanguageModel(build_config(name, vocab_size=20, d_model=16, n_layers=1, **kw)).eval()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"top_k": 0}, r"top_k: expected an int >= 1 or None, got 0"),
        ({"top_k": -1}, r"top_k: expected an int >= 1 or None, got -1"),
        ({"top_k": 2.5}, r"top_k: expected an int >= 1 or None, got 2.5"),
        ({"top_k": True}, r"top_k: expected an int >= 1 or None, got True"),
        ({"temperature": float("nan")}, r"temperature: expected a finite number >= 0 \(0: greedy\), got nan"),
        ({"temperature": float("inf")}, r"temperature: expected a finite number >= 0"),
        ({"temperature": -0.5}, r"temperature: expected a finite number >= 0"),
        ({"temperature": "1"}, r"temperature: expected a finite number >= 0 \(0: greedy\), got '1'"),
        ({"temperature": None}, r"temperature: expected a finite number >= 0"),
        ({"on_token": 3}, r"on_token: expected a function"),
    ],
)
@pytest.mark.parametrize("padded", [False, True])
def test_bad_sampling_arguments_are_named_before_any_work(kwargs, match, padded):
    m = _tiny()
    calls = []
    m.register_forward_pre_hook(lambda mod, args: calls.append(1))
    ids = torch.randint(0, 20, (2, 3))
    extra = {"attention_mask": torch.ones(2, 3, dtype=torch.long)} if padded else {}
    if padded and "on_token" in kwargs:
        match = "on_token"
    with pytest.raises(ValueError, match=match):
        m.generate(ids, 2, **kwargs, **extra)
    assert calls == []


def test_valid_sampling_arguments_still_run():
    m = _tiny()
    ids = torch.randint(0, 20, (2, 3))
    g = torch.Generator().manual_seed(0)
    assert m.generate(ids, 2, temperature=torch.tensor(0.5), top_k=3, generator=g).shape == (2, 5)
    assert m.generate(ids, 2, temperature=1, top_k=100, generator=g).shape == (2, 5)


@pytest.mark.parametrize("padded", [False, True])
def test_learned_positions_are_checked_before_decoding(padded):
    """A generation that would run past max_position was refused only when the decode step reached
    it (after the prefill and every step before: the tokens were lost), naming no argument."""
    m = _tiny("transformer_abs", max_position=8)
    calls = []
    m.register_forward_pre_hook(lambda mod, args: calls.append(1))
    ids = torch.zeros(2, 5, dtype=torch.long)
    extra = {"attention_mask": torch.tensor([[0, 1, 1, 1, 1], [1] * 5])} if padded else {}
    with pytest.raises(
        ValueError,
        match=r"max_new_tokens: a prompt of 5 tokens and 5 new ones read 9 "
        r"positions, but the learned positions cover max_position = 8: at most 4 new",
    ):
        m.generate(ids, 5, temperature=0, **extra)
    assert calls == []
    assert m.generate(ids, 4, temperature=0, **extra).shape == (2, 9)  # the last token is not read
    short = {"attention_mask": torch.tensor([[0, 0, 0, 1, 1], [0, 0, 1, 1, 1]])} if padded else {}
    if padded:  # the longest prompt (3 tokens) counts, not the padded width
        assert m.generate(ids, 6, temperature=0, **short).shape == (2, 11)


@pytest.mark.parametrize("padded", [False, True])
def test_the_training_mode_comes_back_after_a_failed_or_interrupted_generation(padded, monkeypatch):
    import mnemo.models.lm as lm

    m = _tiny("transformer")
    m.train()

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(lm, "sample_next", interrupted)
    extra = {"attention_mask": torch.tensor([[0, 1, 1], [1, 1, 1]])} if padded else {}
    with pytest.raises(KeyboardInterrupt):
        m.generate(torch.zeros(2, 3, dtype=torch.long), 4, **extra)
    assert m.training


def test_attention_mask_values_and_type_are_named():
    m = _tiny()
    ids = torch.ones(2, 3, dtype=torch.long)
    with pytest.raises(
        ValueError, match=r"attention_mask: expected 1 \(token\) and 0 \(padding\) only, got 2"
    ):
        m.generate(ids, 1, attention_mask=torch.tensor([[1, 1, 1], [0, 2, 2]]))
    with pytest.raises(
        ValueError, match=r"attention_mask: expected 1 \(token\) and 0 \(padding\) only, got 0.5"
    ):
        m.generate(ids, 1, attention_mask=torch.full((2, 3), 0.5))
    with pytest.raises(ValueError, match="attention_mask: expected a tensor"):
        m.generate(ids, 1, attention_mask=[[1, 1, 1], [1, 1, 1]])
    # bool and float masks of 0 / 1 are read as such
    bool_mask = torch.tensor([[False, True, True], [True, True, True]])
    a = m.generate(ids, 2, temperature=0, attention_mask=bool_mask)
    assert torch.equal(a, m.generate(ids, 2, temperature=0, attention_mask=bool_mask.float()))


def test_state_size_bytes_names_bad_arguments():
    for name in ("gla", "transformer"):
        m = _tiny(name)
        for args, which in (
            ((-1, 0), "batch_size"),
            ((1, -5), "seq_len"),
            ((1.5, 2), "batch_size"),
            ((1, 2.5), "seq_len"),
        ):
            with pytest.raises(ValueError, match=f"state_size_bytes: {which} expected an int >= 0"):
                m.state_size_bytes(*args)
        assert m.state_size_bytes(0, 0) == 0


@pytest.mark.parametrize("temperature, top_k", [(1.0, None), (0.5, None), (2.0, 3), (1.0, 2), (0.7, 1)])
def test_sampled_frequencies_match_the_hand_computed_distribution(temperature, top_k):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    z = [v / temperature for v in logits.tolist()]
    if top_k is not None:
        kth = sorted(z, reverse=True)[top_k - 1]
        z = [v if v >= kth else -math.inf for v in z]
    e = [math.exp(v - max(z)) for v in z]
    p = torch.tensor([v / sum(e) for v in e], dtype=torch.float64)
    n = 100_000
    draws = sample_next(logits.expand(n, 5), temperature, top_k, torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=5).double() / n
    assert (freq[p == 0] == 0).all()  # outside the top k: never
    assert (freq - p).abs().max() < 5 * math.sqrt(0.25 / n)


def test_top_k_one_and_tiny_temperatures_are_greedy():
    x = torch.randn(500, 50, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    assert torch.equal(sample_next(x, 1.3, 1, g), x.argmax(-1))
    for t in (1e-30, 1e-39, 0.0):
        assert torch.equal(sample_next(x, t, None, g), x.argmax(-1))
    assert torch.equal(sample_next(x.double(), 1e-300, None, g), x.argmax(-1))


def test_same_generator_seed_same_tokens_and_eos_rows_keep_their_end():
    torch.manual_seed(0)
    m = LanguageModel(build_config("gla", vocab_size=6, d_model=16, n_layers=1)).eval()
    ids = torch.randint(0, 6, (4, 3), generator=torch.Generator().manual_seed(0))
    a = m.generate(ids, 20, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, m.generate(ids, 20, generator=torch.Generator().manual_seed(5)))
    out = m.generate(ids, 20, generator=torch.Generator().manual_seed(5), eos_token_id=[2, 4])
    for r in range(4):
        ref, new = a[r, 3:].tolist(), out[r, 3:].tolist()
        cut = next((i for i, t in enumerate(ref) if t in (2, 4)), None)
        assert cut is not None  # (this seed ends every row)
        assert new[: cut + 1] == ref[: cut + 1] and set(new[cut:]) == {ref[cut]}


@pytest.mark.parametrize("name", model_names())
def test_greedy_batches_over_many_steps_equal_the_argmax_of_a_full_pass(name):
    """Three rows, prompts of 1 token (shorter than any conv window) and 6, 40 new tokens (past
    chunk, segment and CMS period boundaries)."""
    torch.manual_seed(0)
    base = build_config(name, vocab_size=50)
    small = {"d_model": 16, "n_layers": len(base.pattern) if base.pattern else 2}
    m = LanguageModel(build_config(name, vocab_size=50, **small)).double().eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    for P in (1, 6):
        prompt = torch.randint(0, 50, (3, P), generator=torch.Generator().manual_seed(2))
        out = m.generate(prompt, 40, temperature=0)
        with torch.no_grad():
            full, _ = m(out)
        assert torch.equal(full[:, P - 1 : -1].argmax(-1), out[:, P:]), (name, P)


@pytest.fixture(scope="module")
def abs_run(tmp_path_factory):
    """A one-step run of the learned-position transformer (max_position 4096)."""
    from mnemo.cli import main

    out = tmp_path_factory.mktemp("review_gen") / "run"
    args = ["--model", "transformer_abs", "--steps", "1", "--seq-len", "16", "--batch-size", "2"]
    args += ["--eval-interval", "1", "--eval-batches", "1", "--d-model", "16", "--n-layers", "1"]
    assert main(["train", "--out", str(out), *args, "--sample-tokens", "0", "--no-progress"]) == 0
    return out


def test_mnemo_generate_refuses_a_length_past_learned_positions_before_decoding(abs_run, capsys, monkeypatch):
    """`mnemo generate --max-new-tokens 5000` on a learned-position checkpoint (max_position 4096)
    decoded ~4,090 tokens, then failed with "learned positions cover max_position = 4096 tokens, but
    the sequence reaches 4097" and printed nothing it had made. Now refused before decoding,
    naming the flag and how many tokens fit."""
    from mnemo.cli import main

    out = abs_run
    capsys.readouterr()
    calls = []
    monkeypatch.setattr(LanguageModel, "generate", lambda *a, **k: calls.append(1))
    gen = ["generate", "--checkpoint", str(out), "--prompt", "KING:"]
    assert main([*gen, "--max-new-tokens", "5000"]) == 2
    err = capsys.readouterr().err
    assert (
        "--max-new-tokens: a prompt of 5 tokens and 5,000 new ones pass the model's learned positions" in err
    )
    assert "(max_position = 4096); at most 4,092 new tokens fit" in err
    assert calls == []
    monkeypatch.undo()
    assert main([*gen, "--max-new-tokens", "3", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("KING:")


def test_mnemo_eval_names_a_length_past_learned_positions_before_any_line(abs_run, capsys):
    """`mnemo eval --length 16,5000` on a learned-position checkpoint printed the 16-token line, then
    failed with the model's "the sequence reaches 5000", naming no flag."""
    from mnemo.cli import main

    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(abs_run), "--length", "16,5000", "--max-batches", "1"]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert "--length: 5000 tokens exceed the model's learned positions (max_position = 4096)" in out.err
    assert main(["eval", "--checkpoint", str(abs_run), "--seq-len", "5000"]) == 2
    assert "--seq-len: 5000 tokens exceed" in capsys.readouterr().err


def test_a_state_that_is_not_the_per_layer_list_is_named():
    m = _tiny("gla")
    with torch.no_grad():
        _, state = m(torch.randint(0, 20, (2, 5)))
        with pytest.raises(
            ValueError, match=r"state must be the list of per-layer BlockState .* got BlockState"
        ):
            m(torch.randint(0, 20, (2, 1)), state[0])
        m(torch.randint(0, 20, (2, 1)), tuple(state))  # a tuple of them is fine
        with pytest.raises(ValueError, match=r"state must be the list of per-layer BlockState .* got int"):
            m(torch.randint(0, 20, (2, 1)), 3)


def _frequencies(logits, n=20000, **kw):
    gen = torch.Generator().manual_seed(0)
    draws = sample_next(logits.expand(n, -1), kw.pop("temperature", 1.0), kw.pop("top_k", None), gen, **kw)
    return torch.bincount(draws, minlength=logits.shape[-1]).double() / n


def test_top_p_samples_the_nucleus_renormalised():
    """Nucleus sampling (Holtzman et al. 2020) on a known distribution, against a hand computation:
    probabilities 0.5 / 0.3 / 0.15 / 0.05 with top_p 0.7 keep the first two (0.5 < 0.7 before the
    second, 0.8 >= 0.7 before the third) at 0.625 / 0.375; top_p 0.5 keeps the first alone; 1 keeps
    all; after top_k 3 and temperature 2 the nucleus is taken on the tempered, cut distribution."""
    p = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    logits = p.log()[None]
    n = 20000

    def close(got, want):
        sigma = (torch.as_tensor(want) * (1 - torch.as_tensor(want)) / n).sqrt()
        assert ((got - torch.as_tensor(want)).abs() <= 5 * sigma + 1e-12).all(), (got, want)

    close(_frequencies(logits, top_p=0.7), [0.625, 0.375, 0, 0])
    close(_frequencies(logits, top_p=0.5), [1, 0, 0, 0])
    close(_frequencies(logits, top_p=1.0), p.tolist())
    tempered = p.sqrt()[:3] / p.sqrt()[:3].sum()  # temperature 2, then the top 3
    assert tempered[0] < 0.75 <= tempered[0] + tempered[1]  # the nucleus is the first two
    want = torch.zeros(4, dtype=torch.float64)
    want[:2] = tempered[:2] / tempered[:2].sum()
    close(_frequencies(logits, temperature=2.0, top_k=3, top_p=0.75), want.tolist())
    # equal probabilities at the nucleus' edge: the lower id is taken first
    tie = torch.tensor([[0.0, 0.0, -30.0]], dtype=torch.float64)
    close(_frequencies(tie, top_p=0.4), [1, 0, 0])


def test_top_p_through_generate_and_the_cli(tmp_path, capsys):
    from mnemo.cli import main

    torch.manual_seed(0)
    lm = LanguageModel(ModelConfig(vocab_size=20, d_model=16, n_layers=1, mixer="gla")).eval()
    ids = torch.tensor([[1, 2, 3]])
    greedy = lm.generate(ids, 6, temperature=0)
    tiny = lm.generate(ids, 6, top_p=1e-9, generator=torch.Generator().manual_seed(1))
    assert torch.equal(tiny, greedy)  # the nucleus of the likeliest token alone
    for bad in (0, 1.5, True, "0.9"):
        with pytest.raises(ValueError, match="top_p: expected a number in \\(0, 1\\] or None"):
            lm.generate(ids, 2, top_p=bad)
    from mnemo.data.tokenizer import CharTokenizer, save_tokenizer

    ck = tmp_path / "ck"
    lm.save_pretrained(ck)
    save_tokenizer(CharTokenizer.from_text("abcdefghij"), ck)
    capsys.readouterr()
    argv = ["generate", "--checkpoint", str(ck), "--prompt", "abc", "--max-new-tokens", "8"]
    assert main([*argv, "--temperature", "0"]) == 0
    greedy_text = capsys.readouterr().out
    assert main([*argv, "--top-p", "1e-9", "--seed", "3"]) == 0
    assert capsys.readouterr().out == greedy_text
    assert main([*argv, "--top-p", "0"]) == 2
    assert "argument --top-p: expected a finite number in (0, 1]" in capsys.readouterr().err
