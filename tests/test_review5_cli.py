"""Fifth break-it review of the command line (mnemo.cli, mnemo.argtypes, mnemo.commands, the sweep
files and the data-folder reading): each test is a defect found by the review, failing before its
fix."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from mnemo.cli import main


def _strict_json(text: str):
    """``json.loads`` that refuses the non-JSON tokens ``NaN`` / ``Infinity``."""

    def refuse(token):
        raise ValueError(f"non-standard JSON token {token}")

    return json.loads(text, parse_constant=refuse)


# ------------------------------------------------------------------------------------------------
# part 1: known leftovers
# ------------------------------------------------------------------------------------------------


def test_probe_spectrum_writes_non_finite_numbers_as_null_mapped_under_nonfinite(tmp_path, capsys):
    """spectrum.json held an infinite half-life as the string ``"inf"`` (where every other command
    writes null): a reader doing arithmetic got a string. Now it is null, and ``"nonfinite"`` maps
    where (``mnemo.train.sinks.loads_record`` restores the floats); stdout is the same record."""
    from mnemo.models import LanguageModel, build_config
    from mnemo.train.sinks import loads_record

    ckpt = tmp_path / "bare"
    # ungated linear attention: A = I, every exponent 0, every half-life infinite
    LanguageModel(build_config("linear_attention", vocab_size=20, d_model=16, n_layers=1)).save_pretrained(
        ckpt
    )
    out = tmp_path / "out"
    argv = ["probe", "spectrum", "--checkpoint", str(ckpt), "--tokens", "16", "--out", str(out)]
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    text = (out / "spectrum.json").read_text()
    strict = _strict_json(text)
    assert _strict_json(stdout) == strict
    flat = json.dumps(strict)
    assert '"inf"' not in flat and '"-inf"' not in flat and '"nan"' not in flat
    assert strict["nonfinite"], "an infinite half-life is mapped, not lost"
    layer = strict["layers"]["0"]
    assert layer["summary"]["median_half_life"] is None
    assert strict["nonfinite"]["layers/0/summary/median_half_life"] == "Infinity"
    restored = loads_record(text)
    assert restored["layers"]["0"]["summary"]["median_half_life"] == math.inf
    assert "nonfinite" not in restored


def test_spectrum_page_reads_new_and_old_spectrum_files_alike(tmp_path):
    """The results script reads spectrum.json with the non-finite numbers restored (new files) and
    reads the ``"inf"`` strings of files written before as it did."""
    import importlib.util

    from mnemo.train.sinks import dumps_record

    path = Path(__file__).resolve().parents[1] / "scripts" / "spectrum_page.py"
    spec = importlib.util.spec_from_file_location("spectrum_page_r5", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    summary = {c: 0.25 for c in mod.CLASSES[:4]} | {"unresolved": 0.0}
    summary |= {"directions": 4, "computed": 4, "max_exponent": 0.0, "median_half_life": math.inf}
    record = {"layers": {"0": {"kind": "linear", "heads": 1, "summary": summary}}}
    new = json.loads(dumps_record(record))
    old = json.loads(json.dumps(record).replace("Infinity", '"inf"'))
    row = "| m | 0 | 4 | 0.25 | 0.25 | 0.25 | 0.25 | 0 | ∞ | +0.0000 |"
    got_new = mod.rows("m", mod.loads_record(json.dumps(new)))
    got_old = mod.rows("m", mod.loads_record(json.dumps(old)))
    assert got_new == got_old
    assert [c.strip() for c in got_new[0].split("|")][9] == "∞"
    assert len(row.split("|")) == len(got_new[0].split("|"))


@pytest.mark.parametrize(
    "doc, want",
    [
        (":file:`~/.cache/mnemo`", "~/.cache/mnemo"),
        (":file:`~/x`", "~/x"),
        (":class:`~a.B`", "B"),
        (":meth:`~a.B.c`", "c"),
        (":func:`the loader <mnemo.data.load_text>`", "the loader"),
        (":class:`!Foo`", "Foo"),
        (":envvar:`MNEMO_HOME`", "MNEMO_HOME"),
        (":math:`x_{t-1}.y`", "x_{t-1}.y"),
        ("see :py:meth:`~mnemo.models.LanguageModel.generate` here", "see generate here"),
    ],
)
def test_plain_text_shows_each_role_as_sphinx_shows_it(doc, want):
    """``plain_text`` treated every ``~`` as "last dotted part": ``:file:`~/.cache/mnemo``` became
    ``cache/mnemo``; an explicit title (``title <target>``) kept its target."""
    from mnemo.argtypes import plain_text

    assert plain_text(doc) == want


SWEEP = """name: rel
metric: val_loss
base:
  data: corpus/a.txt
  tokenizer: tok/tokenizer.json
  init_from: pre/seed{seed}
  steps: 1
  seq_len: 8
  batch_size: 2
  model_overrides: {d_model: 16, n_layers: 1}
models: [gla]
seeds: [0, 1]
db: out/rel.sqlite
out: out/runs
"""


def test_a_sweep_files_relative_paths_are_read_against_its_project_folder_not_the_cwd(tmp_path, monkeypatch):
    """A sweep file's relative ``data`` (and tokenizer, init_from, db, out) were read against the
    working directory: the same sweep started or resumed from another folder read another corpus
    (or none). Now they are read against the file's project folder (the nearest folder with
    pyproject.toml or .git, else the file's own), from wherever it runs; run ids are unchanged."""
    from mnemo.sweep import SweepSpec
    from mnemo.sweep.runner import default_paths

    proj = tmp_path / "proj"
    (proj / "configs").mkdir(parents=True)
    (proj / "pyproject.toml").write_text("")
    f = proj / "configs" / "rel.yaml"
    f.write_text(SWEEP)
    loose = tmp_path / "loose" / "rel.yaml"  # no project above it (tmp_path has none): its own folder
    loose.parent.mkdir()
    loose.write_text(SWEEP)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    written = SweepSpec.from_dict(__import__("yaml").safe_load(SWEEP)).runs()
    for path, root in ((f, proj), (loose, loose.parent)):
        spec = SweepSpec.load(path)
        runs = spec.runs()
        assert [r.run_id for r in runs] == [r.run_id for r in written], "stored sweeps keep their runs"
        for r, w in zip(runs, written):
            assert r.config == w.config, "stored as the file writes it (the report compares them)"
            assert r.train_config["data"] == str(root / "corpus/a.txt")
            assert r.train_config["tokenizer"] == str(root / "tok/tokenizer.json")
            assert r.train_config["init_from"] == str(root / f"pre/seed{r.seed}")
        assert default_paths(spec, path) == (root / "out/rel.sqlite", root / "out/runs")
    # a bundled corpus, the built-in tokenizers and absolute paths stay as they are
    plain = SWEEP.replace("corpus/a.txt", "tinyshakespeare").replace("tok/tokenizer.json", "byte")
    plain = plain.replace("pre/seed{seed}", f"{tmp_path}/pre{{seed}}")
    f.write_text(plain)
    (r, _) = SweepSpec.load(f).runs()
    assert (r.train_config["data"], r.train_config["tokenizer"]) == ("tinyshakespeare", "byte")
    assert r.train_config["init_from"] == f"{tmp_path}/pre0"
    f.write_text(SWEEP.replace("corpus/a.txt", "~/c.txt"))  # a home folder, as a shell reads it
    assert SweepSpec.load(f).runs()[0].train_config["data"] == str(Path.home() / "c.txt")


def test_a_sweep_run_from_another_folder_trains_on_the_files_its_sweep_file_names(tmp_path, monkeypatch):
    """End to end: a text sweep with ``data: corpus.txt`` beside it, run from another working
    directory (which holds a different corpus.txt), trains on the sweep file's corpus."""
    from mnemo.train.checkpoint import TRAIN_CONFIG_NAME, load_json, resolve_checkpoint

    home = tmp_path / "home"
    home.mkdir()
    (home / "corpus.txt").write_text("abcdefgh " * 300)
    (home / "s.yaml").write_text(
        "name: rel\nmetric: val_loss\nbase: {data: corpus.txt, steps: 1, seq_len: 8, batch_size: 2, "
        "eval_batches: 1, sample_tokens: 0, model_overrides: {d_model: 16, n_layers: 1}}\nmodels: [gla]\n"
        "db: out/rel.sqlite\nout: out/runs\n"
    )
    away = tmp_path / "away"
    away.mkdir()
    (away / "corpus.txt").write_text("zyxwvut " * 300)
    monkeypatch.chdir(away)
    assert main(["sweep", str(home / "s.yaml"), "--no-progress"]) == 0
    (run,) = (home / "out" / "runs").iterdir()
    assert load_json(resolve_checkpoint(run) / TRAIN_CONFIG_NAME)["data"] == str(home / "corpus.txt")
    assert not (away / "out").exists()


# ------------------------------------------------------------------------------------------------
# part 2: break-it
# ------------------------------------------------------------------------------------------------


def test_train_on_a_corpus_without_the_sample_prompts_characters_says_so_and_suggests_its_own(
    tmp_path, capsys
):
    """A text run on a corpus without the characters of the default ``ROMEO:`` sampled from an
    all-<unk> prompt without a word, and its closing line suggested ``--prompt 'KING:'``, which
    ``mnemo generate`` then warns is not in the vocabulary. Now the sample says so (naming
    sample_prompt) and the suggestion is a word of the run's own text."""
    import shlex

    data = tmp_path / "lower case.txt"
    data.write_text("hello world, this is a tiny corpus. " * 40)
    out = tmp_path / "run"
    argv = ["train", "--model", "gla", "--data", str(data), "--out", str(out), "--steps", "1"]
    argv += ["--seq-len", "16", "--batch-size", "2", "--d-model", "16", "--n-layers", "1", "--no-progress"]
    assert main([*argv, "--sample-tokens", "4"]) == 0
    captured = capsys.readouterr()
    assert (
        "sample_prompt 'ROMEO:' (a --config file sets it): 5 character(s) are not in the run's vocabulary"
        in captured.err
    )
    (line,) = [x for x in captured.out.splitlines() if x.startswith("try: mnemo generate")]
    prompt = shlex.split(line)[-1]
    assert prompt == "hello"
    assert main(["generate", "--checkpoint", str(out), "--prompt", prompt, "--max-new-tokens", "2"]) == 0
    assert "not in the checkpoint's vocabulary" not in capsys.readouterr().err
    # a prompt the vocabulary holds is kept, without a warning
    argv[argv.index(str(out))] = str(tmp_path / "run2")
    (tmp_path / "c.yaml").write_text("sample_prompt: this\nsample_tokens: 4\n")
    assert main([*argv, "--config", str(tmp_path / "c.yaml")]) == 0
    captured = capsys.readouterr()
    assert "sample_prompt" not in captured.err
    assert captured.out.splitlines()[-1].endswith("--prompt this")


def test_probe_spectrum_refuses_an_irrelevant_half_life_beyond_the_tokens_a_short_text_gives(
    tmp_path, capsys
):
    """``--irrelevant-half-life`` was checked against ``--tokens`` only: a text shorter than that
    ran with the threshold beyond the context it measured (30 tokens over 21), so a direction kept
    for 16 of the 21 tokens was called irrelevant and no direction could be intermediate. Now
    refused, naming the flag and the tokens the text gave."""
    from mnemo.data import build_tokenizer, save_tokenizer
    from mnemo.models import LanguageModel, build_config

    text = tmp_path / "short.txt"
    text.write_text("abcdefghij abcdefghij")
    tok = build_tokenizer("char", text.read_text())
    ckpt = tmp_path / "ckpt"
    LanguageModel(build_config("gla", vocab_size=tok.vocab_size, d_model=16, n_layers=1)).save_pretrained(
        ckpt
    )
    save_tokenizer(tok, ckpt)
    argv = ["probe", "spectrum", "--checkpoint", str(ckpt), "--data", str(text), "--tokens", "64"]
    argv += ["--out", str(tmp_path / "sp")]
    assert main([*argv, "--irrelevant-half-life", "30"]) == 2
    err = capsys.readouterr().err
    assert "--irrelevant-half-life (30 tokens) must be shorter than the context, the 21 tokens" in err
    assert not (tmp_path / "sp").exists()
    assert main([*argv, "--irrelevant-half-life", "4"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["tokens"] == 21 and record["layers"]["0"]["summary"]["context"] == 21
