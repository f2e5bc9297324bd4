"""Multi-head latent attention (DeepSeek-V2 §2.1.2–2.1.3): every form against a hand loop written from
the paper's equations, the absorbed form's logits, what the cache holds, and DeepSeek-V3's attention
in ``transformers`` itself."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mnemo.layers import MultiHeadLatentAttention
from mnemo.models import LanguageModel, ModelConfig
from mnemo.ops.softmax_attention import softmax_attention

D = 24


def _mla(seed=0, **kw) -> MultiHeadLatentAttention:
    torch.manual_seed(seed)
    opts = dict(n_heads=3, kv_lora_rank=10, qk_nope_head_dim=5, qk_rope_head_dim=4, v_head_dim=7)
    opts.update(kw)
    m = MultiHeadLatentAttention(D, **opts).double()
    with torch.no_grad():  # away from init, the norms' weights included
        for p in m.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return m


def _rms(x, w, eps):
    return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def _rope(x, pos, theta=10000.0):
    """RoPE on ``x [d]`` at position ``pos``, pairs ``(i, i + d/2)`` at angle ``pos θ^{−2i/d}``."""
    d = x.shape[-1]
    ang = pos * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    a, b = x[: d // 2], x[d // 2 :]
    return torch.cat([a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin()])


def _hand(m: MultiHeadLatentAttention, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 9–19 token by token and head by head for one sequence ``x [T, d]``: the output and the
    cache ``[c^KV; k^R]`` per token."""
    H, r, dn, dr, dv = m.n_heads, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    eps = m.kv_a_norm.eps
    W = m.kv_a_proj.weight
    b = m.kv_a_proj.bias if m.kv_a_proj.bias is not None else torch.zeros(r + dr, dtype=x.dtype)
    w_uk, w_uv = m.kv_b_proj.weight.view(H, dn + dv, r).split([dn, dv], dim=1)
    keys, values, outs, cache = [], [], [], []
    for t in range(x.shape[0]):
        c = _rms(W[:r] @ x[t] + b[:r], m.kv_a_norm.weight, eps)  # eq. 9 (with the released norm)
        k_r = _rope(W[r:] @ x[t] + b[r:], t)  # eq. 15
        cache.append(torch.cat([c, k_r]))
        keys.append([torch.cat([w_uk[h] @ c, k_r]) for h in range(H)])  # eq. 10, 17
        values.append([w_uv[h] @ c for h in range(H)])  # eq. 11
        if m.q_proj is not None:
            q_all = m.q_proj(x[t])
        else:
            q_all = m.q_b_proj(_rms(m.q_a_proj(x[t]), m.q_a_norm.weight, m.q_a_norm.eps))  # eq. 12–13
        o = []
        for h in range(H):
            q = q_all[h * (dn + dr) : (h + 1) * (dn + dr)]
            q = torch.cat([q[:dn], _rope(q[dn:], t)])  # eq. 14, 16
            s = torch.stack([q @ keys[j][h] for j in range(t + 1)]) / math.sqrt(dn + dr)
            p = s.softmax(0)
            o.append(sum(p[j] * values[j][h] for j in range(t + 1)))  # eq. 18
        outs.append(m.o_proj(torch.cat(o)))  # eq. 19
    return torch.stack(outs), torch.stack(cache)


@pytest.mark.parametrize("variant", ["plain", "q_lora_bias"])
def test_every_form_equals_the_papers_equations_by_hand(variant):
    kw = {} if variant == "plain" else dict(q_lora_rank=9, bias=True)
    m = _mla(**kw)
    x = torch.randn(2, 11, D, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    want = [_hand(m, x[b]) for b in range(2)]
    y_hand = torch.stack([w[0] for w in want])
    cache_hand = torch.stack([w[1] for w in want])
    with torch.no_grad():
        for mode in ("parallel", "recurrent"):
            y, state = m(x, mode=mode)
            assert (y - y_hand).abs().max() < 1e-12, mode
            assert (state.latent - cache_hand).abs().max() < 1e-12, mode
            assert state.offset == 11
        # prefill 4, then one token at a time (the absorbed decode step on the cache)
        y0, s = m(x[:, :4])
        steps = [y0]
        for t in range(4, 11):
            yt, s = m(x[:, t : t + 1], s)
            steps.append(yt)
        assert (torch.cat(steps, 1) - y_hand).abs().max() < 1e-12


def test_the_absorbed_query_scores_the_latents_as_the_expanded_keys():
    """§2.1.2: ``W^UK`` absorbed into the query gives the same logits, ``q̃_hᵀ [c; k^R] = q_hᵀ k_h``."""
    m = _mla()
    x = torch.randn(1, 6, D, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    acts = m.mixing_acts(x)
    q, c, kr = acts["hook_q"], acts["hook_c_kv"], acts["hook_k_rope"]
    latent = torch.cat([c, kr], -1)
    k, _ = m._expand(latent)
    qa = m._absorbed_queries(q)
    expanded = torch.einsum("bthd,bshd->bhts", q, k)
    absorbed = torch.einsum("bthc,bsc->bhts", qa, latent)
    assert (expanded - absorbed).abs().max() < 1e-12
    assert qa.shape[-1] == m.kv_lora_rank + m.qk_rope_head_dim


def test_the_cache_is_the_latents_whatever_the_number_of_heads():
    """The state holds ``d_c + d_h^R`` numbers per token (eq. 9–10), against ``2 H d_h`` for
    multi-head attention: at DeepSeek-V2's proportions (``d_c = 4 d_h``, ``d_h^R = d_h / 2``) and
    16 heads, 4.5 against 32 per ``d_h``."""
    for H in (1, 16):
        m = MultiHeadLatentAttention(64 * H // 4, n_heads=H, head_dim=16)
        assert (m.kv_lora_rank, m.qk_rope_head_dim) == (64, 8)
        assert m.state_size_bytes(2, 100) == 2 * 100 * (64 + 8) * 4  # float32
        x = torch.randn(2, 100, m.d_model)
        with torch.no_grad():
            _, state = m(x)
        assert list(state.latent.shape) == [2, 100, 72]


@pytest.mark.parametrize("dims", [(24, 16), (16, 24)])
def test_attention_with_unequal_widths_pads_to_the_fused_kernel_exactly(dims):
    """The zero padding of the narrower side (``_sdpa``) changes neither the output nor the
    gradients: against the explicit-softmax token loop, float64."""
    dq, dv = dims
    g = torch.Generator().manual_seed(5)
    q, k = (torch.randn(2, 13, 3, dq, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 13, 3, dv, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(2, 13, 3, dv, dtype=torch.float64, generator=g)
    grads = {}
    for mode in ("parallel", "recurrent"):
        o, _ = softmax_attention(q, k, v, mode=mode)
        grads[mode] = (o, *torch.autograd.grad((o * w).sum(), (q, k, v)))
    for a, b in zip(grads["parallel"], grads["recurrent"]):
        assert a.shape == b.shape and (a - b).abs().max() < 1e-12


def test_a_model_of_latent_attention_trains():
    """``ModelConfig(mixer="mla")`` builds a language model whose loss falls (a smoke test; what the
    layer computes is tested above)."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=12, d_model=32, n_layers=2, mixer="mla", mixer_options={"mla": {"n_heads": 2}}
    )
    model = LanguageModel(cfg)
    seq = torch.randint(1, 12, (8, 8))
    ids = torch.cat([seq, seq], 1)  # the second half repeats the first
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(40):
        logits, _ = model(ids[:, :-1])
        loss = F.cross_entropy(logits[:, 8:].reshape(-1, 12), ids[:, 9:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses[::10]


def _hf_attention(m: MultiHeadLatentAttention, interleave: bool, q_lora: int | None, bias: bool):
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    cfg = transformers.DeepseekV3Config(
        hidden_size=D,
        num_attention_heads=m.n_heads,
        num_key_value_heads=m.n_heads,
        q_lora_rank=q_lora,
        kv_lora_rank=m.kv_lora_rank,
        qk_nope_head_dim=m.qk_nope_head_dim,
        qk_rope_head_dim=m.qk_rope_head_dim,
        v_head_dim=m.v_head_dim,
        rope_interleave=interleave,
        attention_bias=bias,
        rms_norm_eps=1e-6,
    )
    cfg._attn_implementation = "sdpa"
    att = hf.DeepseekV3Attention(cfg, layer_idx=0).double().eval()
    rope = hf.DeepseekV3RotaryEmbedding(cfg)
    return att, rope


@pytest.mark.parametrize("interleave, bias", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("q_lora", [None, 9])
def test_equals_deepseek_v3_attention_in_transformers(interleave, q_lora, bias):
    """``transformers``' ``DeepseekV3Attention`` with mnemo's weights: the same output (its RoPE
    angles are float32, hence ~1e-7). With ``rope_interleave`` (the released checkpoints' pairing
    ``(2i, 2i + 1)``) the rotary rows of ``W^QR`` / ``W^KR`` are permuted (evens, then odds) into
    mnemo's ``rotate_half`` pairing, as the docstring says."""
    m = _mla(q_lora_rank=q_lora, bias=bias)
    assert m.q_proj is None or m.q_proj.bias is None  # never biased, as DeepSeek's
    att, rope = _hf_attention(m, interleave, q_lora, bias)
    H, r, dn, dr = m.n_heads, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim
    # mnemo's channel c of a rotary block is HF's channel perm[c] (HF de-interleaves evens then odds)
    perm = torch.cat([torch.arange(0, dr, 2), torch.arange(1, dr, 2)]) if interleave else torch.arange(dr)
    inv = torch.argsort(perm)
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    q_key = "q_proj.weight" if q_lora is None else "q_b_proj.weight"
    wq = sd[q_key].view(H, dn + dr, -1)
    wq = torch.cat([wq[:, :dn], wq[:, dn:][:, inv]], 1).reshape(H * (dn + dr), -1)
    wkv = sd["kv_a_proj.weight"]
    wkv = torch.cat([wkv[:r], wkv[r:][inv]])
    hf_sd = {
        "kv_a_proj_with_mqa.weight": wkv,
        "kv_a_layernorm.weight": sd["kv_a_norm.weight"],
        "kv_b_proj.weight": sd["kv_b_proj.weight"],
        "o_proj.weight": sd["o_proj.weight"],
    }
    if q_lora is None:
        hf_sd["q_proj.weight"] = wq
    else:
        hf_sd.update(
            {"q_a_proj.weight": sd["q_a_proj.weight"], "q_a_layernorm.weight": sd["q_a_norm.weight"]}
        )
        hf_sd["q_b_proj.weight"] = wq
    if bias:
        bkv = sd["kv_a_proj.bias"]
        hf_sd["kv_a_proj_with_mqa.bias"] = torch.cat([bkv[:r], bkv[r:][inv]])
        hf_sd["o_proj.bias"] = sd["o_proj.bias"]
        if q_lora is not None:
            hf_sd["q_a_proj.bias"] = sd["q_a_proj.bias"]
    att.load_state_dict(hf_sd, strict=True)
    x = torch.randn(2, 9, D, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    pos = torch.arange(9)[None].expand(2, -1)
    with torch.no_grad():
        cos, sin = rope(x, pos)
        want, _ = att(x, (cos.double(), sin.double()), attention_mask=None)
        got, _ = m(x)
    assert (got - want).abs().max() < 1e-6


def test_softmax_scale_sets_the_logit_scale_and_is_refused_with_yarn():
    m = _mla(softmax_scale=0.3)
    assert m.scale == 0.3
    x = torch.randn(1, 7, D, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        y, _ = m(x)
        m.softmax_scale = None  # the same layer at the default scale differs
        y_default, _ = m(x)
    assert (y - y_default).abs().max() > 1e-3
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
    with pytest.raises(ValueError, match="softmax_scale"):
        MultiHeadLatentAttention(D, n_heads=2, softmax_scale=0.3, rope_scaling=yarn)
    with pytest.raises(ValueError, match="rope_scaling: rope_type 'yarn'"):
        _mla(softmax_scale=0.3).set_rope_scaling(yarn)
    m = MultiHeadLatentAttention(D, n_heads=2, rope_scaling=yarn)  # the paper's factor on the logits
    assert m.scale == pytest.approx(
        (m.qk_nope_head_dim + m.qk_rope_head_dim) ** -0.5 * (0.1 * math.log(4) + 1) ** 2
    )


def test_the_default_rotary_width_is_even_at_any_head_size():
    """``mnemo train --model mla --d-model 40`` failed (head_dim 10: a rotary width of 5, review 49i):
    the default is half the head rounded down to an even width, DeepSeek-V2's 64 at 128."""
    assert [MultiHeadLatentAttention(4 * h, n_heads=4).qk_rope_head_dim for h in (10, 7, 128, 16)] == [
        4,
        2,
        64,
        8,
    ]
    with pytest.raises(
        ValueError, match=r"qk_rope_head_dim: .* got 0 \(2 · \(head_dim // 4\) with head_dim = 3\)"
    ):
        MultiHeadLatentAttention(12, n_heads=4)
