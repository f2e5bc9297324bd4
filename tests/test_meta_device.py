"""No host syncs on an accelerator (issue 36, item 3), shown on the ``meta`` device.

Every registered model runs a training forward + backward, then a prefill and one decode step, with
its parameters and inputs on ``meta`` and no shims: a value read raises there. The same run under
:class:`mnemo.testing.device_probe.StrictDeviceProbe` also fails on what plain meta lets through
(a CPU tensor mixed into a meta op, a matmul on mixed float dtypes, a host-to-device copy); the
probe itself is shown to catch each of those. The trainer's step on ``meta`` reads one value pair
(its finite check of the loss and gradient norm) and nothing else from the device; on the CPU the
reads are unchanged (counted, not asserted, except that they happen).

Sizes: d_model 32, 2 layers, vocabulary 64, batch 2, 40 tokens (past the CMS periods 8/16/32). The
per-model step runs 1 layer where every layer runs the same mixer (no ``pattern``/``layers``: layer 2
would run layer 1's code again, and on ``meta`` the cost is the op count) and 2 for a pattern model,
whose pattern is then its distinct mixers in order (each is built once).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mnemo.models import LanguageModel, build_config
from mnemo.models.registry import model_names
from mnemo.ops import FavorPlus
from mnemo.testing.device_probe import DeviceProbeError, StrictDeviceProbe, host_reads
from mnemo.train import TrainConfig, Trainer

META = torch.device("meta")
TINY = {"d_model": 32, "n_layers": 2, "vocab_size": 64}


def _meta_model(
    name: str, dtype: torch.dtype | None = None, one_layer_if_uniform: bool = False
) -> LanguageModel:
    cfg = build_config(name, **TINY)
    if one_layer_if_uniform and cfg.pattern is None and cfg.layers is None:
        cfg = build_config(name, **{**TINY, "n_layers": 1})  # every layer the same code: one runs it
    elif cfg.pattern is not None and len(set(cfg.pattern)) <= TINY["n_layers"]:
        # each of the pattern's mixers once, in its order: at 2 layers the pattern [gdn, gdn, gdn,
        # attention] (layer i runs pattern[i % 4]) never built its attention layer
        cfg = build_config(name, **{**TINY, "pattern": list(dict.fromkeys(cfg.pattern))})
    with META:
        model = LanguageModel(cfg)
    return model if dtype is None else model.to(dtype)


def _step(model: LanguageModel, T: int = 40) -> None:
    """Forward + backward in training mode, then prefill + one decode step without gradients."""
    ids = torch.zeros(2, T, dtype=torch.long, device=META)
    model.train()
    logits, _ = model(ids)
    loss = F.cross_entropy(logits.flatten(0, 1), ids.flatten())
    aux = model.aux_loss()
    (loss if aux is None else loss + aux).backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    # a CMS level whose period exceeds T never steps in T tokens, so its rate gets no gradient
    # (hope_long's periods 128-2048 at T 40): that and nothing else may lack one
    slow = {
        f"levels.{i}.rate"
        for b in model.blocks
        for i, period in enumerate(getattr(b.mlp, "periods", None) or ())
        if period > T
    }
    assert all(any(s in n for s in slow) for n in missing), missing
    assert all(p.grad.device == META for p in model.parameters() if p.grad is not None)
    model.eval()
    with torch.no_grad():
        logits, state = model(ids)
        logits, state = model(ids[:, -1:], state)
    assert logits.shape == (2, 1, TINY["vocab_size"]) and logits.device == META


@pytest.mark.parametrize("name", model_names())
def test_meta_step_under_the_strict_probe(name):
    """The plain meta run and the strict probe in one: the probe runs every op as it is (no value
    is answered), so a read raises as on plain meta, and the probe's own checks come on top."""
    model = _meta_model(name, one_layer_if_uniform=True)
    with StrictDeviceProbe() as probe:
        _step(model)
    assert probe.ops_seen > 100  # the probe saw the step (forward and backward)


@pytest.mark.parametrize("name", ["gated_deltanet_attention_moe", "mamba2"])
def test_meta_strict_probe_bf16(name):
    with StrictDeviceProbe():
        _step(_meta_model(name, torch.bfloat16))


# ----------------------------------------------------------------------------------------------
# the probe catches what plain meta misses


def _meta(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype, device=META)


def test_plain_meta_misses_a_cpu_weight_that_the_probe_catches():
    x, w = _meta(3, 4), torch.zeros(5, 4)
    assert F.linear(x, w).device == META  # plain meta: no complaint
    with pytest.raises(DeviceProbeError, match="different devices.*on cpu"), StrictDeviceProbe():
        F.linear(x, w)
    with pytest.raises(DeviceProbeError, match="different devices"), StrictDeviceProbe():
        F.embedding(_meta(2, dtype=torch.long), torch.zeros(7, 4))
    with pytest.raises(DeviceProbeError, match="different devices"), StrictDeviceProbe():
        _meta(3, 4).gather(0, torch.zeros(1, 4, dtype=torch.long))


def test_probe_catches_a_mixed_dtype_matmul():
    a, b = _meta(3, 4, dtype=torch.bfloat16), _meta(4, 5)
    with pytest.raises(DeviceProbeError, match="mixed float dtypes"), StrictDeviceProbe():
        a @ b
    with pytest.raises(DeviceProbeError, match="mixed float dtypes"), StrictDeviceProbe():
        F.linear(a, _meta(5, 4))


def test_probe_catches_a_host_to_device_copy_and_reads():
    x = _meta(4)
    with pytest.raises(DeviceProbeError, match="host-to-device copy"), StrictDeviceProbe():
        x + torch.ones(4).to(META)
    with pytest.raises(DeviceProbeError, match="read back"), StrictDeviceProbe():
        x.sum().item()
    with pytest.raises(DeviceProbeError, match="depends on device values"), StrictDeviceProbe():
        x[x > 0]
    with StrictDeviceProbe():  # a 0-d CPU tensor is a number to PyTorch: allowed
        x * torch.tensor(2.0)


def test_probe_catches_a_planted_cpu_tensor_in_a_model():
    model = _meta_model("transformer")
    model.lm_head = torch.nn.Linear(32, 64, bias=False)  # left on the CPU
    ids = torch.zeros(2, 8, dtype=torch.long, device=META)
    assert model(ids)[0].device == META  # plain meta runs the forward (autograd objects later)
    with pytest.raises(DeviceProbeError, match="different devices"), StrictDeviceProbe():
        model(ids)


def test_favor_projection_moves_with_the_layer():
    """``FavorPlus.projection`` is a buffer: no host copy per call once the layer is on the device;
    a dtype cast keeps its float64 values."""
    fm = FavorPlus(8, 16, seed=1)
    ref = fm.projection.clone()
    fm.to(META)
    assert fm.projection.device == META
    with StrictDeviceProbe():
        fm(_meta(2, 3, 8))
    cast = FavorPlus(8, 16, seed=1).to(torch.bfloat16)
    assert cast.projection.dtype == torch.float64 and torch.equal(cast.projection, ref)
    assert "projection" not in cast.state_dict()  # not saved: the seed redraws it


# ----------------------------------------------------------------------------------------------
# host reads per training step


def _trainer(tmp_path, name: str, **kw) -> Trainer:
    cfg = TrainConfig(
        model=name,
        model_overrides={"d_model": 32, "n_layers": 2},
        seq_len=32,
        batch_size=2,
        grad_accum=2,
        steps=4,
        sample_tokens=0,
        **kw,
    )
    return Trainer(cfg, tmp_path)


def _meta_trainer(tmp_path, name: str, **kw) -> Trainer:
    """A trainer built on the CPU, moved to ``meta`` before its first step (the optimizer's
    state is then created there)."""
    tr = _trainer(tmp_path, name, **kw)
    tr.model.to(META)
    tr.device = META
    return tr


@pytest.mark.parametrize(
    "name, kw", [("gated_deltanet", {}), ("gated_deltanet_attention_moe", {}), ("gla", {"task": "mqar"})]
)
def test_trainer_step_reads_one_value_pair_on_meta(tmp_path, name, kw):
    tr = _meta_trainer(tmp_path, name, **kw)
    for _ in range(2):
        with host_reads(answer_meta=True) as r:
            tr.train_step()
        assert r.syncs == 1, r.sites  # the loss and the gradient norm, read together
        assert "trainer.py" in r.sites[-1][2] and r.sites[-1][0] == "sync"
    assert tr.step == 2


def test_trainer_step_without_answers_fails_only_at_its_one_read(tmp_path):
    """No shim: on meta the step runs forward, backward and the norm, and stops at the one read."""
    tr = _meta_trainer(tmp_path, "gated_deltanet")
    with pytest.raises(NotImplementedError, match="meta"):
        tr.train_step()
    assert all(p.grad is not None for p in tr.model.parameters())


def test_trainer_step_on_cpu_reads_as_before(tmp_path):
    tr = _trainer(tmp_path, "gated_deltanet")
    with host_reads() as r:
        loss = tr.train_step()
    assert r.syncs == 0 and r.host_reads > 0  # the CPU checks still read (counted in the table)
    assert loss == pytest.approx(loss) and tr.step == 1
