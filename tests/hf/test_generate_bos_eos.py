"""``mnemo generate`` on a converted checkpoint reads the prompt and stops as ``transformers`` does:
a Llama/Mistral-style tokenizer whose post-processor puts a BOS before every text gets that BOS
before the prompt (``HFTokenizer.special_prefix``), so greedy decoding equals ``transformers``'
``generate`` on ``tokenizer(prompt)``; a tokenizer without one adds nothing; the end-of-text id the
release declares ends the text (``--ignore-eos`` runs every step). ``LanguageModel.generate``'s
``eos_token_id`` against a hand cut of the plain greedy tokens. Tiny random-weight models built with
transformers itself."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from mnemo.cli import main  # noqa: E402
from mnemo.data import load_tokenizer  # noqa: E402
from mnemo.hf.convert import convert  # noqa: E402

TEXT = ["the memory of the model is a state", "a state that the model keeps"] * 20


def _tokenizer(bos_template: bool):
    """A byte-level BPE with ``<s>`` (id 0) and ``</s>`` (id 1); with ``bos_template`` its
    post-processor puts ``<s>`` before a text, as Llama's and Mistral's do."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(TEXT, trainer)
    if bos_template:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def _folder(tmp_path, bos_template: bool, eos: int | None = 1):
    fast = _tokenizer(bos_template)
    src = tmp_path / "hf"
    fast.save_pretrained(src)
    torch.manual_seed(0)
    cfg = transformers.Mamba2Config(
        vocab_size=len(fast), hidden_size=16, num_hidden_layers=2, state_size=4, num_heads=8, head_dim=4,
        n_groups=2, chunk_size=8, bos_token_id=0, eos_token_id=eos, pad_token_id=1,
    )  # fmt: skip
    model = transformers.Mamba2ForCausalLM(cfg).eval()
    with torch.no_grad():  # away from the init so that greedy tokens differ with the first token
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    model.generation_config.eos_token_id = eos
    model.save_pretrained(src)
    convert(src, tmp_path / "mn")
    return fast, model, tmp_path / "mn"


@pytest.mark.parametrize("bos_template", [True, False])
def test_generate_reads_the_prompt_as_the_tokenizer_of_the_release_does(tmp_path, capsys, bos_template):
    fast, hf, mn = _folder(tmp_path, bos_template, eos=None)
    prompt, n = "the memory", 6
    ids = fast(prompt, return_tensors="pt").input_ids
    assert (ids[0, 0].item() == 0) == bos_template  # transformers' own reading of the prompt
    assert load_tokenizer(mn).special_prefix() == ([0] if bos_template else [])
    with torch.no_grad():
        ref = hf.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=1)
    expected = fast.decode(ref[0, ids.shape[1] :])
    capsys.readouterr()
    argv = ["generate", "--checkpoint", str(mn), "--prompt", prompt, "--temperature", "0"]
    assert main([*argv, "--max-new-tokens", str(n)]) == 0
    out = capsys.readouterr().out
    assert out == prompt + expected + "\n"  # the BOS is read, not printed


def test_special_prefix_names_every_leading_special_token_and_only_those():
    """A template ``<s> </s> $A </s>`` puts two special tokens first and one last: the prefix is
    the two leading ones (the trailing one is not part of it)."""
    from tokenizers import processors

    from mnemo.data.tokenizer import HFTokenizer

    fast = _tokenizer(False)
    raw = fast.backend_tokenizer
    raw.post_processor = processors.TemplateProcessing(
        single="<s> </s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 1)]
    )
    assert HFTokenizer(raw).special_prefix() == [0, 1]
    assert HFTokenizer(raw).encode("a state")[0].item() not in (0, 1)  # encode still adds nothing


def test_generate_stops_at_the_end_id_the_release_declares(tmp_path, capsys):
    """The third greedy token made the release's end-of-text id: ``transformers`` stops there,
    and so does ``mnemo generate`` (the end token is not printed); ``--ignore-eos`` runs all
    ``--max-new-tokens``."""
    prompt, n = "the memory", 6
    fast, hf, _ = _folder(tmp_path / "a", False, eos=None)
    ids = fast(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        free = hf.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=1)
    new = free[0, ids.shape[1] :].tolist()
    eos = new[2]
    cut = new.index(eos)  # its first occurrence (2, or earlier when the token came before)
    fast, hf, mn = _folder(tmp_path / "b", False, eos=eos)
    with torch.no_grad():
        stopped = hf.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=1)
    assert stopped[0, ids.shape[1] :].tolist() == new[: cut + 1]  # transformers itself stops there
    argv = ["generate", "--checkpoint", str(mn), "--prompt", prompt, "--temperature", "0"]
    capsys.readouterr()
    assert main([*argv, "--max-new-tokens", str(n)]) == 0
    assert capsys.readouterr().out == prompt + fast.decode(new[:cut]) + "\n"
    assert main([*argv, "--max-new-tokens", str(n), "--ignore-eos"]) == 0
    assert capsys.readouterr().out == prompt + fast.decode(new) + "\n"


def test_language_model_generate_stops_each_row_at_its_end_id():
    """Greedy rows with and without ``eos_token_id``: up to a row's first end id the tokens are the
    plain run's; after it the row repeats that end id; the call stops once every row has ended (or
    at ``max_new_tokens``). Several ids: each row ends at the first of any."""
    from mnemo.models import LanguageModel, build_config

    torch.manual_seed(0)
    model = LanguageModel(build_config("gated_deltanet", vocab_size=16, d_model=16, n_layers=1))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn_like(p))
    ids = torch.randint(0, 16, (3, 5), generator=torch.Generator().manual_seed(1))
    n = 12
    free = model.generate(ids, n, temperature=0)[:, 5:]

    def by_hand(ends):
        rows, stop = [], 0
        for row in free.tolist():
            at = next((i for i, t in enumerate(row) if t in ends), None)
            rows.append(row if at is None else row[: at + 1] + [row[at]] * (n - at - 1))
            stop = max(stop, n if at is None else at + 1)
        return torch.tensor(rows)[:, :stop]

    for ends in ([free[0, 3].item()], [free[0, 3].item(), free[1, 1].item()], [free[2, 0].item()]):
        got = model.generate(ids, n, temperature=0, eos_token_id=ends if len(ends) > 1 else ends[0])
        assert torch.equal(got[:, :5], ids)
        assert torch.equal(got[:, 5:], by_hand(set(ends))), ends
    for bad in (16, -1, [], [3, 99], True, 1.0):
        with pytest.raises(ValueError, match="eos_token_id"):
            model.generate(ids, 2, temperature=0, eos_token_id=bad)
    with pytest.raises(ValueError, match="eos_token_id: not supported with attention_mask"):
        model.generate(ids, 2, temperature=0, eos_token_id=1, attention_mask=torch.ones_like(ids))


def test_the_end_id_is_read_where_transformers_reads_it(tmp_path):
    """``generation_config.json`` where it exists (without an ``eos_token_id`` there: none, even
    when ``config.json`` has one — transformers then generates every step), else the carried field
    of a converted checkpoint, else ``config.json``'s own (a transformers one, or the ids
    ``MnemoForCausalLM.save_pretrained`` writes to mnemo's, which ``from_pretrained`` and
    ``AutoConfig`` read: review 42h); never for a training run."""
    import json

    from mnemo.hf.special_ids import checkpoint_eos

    def write(name, data):
        (tmp_path / name).write_text(json.dumps(data))

    write("config.json", {"model_type": "mamba2", "eos_token_id": 5})
    assert checkpoint_eos(tmp_path) == 5
    write(
        "hf_config_carried.json", {"source_architecture": "Mamba2ForCausalLM", "fields": {"eos_token_id": 7}}
    )
    assert checkpoint_eos(tmp_path) == 7
    write("generation_config.json", {"eos_token_id": [3, 4]})
    assert checkpoint_eos(tmp_path) == [3, 4]
    write("generation_config.json", {"_from_model_config": True})
    assert checkpoint_eos(tmp_path) is None
    (tmp_path / "generation_config.json").unlink()
    (tmp_path / "hf_config_carried.json").unlink()
    write("config.json", {"model_type": "mnemo", "eos_token_id": 5})
    assert checkpoint_eos(tmp_path) == 5
    write("config.json", {"model_type": "mnemo"})
    assert checkpoint_eos(tmp_path) is None
    write("config.json", {"model_type": "mamba2", "eos_token_id": 5})
    write("train_config.json", {})
    assert checkpoint_eos(tmp_path) is None
