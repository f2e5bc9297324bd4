"""Break-it review of the interventions: a tensor ``hook_state`` (a matrix memory ``[B, H, K, V]``)
has its heads on axis 1 and no position axis; selections that match nothing, hooks that never
fire, and bad arguments answered by an error that names the argument (not a raw torch error)."""

from __future__ import annotations

import pytest
import torch

from mnemo.interp.interventions import (
    ablate,
    ablate_state,
    activation_patching,
    hook_names,
    induction_ablation,
    logit_difference,
    mean_activations,
    next_token_loss,
    patch,
    state_patch,
    steer,
)
from mnemo.layers.hooks import HookPoint, name_hook_points, select
from mnemo.models import LanguageModel, build_config

V = 17


def _model(name, n_layers=2):
    torch.manual_seed(0)
    return LanguageModel(build_config(name, vocab_size=V, d_model=32, n_layers=n_layers)).double().eval()


def _ids(T=12, B=3, seed=1):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------- a tensor hook_state


@torch.no_grad()
def test_mean_of_a_matrix_state_is_over_the_batch_rows_only_not_the_heads():
    m, ids = _model("gla"), _ids()
    name = "blocks.0.mixer.hook_state"
    _, cache = m.run_with_cache(ids, names=name)
    S = cache[name]  # [B, H, K, V]
    means = mean_activations(m, ids, name)
    torch.testing.assert_close(means[name], S.mean(0, keepdim=True))
    # mean-ablating the state with those means: each head keeps its own mean memory
    _, st = m.run_with_hooks(ids, ablate_state(m, 0, how="mean", means=means))
    torch.testing.assert_close(st[0].mixer.memory, S.mean(0, keepdim=True).expand_as(S))
    # ablate with the run's own mean (means=None) on the state: also over the batch rows only
    seen = {}
    m.run_with_hooks(ids, ablate(m, name, how="mean") + [(name, lambda v, n: seen.update(v=v))])
    torch.testing.assert_close(seen["v"], S.mean(0, keepdim=True).expand_as(S))


@torch.no_grad()
def test_heads_of_a_matrix_state_are_its_axis_1_and_it_has_no_positions():
    m, ids = _model("gla"), _ids()
    name = "blocks.0.mixer.hook_state"
    _, cache = m.run_with_cache(ids, names=name)
    S = cache[name]
    seen = {}
    m.run_with_hooks(ids, ablate(m, name, heads=1) + [(name, lambda v, n: seen.update(v=v))])
    want = S.clone()
    want[:, 1] = 0  # head 1's memory, not key channel 1 of every head
    torch.testing.assert_close(seen["v"], want, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"position: blocks\.0\.mixer\.hook_state has no position axis"):
        m.run_with_hooks(ids, ablate(m, name, positions=0))
    with pytest.raises(ValueError, match="no position axis"):
        m.run_with_hooks(ids, patch(m, cache, name, positions=0))


# --------------------------------------------------------------------------- selections, hooks


def test_a_selection_of_no_hook_point_is_refused_not_a_silent_no_op():
    m, ids = _model("gla"), _ids()
    for names in ([], lambda n: False):
        with pytest.raises(KeyError, match="names: selects no hook point"):
            hook_names(m, names)
        with pytest.raises(KeyError, match="names: selects no hook point"):
            ablate(m, names)
        with pytest.raises(KeyError, match="names: selects no hook point"):
            activation_patching(m, ids, ids.flip(0), next_token_loss(ids), names, per="layer")
    with pytest.raises(TypeError, match="names: expected a hook name"):
        select(m.hook_points, 3)
    with pytest.raises(TypeError, match="names: expected a hook name"):
        steer(m, ["hook_o", 3], torch.zeros(8))


def test_activation_patching_names_a_hook_that_never_fires():
    m, ids = _model("mamba"), _ids()
    m.blocks[0].hook_never = HookPoint()  # a point of a part the forward does not run
    m.hook_points = name_hook_points(m)
    with pytest.raises(KeyError, match=r"blocks\.0\.hook_never.*did not fire"):
        activation_patching(m, ids, ids.flip(0), next_token_loss(ids), "hook_never", per="layer")


def test_a_block_without_an_mlp_has_no_mlp_hook_and_moe_no_shared_hook_without_a_shared_expert():
    """Points of parts a model does not have are not created (they would never fire: ablating
    ``hook_mlp_out`` on Mamba was a silent no-op); naming one is an unknown name."""
    m = _model("mamba")
    assert not any(n.endswith("hook_mlp_out") for n in m.hook_points)
    with pytest.raises(KeyError, match="hook_mlp_out"):
        ablate(m, "hook_mlp_out")
    assert any(n.endswith("hook_mlp_out") for n in _model("gla").hook_points)
    from mnemo.layers import MoE

    assert not hasattr(MoE(16, n_experts=4, top_k=2, expert_hidden=8), "hook_shared_out")
    moe = MoE(16, n_experts=4, top_k=2, expert_hidden=8, shared_expert_hidden=8)
    assert "hook_shared_out" in name_hook_points(moe)


# ------------------------------------------------------------------------------------- metrics


def test_metrics_name_a_bad_position_or_logits_of_another_shape():
    logits = torch.randn(2, 6, V)
    with pytest.raises(ValueError, match="position: expected an int"):
        logit_difference(1, 2, position=1.5)(logits)
    with pytest.raises(ValueError, match="position: expected an int"):
        logit_difference(1, 2, position=True)(logits)
    ids = _ids(T=5, B=2)
    with pytest.raises(ValueError, match=r"logits: expected \[2, 5, vocab\].*got \[2, 6, 17\]"):
        next_token_loss(ids)(logits)
    with pytest.raises(ValueError, match=r"logits: expected \[1, 6, vocab\]"):
        next_token_loss(_ids(T=6, B=1))(logits)


# ------------------------------------------------------------------------------ other arguments


@torch.no_grad()
def test_state_patch_with_a_layer_named_twice():
    m = _model("gla")
    A, B = _ids(seed=3, B=2), _ids(seed=4, B=2)
    got, _ = state_patch(m, A, B, 5, layers=[0, 0])
    want, _ = state_patch(m, A, B, 5, layers=[0])
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@torch.no_grad()
def test_state_means_of_another_shape_are_named():
    m, ids = _model("transformer"), _ids()
    means = mean_activations(m, ids[:, :8], "blocks.0.mixer.hook_state")  # a KV cache of 8 keys
    with pytest.raises(ValueError, match=r"means\['blocks\.0\.mixer\.hook_state'\].*leaf"):
        m.run_with_hooks(ids[:, :6], ablate_state(m, 0, how="mean", means=means))


def test_index_arguments_are_named():
    m, ids = _model("gla"), _ids()
    with pytest.raises(ValueError, match="position: slice step cannot be zero"):
        m.run_with_hooks(ids, ablate(m, "hook_o", positions=slice(0, 4, 0)))
    with pytest.raises(ValueError, match="direction: expected"):
        steer(m, "hook_resid_pre", "up")


def test_induction_ablation_counts_are_ints():
    m = _model("transformer")
    with pytest.raises(ValueError, match="draws: expected an int"):
        induction_ablation(m, 1, draws=1.5, length=4, batch=2)
    with pytest.raises(ValueError, match="k: expected an int"):
        induction_ablation(m, True, draws=1, length=4, batch=2)


def test_circuit_scores_name_a_bad_seed_or_vocabulary_offset():
    from mnemo.interp.probe import circuit_scores

    m = _model("transformer", n_layers=1)
    with pytest.raises(ValueError, match="vocab_offset: expected an int >= 0"):
        circuit_scores(m, 4, 2, vocab_offset=-5)
    with pytest.raises(ValueError, match="seed, vocab_offset: expected ints"):
        circuit_scores(m, 4, 2, seed=1.5)
