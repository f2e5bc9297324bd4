"""Document packing in training: windows of short documents train and evaluate as if every
document ran alone (``TrainConfig.pack_documents``)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from mnemo.data import TokenStream
from mnemo.train import TrainConfig, Trainer
from mnemo.train.trainer import packed_logits


def test_document_starts_by_hand():
    ids = torch.arange(20)
    s = TokenStream(ids, 6, doc_starts=torch.tensor([0, 4, 5, 13]))
    first = s.document_starts(torch.tensor([0, 3, 10]))
    # window 0 covers 0..5: documents begin at 0, 4, 5; window 3..8: 4, 5 (+ its own start);
    # window 10..15: 13 (+ its own start)
    expect = torch.zeros(3, 6, dtype=torch.bool)
    expect[0, [0, 4, 5]] = True
    expect[1, [0, 1, 2]] = True
    expect[2, [0, 3]] = True
    assert torch.equal(first, expect)


def test_packed_logits_equal_each_document_alone():
    from mnemo.models import LanguageModel, build_config

    torch.manual_seed(0)
    m = LanguageModel(build_config("transformer", vocab_size=30, d_model=32, n_layers=2)).double().eval()
    x = torch.randint(0, 30, (2, 9))
    first = torch.zeros(2, 9, dtype=torch.bool)
    first[0, [3, 4]] = True
    first[1, 6] = True
    out = packed_logits(m, x, first)
    pieces = {0: [(0, 3), (3, 4), (4, 9)], 1: [(0, 6), (6, 9)]}
    for r, spans in pieces.items():
        for a, b in spans:
            alone, _ = m(x[r : r + 1, a:b])
            assert torch.allclose(out[r, a:b], alone[0], atol=1e-12, rtol=0)


def _corpus(tmp_path):
    g = torch.Generator().manual_seed(0)
    words = ["the", "king", "queen", "of", "a", "night", "day", "sings", "runs"]
    lines = []
    for _ in range(300):
        n = int(torch.randint(2, 9, (1,), generator=g))
        doc = " ".join(words[int(i)] for i in torch.randint(0, len(words), (n,), generator=g))
        lines.append(json.dumps({"text": doc + "."}))
    p = tmp_path / "docs.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_packed_training_evaluates_documents_alone(tmp_path):
    data = _corpus(tmp_path)
    cfg = TrainConfig(
        model="gla",
        model_overrides={"d_model": 32, "n_layers": 1},
        data=str(data),
        tokenizer="byte",
        seq_len=48,
        batch_size=4,
        steps=4,
        eval_interval=4,
        eval_batches=2,
        warmup_steps=1,
        sample_tokens=0,
        pack_documents=True,
    )
    tr = Trainer(cfg, tmp_path / "run", progress=False)
    tr.fit()
    got = tr.evaluate(cfg.eval_batches)["val_loss"]
    # independently: split every validation window at its documents and run each piece alone
    model, total, count = tr.model.eval(), 0.0, 0
    starts = set(tr.val_data.doc_starts.tolist())
    with torch.no_grad():
        for w in range(cfg.eval_batches * cfg.batch_size):
            a = w * cfg.seq_len
            cuts = [0] + [j for j in range(1, cfg.seq_len) if a + j in starts] + [cfg.seq_len]
            assert len(cuts) > 2  # short documents: every window holds several
            for s, e in zip(cuts[:-1], cuts[1:]):
                logits, _ = model(tr.val_data.ids[a + s : a + e][None])
                y = tr.val_data.ids[a + s + 1 : a + e + 1]
                total += F.cross_entropy(logits[0].float(), y, reduction="sum").item()
                count += e - s
    assert math.isclose(got, total / count, rel_tol=1e-6)
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert math.isclose([r for r in logged if "val_loss" in r][-1]["val_loss"], got, rel_tol=1e-6)


def test_pack_documents_refuses_tasks():
    with pytest.raises(ValueError, match="TrainConfig.pack_documents"):
        TrainConfig(task="mqar", pack_documents=True).validate()


def test_mnemo_eval_measures_a_packed_run_as_training_did(tmp_path, capsys):
    from mnemo.cli import main

    data = _corpus(tmp_path)
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"model_overrides": {"d_model": 32, "n_layers": 1}}))
    args = [
        "train",
        "--model",
        "gla",
        "--data",
        str(data),
        "--tokenizer",
        "byte",
        "--seq-len",
        "48",
        "--batch-size",
        "4",
        "--steps",
        "2",
        "--eval-interval",
        "2",
        "--eval-batches",
        "2",
        "--warmup-steps",
        "1",
        "--sample-tokens",
        "0",
        "--pack-documents",
        "--out",
        str(tmp_path / "run"),
        "--config",
        str(cfg),
    ]
    code = main(args)
    assert code == 0
    logged = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(tmp_path / "run")]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["pack_documents"] is True and got["as_in_training"] is True
    assert math.isclose(got["val_loss"], logged[-1]["val_loss"], rel_tol=1e-6)
    # unpacked, the same windows give another number (information crosses documents)
    assert main(["eval", "--checkpoint", str(tmp_path / "run"), "--pack-documents", "off"]) == 0
    off = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert off["as_in_training"] is False and abs(off["val_loss"] - got["val_loss"]) > 1e-6
