"""flash-linear-attention's released models (the fla-hub checkpoints: GLA, RetNet, DeltaNet, Gated
DeltaNet) in mnemo, against fla itself.

The fixtures in ``tests/data/fla_hub/<model_type>/`` were built and saved by fla 0.6.0
(``scripts/make_fla_fixtures.py``: tiny random-weight ``GLAForCausalLM``, ``RetNetForCausalLM``,
``DeltaNetForCausalLM``, ``GatedDeltaNetForCausalLM``, every weight moved off its initial value),
with fla's own float32 logits on two fixed rows of 40 tokens (``reference.safetensors``). Nothing
here imports fla.

Measured (float32, CPU; logits of size ~1–5; chunked form / token loop / prefill + one-token steps):
max |Δlogits| GLA 3.4e-5 / 4.3e-5 / 3.9e-5, RetNet 1.1e-5 / 1.2e-5 / 9.4e-6, DeltaNet 5.6e-6 /
8.0e-6 / 8.2e-6, Gated DeltaNet 9.1e-6 / 8.9e-6 / 1.0e-5. GLA's and RetNet's largest sit at the
first token, where the read-out is tiny and the RMSNorm after it (ε 1e-6) magnifies float32
rounding (mnemo in float64 differs from fla's float32 there by 2.3e-5 too); the tests bound it by
:data:`ATOL`. The function is pinned much tighter than that: the read-out norm's ε alone (1e-5 for
fla's 1e-6) moves the logits by 0.1–3.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from mnemo.hf.convert import CARRIED_CONFIG_NAME, convert, import_hf
from mnemo.models import LanguageModel

pytestmark = pytest.mark.filterwarnings("ignore:.*holds no tokenizer:UserWarning")

DATA = Path(__file__).resolve().parent.parent / "data" / "fla_hub"
#: fla's model_type -> (its class, mnemo's mixer)
MODELS = {
    "gla": ("GLAForCausalLM", "gla"),
    "retnet": ("RetNetForCausalLM", "retnet"),
    "delta_net": ("DeltaNetForCausalLM", "deltanet"),
    "gated_deltanet": ("GatedDeltaNetForCausalLM", "gated_deltanet"),
}
ATOL = 1e-4  # float32; measured ≤ 4.3e-5 (see the module docstring)


def reference(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's ``(input_ids [2, 40], logits [2, 40, 32])`` for the fixture ``name``."""
    r = load_file(DATA / name / "reference.safetensors")
    return r["input_ids"], r["logits"]


@pytest.fixture(scope="module")
def models() -> dict[str, LanguageModel]:
    return {name: LanguageModel.from_pretrained(DATA / name).eval() for name in MODELS}


def copy_fixture(name: str, tmp_path: Path, **config_changes) -> Path:
    """The fixture ``name`` copied into ``tmp_path`` with ``config.json`` fields changed."""
    out = tmp_path / name
    shutil.copytree(DATA / name, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(config_changes)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize("name", MODELS)
def test_logits_equal_fla(models, name):
    """The imported model's logits equal fla's, in mnemo's chunked form and in its token loop."""
    lm = models[name]
    assert lm.config.layer_mixers() == [MODELS[name][1]] * 2
    ids, expected = reference(name)
    with torch.no_grad():
        for mode in (None, "recurrent"):
            logits, _ = lm(ids, mode=mode)
            assert (logits - expected).abs().max().item() <= ATOL, (name, mode)


@pytest.mark.parametrize("name", MODELS)
def test_token_steps_and_greedy_generation(models, name):
    """A prefill of 3 tokens (shorter than the short convolutions), then one token at a time with the
    carried state, gives fla's logits at every position; greedy ``generate`` continues a prompt with
    the argmax of the full forward pass over what it wrote."""
    lm = models[name]
    ids, expected = reference(name)
    with torch.no_grad():
        logits, state = lm(ids[:, :3])
        steps = [logits]
        for t in range(3, 24):
            logits, state = lm(ids[:, t : t + 1], state)
            steps.append(logits)
        assert (torch.cat(steps, 1) - expected[:, :24]).abs().max().item() <= ATOL
        out = lm.generate(ids[:, :7], 8, temperature=0)
        full, _ = lm(out)
    assert out.shape == (2, 15)
    assert torch.equal(out[:, 7:], full[:, 6:-1].argmax(-1))


def test_convert_cli_writes_a_mnemo_checkpoint(tmp_path, capsys):
    """``mnemo convert`` on an fla folder: the checkpoint gives fla's logits and records its source."""
    from mnemo.cli import main

    assert main(["convert", str(DATA / "gated_deltanet"), str(tmp_path / "ck")]) == 0
    record = json.loads((tmp_path / "ck" / CARRIED_CONFIG_NAME).read_text())
    assert record["source_architecture"] == "GatedDeltaNetForCausalLM"
    lm = LanguageModel.from_pretrained(tmp_path / "ck").eval()
    ids, expected = reference("gated_deltanet")
    with torch.no_grad():
        assert (lm(ids)[0] - expected).abs().max().item() <= ATOL
    assert main(["convert", str(DATA / "gla"), str(tmp_path / "ck2")]) == 0
    assert json.loads((tmp_path / "ck2" / "config.json").read_text())["mixer"] == "gla"


def test_the_import_reads_fla_settings(models):
    """What each fixture sets reaches mnemo's mixers: heads and sizes, fla's norm epsilon, RetNet's
    rotary positions without convolutions, the tied head and ungated read-out of the DeltaNet fixture
    (fla's default ``use_gate``), the grouped value heads of the Gated DeltaNet one."""
    gla = models["gla"].blocks[0].mixer
    assert (gla.n_heads, gla.key_dim, gla.value_dim, gla.norm.eps) == (2, 8, 24, 1e-6)
    assert gla.conv is not None and torch.equal(gla.conv.bias, torch.zeros_like(gla.conv.bias))
    ret = models["retnet"].blocks[1].mixer
    assert (ret.gate, ret.key_dim, ret.value_dim, ret.conv, ret.rotary.theta) == ("retnet", 8, 16, None, 1e4)
    dn = models["delta_net"]
    assert dn.config.tie_embeddings and dn.lm_head.weight is dn.embed.weight
    m = dn.blocks[1].mixer
    assert (m.head_dim, m.value_head_dim, m.allow_neg_eigval, m.conv.kernel_size) == (8, 16, True, 3)
    assert m.g_proj is None and m.norm.eps == 1e-5 and m.conv.bias is None
    gdn = models["gated_deltanet"].blocks[0].mixer
    sizes = (gdn.n_heads, gdn.n_v_heads, gdn.head_dim, gdn.value_head_dim, gdn.qk_norm_eps)
    assert sizes == (2, 4, 8, 12, 1e-6)


@pytest.mark.parametrize("name", MODELS)
def test_fields_left_out_read_as_fla_defaults(tmp_path, name):
    """A ``config.json`` without the fields that equal fla's config-class defaults (a hand-written or
    older file) imports to the same model: the import's defaults are fla 0.6.0's."""
    from mnemo.hf import fla_hub

    fmt = {"gla": fla_hub.GLA, "retnet": fla_hub.RETNET, "delta_net": fla_hub.DELTA_NET}.get(
        name, fla_hub.GATED_DELTANET
    )
    folder = copy_fixture(name, tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    left_out = {k for k, v in cfg.items() if k in fmt.defaults and type(v) is type(fmt.defaults[k])}
    left_out = {k for k in left_out if cfg[k] == fmt.defaults[k]}
    assert len(left_out) >= 5, left_out
    (folder / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k not in left_out}))
    config, state, _ = import_hf(folder)
    expected_config, expected_state, _ = import_hf(DATA / name)
    assert config == expected_config
    assert all(torch.equal(state[k], expected_state[k]) for k in expected_state)


@pytest.mark.parametrize(
    ("name", "changes", "message"),
    [
        ("gla", {"feature_map": "relu"}, "fla GLA conversion: field 'feature_map' = 'relu'"),
        ("gla", {"num_kv_heads": 3}, "field 'num_kv_heads' = 3: expected null or a divisor of num_heads = 2"),
        ("gla", {"attn": {"layers": [1], "num_heads": 2}}, "field 'attn' = .*hybrid softmax-attention"),
        ("gla", {"clamp_min": -1.0}, "field 'clamp_min' = -1.0"),
        ("gla", {"use_output_gate": False}, "field 'use_output_gate' = False is not supported"),
        ("retnet", {"feature_map": "elu"}, "fla RetNet conversion: field 'feature_map' = 'elu'"),
        ("retnet", {"expand_k": 0.3}, "field 'expand_k' = 0.3: hidden_size · expand_k = 9.6 is not a whole"),
        ("delta_net", {"qk_activation": "relu"}, "fla DeltaNet conversion: field 'qk_activation' = 'relu'"),
        ("delta_net", {"qk_norm": "sum"}, "field 'qk_norm' = 'sum' is not supported"),
        ("delta_net", {"use_beta": False}, "field 'use_beta' = False is not supported"),
        ("delta_net", {"hidden_act": "powlu"}, "field 'hidden_act' = 'powlu' is not supported"),
        ("gated_deltanet", {"output_gate_activation": "sigmoid"}, "'output_gate_activation' = 'sigmoid'"),
        ("gated_deltanet", {"num_v_heads": 3}, "'num_v_heads' = 3: expected a multiple of num_heads = 2"),
        ("gated_deltanet", {"attnres_block_size": 2}, "field 'attnres_block_size' = 2"),
        ("gated_deltanet", {"use_gate": "yes"}, "field 'use_gate': expected true or false, got 'yes'"),
        # fla derives the MLP width from hidden_ratio: 256 here, not the file's 16
        ("gla", {"intermediate_size": None}, r"gate_proj.weight' has shape \[16, 32\], expected \[256, 32\] "
         r"\(its shape is set by intermediate_size = None \(default\), hidden_ratio = 4"),
    ],
)  # fmt: skip
def test_refusals_are_named(tmp_path, name, changes, message):
    with pytest.raises(ValueError, match=message):
        import_hf(copy_fixture(name, tmp_path, **changes))


def test_missing_and_unexpected_weights_are_named(tmp_path):
    folder = copy_fixture("gla", tmp_path)
    weights = load_file(folder / "model.safetensors")
    key = "model.layers.1.attn.gk_proj.1.bias"
    save_file({k: v for k, v in weights.items() if k != key}, folder / "model.safetensors")
    with pytest.raises(ValueError, match=f"fla GLA conversion: weight '{key}' is missing"):
        import_hf(folder)
    extra = "model.layers.0.attn.q_conv1d.bias"  # (fla's GLA convolutions have no bias)
    save_file({**weights, extra: torch.zeros(16)}, folder / "model.safetensors")
    with pytest.raises(ValueError, match=f"unexpected weights .*{extra}"):
        import_hf(folder)


def test_export_is_not_offered(tmp_path):
    """Import only: a converted fla GLA model has no export format (transformers has no GLA class)."""
    from mnemo.hf.convert import export_hf

    convert(DATA / "gla", tmp_path / "ck")
    with pytest.raises(ValueError, match=r"no export format expresses a model of mixers \['gla'\]"):
        export_hf(tmp_path / "ck", tmp_path / "out")


def gla_map(weights: dict, layer: int, x: torch.Tensor, heads: int, conv: int) -> tuple[torch.Tensor, ...]:
    """GLA's implicit attention ``M [B, H, T, T]`` of fla's layer ``layer`` on its block input ``x``,
    from the fla file's own weights (names, layout and formula of fla's ``GatedLinearAttention``):
    ``M_ts = K^{-1/2} Σ_k q_tk k_sk exp(Σ_{s<r≤t} g_rk)``; also ``v [B, H, T, V]``."""
    p = f"model.layers.{layer}."
    h = F.rms_norm(x, (x.shape[-1],), weights[p + "attn_norm.weight"], 1e-6)
    a = p + "attn."

    def short_conv(name):
        y = h @ weights[f"{a}{name}_proj.weight"].T  # [B, T, C]
        w = weights[f"{a}{name}_conv1d.weight"]  # [C, 1, W]
        y = F.conv1d(F.pad(y.transpose(1, 2), (conv - 1, 0)), w, groups=w.shape[0])
        return F.silu(y).transpose(1, 2).unflatten(-1, (heads, -1)).transpose(1, 2)  # [B, H, T, d]

    q, k, v = short_conv("q"), short_conv("k"), short_conv("v")
    w1, w2, b = (weights[a + n] for n in ("gk_proj.0.weight", "gk_proj.1.weight", "gk_proj.1.bias"))
    gk = h @ w1.T @ w2.T + b
    g = (F.logsigmoid(gk) / 16).unflatten(-1, (heads, -1)).transpose(1, 2)  # [B, H, T, K]
    c = g.cumsum(2)
    T, K = q.shape[2], q.shape[-1]
    decay = torch.exp((c[:, :, :, None, :] - c[:, :, None, :, :]).clamp(max=0))  # [B, H, t, s, K]
    M = torch.einsum("bhtk,bhsk,bhtsk->bhts", q, k, decay) / math.sqrt(K)
    return M.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), 0.0), v


def test_probe_circuits_reads_the_gla_fla_computes(tmp_path, capsys):
    """``mnemo probe circuits`` on the converted fla GLA: each layer's implicit attention, computed
    here from the fla file's own weights with GLA's formula, times the values gives the layer's
    read-out, and its induction and previous-token scores are those the probe reports."""
    from mnemo.cli import main
    from mnemo.interp.scores import induction_score, previous_token_score, repeated_random_tokens

    convert(DATA / "gla", tmp_path / "ck")
    L = 8
    argv = ["probe", "circuits", "--checkpoint", str(tmp_path / "ck"), "--length", str(L), "--batch", "2",
            "--out", str(tmp_path / "circ")]  # fmt: skip
    assert main(argv) == 0
    scores = json.loads(capsys.readouterr().out.strip().splitlines()[0])["layers"]
    ids = repeated_random_tokens(2, L, 32, torch.Generator().manual_seed(0))
    weights = load_file(DATA / "gla" / "model.safetensors")
    lm = LanguageModel.from_pretrained(tmp_path / "ck").eval()
    _, cache = lm.run_with_cache(ids)
    for layer in range(2):
        M, v = gla_map(weights, layer, cache[f"blocks.{layer}.hook_resid_pre"], heads=2, conv=4)
        read_out = cache[f"blocks.{layer}.mixer.hook_o"]  # [B, T, H, V]
        assert torch.allclose((M @ v).transpose(1, 2), read_out, atol=1e-5)
        got = scores[str(layer)]
        assert torch.allclose(torch.tensor(got["induction"]), induction_score(M, L), atol=1e-5)
        assert torch.allclose(torch.tensor(got["previous_token"]), previous_token_score(M), atol=1e-5)
