"""Review of the Nested Learning / HOPE layers: states of another configuration and bad arguments are
refused with messages that name them, and a CMS level steps by Eq. 71 exactly (a hand loop)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mnemo.layers.cms import CMSLevel, ContinuumMemory, Level
from mnemo.layers.self_modifying import SelfModifyingTitans
from mnemo.models import LanguageModel, build_config
from tests.helpers import assert_close

D = 8


def _x(T, B=2, seed=0):
    return torch.randn(B, T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _eq71(level: CMSLevel, x: torch.Tensor):
    """Eq. 71 token by token: every token's gradient at the period-start weights, summed, applied
    (gd or momentum) when the position is a multiple of the period. Returns ``(y, (W_in, W_out))``."""
    B, T, d = x.shape
    lv = level.level
    W = [w.detach().expand(B, *w.shape).clone() for w in (level.W_in, level.W_out)]
    acc = [torch.zeros_like(w) for w in W]
    mom = [torch.zeros_like(w) for w in W]
    ys = []
    for t in range(T):
        xt = x[:, t : t + 1]
        Wg = [w.clone().requires_grad_() for w in W]
        y = F.gelu(xt @ Wg[0]) @ Wg[1]
        ys.append(y.detach())
        eta = (lv.lr * torch.sigmoid(level.rate(xt)) / d).detach()
        loss = (eta * 0.5 * (y - level.value(xt).detach()).square().sum(-1, keepdim=True)).sum()
        acc = [a + g for a, g in zip(acc, torch.autograd.grad(loss, Wg))]
        if (t + 1) % lv.period == 0:
            if lv.optimizer == "gd":
                W = [w - a for w, a in zip(W, acc)]
            else:
                mom = [lv.beta * m - a for m, a in zip(mom, acc)]
                W = [w + m for w, m in zip(W, mom)]
            acc = [torch.zeros_like(a) for a in acc]
    return torch.cat(ys, 1), W


@pytest.mark.parametrize("period", [1, 2, 3, 4])
@pytest.mark.parametrize("optimizer", ["gd", "momentum"])
def test_a_level_steps_by_eq_71_in_one_pass_and_in_any_split(period, optimizer):
    """Periods 1, 2, 3, 4 over 11 tokens (not a multiple of 2, 3, 4): outputs and weights equal the
    hand loop; a split at 1, 2, 5 carries the partial period in the state and equals one pass."""
    torch.manual_seed(0)
    level = CMSLevel(D, Level(period, optimizer=optimizer, lr=2.0)).double()
    with torch.no_grad():
        level.W_out.mul_(3.0)
        level.rate.weight.normal_()
    x = _x(11)
    y, st = level(x)
    ref, W = _eq71(level, x)
    assert_close(y, ref, 1e-12, what="output")
    for a, b in zip(st.weights, W):
        assert_close(a, b, 1e-12, what="weights")
    assert st.updates == 11 // period and st.position == 11
    outs, part, a = [], None, 0
    for b in (1, 2, 5, 11):
        yb, part = level(x[:, a:b], part)
        outs.append(yb)
        a = b
    assert_close(torch.cat(outs, 1), y, 1e-12, what="split")
    for u, v in zip(part.weights + part.grad, st.weights + st.grad):
        assert_close(u, v, 1e-12, what="split state")


def test_a_cms_state_of_another_configuration_is_refused_naming_the_level():
    """Before the fix a state without momentum buffers given to a momentum level crashed with
    ``TypeError: 'NoneType' object is not iterable``, and a state whose fast weights have another
    hidden width (another ``expansion``) was read and stepped silently."""
    _, st = ContinuumMemory(D, [Level(2), Level(4)]).double()(_x(3))
    momentum = ContinuumMemory(D, [Level(2), Level(4, optimizer="momentum")]).double()
    with pytest.raises(
        ValueError, match=r"state.levels\[1\].momentum: the level's optimizer 'momentum' needs"
    ):
        momentum(_x(3), st)
    _, st_m = momentum(_x(3))
    plain = ContinuumMemory(D, [Level(2), Level(4)]).double()
    with pytest.raises(
        ValueError, match=r"state.levels\[1\].momentum: the level's optimizer 'gd' needs none"
    ):
        plain(_x(3), st_m)
    wide = ContinuumMemory(D, [Level(2, expansion=4.0), Level(4)]).double()
    with pytest.raises(
        ValueError, match=r"state.levels\[0\].weights: expected shapes \[\[2, 8, 32\], \[2, 32, 8\]\]"
    ):
        wide(_x(3), st)
    wide(_x(3), wide(_x(3))[1])  # its own state continues


def test_a_language_models_cms_state_of_another_configuration_is_refused():
    V = 23
    ids = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(1))

    def model(**level):
        torch.manual_seed(0)
        cfg = build_config(
            "hope_attention",
            vocab_size=V,
            d_model=16,
            n_layers=1,
            mlp_options={"levels": [{"period": 2, **level}]},
        )
        return LanguageModel(cfg).double()

    _, st = model()(ids)
    with pytest.raises(ValueError, match=r"state.levels\[0\].weights: expected shapes"):
        model(expansion=4.0)(ids, st)
    with pytest.raises(ValueError, match=r"state.levels\[0\].momentum"):
        model(optimizer="momentum")(ids, st)


def test_bad_cms_constructor_arguments_are_named():
    for bad in (0, -3, 8.0, True):
        with pytest.raises(ValueError, match=rf"ContinuumMemory.d_model: expected an int >= 1, got {bad!r}"):
            ContinuumMemory(bad, [Level(2)])
        with pytest.raises(ValueError, match=rf"CMSLevel.d_model: expected an int >= 1, got {bad!r}"):
            CMSLevel(bad, Level(2))
    with pytest.raises(ValueError, match="ContinuumMemory.levels: expected a sequence of Level"):
        ContinuumMemory(D, None)
    with pytest.raises(ValueError, match="ContinuumMemory.levels: expected a sequence of Level"):
        ContinuumMemory(D, Level(2))
    with pytest.raises(
        ValueError, match=r"ContinuumMemory.levels\[1\]: expected a Level or a dict .* got int 4"
    ):
        ContinuumMemory(D, [Level(2), 4])
    with pytest.raises(
        ValueError, match=r"ContinuumMemory.levels\[0\]: unknown Level field\(s\) \['perid'\]"
    ):
        ContinuumMemory(D, [{"perid": 2}])
    with pytest.raises(ValueError, match="CMSLevel.level: expected a Level, got dict"):
        CMSLevel(D, {"period": 2})
    cms = ContinuumMemory(D, [{"period": 2}, {"period": 4, "optimizer": "momentum"}])  # dicts still work
    assert cms.periods == [2, 4]


def test_self_modifying_titans_refuses_a_state_of_another_configuration_and_bad_arguments():
    """Before the fix a state from a mixer with another ``expansion`` was read and stepped silently
    (its memories' hidden width differs), and one from an ``adaptive_q`` mixer crashed inside a
    broadcast; ``chunk_size=True`` was taken as 1 and ``beta_max="1"`` raised a ``TypeError``."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, D)
    _, st = SelfModifyingTitans(D, n_heads=2, chunk_size=2)(x)
    for kwargs, what in (({"expansion": 2.0}, r"hidden = 16"), ({"adaptive_q": True}, r"adaptive_q=True")):
        other = SelfModifyingTitans(D, n_heads=2, chunk_size=2, **kwargs)
        for T in (5, 1):  # chunk form and token step
            with pytest.raises(ValueError, match=rf"state.proj: expected weights of shapes .*{what}"):
                other(x[:, :T], st)
    with pytest.raises(ValueError, match="chunk_size must be a positive int, got True"):
        SelfModifyingTitans(D, n_heads=2, chunk_size=True)
    with pytest.raises(ValueError, match="beta_max must be a number in"):
        SelfModifyingTitans(D, n_heads=2, beta_max="1")
