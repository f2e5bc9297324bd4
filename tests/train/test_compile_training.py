"""``TrainConfig.compile`` (``mnemo train --compile``): the training forward and backward run under
``torch.compile``; the losses equal eager training's, and the checkpoints are the eager model's
(no ``_orig_mod.`` prefix), so a compiled run resumes eagerly.

Tolerance: relative ``1e-4`` per step over 4 AdamW steps of a tiny float32 transformer. Inductor
reorders and fuses reductions (float32 rounding, ~1e-6 relative per forward, see
tests/models/test_compile.py); Adam's first steps move every weight by ~lr whatever the gradient's
size, so rounding differences stay at that level; a wrong graph is off by O(1).

Compiling costs ~10 s on 2 cores (one family: the transformer)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from mnemo.models import LanguageModel
from mnemo.models.lm import WEIGHTS_NAME
from mnemo.train import TrainConfig, Trainer, resolve_checkpoint
from mnemo.train.checkpoint import TRAIN_CONFIG_NAME
from tests.models.test_compile import compile_required, needs_compile  # noqa: F401  (the fixture needs_compile names)

pytestmark = pytest.mark.filterwarnings("ignore")


def _cfg(**kw) -> TrainConfig:
    base = dict(
        model="transformer",
        model_overrides={"d_model": 16, "n_layers": 1},
        seq_len=16,
        batch_size=4,
        steps=4,
        eval_interval=4,
        eval_batches=1,
        warmup_steps=1,
        lr=1e-2,
        sample_tokens=0,
    )
    base.update(kw)
    return TrainConfig(**base)


def _losses(tr: Trainer, n: int) -> torch.Tensor:
    return torch.tensor([tr.train_step() for _ in range(n)], dtype=torch.float64)


@needs_compile
def test_compiled_training_equals_eager_and_its_checkpoint_resumes_eagerly(tmp_path):
    torch._dynamo.reset()
    quiet = dict(progress=False, log=lambda *a, **k: None)
    eager = Trainer(_cfg(), tmp_path / "eager", **quiet)
    compiled = Trainer(_cfg(compile=True), tmp_path / "compiled", **quiet)
    compiled_type = torch._dynamo.eval_frame.OptimizedModule
    assert isinstance(compiled.train_model, compiled_type) and isinstance(compiled.model, LanguageModel)
    ref, got = _losses(eager, 4), _losses(compiled, 4)
    assert ref[-1] < ref[0], f"eager training did not learn: {ref.tolist()}"
    rel = ((got - ref).abs() / ref).max().item()
    assert rel < 1e-4, f"compiled losses differ from eager by {rel:.1e}: {got.tolist()} vs {ref.tolist()}"

    # the compiled run's checkpoint: the eager model's keys, and the flag in train_config.json
    keys = {}
    for name, tr in (("eager", eager), ("compiled", compiled)):
        tr._write_checkpoint()
        with safe_open(str(resolve_checkpoint(tmp_path / name) / WEIGHTS_NAME), "pt") as f:
            keys[name] = set(f.keys())
    assert keys["compiled"] == keys["eager"], "the compiled run's checkpoint keys differ from eager's"
    assert not any("_orig_mod" in k for k in keys["compiled"])
    saved = json.loads((resolve_checkpoint(tmp_path / "compiled") / TRAIN_CONFIG_NAME).read_text())
    assert saved["compile"] is True

    # resumed without compiling: same weights, and the next step is eager's from the same weights
    resumed = Trainer({"compile": False}, tmp_path / "compiled", resume=True, **quiet)
    assert resumed.step == 4 and resumed.cfg.compile is False
    assert not isinstance(resumed.train_model, compiled_type)
    for n, p in resumed.model.state_dict().items():
        assert torch.equal(p, compiled.model.state_dict()[n]), f"{n} changed through the checkpoint"
    assert torch.isfinite(torch.tensor(resumed.train_step()))


def test_compile_is_a_switch_and_not_with_context_parallelism():
    with pytest.raises(ValueError, match=r"TrainConfig\.compile: expected true or false, got 'yes'"):
        _cfg(compile="yes").validate()
    with pytest.raises(ValueError, match=r"TrainConfig\.compile: expected false with context_parallel"):
        _cfg(model="gla", compile=True, context_parallel=True).validate()
