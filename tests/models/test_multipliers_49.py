"""Granite's scalars in mnemo's core (no ``transformers``): ``ModelConfig.embedding_multiplier`` /
``residual_multiplier`` / ``logits_scaling`` and the attention's ``softmax_scale``.

Every path computes the equation ``x₀ = m_e · embed(ids)``, ``x ← x + m_r · mixer(norm(x))``,
``x ← x + m_r · mlp(norm(x))``, ``logits = lm_head(norm(x)) / s``: the full forward (checked
against a hand loop over the blocks), the token loop (``mode="recurrent"``), a stream split into
calls, ``generate`` (eager; compiled under ``-m slow``), ``logits_at``, packed documents, the chunked training
loss and the task signal of CMS levels; and the defaults (1, ``None``) change nothing.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mnemo.models import LanguageModel, ModelConfig
from mnemo.models.fused_loss import chunked_cross_entropy

V = 37
SCALARS = dict(embedding_multiplier=2.5, residual_multiplier=0.6, logits_scaling=1.7)


def config(**over) -> ModelConfig:
    """A hybrid (Mamba-2 + attention with ``softmax_scale``, a MoE with a shared expert) with the
    scalars away from 1."""
    base = dict(
        vocab_size=V, d_model=16, n_layers=2, layers=["mamba2", "attention"], mlp="moe",
        mixer_options={"attention": {"n_heads": 2, "softmax_scale": 0.4},
                       "mamba2": {"head_dim": 8, "d_state": 4, "chunk_size": 4}},
        mlp_options={"n_experts": 3, "top_k": 2, "expert_hidden": 8, "shared_expert_hidden": 12},
        tie_embeddings=False, **SCALARS,
    )  # fmt: skip
    return ModelConfig(**{**base, **over})


def model(seed: int = 0, dtype=torch.float64, **over) -> LanguageModel:
    torch.manual_seed(seed)
    m = LanguageModel(config(**over)).to(dtype).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return m


def ids(batch: int = 2, length: int = 11, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (batch, length), generator=torch.Generator().manual_seed(seed))


def max_diff(a, b) -> float:
    return (a - b).abs().max().item()


def test_forward_is_the_equation():
    """The forward equals a hand loop over the blocks written from the equation (float64)."""
    m, x = model(), ids()
    c = m.config
    with torch.no_grad():
        h = m.embed.weight[x] * c.embedding_multiplier
        for b in m.blocks:
            h = h + c.residual_multiplier * b.mixer(b.mixer_norm(h))[0]
            h = h + c.residual_multiplier * b.mlp(b.mlp_norm(h))
        ref = (m.norm(h) @ m.lm_head.weight.T) / c.logits_scaling
        assert max_diff(m(x)[0], ref) <= 1e-13
        assert m.blocks[1].mixer.scale == 0.4


def test_each_scalar_is_a_reparametrisation():
    """Independent meaning: ``logits_scaling = s`` is the head's weight divided by ``s``;
    ``embedding_multiplier = m`` is the (untied) embedding multiplied by ``m``; ``softmax_scale``
    = ``c`` is the query projection multiplied by ``c · √head_dim``."""
    m, x = model(), ids()
    with torch.no_grad():
        ref = m(x)[0]
        for field, scale_weight in (
            ("logits_scaling", lambda o: o.lm_head.weight.div_(SCALARS["logits_scaling"])),
            ("embedding_multiplier", lambda o: o.embed.weight.mul_(SCALARS["embedding_multiplier"])),
        ):
            other = model(**{field: 1.0})
            other.load_state_dict(m.state_dict())
            scale_weight(other)
            assert max_diff(other(x)[0], ref) <= 1e-12, field
        opts = {"attention": {"n_heads": 2}, "mamba2": config().mixer_options["mamba2"]}
        other = model(mixer_options=opts)
        other.load_state_dict(m.state_dict())
        other.blocks[1].mixer.q_proj.weight.mul_(0.4 * math.sqrt(8))
        assert max_diff(other(x)[0], ref) <= 1e-12


def test_recurrent_split_and_generate_agree_with_the_forward():
    """The token loop, a stream split into calls, ``logits_at``, packed documents and greedy
    ``generate`` (a full forward per token as the reference) compute the forward's logits."""
    m, x = model(), ids()
    with torch.no_grad():
        ref = m(x)[0]
        assert max_diff(m(x, mode="recurrent")[0], ref) <= 1e-12
        a, state = m(x[:, :6])
        b, state = m(x[:, 6:7], state)
        c, _ = m(x[:, 7:], state)
        assert max_diff(torch.cat([a, b, c], 1), ref) <= 1e-12
        at = torch.rand(x.shape, generator=torch.Generator().manual_seed(3)) < 0.5
        assert max_diff(m(x, logits_at=at)[0], ref[at]) <= 1e-13
        cu = torch.tensor([0, 4, 11])
        packed = m(x[:1], cu_seqlens=cu)[0]
        alone = torch.cat([m(x[:1, :4])[0], m(x[:1, 4:])[0]], 1)
        assert max_diff(packed, alone) <= 1e-12
    prompt, out = x[:, :4], x[:, :4]
    for _ in range(6):
        with torch.no_grad():
            out = torch.cat([out, m(out)[0][:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(m.generate(prompt, 6, temperature=0), out)


@pytest.mark.slow
def test_compiled_generation_equals_eager():
    """``generate(compile=True)`` (compiled prefill and one-token step) picks the eager tokens (slow:
    the compilation, 30-100 s on 2 cores; the eager paths above run the same forward)."""
    from mnemo.bench.models import compile_available

    if not compile_available()[0]:
        pytest.skip("torch.compile unavailable here")
    m, x = model(dtype=torch.float32, layers=["attention", "attention"], mlp="swiglu", mlp_options={}), ids()
    prompt = x[:, :5]
    eager = m.generate(prompt, 5, temperature=0)
    assert torch.equal(m.generate(prompt, 5, temperature=0, compile=True), eager)


def test_fused_loss_equals_cross_entropy_of_the_logits():
    """The chunked training loss (``forward(targets=)``) equals ``F.cross_entropy`` of the forward's
    logits, gradients too; and :func:`chunked_cross_entropy`'s ``logits_scaling`` equals dividing
    the logits, over several chunks and with ignored targets."""
    m, x = model(), ids()
    y = torch.roll(x, -1, 1)
    y[0, 3] = -100
    loss = m(x, targets=y)[0]
    g_fused = torch.autograd.grad(loss, [m.lm_head.weight, m.embed.weight])
    logits = m(x)[0]
    ref = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
    g_ref = torch.autograd.grad(ref, [m.lm_head.weight, m.embed.weight])
    assert abs(loss.item() - ref.item()) <= 1e-12
    assert all(max_diff(a, b) <= 1e-12 for a, b in zip(g_fused, g_ref))
    h = torch.randn(13, 8, dtype=torch.float64, requires_grad=True)
    W = torch.randn(V, 8, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, V, (13,))
    t[5] = -100
    got = chunked_cross_entropy(h, W, t, chunk_rows=4, logits_scaling=3.0, reduction="mean")
    want = F.cross_entropy(F.linear(h, W) / 3.0, t, reduction="mean")
    assert abs(got.item() - want.item()) <= 1e-14
    for a, b in zip(torch.autograd.grad(got, [h, W]), torch.autograd.grad(want, [h, W])):
        assert max_diff(a, b) <= 1e-14
    with pytest.raises(ValueError, match=r"logits_scaling: expected a finite number > 0, got 0"):
        chunked_cross_entropy(h, W, t, logits_scaling=0)


def test_task_signal_reads_the_scaled_logits():
    """CMS levels that learn from the next-token loss take it of the scaled logits: a model with
    ``logits_scaling = s`` and one with the head divided by ``s`` read and learn alike."""
    cms = {"levels": [{"period": 4, "objective": "task"}]}
    kw = dict(layers=["attention", "attention"], mlp="cms", mlp_options=cms, dtype=torch.float64)
    m, x = model(**kw), ids(length=10)
    other = model(**kw, logits_scaling=1.0)
    other.load_state_dict(m.state_dict())
    with torch.no_grad():
        other.lm_head.weight.div_(SCALARS["logits_scaling"])
    assert m.task_segment == 4
    a, sa = m(x)
    b, sb = other(x)
    assert max_diff(a, b) <= 1e-12
    assert max_diff(m(x[:, :1], sa)[0], other(x[:, :1], sb)[0]) <= 1e-12


def test_hooks_see_the_scaled_values():
    """``hook_embed`` sees ``m_e · embed``; ``hook_resid_mid = resid_pre + m_r · hook_mixer_out``
    (the mixer's output before the multiplier)."""
    m, x = model(), ids()
    _, cache = m.run_with_cache(x)
    assert max_diff(cache["hook_embed"], m.embed.weight[x] * 2.5) == 0
    for i in range(2):
        mid = cache[f"blocks.{i}.hook_resid_pre"] + 0.6 * cache[f"blocks.{i}.hook_mixer_out"]
        assert max_diff(cache[f"blocks.{i}.hook_resid_mid"], mid) == 0


def test_defaults_change_nothing(tmp_path):
    """A config saved before the fields existed loads with them at 1 / ``None``, and a model with
    the defaults spelled out computes bit for bit what one without them does (no multiplication
    is made); ``softmax_scale = head_dim ** -0.5`` is the default scale."""
    plain = dict(vocab_size=V, d_model=16, n_layers=2, mixer_options={"attention": {"n_heads": 2}})
    old = ModelConfig(**plain).to_dict()
    for k in SCALARS:
        del old[k]
    c = ModelConfig.from_dict(old)
    assert (c.embedding_multiplier, c.residual_multiplier, c.logits_scaling) == (1.0, 1.0, 1.0)
    torch.manual_seed(0)
    a = LanguageModel(c).eval()
    spelled = ModelConfig(**plain, embedding_multiplier=1.0, residual_multiplier=1.0, logits_scaling=1.0)
    b = LanguageModel(spelled).eval()
    b.load_state_dict(a.state_dict())
    x = ids()
    with torch.no_grad():
        assert torch.equal(a(x)[0], b(x)[0])
        b.blocks[0].mixer.softmax_scale = 8**-0.5
        assert torch.equal(a(x)[0], b(x)[0])
    a.save_pretrained(tmp_path)
    assert LanguageModel.from_pretrained(tmp_path).config == c


def test_bad_values_are_refused_by_name():
    for field in SCALARS:
        for bad in (0, -1.0, float("nan"), float("inf"), True, "2"):
            with pytest.raises(ValueError, match=rf"ModelConfig\.{field}: expected a finite number > 0"):
                ModelConfig(**{field: bad}).validate()
    from mnemo.layers.attention import Attention

    for bad in (0, -0.5, float("inf"), True):
        with pytest.raises(ValueError, match=r"softmax_scale: expected a finite number > 0 or None"):
            Attention(16, 2, softmax_scale=bad)
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    with pytest.raises(
        ValueError, match=r"softmax_scale: 0\.3 is not supported with rope_scaling of rope_type 'yarn'"
    ):
        Attention(16, 2, softmax_scale=0.3, rope_scaling=yarn)
    a = Attention(16, 2, softmax_scale=0.3)
    with pytest.raises(ValueError, match=r"rope_scaling: rope_type 'yarn' multiplies the logits"):
        a.set_rope_scaling(yarn)
    a.set_rope_scaling({**yarn, "rope_type": "yarn_hf"})  # (q and k scaled, not the logits)
    assert a.scale == 0.3
