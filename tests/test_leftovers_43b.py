"""Leftovers of session 42's reviews (area B): the end-of-text stop of a training run's text
sample, a sweep's ``model`` grid axis and ``task_options`` axes, ``mnemo bench --suite decode``'s
model names."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _bpe_lm():
    """A byte-level BPE tokenizer of ``mnemo tokenizer train`` and a tiny model on its vocabulary."""
    pytest.importorskip("tokenizers")
    from mnemo.commands.tokenizer import train_tokenizer
    from mnemo.data.tokenizer import HFTokenizer
    from mnemo.models import LanguageModel, ModelConfig

    tok = HFTokenizer(train_tokenizer(["the cat sat on the mat and the dog sat on the log " * 4], 262))
    torch.manual_seed(0)
    lm = LanguageModel(
        ModelConfig(vocab_size=tok.vocab_size, d_model=16, n_layers=1, mixer="mamba", mlp="none")
    ).eval()
    return tok, lm


def test_a_runs_text_sample_ends_at_the_bpe_endoftext_token():
    """``Trainer.sample`` / ``sample_run`` (the end-of-run sample) ran past a BPE run's
    ``<|endoftext|>`` (its text held the token and went on) while ``mnemo generate``, the harness
    and the HF export end the text there. A hook makes ``<|endoftext|>`` the third new token; the
    text must be the prompt and the two greedy tokens before it, by a hand loop of full forwards."""
    from mnemo.train import TrainConfig
    from mnemo.train.generation import sample_run

    tok, lm = _bpe_lm()
    eot = tok.eot_id
    assert tok.eot_token == "<|endoftext|>"
    calls = []

    def force_eot_on_third_call(module, inputs, logits):
        calls.append(1)
        if len(calls) == 3:  # the prefill gives the first new token, each decode step one more
            logits = logits.clone()
            logits[..., eot] = 1e4
            return logits
        return None

    prompt = "the cat"
    ids = tok.encode(prompt).tolist()
    with torch.no_grad():  # the two tokens before it: greedy argmax of a full forward, by hand
        for _ in range(2):
            nxt = int(lm(torch.tensor([ids]))[0][0, -1].argmax())
            assert nxt != eot
            ids.append(nxt)
    expected = tok.decode(torch.tensor(ids))
    handle = lm.lm_head.register_forward_hook(force_eot_on_third_call)
    try:
        cfg = TrainConfig(model="mamba", sample_prompt=prompt, sample_tokens=8, sample_temperature=0.0)
        text = sample_run(cfg, lm, tok, "cpu")
    finally:
        handle.remove()
    assert "<|endoftext|>" not in text
    assert text == expected


_BASE = {
    "task": "mqar",
    "seq_len": 64,
    "task_options": {"num_pairs": 4, "vocab_size": 64},
    "steps": 2,
    "model_overrides": {"d_model": 16, "n_layers": 1},
}


@pytest.mark.parametrize("where", ["grid", "entry"])
def test_a_sweep_grid_axis_model_is_refused_pointing_to_models(where):
    """A grid axis ``model`` (the sweep's own, or a model entry's ``grid:``) replaced the entry's model
    after the merge: ``models: [transformer]`` with ``grid: {model: [mamba, ...]}`` trained Mamba
    under the label ``transformer``. The models are the ``models:`` list: the axis is refused."""
    from mnemo.sweep.spec import SweepSpec

    spec = {"name": "s", "base": _BASE, "models": ["transformer"]}
    if where == "grid":
        spec["grid"] = {"model": ["mamba", "transformer"]}
    else:
        spec["models"] = [{"model": "transformer", "grid": {"model": ["mamba"]}}]
    with pytest.raises(ValueError, match=r"axis 'model'.*'transformer'.*under 'models:'"):
        SweepSpec.from_dict(spec)


@pytest.mark.parametrize("base_order", [("num_pairs", "vocab_size"), ("vocab_size", "num_pairs")])
def test_a_dotted_task_options_axis_wins_over_the_base_dict_in_any_key_order(base_order):
    """Not a defect (kept as the module docstring now says it): ``task_options.num_pairs`` on the grid
    sets that entry whatever the base ``task_options`` dict holds and in whatever order its keys are
    written; the base's other entries stay."""
    from mnemo.sweep.spec import SweepSpec

    given = {"num_pairs": 4, "vocab_size": 64}
    base = {**_BASE, "task_options": {k: given[k] for k in base_order}}
    spec = SweepSpec.from_dict(
        {"name": "s", "base": base, "models": ["transformer"], "grid": {"task_options.num_pairs": [8, 16]}}
    )
    got = [(r.config["task_options"], r.cell["task_options.num_pairs"]) for r in spec.runs()]
    assert got == [({"num_pairs": 8, "vocab_size": 64}, 8), ({"num_pairs": 16, "vocab_size": 64}, 16)]


@pytest.mark.parametrize("reverse", [False, True])
def test_a_whole_task_options_axis_beside_a_dotted_one_is_refused_by_name(reverse):
    """Grid axes ``task_options`` and ``task_options.num_pairs`` together: the one written later won,
    so with the dotted axis first the runs trained with ``num_pairs`` 2 while their cells said 8.
    The spec is refused naming both axes, in either order."""
    from mnemo.sweep.spec import SweepSpec

    axes = [("task_options.num_pairs", [8]), ("task_options", [{"num_pairs": 2, "vocab_size": 64}])]
    grid = dict(reversed(axes) if reverse else axes)
    with pytest.raises(ValueError, match=r"'task_options' and 'task_options\.num_pairs' both set"):
        SweepSpec.from_dict({"name": "s", "base": _BASE, "models": ["transformer"], "grid": grid})


@pytest.mark.parametrize("suite", ["decode", "models", "roofline"])
@pytest.mark.parametrize(
    "given, refused",
    [("gla, Mamba", "Mamba"), ("attention", "attention"), ("gla ,mamba2 , Transformer", "Transformer")],
)
def test_bench_model_names_are_read_alike_by_the_decode_models_and_roofline_suites(
    suite, given, refused, capsys
):
    """Not a defect: ``--suite decode --models`` reads names as the models and roofline suites do:
    blanks around a name dropped, the case kept (``Mamba`` is no model), a mixer name that
    ``build_config`` accepts (``attention``) refused as not a registered model; each suite names
    exactly the near-miss, before any timing starts."""
    from mnemo.cli import main

    assert main(["bench", "--suite", suite, "--models", given]) == 2
    err = capsys.readouterr().err
    assert f"--models: unknown model(s) [{refused!r}]; registered: " in err
