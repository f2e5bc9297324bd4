"""Third break-it review of mnemo.interp: layer indices given as numpy / 0-d tensor integers, the
heads of a delta rule with grouped value heads, and the numbers against hand computations."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mnemo.interp import ablate_head, capture_maps, copying_score, memory_spectrum, mixing
from mnemo.interp.interventions import ablate, ablate_state, ablate_write
from mnemo.models import LanguageModel, build_config

V = 23


def _model(name, n_layers=2, **kw):
    torch.manual_seed(0)
    return LanguageModel(build_config(name, vocab_size=V, d_model=16, n_layers=n_layers, **kw)).eval()


def _ids(T, B=1, seed=1):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("index", [np.int64(1), torch.tensor(1), [np.int64(1)], (torch.tensor(1),)])
def test_capture_maps_and_the_spectrum_take_numpy_and_0d_tensor_layer_indices(index):
    """``capture_maps(layers=np.int64(1))`` raised ``TypeError: 'numpy.int64' object is not
    iterable`` (not naming ``layers``) and ``layers=[np.int64(1)]`` claimed the layer was out of
    range; ``state_patch`` takes such indices (review 38a)."""
    m = _model("gated_deltanet")
    ids = _ids(7)
    want = capture_maps(m, ids, layers=1)
    got = capture_maps(m, ids, layers=index)
    assert list(got) == [1] and torch.equal(got[1], want[1])
    spec = memory_spectrum(m, ids, layers=index)
    assert list(spec) == ["1"]
    assert spec["1"]["exponents"] == memory_spectrum(m, ids, layers=1)["1"]["exponents"]


@pytest.mark.parametrize("bad", [np.int64(2), 1.0, "1", torch.tensor(True), [True]])
def test_a_layer_index_that_is_not_an_int_in_range_is_named(bad):
    m = _model("gla")
    with pytest.raises(ValueError, match=r"layers: .*the model has 2 layers"):
        capture_maps(m, _ids(5), layers=bad)
    with pytest.raises(ValueError, match=r"layers: .*the model has 2 layers"):
        memory_spectrum(m, _ids(5), layers=bad)


def test_interventions_and_the_copying_score_take_a_numpy_layer_index():
    """``ablate_head(m, np.int64(1), 0)`` was refused as "expected an int"."""
    m = _model("transformer")
    ids = _ids(6)
    with torch.no_grad():
        for make in (
            lambda layer: ablate_head(m, layer, 0),
            lambda layer: ablate_write(m, layer, [2]),
        ):
            want, _ = m.run_with_hooks(ids, make(1))
            got, _ = m.run_with_hooks(ids, make(np.int64(1)))
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        _, s_want = m.run_with_hooks(ids, ablate_state(m, 1))
        _, s_got = m.run_with_hooks(ids, ablate_state(m, torch.tensor(1)))
        k_got, k_want = s_got[1].mixer.kv.k, s_want[1].mixer.kv.k
        assert torch.equal(k_got, k_want) and not k_got.any()
    assert torch.equal(copying_score(m, np.int64(1)), copying_score(m, 1))
    with pytest.raises(ValueError, match=r"layer: expected an int in \[0, 2\).*got tensor\(True\)"):
        ablate_head(m, torch.tensor(True), 0)


def _grouped_gdn():
    opts = {"gated_deltanet": {"n_heads": 2, "n_v_heads": 4}}
    return _model("gated_deltanet", n_layers=1, mixer_options=opts)


def test_a_grouped_value_head_delta_rule_has_one_map_per_value_head():
    """What does hold: the map of a Gated DeltaNet with grouped value heads (Qwen3-Next's) has the
    ``H_v`` value heads and reproduces the read-out (see the next test for the heads' count)."""
    m = _grouped_gdn().double()
    mx = mixing(m.blocks[0].mixer, torch.randn(2, 9, 16, dtype=torch.float64))
    assert mx.maps.shape == (2, 4, 9, 9)
    recon = torch.einsum("bhts,bshv->bthv", mx.maps, mx.values)
    torch.testing.assert_close(recon, mx.output, rtol=0, atol=1e-12)


def test_heads_of_a_grouped_value_head_delta_rule_are_its_value_heads():
    """``DeltaNet.map_heads`` was ``n_heads`` (the key heads), not ``n_v_heads``, the map's heads:
    ``ablate_head`` refused value head 3 of 4 and ``mnemo probe ablate`` failed on such a model."""
    m = _grouped_gdn()
    ids = _ids(8)
    assert m.blocks[0].mixer.map_heads == 4
    with torch.no_grad():
        got, _ = m.run_with_hooks(ids, ablate_head(m, 0, 3))

        def zero_head_3(value, name):
            value = value.clone()
            value[:, :, 3] = 0
            return value

        want, _ = m.run_with_hooks(ids, [("blocks.0.mixer.hook_o", zero_head_3)])
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        m.run_with_hooks(ids, ablate(m, "blocks.0.mixer.hook_beta", heads=3))  # [B, T, H_v]


@pytest.mark.parametrize("ids", [torch.tensor([[3]]), torch.tensor([3, 4, 5])])
def test_next_token_loss_of_one_token_or_an_unbatched_row_is_refused_not_nan(ids):
    """``next_token_loss`` of ``[B, 1]`` ids returned NaN (the mean over no prediction), so an
    activation-patching sweep on one token filled its table with NaN without a word."""
    from mnemo.interp import next_token_loss

    with pytest.raises(ValueError, match=r"input_ids: expected \[B, T\] token ids with T >= 2"):
        next_token_loss(ids)


def test_next_token_loss_is_the_mean_cross_entropy_by_hand():
    from mnemo.interp import next_token_loss

    logits = torch.randn(2, 4, 5, dtype=torch.float64)
    ids = torch.tensor([[1, 2, 3, 4], [0, 4, 4, 1]])
    logp = logits.log_softmax(-1)
    hand = -sum(logp[b, t, ids[b, t + 1]] for b in range(2) for t in range(3)) / 6
    assert next_token_loss(ids)(logits).item() == pytest.approx(hand.item(), rel=1e-14)


def test_mean_activations_of_every_hook_of_an_moe_model_leave_out_the_expert_indices():
    """``mean_activations(m, ids, None)`` (every hook) raised torch's unnamed ``RuntimeError: mean():
    could not infer output dtype`` on a model with an MoE MLP: ``hook_topk_indices`` carries expert
    ids (integers). Now they get no entry, and the float means are the hand means."""
    from mnemo.interp import mean_activations

    m = _model("gated_deltanet_attention_moe")
    ids = _ids(6, B=3)
    means = mean_activations(m, ids, None)
    assert not any(n.endswith("hook_topk_indices") for n in means)
    _, cache = m.run_with_cache(ids)
    name = "blocks.0.mlp.hook_topk_weights"
    torch.testing.assert_close(means[name], cache[name].mean((0, 1), keepdim=True), rtol=0, atol=0)
    assert set(means) == {
        n for n, v in cache.items() if not isinstance(v, torch.Tensor) or v.is_floating_point()
    }


def test_mean_ablation_of_integer_values_is_refused_naming_the_hook():
    m = _model("gated_deltanet_attention_moe")
    hooks = ablate(m, "blocks.0.mlp.hook_topk_indices", how="mean")
    with pytest.raises(
        ValueError, match=r"how='mean': blocks\.0\.mlp\.hook_topk_indices carries torch\.int64"
    ):
        m.run_with_hooks(_ids(6), hooks)
