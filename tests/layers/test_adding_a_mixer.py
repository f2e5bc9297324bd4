"""docs/adding_a_mixer.md: the example mixer, taken from the page itself, passes every generic
check, and the checks catch a mixer that breaks the streaming contract."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from mnemo.layers import MIXERS
from mnemo.testing.mixers import check_mixer

DOC = Path(__file__).resolve().parents[2] / "docs" / "adding_a_mixer.md"


def _load(code: str, tmp_path: Path, name: str):
    path = tmp_path / f"{name}.py"
    path.write_text(code)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def example(tmp_path):
    code = re.search(r"```python\n(.*?)```", DOC.read_text(), re.S).group(1)
    before = dict(MIXERS)
    module = _load(code, tmp_path, "toy_decay_memory")
    yield module, code
    MIXERS.clear()
    MIXERS.update(before)
    sys.modules.pop("toy_decay_memory", None)


def test_the_documented_mixer_passes_every_check(example):
    assert "decay_memory" in MIXERS
    results = check_mixer("decay_memory")
    assert [r.check for r in results] == [
        "split",
        "token_steps",
        "state_size",
        "hooks",
        "mixing",
        "gradients",
        "cached_decoding",
    ]
    failed = [(r.check, r.message) for r in results if not r.passed]
    assert not failed, failed
    assert all(r.error <= 1e-10 for r in results)


def test_the_documented_mixer_is_one_file_away_from_a_model(example):
    from mnemo.models import LanguageModel, ModelConfig

    cfg = ModelConfig(vocab_size=11, d_model=16, n_layers=2, pattern=["decay_memory", "attention"])
    model = LanguageModel(cfg)
    import torch

    _, cache = model.run_with_cache(torch.randint(0, 11, (1, 5)), names="hook_g")
    assert list(cache) == ["blocks.0.mixer.hook_g"]  # the attention layer has no decay


def test_the_checks_catch_a_mixer_that_forgets_its_state(example, tmp_path):
    _, code = example
    broken = code.replace('@register_mixer("decay_memory")', '@register_mixer("forgetful_memory")').replace(
        "initial_state=state.memory if state is not None else None", "initial_state=None"
    )
    assert broken != code
    _load(broken, tmp_path, "toy_forgetful_memory")
    try:
        by_check = {r.check: r for r in check_mixer("forgetful_memory")}
    finally:
        MIXERS.pop("forgetful_memory", None)
        sys.modules.pop("toy_forgetful_memory", None)
    for check in ("split", "token_steps", "cached_decoding"):
        assert not by_check[check].passed and by_check[check].error > 1e-3
    assert by_check["state_size"].passed and by_check["mixing"].passed  # unrelated to streaming


def test_the_documented_mixer_trains_by_its_name(example, tmp_path):
    """No model registration needed: a mixer name is a model name (``ModelConfig(mixer=name)``)."""
    from mnemo.models import build_config
    from mnemo.train import TrainConfig, Trainer

    assert build_config("decay_memory", vocab_size=11).layer_mixers() == ["decay_memory"] * 4
    cfg = TrainConfig(
        model="decay_memory",
        model_overrides={"d_model": 16, "n_layers": 1},
        task="induction_heads",
        seq_len=16,
        batch_size=4,
        steps=2,
        eval_interval=2,
        eval_batches=1,
        sample_tokens=0,
    )
    record = Trainer(cfg, tmp_path / "run", progress=False, log=lambda *a, **k: None).fit()
    assert record["step"] == 2 and record["val_loss"] > 0
