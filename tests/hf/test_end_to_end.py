"""A released-architecture checkpoint through every command: a random-weight ``Mamba2ForCausalLM``
with its own BPE tokenizer is converted (``mnemo convert``) and then used by ``generate``,
``eval``, ``probe circuits`` and ``probe timescales``; a Qwen3-Next checkpoint converts and
exports through the commands with equal logits."""

from __future__ import annotations

import json
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from mnemo.cli import main  # noqa: E402
from mnemo.data import load_corpus, load_tokenizer  # noqa: E402
from mnemo.models import LanguageModel  # noqa: E402
from tests.helpers import rel_rms  # noqa: E402

TEXT = "\n".join(
    f"KING {i}: the night is {w}, and the day is {v}."
    for i, (w, v) in enumerate(
        [("long", "short"), ("dark", "bright"), ("cold", "warm"), ("still", "loud")] * 12
    )
)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    (root / "corpus.txt").write_text(TEXT)
    assert (
        main(
            [
                "tokenizer",
                "train",
                "--data",
                str(root / "corpus.txt"),
                "--vocab-size",
                "300",
                "--out",
                str(root / "tok"),
            ]
        )
        == 0
    )
    tok = load_tokenizer(root / "tok")
    torch.manual_seed(0)
    cfg = transformers.Mamba2Config(
        vocab_size=tok.vocab_size,
        hidden_size=16,
        num_hidden_layers=2,
        state_size=4,
        head_dim=4,
        num_heads=8,
        n_groups=2,
        expand=2,
        conv_kernel=4,
        chunk_size=8,
    )
    hf = transformers.Mamba2ForCausalLM(cfg).eval()
    hf.save_pretrained(root / "hf")
    (root / "hf" / "tokenizer.json").write_text((root / "tok" / "tokenizer.json").read_text())
    assert main(["convert", str(root / "hf"), str(root / "ck")]) == 0
    return root, hf


def test_converted_checkpoint_carries_its_tokenizer_and_logits(converted):
    root, hf = converted
    tok = load_tokenizer(root / "ck")
    assert tok.kind == "hf" and tok.decode(tok.encode("KING 3: the night")) == "KING 3: the night"
    ids = tok.encode("KING 7: the day is warm")[None]
    lm = LanguageModel.from_pretrained(root / "ck").eval()
    with torch.no_grad():
        assert rel_rms(lm(ids)[0], hf(ids).logits) <= 1e-5


def test_generate_and_eval(converted, capsys):
    root, _ = converted
    assert (
        main(
            [
                "generate",
                "--checkpoint",
                str(root / "ck"),
                "--prompt",
                "KING 1:",
                "--max-new-tokens",
                "8",
                "--temperature",
                "0",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("KING 1:")
    assert (
        main(
            [
                "eval",
                "--checkpoint",
                str(root / "ck"),
                "--data",
                str(root / "corpus.txt"),
                "--seq-len",
                "16",
                "--batch-size",
                "4",
                "--max-batches",
                "all",
            ]
        )
        == 0
    )
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # independently: the validation split's non-overlapping windows, summed cross-entropy
    tok, lm = load_tokenizer(root / "ck"), LanguageModel.from_pretrained(root / "ck").eval()
    val = load_corpus(str(root / "corpus.txt")).split()[1].documents[0]
    ids = tok.encode(val)
    n = (ids.numel() - 1) // 16
    total = 0.0
    with torch.no_grad():
        for w in range(n):
            x, y = ids[w * 16 : w * 16 + 16], ids[w * 16 + 1 : w * 16 + 17]
            total += torch.nn.functional.cross_entropy(lm(x[None])[0][0], y, reduction="sum").item()
    assert got["tokens"] == 16 * n and math.isclose(got["val_loss"], total / (16 * n), rel_tol=1e-6)


def test_probes(converted, capsys):
    root, _ = converted
    assert (
        main(
            [
                "probe",
                "circuits",
                "--checkpoint",
                str(root / "ck"),
                "--length",
                "8",
                "--batch",
                "2",
                "--out",
                str(root / "circ"),
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "probe",
                "timescales",
                "--checkpoint",
                str(root / "ck"),
                "--data",
                str(root / "corpus.txt"),
                "--tokens",
                "64",
                "--out",
                str(root / "ts"),
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    first, second = captured.out.strip().splitlines()[:2]
    scores = json.loads(first)["layers"]
    assert set(scores) == {"0", "1"} and all(s["mixer"] == "Mamba2" for s in scores.values())
    assert len(scores["0"]["induction"]) == 8  # one score per head
    assert (root / "circ").exists() and (root / "ts").exists()
    assert str(root / "circ") in captured.err + captured.out


def test_qwen3_next_through_the_commands(tmp_path):
    from tests.hf.test_qwen3_next_interop import hf_config, hf_model

    hf = hf_model(hf_config(), dtype=torch.float32)
    hf.save_pretrained(tmp_path / "hf")
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "ck")]) == 0
    lm = LanguageModel.from_pretrained(tmp_path / "ck").eval()
    assert main(["export", str(tmp_path / "ck"), str(tmp_path / "back"), "--format", "hf"]) == 0
    back = transformers.Qwen3NextForCausalLM.from_pretrained(tmp_path / "back").eval()
    ids = torch.randint(0, 61, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
        assert rel_rms(lm(ids)[0], ref) <= 1e-5
        assert rel_rms(back(ids).logits, ref) <= 1e-5
    # the in-memory path reads the transformers folder directly
    direct = LanguageModel.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        assert torch.equal(direct(ids)[0], lm(ids)[0])


def test_new_user_findings(tmp_path, capsys):
    """Run folders export; mnemo's own char tokenizer is not shipped as a transformers tokenizer;
    a damaged foreign weights file is named; SRC == OUT is refused; eval warns about <unk>."""
    from mnemo.train import TrainConfig, Trainer, resolve_checkpoint

    Trainer(
        TrainConfig(
            model="mamba",
            model_overrides={"d_model": 16, "n_layers": 1, "mlp": "none"},
            seq_len=16,
            batch_size=2,
            steps=1,
            eval_interval=1,
            eval_batches=1,
            sample_tokens=0,
        ),
        tmp_path / "run",
        progress=False,
    ).fit()
    with pytest.warns(UserWarning, match="mnemo's own char/byte tokenizer"):
        assert main(["export", str(tmp_path / "run"), str(tmp_path / "ex")]) == 0
    assert not (tmp_path / "ex" / "tokenizer.json").exists()
    assert load_tokenizer(tmp_path / "ex" / "mnemo_tokenizer.json").kind == "char"
    assert transformers.MambaForCausalLM.from_pretrained(tmp_path / "ex") is not None
    # ... and the way back gives the tokenizer its checkpoint name again: the same char vocabulary
    assert main(["convert", str(tmp_path / "ex"), str(tmp_path / "back")]) == 0
    before = load_tokenizer(resolve_checkpoint(tmp_path / "run"))
    after = load_tokenizer(tmp_path / "back")
    assert (tmp_path / "back" / "tokenizer.json").is_file() and after.kind == "char"
    assert after.encode("To be, or not").tolist() == before.encode("To be, or not").tolist()
    # a negative time_step_rank (sixth trial: a traceback from torch) is named as a field
    import json as _json

    cfg = _json.loads((tmp_path / "ex" / "config.json").read_text())
    (tmp_path / "ex" / "config.json").write_text(_json.dumps({**cfg, "time_step_rank": -3}))
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "ex"), str(tmp_path / "bad")]) == 2
    assert "field 'time_step_rank': expected a positive int or \"auto\", got -3" in capsys.readouterr().err
    # a mnemo run given to convert is named as one
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "run"), str(tmp_path / "y")]) == 2
    assert "is a mnemo training run, not a foreign checkpoint" in capsys.readouterr().err

    hf = transformers.MambaForCausalLM(
        transformers.MambaConfig(vocab_size=20, hidden_size=8, num_hidden_layers=1, state_size=4)
    )
    hf.save_pretrained(tmp_path / "hf")
    w = tmp_path / "hf" / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "x")]) == 2
    assert f"corrupt or unreadable weights file {w}" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "hf"), "--force"]) == 2
    err = capsys.readouterr().err
    assert "is the source" in err and "--force does not change that" in err

    (tmp_path / "odd.txt").write_text("ÆØÅ ÆØÅ ÆØÅ ÆØÅ " * 40)
    assert (
        main(
            [
                "eval",
                "--checkpoint",
                str(tmp_path / "run"),
                "--data",
                str(tmp_path / "odd.txt"),
                "--seq-len",
                "8",
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert "outside the tokenizer's vocabulary" in err and "%" in err
    assert main(["eval", "--checkpoint", str(tmp_path / "run"), "--seq-len", "-5"]) == 2
    assert "argument --seq-len: expected an int >= 1, got '-5'" in capsys.readouterr().err


def test_foreign_folder_without_registered_converters_says_what_to_do(tmp_path, monkeypatch):
    from mnemo.models import formats

    hf = transformers.MambaForCausalLM(
        transformers.MambaConfig(vocab_size=20, hidden_size=8, num_hidden_layers=1, state_size=4)
    )
    hf.save_pretrained(tmp_path)
    monkeypatch.setattr(formats, "FOREIGN_LOADERS", [])
    with pytest.raises(ValueError, match="`import mnemo.hf` registers the converters"):
        LanguageModel.from_pretrained(tmp_path)


def test_spectrum_and_induction_ablation_on_a_converted_checkpoint(converted, capsys):
    """Issue 19 §5: the spectrum and the causal induction test run on an imported Mamba-2 as on a
    trained mnemo model (per-head scalar decays: one exponent per head; heads are ablatable)."""
    root, _ = converted
    argv = ["probe", "spectrum", "--checkpoint", str(root / "ck"), "--data", str(root / "corpus.txt")]
    assert main([*argv, "--tokens", "64", "--out", str(root / "spec")]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert set(spec["layers"]) == {"0", "1"}
    for e in spec["layers"].values():
        assert e["kind"] == "diagonal" and e["gate"] == "per-head" and e["heads"] == 8
        assert all(x <= 0 for row in e["exponents"] for x in row)  # exp(dt·A) with A < 0: contracts
    argv = ["probe", "ablate", "--checkpoint", str(root / "ck"), "--top-induction", "2", "--draws", "2"]
    assert main([*argv, "--length", "8", "--batch", "2"]) == 0
    result = json.loads(capsys.readouterr().out)
    heads = result["top_k"]["heads"]
    assert len(heads) == 2 and all(layer in (0, 1) and 0 <= head < 8 for layer, head, _ in heads)
    assert len(result["random"]["heads"]) == 2 and "gain_removed" in result["top_k"]
