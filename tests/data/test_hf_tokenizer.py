"""Hugging Face tokenizers: trained with `mnemo tokenizer train`, used by `mnemo train
--tokenizer`, carried inside checkpoints as the Hugging Face file itself, read back by
`load_tokenizer` for eval and generate; mnemo's char/byte format unchanged."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

pytest.importorskip("tokenizers")

from mnemo.cli import main  # noqa: E402
from mnemo.commands.tokenizer import train_tokenizer  # noqa: E402
from mnemo.data import (  # noqa: E402
    ByteTokenizer,
    CharTokenizer,
    HFTokenizer,
    build_tokenizer,
    load_text,
    load_tokenizer,
    save_tokenizer,
)
from mnemo.train import TrainConfig, resolve_checkpoint  # noqa: E402

SLICE = 60_000  # characters of tinyshakespeare to train the test tokenizer on
FAST = ["--seq-len", "32", "--batch-size", "4", "--eval-interval", "3", "--eval-batches", "1"]
FAST += ["--d-model", "32", "--n-layers", "1", "--sample-tokens", "10", "--no-progress"]
SAMPLES = [
    "ROMEO:\nBut soft, what light through yonder window breaks?\n\n",
    "héllo wörld — naïve café, 日本語, emoji 🙂\r\n\ttabs  and   spaces ",
    "",
    " leading space",
    "x<|endoftext|>y",
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    """A byte-level BPE (vocabulary 320) trained by the command on a slice of tinyshakespeare."""
    d = tmp_path_factory.mktemp("tok")
    (d / "slice.txt").write_text(load_text("tinyshakespeare")[:SLICE], encoding="utf-8")
    argv = ["tokenizer", "train", "--data", str(d / "slice.txt"), "--vocab-size", "320"]
    argv += ["--out", str(d / "bpe")]
    assert main(argv) == 0
    return d / "bpe"


def test_bpe_round_trips_and_counts(tok_dir):
    tok = build_tokenizer(str(tok_dir))  # a folder holding tokenizer.json
    assert isinstance(tok, HFTokenizer) and tok.kind == "hf" and tok.model_type == "bpe"
    assert tok.vocab_size == 320 == tok.tokenizer.get_vocab_size(with_added_tokens=True)
    assert tok.eot_id == 0 and tok.eot_token == "<|endoftext|>"
    for s in SAMPLES:
        ids = tok.encode(s)
        assert ids.dtype == torch.long and ids.dim() == 1
        assert tok.decode(ids) == s and tok.decode(ids.tolist()) == s
        assert tok.num_chars(s) == len(s)
    text = load_text("tinyshakespeare")[:SLICE]
    assert len(text) / tok.encode(text).numel() > 1.4  # merges learned: fewer tokens than chars
    assert tok.encode("x<|endoftext|>y").tolist().count(0) == 1  # the special token is read as one
    # the file itself works too, and batch encoding equals one-by-one
    same = build_tokenizer(str(tok_dir / "tokenizer.json"))
    assert same.encode_batch(SAMPLES) == [tok.encode(s).tolist() for s in SAMPLES]


def test_unigram_round_trips():
    text = load_text("tinyshakespeare")[:20_000]
    tok = HFTokenizer(train_tokenizer([text], 300, "unigram"))
    assert tok.model_type == "unigram" and tok.eot_id == 0 and tok.vocab_size <= 300
    for s in SAMPLES:
        assert tok.decode(tok.encode(s)) == s
    with pytest.raises(ValueError, match="--min-frequency applies to --kind bpe only"):
        train_tokenizer([text], 300, "unigram", min_frequency=3)
    with pytest.raises(ValueError, match="--vocab-size: expected an int >= 258"):
        train_tokenizer([text], 100)


def test_checkpoint_file_is_the_hugging_face_file(tok_dir, tmp_path):
    import tokenizers

    tok = load_tokenizer(tok_dir)
    save_tokenizer(tok, tmp_path)
    raw = json.loads((tmp_path / "tokenizer.json").read_text())
    assert "model" in raw and "kind" not in raw and raw["model"]["type"] == "BPE"
    direct = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert direct.encode(SAMPLES[0]).ids == tok.encode(SAMPLES[0]).tolist()
    back = load_tokenizer(tmp_path)
    assert isinstance(back, HFTokenizer) and back.to_dict() == tok.to_dict()
    # transformers' AutoTokenizer reads the same folder (tokenizer_config.json written beside it)
    transformers = pytest.importorskip("transformers")
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert auto(SAMPLES[0])["input_ids"] == tok.encode(SAMPLES[0]).tolist()
    assert auto.eos_token_id == tok.eot_id
    # mnemo's own formats keep their {"kind": ...} object and load as before
    for own in (CharTokenizer.from_text("abc\n"), ByteTokenizer()):
        save_tokenizer(own, tmp_path)
        assert json.loads((tmp_path / "tokenizer.json").read_text())["kind"] == own.kind
        again = load_tokenizer(tmp_path)
        assert type(again) is type(own) and again.to_dict() == own.to_dict() and again.eot_id is None
    (tmp_path / "tokenizer.json").write_text(json.dumps({"kind": "bpe"}))
    with pytest.raises(ValueError, match="unknown tokenizer kind 'bpe'"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "Nope"}}))
    with pytest.raises(ValueError, match="not a valid Hugging Face tokenizer file"):
        load_tokenizer(tmp_path)


def test_missing_tokenizers_library_says_how_to_install(tok_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # `import tokenizers` raises ImportError
    with pytest.raises(ImportError, match=r'pip install "mnemo\[hf\]"'):
        load_tokenizer(tok_dir)
    # char and byte never need it
    assert build_tokenizer("char", "ab").vocab_size == 3 and build_tokenizer("byte").vocab_size == 256


def test_tokenizer_config_values(tmp_path):
    with pytest.raises(ValueError, match="TrainConfig.tokenizer: expected 'char', 'byte' or a path"):
        TrainConfig(tokenizer="bpe").validate()
    TrainConfig(tokenizer=str(tmp_path / "later" / "tok")).validate()  # a path: read when training
    with pytest.raises(FileNotFoundError, match="tokenizer not found: .* neither 'char', 'byte'"):
        build_tokenizer(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="TrainConfig.text_field"):
        TrainConfig(text_field="").validate()


def test_train_generate_eval_resume_with_a_bpe_tokenizer(tok_dir, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "--model", "gla", "--tokenizer", str(tok_dir), "--out", str(out), "--steps", "3", *FAST]
    assert main(argv) == 0
    ckpt = resolve_checkpoint(out)
    # the checkpoint carries the Hugging Face file itself; the model's vocabulary is the tokenizer's
    assert (ckpt / "tokenizer.json").read_text() == (tok_dir / "tokenizer.json").read_text()
    assert json.loads((ckpt / "config.json").read_text())["vocab_size"] == 320
    record = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][-1]
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(out), "--prompt", "ROMEO:", "--max-new-tokens", "8"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("ROMEO:") and len(text.rstrip("\n")) > len("ROMEO:")
    assert main(["eval", "--checkpoint", str(out)]) == 0
    ev = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert ev["as_in_training"] and ev["val_loss"] == pytest.approx(record["val_loss"], rel=1e-9)
    assert ev["bpc"] == pytest.approx(record["val_bpc"], rel=1e-9)
    # bits per character count characters: the tokens stand for more than one each
    assert record["val_bpc"] < record["val_loss"] / math.log(2)
    # resume reads the tokenizer from the checkpoint, even with the tokenizer folder gone
    (tok_dir.parent / "moved").mkdir(exist_ok=True)
    (tok_dir / "tokenizer.json").rename(tok_dir.parent / "moved" / "tokenizer.json")
    try:
        resume = ["train", "--resume", "--out", str(out), "--steps", "4", "--reschedule", "hold"]
        assert main([*resume, "--no-progress"]) == 0
    finally:
        (tok_dir.parent / "moved" / "tokenizer.json").rename(tok_dir / "tokenizer.json")
    assert resolve_checkpoint(out).name == "ckpt-000004"


def test_tokenizer_command_errors(tok_dir, tmp_path, capsys):
    argv = ["tokenizer", "train", "--data", "tinyshakespeare", "--vocab-size", "300", "--out", str(tok_dir)]
    assert main(argv) == 2
    assert "exists (pass --overwrite to replace it)" in capsys.readouterr().err
    argv = ["tokenizer", "train", "--data", str(tmp_path / "nope.txt"), "--vocab-size", "300"]
    assert main([*argv, "--out", str(tmp_path / "t")]) == 2
    assert "data file not found" in capsys.readouterr().err
    argv = ["tokenizer", "train", "--data", "tinyshakespeare", "--vocab-size", "300", "--kind", "unigram"]
    assert main([*argv, "--min-frequency", "2", "--out", str(tmp_path / "u")]) == 2
    assert "--min-frequency applies to --kind bpe only" in capsys.readouterr().err


def test_tokenizer_train_refuses_a_model_checkpoint(tmp_path, capsys):
    """Hostile trial 13: `tokenizer train --out CKPT --overwrite` into a standalone checkpoint (a
    conversion or an export) replaced its tokenizer with one of other ids: generate then failed
    with "input_ids must lie in [0, vocab_size)". Refused before the work; the files stay."""
    ck = tmp_path / "cv1"
    ck.mkdir()
    (ck / "config.json").write_text("{}")
    (ck / "model.safetensors").write_bytes(b"x")
    (ck / "tokenizer.json").write_text('{"kind": "char"}')
    argv = ["tokenizer", "train", "--data", "tinyshakespeare", "--vocab-size", "300", "--overwrite"]
    assert main([*argv, "--out", str(ck)]) == 2
    assert f"--out: {ck} holds a model checkpoint (config.json / *.safetensors)" in capsys.readouterr().err
    assert (ck / "tokenizer.json").read_text() == '{"kind": "char"}'
