"""The library runs unchanged on CUDA (DESIGN.md §8): ops, models, decoding and training on a GPU
give the same numbers as on the CPU.

Run on a GPU machine (the device under test defaults to ``cuda``)::

    python3 -m pytest tests/test_cuda.py -q

``MNEMO_TEST_DEVICE`` names another device under test (``cuda:1``, or ``cpu`` to check this
module's logic on a machine without a GPU)::

    MNEMO_TEST_DEVICE=cpu OMP_NUM_THREADS=1 python -m pytest tests/test_cuda.py -q -p no:cacheprovider

Without CUDA (and without ``MNEMO_TEST_DEVICE``) the whole module is skipped.

What is checked, on the device under test:

1. Every op of the equivalence contract (``tests/ops/specs.py``: linear attention, gated linear
   attention with no / scalar / per-channel gates, delta rule, gated delta rule, selective scan,
   SSD) in each of its forms, float32, with an initial state and ``T`` not a multiple of the chunk:
   outputs, final states and the gradients w.r.t. every input and the initial state equal the
   recurrent form on the CPU in float64 (relative RMS ``1e-4``). bfloat16 inputs to the chunk form
   of gated linear attention and the gated delta rule stay finite and within ``3e-2`` of float32.
2. ``softmax_attention`` (SDPA form, causal / GQA + window / non-causal / KV cache / one-token
   decoding) against the CPU token-loop reference in float64, gradients included.
3. Every registered model, tiny: logits and gradients on the device equal the CPU model's (same
   weights, float32, ``1e-3``); streaming the sequence in pieces (17 + 1 + 22 tokens) with the
   carried state equals the full forward on the device; sampling with a device generator works.
4. A few ``Trainer`` steps on the device (char corpus; a synthetic task in bf16 autocast): the loss
   is finite, the checkpoint loads on the CPU with the same weights and logits, and a CPU trainer
   resumes from it. Circuit tracking (``track_circuits``) during a device run.

5. Each peer backend the table offers on the device (fla-core, mamba-ssm: ``mnemo.ops.backends``),
   forced with ``use_backend``: outputs, final states and all gradients equal the ``torch``
   backend's on the same device (float32 ``1e-4``; bfloat16 inputs ``3e-2``, states float32).

Marked ``cuda`` (``pytest -m cuda``; ``scripts/gpu_check.sh`` runs them).

Matmuls run at full float32 precision here (``torch.set_float32_matmul_precision("highest")``,
restored afterwards): TF32 would need looser tolerances and is not what these checks are about.
"""

from __future__ import annotations

import copy
import math
import os
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.cuda  # scripts/gpu_check.sh selects them with -m cuda

DEVICE_NAME = os.environ.get("MNEMO_TEST_DEVICE", "cuda")
DEVICE = torch.device(DEVICE_NAME)
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    pytest.skip(
        f"device under test {DEVICE_NAME!r} needs CUDA, which is not available "
        "(set MNEMO_TEST_DEVICE=cpu to check this module on the CPU)",
        allow_module_level=True,
    )

from mnemo.models import LanguageModel, model_names  # noqa: E402
from mnemo.ops import KVCache, softmax_attention  # noqa: E402
from mnemo.testing.specs import SPECS  # noqa: E402
from mnemo.train import TrainConfig, Trainer, resolve_checkpoint  # noqa: E402
from tests.helpers import assert_close  # noqa: E402
from tests.models.test_lm import _model  # noqa: E402
from tests.train.test_trainer import _cfg as _trainer_cfg  # noqa: E402

B, T, H, K, V = 2, 37, 2, 16, 16  # T odd: a partial last chunk
DIMS = (B, H, K, V)
CHUNK = 16
F32_TOL = 1e-4  # float32 on the device vs float64 on the CPU
BF16_TOL = 3e-2  # bfloat16 vs float32, both on the device
MODEL_TOL = 1e-3  # float32 model on the device vs the same model on the CPU


@pytest.fixture(autouse=True)
def _full_float32_matmuls():
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(prev)


def _weights(shape, seed: int, like: torch.Tensor) -> torch.Tensor:
    """Fixed random loss weights (drawn on the CPU, so every device gets the same ones)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen, dtype=torch.float64)
    return w.to(device=like.device, dtype=torch.promote_types(like.dtype, torch.float32))


def _forward_backward(spec, x: dict, S0: torch.Tensor, mode: str, device, dtype, monkeypatch):
    """Run ``spec`` in ``mode`` on ``device`` in ``dtype`` with ``S0``; backpropagate a random
    linear function of the output and the final state. Returns ``(o, S, grads)``, where ``grads``
    holds ``spec.grad_inputs`` and ``initial_state``."""
    x = {n: t.detach().to(device, dtype).requires_grad_(n in spec.grad_inputs) for n, t in x.items()}
    S0 = S0.detach().to(device, dtype).requires_grad_(True)
    # (the per-op parameters of selective_scan / ssd, A, D and the biases, are inputs of their own,
    # OpSpec.static: moved to the device with the others above)
    o, S = spec.run(x, mode, S0, chunk_size=CHUNK)
    wo, ws = _weights(o.shape, 7, o), _weights(S.shape, 8, S)
    ((o.to(wo.dtype) * wo).sum() + (S.to(ws.dtype) * ws).sum()).backward()
    grads = {n: x[n].grad for n in spec.grad_inputs}
    grads["initial_state"] = S0.grad
    return o.detach(), S.detach(), grads


def _compare(got, ref, tol: float, what: str) -> None:
    o, S, grads = got
    o_ref, S_ref, grads_ref = ref
    assert o.device.type == DEVICE.type and S.device.type == DEVICE.type, f"{what}: left the device"
    assert_close(o.cpu(), o_ref.cpu(), tol, what=f"{what} output")
    assert_close(S.cpu(), S_ref.cpu(), tol, what=f"{what} final state")
    for n, g in grads_ref.items():
        assert grads[n] is not None, f"{what}: no gradient reached {n}"
        assert_close(grads[n].cpu(), g.cpu(), tol, what=f"{what} d/d{n}")


# --- 1. recurrent ops ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["chunk", "recurrent", "parallel"])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_op_on_device_matches_cpu_float64_reference(spec, mode, monkeypatch):
    """float32 ``mode`` form on the device == float64 recurrent form on the CPU (outputs, final
    state, gradients w.r.t. every input and the initial state)."""
    if mode not in spec.modes:
        pytest.skip(f"{spec.name} has no {mode} form")
    x = spec.inputs(T, dtype=torch.float32, dims=DIMS)
    S0 = spec.state(B, dtype=torch.float32, dims=DIMS)
    ref = _forward_backward(spec, x, S0, "recurrent", "cpu", torch.float64, monkeypatch)
    got = _forward_backward(spec, x, S0, mode, DEVICE, torch.float32, monkeypatch)
    assert got[0].dtype == torch.float32
    _compare(got, ref, F32_TOL, f"{spec.name} {mode} on {DEVICE}")


@pytest.mark.parametrize(
    "spec",
    [s for s in SPECS if s.name in ("gla_scalar", "gla_channel", "gated_delta_rule")],
    ids=lambda s: s.name,
)
def test_bf16_chunk_form_on_device_is_close_to_float32(spec, monkeypatch):
    """bfloat16 inputs and initial state: the chunk form stays finite and near float32."""
    x = spec.inputs(T, dtype=torch.float32, dims=DIMS)
    S0 = spec.state(B, dtype=torch.float32, dims=DIMS)
    ref = _forward_backward(spec, x, S0, "chunk", DEVICE, torch.float32, monkeypatch)
    got = _forward_backward(spec, x, S0, "chunk", DEVICE, torch.bfloat16, monkeypatch)
    assert got[0].dtype == torch.bfloat16
    _compare(got, ref, BF16_TOL, f"{spec.name} bf16 chunk on {DEVICE}")


# --- 2. softmax attention ----------------------------------------------------------------------

ATTENTION_CASES = {
    # name: (Hq, Hkv, T, past keys P, causal, window)
    "causal": (4, 4, T, 0, True, None),
    "gqa_window": (4, 2, T, 0, True, 5),
    "noncausal": (4, 2, T, 0, False, None),
    "kv_cache": (4, 2, T, 6, True, None),
    "decode_one_token": (4, 2, 1, T, True, None),
}


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_softmax_attention_on_device_matches_cpu_float64(case):
    """SDPA form in float32 on the device == token-loop reference in float64 on the CPU, for the
    output, the returned KV cache and the gradients w.r.t. q, k, v and the cache."""
    Hq, Hkv, Tq, P, causal, window = ATTENTION_CASES[case]
    gen = torch.Generator().manual_seed(0)
    names = ["q", "k", "v", "past_k", "past_v"]
    shapes = [(B, Tq, Hq, K), (B, Tq, Hkv, K), (B, Tq, Hkv, V), (B, P, Hkv, K), (B, P, Hkv, V)]
    base = {n: torch.randn(s, generator=gen) for n, s in zip(names, shapes)}

    def run(device, dtype, mode):
        t = {n: x.detach().to(device, dtype).requires_grad_(True) for n, x in base.items()}
        cache = KVCache(t["past_k"], t["past_v"]) if P else None
        o, c = softmax_attention(
            t["q"],
            t["k"],
            t["v"],
            causal=causal,
            window=window,
            initial_state=cache,
            output_final_state=True,
            mode=mode,
        )
        (o * _weights(o.shape, 3, o)).sum().backward()
        grads = {n: t[n].grad for n in names if P or not n.startswith("past")}
        return o.detach(), torch.cat([c.k, c.v], -1).detach(), grads

    ref = run("cpu", torch.float64, "recurrent")
    got = run(DEVICE, torch.float32, "parallel")
    _compare(got, ref, F32_TOL, f"softmax_attention {case} on {DEVICE}")


# --- 3. models -----------------------------------------------------------------------------------

VOCAB = 50  # the vocabulary of tests/models/test_lm.py's tiny models


def _ids(T_: int = 40, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, T_), generator=torch.Generator().manual_seed(seed))


def _tiny_pair(name):
    """A tiny float32 model (d_model 32, two layers or one full hybrid pattern) and its copy on
    the device."""
    cpu = _model(name).float()
    return cpu, copy.deepcopy(cpu).to(DEVICE)


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


@pytest.mark.parametrize("name", model_names())
def test_model_forward_backward_on_device_matches_cpu(name):
    """Same weights: device logits, loss and gradients == the CPU model's; all finite."""
    cpu, dev = _tiny_pair(name)
    ids = _ids()
    logits_cpu, _ = cpu(ids)
    logits_dev, _ = dev(ids.to(DEVICE))
    assert logits_dev.device.type == DEVICE.type
    assert_close(logits_dev.detach().cpu(), logits_cpu.detach(), MODEL_TOL, what=f"{name} logits")
    loss_cpu, loss_dev = _loss(logits_cpu, ids), _loss(logits_dev, ids.to(DEVICE))
    assert math.isfinite(loss_dev.item())
    loss_cpu.backward()
    loss_dev.backward()
    reached = 0
    for (pname, p_cpu), p_dev in zip(cpu.named_parameters(), dev.parameters()):
        assert (p_dev.grad is None) == (p_cpu.grad is None), (
            f"{name} {pname}: gradient reached one device only"
        )
        if p_dev.grad is None:
            continue  # e.g. slow CMS levels that do not update within 40 tokens
        reached += 1
        assert p_dev.grad.device.type == DEVICE.type
        assert_close(p_dev.grad.cpu(), p_cpu.grad, MODEL_TOL, floor=1e-4, what=f"{name} d/d{pname}")
    assert reached, f"{name}: no parameter received a gradient"


@pytest.mark.parametrize("name", model_names())
def test_streaming_on_device_equals_full_forward(name):
    """Feeding 17, then 1, then 22 tokens with the carried state == one pass over 40 tokens, on the
    device; sampling with a device generator stays on the device."""
    _, dev = _tiny_pair(name)
    ids = _ids().to(DEVICE)
    with torch.no_grad():
        full, _ = dev(ids)
        outs, state = [], None
        for a, b in ((0, 17), (17, 18), (18, 40)):
            logits, state = dev(ids[:, a:b], state)
            outs.append(logits)
    assert_close(torch.cat(outs, 1).cpu(), full.cpu(), F32_TOL, what=f"{name} streamed 17+1+22 on {DEVICE}")
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    out = dev.generate(ids[:, :5], 4, temperature=1.0, generator=gen)
    assert out.shape == (2, 9) and out.device.type == DEVICE.type
    assert torch.equal(out[:, :5], ids[:, :5]) and int(out.max()) < VOCAB


# --- 4. training ---------------------------------------------------------------------------------

TRAIN_CASES = {
    "char_gla": dict(model="gla", sample_tokens=16),
    "mqar_gated_deltanet_bf16": dict(
        model="gated_deltanet",
        task="mqar",
        task_options={"num_pairs": 2, "vocab_size": 16},
        seq_len=16,
        eval_lengths=[32],
        precision="bf16",
        sample_tokens=0,
    ),
}


def _train_cfg(**kw) -> TrainConfig:
    """The trainer tests' tiny config, 5 steps on the device under test."""
    base = dict(batch_size=4, steps=5, eval_interval=5, eval_batches=1, warmup_steps=1, device=DEVICE_NAME)
    return _trainer_cfg(**{**base, **kw})


@pytest.mark.parametrize("case", list(TRAIN_CASES))
def test_training_on_device_and_loading_the_checkpoint_on_cpu(case, tmp_path):
    cfg = _train_cfg(**TRAIN_CASES[case])
    tr = Trainer(cfg, tmp_path, progress=False, log=lambda *a, **k: None)
    assert next(tr.model.parameters()).device.type == DEVICE.type
    rec = tr.fit()
    assert rec["step"] == 5
    assert math.isfinite(rec["train_loss"]) and math.isfinite(rec["val_loss"]), rec

    ckpt = resolve_checkpoint(tmp_path)
    assert ckpt.name == "ckpt-000005"
    loaded = LanguageModel.from_pretrained(ckpt)  # map_location="cpu"
    trained = tr.model.state_dict()
    for n, p in loaded.state_dict().items():
        assert p.device.type == "cpu", n
        assert torch.equal(p, trained[n].cpu()), f"{n}: the checkpoint differs from the trained weights"
    ids = torch.randint(0, loaded.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    tr.model.eval()
    with torch.no_grad():
        assert_close(
            loaded(ids)[0], tr.model(ids.to(DEVICE))[0].cpu(), MODEL_TOL, what=f"{case} reloaded logits"
        )

    # the optimizer state, RNG states and config of a device run resume on the CPU
    on_cpu = Trainer(
        replace(cfg, device="cpu"), tmp_path, resume=True, progress=False, log=lambda *a, **k: None
    )
    assert on_cpu.step == 5 and next(on_cpu.model.parameters()).device.type == "cpu"
    assert math.isfinite(on_cpu.train_step())


def test_circuit_tracking_during_training_on_device(tmp_path):
    """``track_circuits`` scores the model on the device it trains on."""
    cfg = _train_cfg(
        model="transformer", steps=2, eval_interval=2, sample_tokens=0, track_circuits=True, circuit_length=8
    )
    from mnemo.interp import CircuitTracker

    tracker = CircuitTracker(length=cfg.circuit_length)
    rec = Trainer(cfg, tmp_path, progress=False, log=lambda *a, **k: None, callbacks=[tracker]).fit()
    assert math.isfinite(rec["induction_max"]), rec


# --- 5. the peers' kernels on the device ----------------------------------------------------------

#: the op each spec of the equivalence contract calls (specs of other ops have no peer backend)
SPEC_OP = {
    "linear_identity": "linear_attention",
    "gla_nogate": "gated_linear_attention",
    "gla_scalar": "gated_linear_attention",
    "gla_channel": "gated_linear_attention",
    "delta_rule": "delta_rule",
    "gated_delta_rule": "gated_delta_rule",
    "ssd": "ssd",
}


def _peer_cases():
    from mnemo.ops import dispatch

    return [
        pytest.param(spec, backend, id=f"{spec.name}-{backend}")
        for spec in SPECS
        if spec.name in SPEC_OP
        for backend in ("fla", "mamba_ssm")
        if (SPEC_OP[spec.name], backend) in dispatch.PEER_KERNELS
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("spec, backend", _peer_cases())
def test_peer_backend_on_device_matches_the_torch_backend(spec, backend, dtype, monkeypatch):
    from mnemo import ops
    from mnemo.ops import dispatch

    row = {(r.op, r.backend): r for r in ops.backends(DEVICE)}[(SPEC_OP[spec.name], backend)]
    if not row.available:
        pytest.skip(f"{backend} cannot serve {row.op} on {DEVICE}: {row.reason}")
    if DEVICE.type == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter computes bfloat16 wrongly (the table refuses it on a CPU)")
    x = spec.inputs(T, dtype=torch.float32, dims=DIMS)
    S0 = spec.state(B, dtype=torch.float32, dims=DIMS)
    with ops.use_backend("torch"):
        ref = _forward_backward(spec, x, S0, "chunk", DEVICE, dtype, monkeypatch)
    dispatch.reset_dispatch_log()
    with ops.use_backend(backend):
        got = _forward_backward(spec, x, S0, "chunk", DEVICE, dtype, monkeypatch)
    assert any(b == backend for (_, b, _) in ops.dispatch_log()), f"{backend} did not run"
    assert got[0].dtype == dtype, f"output {got[0].dtype}, expected the inputs' {dtype}"
    assert got[1].dtype == torch.float32, f"final state {got[1].dtype}, expected float32"
    _compare(got, ref, BF16_TOL if dtype == torch.bfloat16 else F32_TOL, f"{spec.name} on {backend}")
