"""Regression review 40c (of review 5-D's and 5-M's fixes): context parallelism's failure path, which
relays a NaN state to the next rank, for the meta-learned nested CMS that 5-D made relayable."""

from __future__ import annotations

from pathlib import Path

from mnemo.train import TrainConfig, Trainer
from tests.helpers import free_port, join_as_torchrun, nan_step_on_rank0, spawn

NESTED = {"levels": [{"period": 2}, {"period": 4}], "transfer": "nested", "meta": "unrolled"}


def _nested_cfg(**kw) -> TrainConfig:
    base = dict(
        model="gated_deltanet",
        model_overrides={
            "d_model": 16,
            "n_layers": 1,
            # a mixer whose op never reads its NaN initial state's values first (no short conv)
            "mixer": "neural_memory",
            "mixer_options": {"neural_memory": {"short_conv": False}},
            "mlp": "cms",
            "mlp_options": NESTED,
        },
        seq_len=12,
        batch_size=2,
        steps=2,
        warmup_steps=1,
        sample_tokens=0,
        context_parallel=True,
    )
    base.update(kw)
    return TrainConfig(**base)


def _nan_worker(rank, world, port, out):
    join_as_torchrun(rank, world, port)
    from mnemo.train.distributed import cleanup

    out = Path(out)
    try:
        nan_step_on_rank0(Trainer(_nested_cfg(), out / "nan", progress=False), rank, out)
    finally:
        cleanup()


def test_context_parallel_nan_relay_of_a_nested_cms_diverges_on_every_rank(tmp_path):
    """A failing rank relays a NaN state shaped like the one-token dry run (a slower level's kept
    inputs ``[B, 1, 2d + 1]``) with its integer counters 0 (position 0): the next rank refused it as
    a state of another configuration (``ValueError``) instead of running on the NaN: rank 1 left the
    step with that error while rank 0 waited in the loss all-reduce until the process group's
    timeout. Now both raise ``TrainingDiverged``."""
    spawn(_nan_worker, (2, free_port(), str(tmp_path)), 2, timeout_s=120, start_method="forkserver")
    for rank in range(2):
        other = tmp_path / f"other{rank}.txt"
        assert not other.exists(), other.read_text()
        text = (tmp_path / f"diverged{rank}.txt").read_text()
        assert "the loss became nan" in text or "non-finite" in text.lower(), text
