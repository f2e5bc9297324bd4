"""Leftovers mended by the lead in session 40 (each test fails on the code before)."""

import dataclasses
import math

import pytest
import torch

from mnemo.layers.linear_attention import GatedLinearAttention, LinearAttention
from mnemo.models import model_names
from mnemo.ops.feature_maps import FavorPlus
from tests.helpers import assert_meta_build_equals_eager


@pytest.mark.parametrize("name", model_names())
def test_every_preset_built_on_meta_and_loaded_computes_what_an_eager_build_does(name):
    """The large-model build — ``with torch.device("meta")``, ``to_empty``, ``load_state_dict`` —
    leaves non-persistent buffers as uninitialised memory (``load_state_dict`` does not fill them):
    RetNet's fixed decays ``log γ`` read garbage (review 5-Y's leftover). Every preset's logits must
    equal an eager build's with the same weights, bit for bit."""
    assert_meta_build_equals_eager(name)


def test_retnet_decays_after_to_empty_are_the_papers():
    """``log γ_h = log(1 − 2^{−5−h})`` (Sun et al. 2023, §2.2) after a meta build, by hand."""
    with torch.device("meta"):
        layer = GatedLinearAttention(16, n_heads=4, gate="retnet")
    layer.to_empty(device="cpu")
    hand = torch.tensor([math.log(1 - 2.0 ** (-5 - h)) for h in range(4)])
    assert torch.allclose(layer.log_gamma.double(), hand.double(), rtol=1e-7, atol=0)


def test_favor_features_after_to_empty_are_the_seeds_draw():
    """FAVOR+'s projection is redrawn from its seed when materialised (it is not saved), so a
    linear attention with ``feature_map="favor"`` built on meta equals an eager one."""
    eager = FavorPlus(8, 12, seed=3)
    with torch.device("meta"):
        lazy = FavorPlus(8, 12, seed=3)
    lazy.to_empty(device="cpu")
    assert lazy.projection.dtype == torch.float64
    assert torch.equal(lazy.projection, eager.projection)
    torch.manual_seed(0)
    ref = LinearAttention(16, n_heads=2, feature_map="favor")
    with torch.device("meta"):
        att = LinearAttention(16, n_heads=2, feature_map="favor")
    att.to_empty(device="cpu")
    att.load_state_dict(ref.state_dict())
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        assert torch.equal(att(x)[0], ref(x)[0])


def test_an_odd_derived_head_size_under_rope_names_d_model_and_n_heads():
    """``Attention(16, n_heads=3)`` takes ``head_dim = 16 // 3 = 5`` and failed with "rotary
    embeddings need an even head_dim, got 5", which does not say where the 5 came from."""
    from mnemo.layers import Attention

    with pytest.raises(ValueError, match=r"n_heads: .*d_model // n_heads = 16 // 3 = 5"):
        Attention(16, n_heads=3)
    assert Attention(16, n_heads=3, rope=False).head_dim == 5  # no rotary: any size
    assert Attention(16, n_heads=3, head_dim=6).head_dim == 6


def test_ttt_linear_starts_its_learned_w0_as_the_ttt_reference_not_at_zero():
    """TTT-Linear's ``x + LN(W x)`` started at ``W_0 = 0``, where the layer norm's gain is ``1/√ε``
    (~316): the first chunk's step was hundreds of times the later ones (review 5-S measured the
    first chunk's stretch at ``e^10``). The TTT authors' code draws ``W_0 ~ N(0, 0.02²)``; matrix
    memories without the norm (the delta rule's state) still start at zero."""
    from mnemo.layers import NeuralMemory

    torch.manual_seed(0)
    ttt = NeuralMemory(64, spec="ttt_linear", n_heads=1)
    (w,) = list(ttt.init_weights)
    assert w.shape == (1, 64, 64)
    assert abs(w.std().item() - 0.02) < 0.001 and abs(w.mean().item()) < 0.001
    delta = NeuralMemory(64, spec="deltanet", n_heads=1)
    assert all(bool((p == 0).all()) for p in delta.init_weights)


def test_a_resumed_run_accepts_its_data_path_spelled_absolute(tmp_path, monkeypatch):
    """Sweep files' relative paths are now made absolute (review 5-T), so a run interrupted before
    that resumes with ``data`` spelled otherwise: it was refused as a change of data ("a resumed
    run keeps data = 'corpus.txt'"). The same file under another spelling is no change; another
    file still is."""
    from mnemo.train.config import TrainConfig
    from mnemo.train.run_folder import resume_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus.txt").write_text("abc " * 50)
    (tmp_path / "other.txt").write_text("xyz " * 50)
    saved = TrainConfig(data="corpus.txt", model="transformer", steps=4)
    cfg, notes = resume_config(saved, {"data": str(tmp_path / "corpus.txt")})
    assert cfg.data == "corpus.txt" and notes == []
    cfg, _ = resume_config(saved, dataclasses.replace(saved, data=str(tmp_path / "corpus.txt")))
    assert cfg.data == "corpus.txt"
    with pytest.raises(ValueError, match=r"TrainConfig.data: a resumed run keeps data = 'corpus.txt'"):
        resume_config(saved, {"data": str(tmp_path / "other.txt")})


@pytest.mark.parametrize("mixer", ["linear_attention", "gla", "deltanet"])
@pytest.mark.parametrize("bad", ["False", 0, None])
def test_short_conv_must_be_a_bool_in_every_matrix_mixer(mixer, bad):
    """Review 5-M made ``NeuralMemory`` refuse a non-bool ``short_conv`` (a config's "False" is
    truthy and silently built the conv); its siblings took it by truthiness still."""
    from mnemo.layers import DeltaNet, GatedLinearAttention

    cls = {"linear_attention": LinearAttention, "gla": GatedLinearAttention, "deltanet": DeltaNet}[mixer]
    with pytest.raises(ValueError, match=r"short_conv: expected a bool, got"):
        cls(16, n_heads=2, short_conv=bad)
    assert (cls(16, n_heads=2, short_conv=False).conv is None) and cls(16, n_heads=2, short_conv=True).conv


def test_verify_under_a_forced_backend_checks_its_forms_against_the_token_loop(monkeypatch, capsys):
    """With ``MNEMO_BACKEND=native`` most of ``mnemo verify``'s checks failed with ``BackendError``
    (review 5-F): the token-loop reference (``mode="recurrent"``) was refused under the forced
    backend, and the forms it cannot serve (``parallel``) counted as failures. The reference now runs
    on mnemo's PyTorch code, the native chunk form is checked against it, and unserved forms are
    listed as n/a (exit 0)."""
    from mnemo.commands import verify

    monkeypatch.setenv("MNEMO_BACKEND", "native")
    rc = verify.main(["--ops", "delta_rule", "--quick", "--third-party", "none"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "backend forced: native" in out and "n/a on 'native'" in out
    assert "delta_rule" in out and " 0 failed" in out
    assert "forms[chunk]" in out.split("n/a on backend")[0]  # the native chunk form was checked
