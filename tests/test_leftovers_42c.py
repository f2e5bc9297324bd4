"""Leftovers of review 7-F: a recomputed forward keeps the forward's backend; ``mnemo verify`` under a
forced backend says which backend served each row."""

from __future__ import annotations

import threading

import pytest
import torch

from mnemo import ops
from mnemo.models import LanguageModel, ModelConfig
from mnemo.ops import _native, dispatch


def _gla_model():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=23, d_model=16, n_layers=2, mixer="gla")
    m = LanguageModel(cfg).train()
    m.activation_checkpointing = True
    return m


def _grads(m, ids):
    m.zero_grad()
    return torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])


@pytest.mark.parametrize("where", ["same thread, another block open", "another thread"])
def test_the_models_recompute_reenters_the_forwards_backend(monkeypatch, where):
    """Before: the recompute of a checkpointed block chose its backend again in the backward's
    thread (outside the ``use_backend("torch")`` block: ``auto``, native on a CPU), so a run forced
    to torch recomputed on native. Now every op call of the recompute is logged as forced torch, and
    the gradients equal those of the same forced forward without checkpointing."""
    monkeypatch.delenv("MNEMO_BACKEND", raising=False)
    m = _gla_model()
    ids = torch.randint(0, 23, (1, 11))
    m.activation_checkpointing = False
    with ops.use_backend("torch"):
        m(ids)[0].pow(2).mean().backward()
    ref = torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])
    m.zero_grad()
    m.activation_checkpointing = True
    dispatch.reset_dispatch_log()
    with ops.use_backend("torch"):
        loss = m(ids)[0].pow(2).mean()
    assert dispatch.dispatch_log() == {("gated_linear_attention", "torch", "forced"): 2}
    if where == "another thread":
        errors = []

        def run():
            try:
                loss.backward()
            except Exception as e:  # pragma: no cover - reported below
                errors.append(e)

        t = threading.Thread(target=run)
        t.start()
        t.join()
        assert not errors, errors
    else:
        with ops.use_backend("auto"):
            loss.backward()
    assert dispatch.dispatch_log() == {("gated_linear_attention", "torch", "forced"): 4}
    got = torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)
    assert dispatch.current_backend() == "auto" and _native._suppressed.depth == 0  # restored


def test_the_recompute_reenters_suppressed_c_kernels_and_restores_the_thread(monkeypatch):
    """An ``auto`` forward with the C kernels suppressed chose torch; its recompute (backward outside
    the block) chooses torch again, for the same reason, and the thread's own choice is back after."""
    monkeypatch.delenv("MNEMO_BACKEND", raising=False)
    m = _gla_model()
    ids = torch.randint(0, 23, (2, 9))
    dispatch.reset_dispatch_log()
    with _native.suppressed():
        loss = m(ids)[0].pow(2).mean()
    with ops.use_backend("native"):
        loss.backward()
        assert dispatch.current_backend() == "native"
    log = dispatch.dispatch_log()
    assert set(b for (_, b, _) in log) == {"torch"} and sum(log.values()) == 4, log
    assert _native._suppressed.depth == 0


def test_recompute_as_chosen_restores_an_open_block_of_the_running_thread():
    again_factory = None
    with ops.use_backend("torch"):
        again_factory = dispatch.recompute_as_chosen()
    with ops.use_backend("native"):
        with again_factory():
            assert dispatch.current_backend() == "torch"
            with ops.use_backend("auto"):
                assert dispatch.current_backend() == "auto"
            assert dispatch.current_backend() == "torch"
        assert dispatch.current_backend() == "native"
    assert dispatch.current_backend() == "auto"


# ----------------------------------------------------------------------------------------------
# mnemo verify under a forced backend: which backend served each row
# ----------------------------------------------------------------------------------------------


def _verify(monkeypatch, tmp_path, backend, ops_, checks="varlen"):
    import json

    from mnemo.commands import verify

    monkeypatch.setenv("MNEMO_BACKEND", backend)
    out = tmp_path / f"{backend}.json"
    rc = verify.main(
        ["--quick", "--ops", ops_, "--checks", checks, "--third-party", "none", "--json", str(out)]
    )
    return rc, {(r["op"], r["check"]): r for r in json.loads(out.read_text())}


def test_verify_lists_rows_the_forced_backend_never_served_as_na(monkeypatch, tmp_path, capsys):
    """Before: under ``MNEMO_BACKEND=torch`` selective_scan's rows (an op without a backend table:
    no call is ever served by a backend) were listed as "pass" under the banner "the forms it cannot
    serve are listed as n/a". Now each row says which backends served its calls, and those rows are
    n/a (not run on 'torch'); gated linear attention's rows were served by torch and pass."""
    rc, rows = _verify(monkeypatch, tmp_path, "torch", "selective_scan,gla_scalar", checks="empty")
    out = capsys.readouterr().out
    assert rc == 0, out
    for check in ("empty[recurrent]", "empty[chunk]", "empty[parallel]"):
        na = rows[("selective_scan", check)]
        assert na["status"] == "n/a" and na["passed"] is None and na["served"] == {}, na
        assert "not run on 'torch'" in na["message"], na
        ok = rows[("gla_scalar", check)]
        assert ok["status"] == "pass" and set(ok["served"]) == {"torch"} and ok["served"]["torch"] > 0, ok
    table = out.split("n/a on backend")[0]
    assert "served by" in table and "selective_scan" not in table.split("served by", 1)[1], out
    assert "gla_scalar  empty[chunk]" in table and "3 passed, 0 failed, 6 n/a on 'torch'" in out


def test_verify_lists_a_token_loop_row_under_native_as_na(monkeypatch, tmp_path, capsys):
    """``varlen[recurrent]`` runs the token loop on mnemo's PyTorch code whatever is forced: under
    ``MNEMO_BACKEND=native`` it was "pass"; now n/a, served by torch; the chunk row was native's."""
    if dispatch._native_problem(torch.device("cpu")) is not None:
        pytest.skip("the C kernels are not available here")
    rc, rows = _verify(monkeypatch, tmp_path, "native", "gla_scalar")
    assert rc == 0, capsys.readouterr().out
    rec, chunk = rows[("gla_scalar", "varlen[recurrent]")], rows[("gla_scalar", "varlen[chunk]")]
    assert rec["status"] == "n/a" and set(rec["served"]) == {"torch"}, rec
    assert chunk["status"] == "pass" and chunk["served"].get("native", 0) > 0, chunk
    assert "backend 'native' cannot serve" in rows[("gla_scalar", "varlen[parallel]")]["message"]


def test_verify_with_only_unserved_rows_says_na_and_exits_3(monkeypatch, tmp_path, capsys):
    """Every row of selective_scan under a forced torch: before, all "pass" in the table and then
    "nothing verified on backend 'torch'" (exit 3); now the rows agree with the exit status."""
    rc, rows = _verify(monkeypatch, tmp_path, "torch", "selective_scan", checks="empty")
    cap = capsys.readouterr()
    assert rc == 3, cap.out
    assert {r["status"] for r in rows.values()} == {
        "n/a"
    } and "nothing verified on backend 'torch'" in cap.out
