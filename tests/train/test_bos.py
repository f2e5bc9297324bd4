"""``TrainConfig.bos``: a fixed first token at position 0 of every text window (StreamingLLM's
pretraining with a sink token), in training, in the training log's evaluation and in ``mnemo eval``."""

from __future__ import annotations

import json

import pytest
import torch

from mnemo.cli import main
from mnemo.train import TrainConfig
from mnemo.train.batches import RunData, bos_id, with_bos

BASE = dict(model="gla", model_overrides={"d_model": 32, "n_layers": 1}, seq_len=16, batch_size=4)


def test_the_windows_start_with_the_token_and_are_otherwise_the_same_text():
    plain = RunData(TrainConfig(**BASE))
    data = RunData(TrainConfig(**BASE, bos="\x02"))
    assert data.bos_id == 0  # an absent character: the char tokenizer's unknown id, which no text id is
    assert not (data.train_data.ids == 0).any()
    x0, y0, _ = plain.next_batch(0, plain.batch_generator())
    x, y, _ = data.next_batch(0, data.batch_generator())
    assert (x[:, 0] == 0).all()
    assert torch.equal(x[:, 1:], x0[:, 1:]) and torch.equal(y, y0)  # [BOS, t1 … t_{T-1}] -> t1 … t_T
    # a character of the text is that character's id
    assert RunData(TrainConfig(**BASE, bos="\n")).bos_id == plain.tokenizer.encode("\n").item()
    assert with_bos(x0, None) is x0


def test_a_text_of_more_than_one_token_is_refused_naming_bos():
    data = RunData(TrainConfig(**BASE))
    with pytest.raises(ValueError, match=r"TrainConfig.bos \(--bos\): expected a text of exactly one token"):
        bos_id(data.tokenizer, "<s>")


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"task": "mqar"}, "expected task = None with bos = '<'"),
        ({"pack_documents": True}, "expected pack_documents = False"),
        ({"carry_state": True}, "expected carry_state = False"),
        ({"bos": ""}, r"TrainConfig.bos: expected None or a non-empty text"),
    ],
)
def test_settings_bos_cannot_run_with_are_named(extra, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**{**BASE, "bos": "<", **extra}).validate()


def test_mnemo_eval_measures_what_training_logged_with_the_first_token(tmp_path, capsys):
    """The run's log and ``mnemo eval`` read the same windows with BOS first: the same loss; a
    model evaluated without it reads other inputs (a different loss)."""
    out = tmp_path / "run"
    flags = ["--model", "gla", "--d-model", "32", "--n-layers", "1", "--seq-len", "16"]
    flags += [
        "--batch-size",
        "4",
        "--steps",
        "3",
        "--eval-interval",
        "3",
        "--eval-batches",
        "2",
        "--warmup-steps",
        "1",
    ]
    flags += ["--sample-tokens", "0", "--no-progress", "--bos", "\x02"]
    assert main(["train", "--out", str(out), *flags]) == 0
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(out)]) == 0
    measured = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert measured["val_loss"] == pytest.approx(logged["val_loss"], rel=1e-6)
    saved = json.loads(next(out.glob("ckpt-*/train_config.json")).read_text())
    assert saved["bos"] == "\x02"
    # the first token matters: the same model without it gives another number
    from mnemo.models import LanguageModel
    from mnemo.train import resolve_checkpoint

    model = LanguageModel.from_pretrained(resolve_checkpoint(out)).eval()
    data = RunData(TrainConfig(**BASE, bos="\x02"))
    x, y = next(iter(data.val_data.eval_batches(4, 1)))
    with torch.no_grad():
        a = torch.nn.functional.cross_entropy(model(with_bos(x, 0))[0].transpose(1, 2), y)
        b = torch.nn.functional.cross_entropy(model(x)[0].transpose(1, 2), y)
    assert a.item() != b.item()


def test_a_task_run_refuses_bos_on_the_command_line(tmp_path, capsys):
    assert main(["train", "--task", "mqar", "--bos", "<", "--out", str(tmp_path / "r")]) == 2
    assert "--bos: text options" in capsys.readouterr().err


def test_generation_reads_the_first_token_before_the_prompt_and_does_not_print_it(tmp_path, capsys):
    """``mnemo generate`` on a run trained with ``--bos`` gives the model ``[BOS] + prompt``, as
    its windows were; greedy decoding equals a hand loop from those ids, and the text holds the
    prompt and the new characters only."""
    from mnemo.data import load_tokenizer
    from mnemo.models import LanguageModel
    from mnemo.train import resolve_checkpoint

    out = tmp_path / "run"
    flags = ["--model", "gla", "--d-model", "32", "--n-layers", "1", "--seq-len", "16", "--batch-size", "4"]
    flags += ["--steps", "2", "--eval-interval", "2", "--eval-batches", "1", "--warmup-steps", "1"]
    assert (
        main(["train", "--out", str(out), *flags, "--sample-tokens", "0", "--no-progress", "--bos", "\x02"])
        == 0
    )
    capsys.readouterr()
    assert (
        main(
            [
                "generate",
                "--checkpoint",
                str(out),
                "--prompt",
                "ROM",
                "--max-new-tokens",
                "6",
                "--temperature",
                "0",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out.rstrip("\n")
    ckpt = resolve_checkpoint(out)
    model, tok = LanguageModel.from_pretrained(ckpt).eval(), load_tokenizer(ckpt)
    ids = torch.cat([torch.tensor([0]), tok.encode("ROM")])[None]
    with torch.no_grad():
        for _ in range(6):
            ids = torch.cat([ids, model(ids)[0][:, -1].argmax(-1, keepdim=True)], dim=1)
    assert text == tok.decode(ids[0, 1:]) and text.startswith("ROM") and len(text) == 9


def test_probe_timescales_reads_the_text_with_the_runs_first_token(tmp_path, capsys):
    """``mnemo probe timescales`` on a run trained with ``--bos`` measures the gates on the text as
    the run's windows read it (the BOS at position 0): equal to :func:`timescales` on those ids by
    hand, and different from the plain text's (a gated model's gates depend on the token)."""
    from mnemo.data import load_text, load_tokenizer
    from mnemo.interp.timescales import timescales
    from mnemo.models import LanguageModel
    from mnemo.train import resolve_checkpoint

    out = tmp_path / "run"
    flags = ["--model", "gla", "--d-model", "32", "--n-layers", "1", "--seq-len", "16", "--batch-size", "4"]
    flags += ["--steps", "2", "--eval-interval", "2", "--eval-batches", "1", "--warmup-steps", "1"]
    flags += ["--sample-tokens", "0", "--no-progress", "--bos", "\x02"]
    assert main(["train", "--out", str(out), *flags]) == 0
    capsys.readouterr()
    argv = ["probe", "timescales", "--checkpoint", str(out), "--tokens", "24", "--out", str(tmp_path / "p")]
    assert main(argv) == 0
    captured = capsys.readouterr()
    got = json.loads(captured.out.strip().splitlines()[-1])["layers"]
    assert "the run's first token '\\x02'" in captured.err
    ckpt = resolve_checkpoint(out)
    model, tok = LanguageModel.from_pretrained(ckpt).eval(), load_tokenizer(ckpt)
    ids = tok.encode(load_text("tinyshakespeare")[:24])[None]
    as_trained = json.loads(json.dumps(timescales(model, with_bos(ids, bos_id(tok, "\x02")))))
    plain = json.loads(json.dumps(timescales(model, ids)))
    assert got == as_trained and got != plain


def test_probe_circuits_and_the_tracker_score_a_bos_run_as_it_trained(tmp_path, capsys, monkeypatch):
    """``mnemo probe circuits`` on a ``--bos`` run puts the BOS before its random sequences and
    leaves position 0 out of the scores (equal to :func:`circuit_scores` with ``bos`` and to the
    scores computed by hand from the maps on those ids); the tracker reads the run's BOS from the
    trainer's data; a BOS outside the vocabulary is refused."""
    from mnemo.data import load_tokenizer
    from mnemo.interp import capture_maps, circuit_scores, induction_score
    from mnemo.interp.scores import normalise, repeated_random_tokens
    from mnemo.models import LanguageModel
    from mnemo.train import resolve_checkpoint

    out = tmp_path / "run"
    flags = ["--model", "transformer", "--d-model", "32", "--n-layers", "1", "--seq-len", "16"]
    flags += ["--batch-size", "4", "--steps", "2", "--eval-interval", "2", "--eval-batches", "1"]
    flags += ["--warmup-steps", "1", "--sample-tokens", "0", "--no-progress", "--bos", "\x02"]
    flags += ["--track-circuits", "--circuit-length", "8"]
    assert main(["train", "--out", str(out), *flags]) == 0
    capsys.readouterr()
    import mnemo.interp.probe as probe_module

    seen = []
    capture = probe_module.capture_maps
    monkeypatch.setattr(probe_module, "capture_maps", lambda m, ids: seen.append(ids) or capture(m, ids))
    argv = ["probe", "circuits", "--checkpoint", str(out), "--length", "8", "--batch", "2"]
    assert main([*argv, "--out", str(tmp_path / "p")]) == 0
    captured = capsys.readouterr()
    got = json.loads(captured.out.strip().splitlines()[-1])["layers"]
    assert "the run's first token '\\x02' (id 0) before each sequence" in captured.err
    ckpt = resolve_checkpoint(out)
    model = LanguageModel.from_pretrained(ckpt).eval()
    bos = bos_id(load_tokenizer(ckpt), "\x02")
    assert bos == 0
    ids = seen[0]  # [BOS, seq, seq]: the random tokens never hold the BOS
    assert (ids[:, 0] == bos).all() and (ids[:, 1:] != bos).all() and torch.equal(ids[:, 1:9], ids[:, 9:])
    want = json.loads(json.dumps(circuit_scores(model, 8, 2, 0, bos=bos)))
    assert got == want
    # by hand: the maps on [BOS, seq, seq], rows normalised over all 17 keys, position 0 dropped
    seq = repeated_random_tokens(2, 8, model.config.vocab_size - 1, torch.Generator().manual_seed(0)) + 1
    assert torch.equal(ids[:, 1:], seq)
    p = normalise(capture_maps(model, ids)[0])[..., 1:, 1:]
    i = torch.arange(8, 16)  # every position of the second copy
    assert want["0"]["induction"] == pytest.approx(p[..., i, i - 7].mean((0, -1)).tolist(), abs=1e-6)
    assert want["0"]["induction"] == pytest.approx(
        induction_score(capture_maps(model, ids)[0], 8, 1).tolist()
    )
    assert want != json.loads(json.dumps(circuit_scores(model, 8, 2, 0)))  # the plain sequences differ
    with pytest.raises(
        ValueError, match=r"bos: expected a token id in \[0, \d+\) of a vocabulary of >= 2 ids, got -1"
    ):
        circuit_scores(model, 8, 2, 0, bos=-1)

    # the tracker during training read the run's BOS: its last record equals the scores with it
    # on the same (final) weights and its own tokens (seed 1234, batch 8)
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    tracked = circuit_scores(model, 8, 8, 1234, bos=bos)
    assert last["induction_by_layer"] == pytest.approx([max(tracked["0"]["induction"])])
    plain = circuit_scores(model, 8, 8, 1234)
    assert max(plain["0"]["induction"]) != pytest.approx(max(tracked["0"]["induction"]))
    # the ablation puts the BOS first too: its baseline halves are the mean losses at positions
    # 2 … 8 and 10 … 16 of [BOS, seq, seq] (each copy's own positions 1 … 7; seq drawn with
    # seed + 1), computed here by hand
    argv = ["probe", "ablate", "--checkpoint", str(out), "--top-induction", "1", "--draws", "1"]
    assert main([*argv, "--length", "8", "--batch", "2", "--out", str(tmp_path / "a.json")]) == 0
    captured = capsys.readouterr()
    res = json.loads(captured.out.strip().splitlines()[-1])
    assert "the run's first token '\\x02' (id 0) before each sequence" in captured.err
    assert res["bos"] == bos == 0
    V = model.config.vocab_size
    seq = torch.randint(0, V - 1, (2, 8), generator=torch.Generator().manual_seed(1)) + 1  # skips id 0
    ids = torch.cat([torch.zeros(2, 1, dtype=torch.long), seq, seq], 1)
    with torch.no_grad():
        logp = torch.log_softmax(model(ids)[0].double(), -1)
    nll = {(b, t): -float(logp[b, t - 1, ids[b, t]]) for t in range(1, 17) for b in range(2)}
    first = sum(nll[b, t] for b in range(2) for t in range(2, 9)) / 14  # copy 1, positions 1 … 7
    repeat = sum(nll[b, t] for b in range(2) for t in range(10, 17)) / 14  # copy 2, positions 1 … 7
    assert res["baseline"]["first_half_loss"] == pytest.approx(first, rel=1e-5)
    assert res["baseline"]["repeat_loss"] == pytest.approx(repeat, rel=1e-5)
    # the ICL score on the 15 predictions after the BOS's (positions 2 … 16): late 80-100% (the
    # last 3) minus early 5-15% (the first 3), each averaged over the batch
    per_t = [sum(nll[b, t] for b in range(2)) / 2 for t in range(2, 17)]
    icl = sum(per_t[12:]) / 3 - sum(per_t[:3]) / 3
    assert res["baseline"]["icl_score"] == pytest.approx(icl, rel=1e-5, abs=1e-6)
    assert res["top_k"]["heads"][0][2] == pytest.approx(max(want["0"]["induction"]), abs=1e-4)
