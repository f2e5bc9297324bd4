"""``precision="bf16"`` is mixed precision as a GPU run needs it, checked on the CPU (autocast works
the same way on either device type): bf16 matmuls inside the forward, float32 master weights,
gradients and optimizer state, float32 recurrent states from every op under autocast, a float32
cross-entropy, the ops' backends called with bf16 ``q, k, v`` / ``x``; and a bf16 run's losses
track the fp32 run's.

Tolerance of the bf16-vs-fp32 losses: 2 % relative per step over 10 steps of a tiny model. bf16
keeps 8 bits of mantissa (relative rounding 2⁻⁹ ≈ 2e-3 per matmul); measured: ≤ 3e-4 at d_model 32
(docs/benchmarks/bf16_vs_fp32_cpu.txt: the README's default job, 300 steps). A wrong cast (a
bf16 state accumulating over the sequence, a bf16 loss) shows as a drift several times larger."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import mnemo.ops.dispatch as dispatch
from mnemo.models import LanguageModel, build_config
from mnemo.models.registry import MODELS
from mnemo.train import TrainConfig, Trainer

#: state fields that hold activations (in the compute dtype), not a recurrent memory
ACTIVATION_FIELDS = {"conv", "kv", "latent"}  # conv windows, KV caches, MLA's cache of latents


def _trainer(tmp_path, name: str = "run", **kw) -> Trainer:
    cfg = dict(
        model="gated_deltanet",
        model_overrides={"d_model": 32, "n_layers": 1},
        seq_len=32,
        batch_size=4,
        steps=10,
        eval_interval=10,
        eval_batches=1,
        warmup_steps=2,
        sample_tokens=0,
    )
    cfg.update(kw)
    return Trainer(TrainConfig(**cfg), tmp_path / name, progress=False, log=lambda *a, **k: None)


def test_bf16_steps_keep_float32_weights_gradients_optimizer_state_and_loss(tmp_path, monkeypatch):
    import mnemo.models.lm as lm_module

    tr = _trainer(tmp_path, precision="bf16")
    linear_out, ce_in, ce_out = [], [], []
    tr.model.blocks[0].mixer.qkv_proj.register_forward_hook(lambda m, i, o: linear_out.append(o.dtype))
    # the training loss is the chunked cross-entropy (no [B, T, vocab] logits): its logits reach
    # logsumexp in float32 and its loss is float32
    real_ce, real_lse = lm_module.chunked_cross_entropy, torch.logsumexp

    def ce(*a, **k):
        loss = real_ce(*a, **k)
        ce_out.append(loss.dtype)
        return loss

    monkeypatch.setattr(lm_module, "chunked_cross_entropy", ce)
    monkeypatch.setattr(torch, "logsumexp", lambda x, *a, **k: ce_in.append(x.dtype) or real_lse(x, *a, **k))
    for _ in range(3):
        loss = tr.train_step()
        assert isinstance(loss, float) and loss > 0
    assert linear_out == [torch.bfloat16] * 3, "the forward's matmuls did not run in bf16"
    assert ce_in == [torch.float32] * 3, "the cross-entropy must see float32 logits"
    assert ce_out == [torch.float32] * 3, "the loss must be float32"
    for n, p in tr.model.named_parameters():
        assert p.dtype == torch.float32, f"{n}: master weights must stay float32"
        assert p.grad is None or p.grad.dtype == torch.float32, f"{n}: gradient not float32"
        for k, v in tr.optimizer.state[p].items():
            if torch.is_tensor(v) and v.is_floating_point():
                assert v.dtype == torch.float32, f"{n}: optimizer state {k} is {v.dtype}"


def _state_dtypes(state, path: str = "") -> dict[str, torch.dtype]:
    """``{field path: dtype}`` of the floating tensors of a (nested) state dataclass."""
    if torch.is_tensor(state):
        return {path: state.dtype} if state.is_floating_point() else {}
    out: dict = {}
    if dataclasses.is_dataclass(state):
        for f in dataclasses.fields(state):
            out.update(_state_dtypes(getattr(state, f.name), f"{path}.{f.name}".lstrip(".")))
    elif isinstance(state, (tuple, list)):
        for i, s in enumerate(state):
            out.update(_state_dtypes(s, f"{path}[{i}]"))
    return out


@pytest.mark.parametrize("name", ["gated_deltanet", "gla", "mamba2", "titans_lmm", "transformer"])
def test_recurrent_states_are_float32_and_backends_get_bf16_under_autocast(name, monkeypatch):
    """A bf16 forward: every recurrent memory in the returned state is float32 (the KV cache and
    the short-conv windows are activations, bf16); each op dispatched gets bf16 ``q, k, v``
    (``x``, ``B``, ``C`` for SSD), which is what the fla / mamba-ssm kernels are fed on CUDA."""
    calls = []
    real_select = dispatch.select
    monkeypatch.setattr(dispatch, "select", lambda call: calls.append(call) or real_select(call))
    torch.manual_seed(0)
    model = LanguageModel(build_config(name, vocab_size=32, d_model=32, n_layers=1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, state = model(torch.randint(0, 32, (2, 20), generator=torch.Generator().manual_seed(0)))
    dtypes = _state_dtypes(state[0].mixer)
    assert dtypes, f"{name}: no state tensors"
    for field, dt in dtypes.items():
        want = torch.bfloat16 if field.split(".")[0].split("[")[0] in ACTIVATION_FIELDS else torch.float32
        assert dt == want, f"{name}: state {field} is {dt}, expected {want}"
    if name in ("gated_deltanet", "gla", "mamba2"):
        assert calls, f"{name}: the op was not dispatched through mnemo.ops.dispatch"
        for call in calls:  # (ssd's dtypes: x, dt, A, B, C, ...; the others' q, k, v first)
            got = [call.dtypes[i] for i in ((0, 3, 4) if call.op == "ssd" else (0, 1, 2))]
            assert got == [torch.bfloat16] * 3, f"{name}: {call.op} got {call.dtypes}"


def test_bf16_training_tracks_fp32_on_a_tiny_run(tmp_path):
    """Same seed, same batches: 10 steps of bf16 autocast stay within 2 % of the fp32 losses."""
    fp32 = _trainer(tmp_path, "fp32", model="transformer", lr=1e-2)
    bf16 = _trainer(tmp_path, "bf16", model="transformer", lr=1e-2, precision="bf16")
    a = torch.tensor([fp32.train_step() for _ in range(10)])
    b = torch.tensor([bf16.train_step() for _ in range(10)])
    assert a[-1] < a[0] - 0.3, f"the fp32 run did not learn: {a.tolist()}"
    rel = ((b - a).abs() / a).max().item()
    assert rel < 2e-2, f"bf16 losses drift {rel:.2e} from fp32: {a.tolist()} vs {b.tolist()}"


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_preset_trains_under_bf16_autocast_with_float32_recurrent_states(name):
    """The bf16 claim for every registered preset (hope_paper's DGD momentum solve raised
    "triangular_solve_cpu not implemented for 'BFloat16'" before its upcast): the fused loss and
    its backward run under CPU bf16 autocast, finite, with float32 gradients and float32 recurrent
    states in every block's mixer (KV caches and conv windows are activations, bf16)."""
    torch.manual_seed(0)
    model = LanguageModel(build_config(name, vocab_size=32, d_model=16, n_layers=1))
    ids = torch.randint(0, 32, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = model(ids, targets=ids)
        _, state = model(ids)
    loss.backward()
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    for n, p in model.named_parameters():
        assert p.grad is None or (p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all()), n
    for field, dt in _state_dtypes(state[0].mixer).items():
        leaf = field.split(".")[-1].split("[")[0]
        if leaf in ACTIVATION_FIELDS | {"attn_k", "attn_v", "read_k", "read_v"} or leaf.endswith("conv"):
            continue  # activations (conv windows, KV caches): the dtype they were computed in
        assert dt == torch.float32, f"{name}: state {field} is {dt}, expected torch.float32"


@pytest.mark.parametrize("op", ["gated_delta_rule", "gated_linear_attention"])
@pytest.mark.parametrize("mode", ["chunk", "chunk (strong decay)", "parallel", "recurrent"])
def test_every_form_accumulates_in_float32_under_autocast(op, mode):
    """bf16 q, k, v under CPU bf16 autocast: every form returns a float32 state equal to the same
    call without autocast (fp32 accumulation), also where a chunk decays by more than 30 nats and
    the autograd chunk form takes over (it ran its matmuls in bf16 and returned a bf16 state)."""
    from mnemo.ops import gated_delta_rule, gated_linear_attention, use_backend

    gen = torch.Generator().manual_seed(0)
    B, T, H, K = 2, 24, 2, 4
    q, k, v = (torch.randn(B, T, H, K, generator=gen).bfloat16() for _ in range(3))
    k = torch.nn.functional.normalize(k.float(), dim=-1).bfloat16()
    g = -torch.rand(B, T, H, generator=gen) * (3.0 if "strong" in mode else 0.1)
    beta = torch.rand(B, T, H, generator=gen)
    m = mode.split(" ")[0]

    def run():
        if op == "gated_delta_rule":
            return gated_delta_rule(q, k, v, g=g, beta=beta, mode=m, output_final_state=True)
        return gated_linear_attention(q, k, v, g=g, mode=m, output_final_state=True)

    with use_backend("torch"):
        o_ref, s_ref = run()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            o, s = run()
    assert s.dtype == torch.float32
    assert torch.equal(s, s_ref) and torch.equal(o, o_ref)


@pytest.mark.parametrize("mode", ["chunk", "parallel", "recurrent"])
def test_the_ssm_scans_accumulate_in_float32_under_autocast(mode):
    """Likewise for the selective scan and SSD: bf16 inputs under CPU bf16 autocast give the
    autocast-free outputs and float32 states bit for bit (the selective scan's parallel form ran
    its matmuls in bf16)."""
    from mnemo.ops import selective_scan, ssd, use_backend

    gen = torch.Generator().manual_seed(0)
    B, T, H, P, N, D = 2, 24, 2, 4, 4, 3
    x = torch.randn(B, T, H, P, generator=gen).bfloat16()
    dt, A = torch.rand(B, T, H, generator=gen) * 2, -torch.rand(H, generator=gen) * 3
    Bs, Cs = (torch.randn(B, T, 1, N, generator=gen).bfloat16() for _ in range(2))
    u, delta = torch.randn(1, T, D, generator=gen).bfloat16(), torch.rand(1, T, D, generator=gen) * 2
    A2 = -torch.rand(D, N, generator=gen) * 3
    B2, C2 = (torch.randn(1, T, N, generator=gen).bfloat16() for _ in range(2))
    runs = {
        "ssd": lambda: ssd(x, dt, A, Bs, Cs, mode=mode, output_final_state=True),
        "selective_scan": lambda: selective_scan(u, delta, A2, B2, C2, mode=mode, output_final_state=True),
    }
    for name, run in runs.items():
        with use_backend("torch"):
            o_ref, s_ref = run()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                o, s = run()
        assert s.dtype == torch.float32, name
        assert torch.equal(s, s_ref) and torch.equal(o, o_ref), name
