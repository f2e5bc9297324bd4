"""The chunk forms' buffer cache (mnemo/ops/_workspace.py): a buffer is handed out again only once
nothing holds it, within its limit, and the ops give the same results with and without it."""

import gc
import platform
import resource

import pytest
import torch

import mnemo.ops as ops
from mnemo.layers.conv import ShortConvolution
from mnemo.layers.norm import gated_rms_norm
from mnemo.ops import _workspace as ws
from mnemo.ops import gated_delta_rule, gated_linear_attention, selective_scan, ssd

SHAPE = (64, 1024)  # 256 KiB of float32: above MIN_BYTES
NBYTES = 64 * 1024 * 4


@pytest.fixture(scope="module", autouse=True)
def _collect_once_then_freeze():
    """One full collection for the module (the garbage of the tests run before it), after which
    the objects alive then are left out of every collection (``gc.freeze``) until the module ends:
    each test's collection below then walks only what was made since. In a worker that had run
    much of the suite a full collection took ~0.8 s, before each of this module's 36 tests."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture(autouse=True)
def fresh_cache():
    """Every test starts from an empty cache at the default limit and leaves it so."""
    before = ws.limit()
    ws.set_limit(1 << 30)
    gc.collect()  # buffers of earlier tests' dead autograd graphs (those before the module: collected above)
    ws.release()
    yield
    ws.set_limit(before)
    ws.release()


def test_the_storage_count_reads_as_assumed():
    assert ws.enabled()
    t = torch.empty(8)
    assert ws._unused(t)
    v = t[2:]
    assert not ws._unused(t)
    del v
    assert ws._unused(t)


def test_a_buffer_comes_back_once_nothing_holds_it():
    before = ws.stats()
    a = ws.empty(SHAPE, torch.float32, "cpu")
    assert a.shape == SHAPE and a.is_contiguous() and a.dtype == torch.float32
    ptr = a.data_ptr()
    b = ws.empty((1024, 64), torch.float32, "cpu")  # same size, a is still alive
    assert b.data_ptr() != ptr
    del a
    c = ws.empty((1024, 64), torch.float32, "cpu")  # a's buffer, viewed to the new shape
    assert c.data_ptr() == ptr and c.shape == (1024, 64)
    s = ws.stats()
    assert (s["hits"] - before["hits"], s["misses"] - before["misses"]) == (1, 2)
    assert (s["buffers"], s["in_use"]) == (2, 2)
    assert s["held_bytes"] == 2 * NBYTES


@pytest.mark.parametrize("holder", ["view", "saved", "grad", "numpy"])
def test_a_held_buffer_is_not_handed_out(holder):
    a = ws.empty(SHAPE, torch.float32, "cpu")
    ptr = a.data_ptr()
    if holder == "view":
        keep = a.t()
    elif holder == "saved":  # autograd keeps it for the backward pass
        w = torch.ones(SHAPE, requires_grad=True)
        keep = (w * a).sum()
    elif holder == "grad":
        w = torch.zeros(SHAPE, requires_grad=True)
        w.grad = a
        keep = w
    else:
        keep = a.numpy()
    del a
    b = ws.empty(SHAPE, torch.float32, "cpu")
    assert b.data_ptr() != ptr
    del keep, b
    if holder == "grad":
        del w
    hits = ws.stats()["hits"]
    c = ws.empty(SHAPE, torch.float32, "cpu")  # free again once the holder is gone
    assert ws.stats()["hits"] == hits + 1
    assert c.data_ptr() in {ptr, *(x.data_ptr() for _, x, _ in ws._order.values())}


def test_a_buffer_moved_to_shared_memory_leaves_the_cache():
    """A tensor sent to another process (torch.multiprocessing, DataLoader workers) is moved into
    shared memory in place; the receiver may read it after the sender dropped it."""
    a = ws.empty(SHAPE, torch.float32, "cpu")
    a.share_memory_()
    ptr = a.data_ptr()
    del a
    b = ws.empty(SHAPE, torch.float32, "cpu")
    assert b.data_ptr() != ptr and not b.is_shared()
    assert ws.stats()["buffers"] == 1  # the shared one was dropped


def test_a_shared_buffer_in_use_is_not_handed_out_and_leaves_once_free():
    a = ws.empty(SHAPE, torch.float32, "cpu")
    a.share_memory_()
    b = ws.empty(SHAPE, torch.float32, "cpu")  # a is still held: a second buffer
    assert b.data_ptr() != a.data_ptr() and ws.stats()["buffers"] == 2
    ptr_a, ptr_b = a.data_ptr(), b.data_ptr()
    del a, b
    c = ws.empty(SHAPE, torch.float32, "cpu")
    assert c.data_ptr() == ptr_b and ws.stats()["buffers"] == 1  # the shared one was found free and dropped
    assert all(x.data_ptr() != ptr_a for _, x, _ in ws._order.values())


def test_a_scan_asks_is_shared_of_free_buffers_only(monkeypatch):
    """The scan over a key's buffers reads each storage's count through its kept handle; the costly
    ``is_shared`` is asked only of a buffer found free."""
    held = [ws.empty(SHAPE, torch.float32, "cpu") for _ in range(5)]
    asked = []
    real = torch.Tensor.is_shared
    monkeypatch.setattr(torch.Tensor, "is_shared", lambda t: asked.append(t.data_ptr()) or real(t))
    free_ptr = held.pop(3).data_ptr()
    d = ws.empty(SHAPE, torch.float32, "cpu")
    assert d.data_ptr() == free_ptr and asked == [free_ptr]


def test_eviction_asks_nothing_costly_of_buffers_in_use_and_drops_free_ones_shared_or_not(monkeypatch):
    """A miss while the cache is full walks every buffer, LRU first: it reads each count through the
    kept handle (``is_shared`` is asked of none), passes over the ones in use, drops free ones —
    a free buffer moved to shared memory among them — until the request fits."""
    ws.set_limit(4 * NBYTES)
    held = [ws.empty(SHAPE, torch.float32, "cpu") for _ in range(4)]
    shared = held.pop(1)
    shared.share_memory_()  # free once dropped below, and shared: it goes as a free one does
    plain_ptr = held.pop(1).data_ptr()  # free too
    del shared
    asked = []
    real = torch.Tensor.is_shared
    monkeypatch.setattr(torch.Tensor, "is_shared", lambda t: asked.append(t.data_ptr()) or real(t))
    bigger = ws.empty((2 * SHAPE[0], SHAPE[1]), torch.float32, "cpu")  # another key: a miss
    assert asked == []
    s = ws.stats()
    assert (s["buffers"], s["held_bytes"], s["in_use"]) == (3, 4 * NBYTES, 3)  # two evicted, the new one kept
    assert all(x.data_ptr() != plain_ptr for _, x, _ in ws._order.values())
    assert all(not ws._unused(t) for t in held) and bigger.shape == (128, 1024)


def test_handed_out_tensors_are_not_views():
    a = ws.empty(SHAPE, torch.float32, "cpu")
    assert a._base is None and a.is_contiguous() and a.storage_offset() == 0


@pytest.mark.parametrize("op", ["gla", "gdr", "ssd"])
def test_outputs_may_be_modified_in_place_as_without_the_cache(op):
    """The gated delta rule's output is a tensor of its own (in-place changes allowed); GLA's and
    SSD's are views of their chunk-layout results (autograd refuses in-place changes), with or
    without the cache."""

    def modify_in_place():
        q, k, v, g, beta = (t.requires_grad_() for t in _inputs(0))
        if op == "gla":
            o, _ = gated_linear_attention(q, k, v, g, mode="chunk")
        elif op == "gdr":
            o, _ = gated_delta_rule(q, k, v, g, beta, mode="chunk")
        else:
            o, _ = ssd(v, beta, -torch.ones(q.shape[2]), k[:, :, :1], q[:, :, :1], mode="chunk")
        expected = o.detach() + 1.0
        try:
            o.add_(1.0)
        except RuntimeError as err:
            assert "is a view and is being modified inplace" in str(err)
            return False
        torch.testing.assert_close(o.detach(), expected)
        return True

    ws.set_limit(0)
    without = modify_in_place()
    ws.set_limit(1 << 30)
    assert modify_in_place() == without == (op == "gdr")


def test_keys_dtype_size_and_inference_mode_apart():
    a = ws.empty(SHAPE, torch.float32, "cpu")
    ptr = a.data_ptr()
    del a
    assert ws.empty((64, 512), torch.float64, "cpu").data_ptr() != ptr  # same bytes, other dtype
    with torch.inference_mode():
        inf = ws.empty(SHAPE, torch.float32, "cpu")
        assert inf.is_inference() and inf.data_ptr() != ptr
    del inf
    b = ws.empty(SHAPE, torch.float32, "cpu")
    assert b.data_ptr() == ptr and not b.is_inference()


def test_small_and_non_cpu_requests_bypass_the_cache():
    before = ws.stats()
    small = ws.empty((16, 16), torch.float32, "cpu")
    meta = ws.empty(SHAPE, torch.float32, "meta")
    assert small.shape == (16, 16) and meta.device.type == "meta"
    after = ws.stats()
    assert after["buffers"] == 0 and (after["hits"], after["misses"]) == (before["hits"], before["misses"])


def test_limit_evicts_least_recently_used_free_buffers_then_bypasses():
    ws.set_limit(2 * NBYTES)
    a = ws.empty(SHAPE, torch.float32, "cpu")
    b = ws.empty(SHAPE, torch.float32, "cpu")
    pa, pb = a.data_ptr(), b.data_ptr()
    bypassed = ws.stats()["bypassed"]
    c = ws.empty(SHAPE, torch.float32, "cpu")  # both in use: served outside the cache
    assert ws.stats()["bypassed"] == bypassed + 1 and ws.stats()["buffers"] == 2
    assert c.data_ptr() not in (pa, pb)
    del a, c
    d = ws.empty((32, 1024), torch.float32, "cpu")  # new size: a's (free, LRU) buffer is evicted
    s = ws.stats()
    assert s["buffers"] == 2 and s["held_bytes"] == NBYTES + NBYTES // 2 and s["bypassed"] == bypassed + 1
    assert all(x.data_ptr() != pa for _, x, _ in ws._order.values())
    del b, d
    assert ws.release() == NBYTES + NBYTES // 2 and ws.stats()["held_bytes"] == 0
    ws.set_limit(0)
    assert not ws.enabled()
    ws.empty(SHAPE, torch.float32, "cpu")
    assert ws.stats()["buffers"] == 0


def test_set_limit_drops_free_buffers_beyond_it():
    a = ws.empty(SHAPE, torch.float32, "cpu")
    keep = ws.empty(SHAPE, torch.float32, "cpu")
    del a
    ws.set_limit(NBYTES)  # the free one goes, the held one stays
    assert ws.stats()["buffers"] == 1 and ws.stats()["in_use"] == 1
    del keep


@pytest.mark.parametrize("bad", [-1, 1.5, "1", True])
def test_set_limit_rejects_bad_values(bad):
    with pytest.raises(ValueError, match="nbytes: expected an int >= 0"):
        ops.set_workspace_limit(bad)


@pytest.mark.parametrize("raw,ok", [("0", 0), ("1.5", 3 << 19), ("abc", None), ("-2", None), ("nan", None)])
def test_the_environment_variable(monkeypatch, raw, ok):
    monkeypatch.setenv("MNEMO_WORKSPACE_MB", raw)
    if ok is None:
        with pytest.raises(ValueError, match="MNEMO_WORKSPACE_MB"):
            ws._limit_from_env()
    else:
        assert ws._limit_from_env() == ok


def test_public_functions():
    a = ws.empty(SHAPE, torch.float32, "cpu")
    del a
    assert ops.workspace_stats()["held_bytes"] == NBYTES
    assert ops.release_workspaces() == NBYTES
    assert ops.workspace_stats()["buffers"] == 0


def _inputs(seed, T=1000, H=2, D=32, channel=False):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, T, H, D, generator=gen) for _ in range(3))
    k = torch.nn.functional.normalize(k, dim=-1)
    g = -0.1 * torch.rand(1, T, H, *((D,) if channel else ()), generator=gen)
    beta = torch.rand(1, T, H, generator=gen)
    return q, k, v, g, beta


def _run(op, seed, channel=False):
    if op == "selective_scan":  # the native Mamba scan (Mamba-1 shapes: 64 channels, d_state 16)
        gen = torch.Generator().manual_seed(seed)
        u, delta, z = (torch.randn(1, 1000, 64, generator=gen).requires_grad_() for _ in range(3))
        A = (-torch.rand(64, 16, generator=gen) - 0.5).requires_grad_()
        B, C = (torch.randn(1, 1000, 16, generator=gen).requires_grad_() for _ in range(2))
        y, h = selective_scan(u, delta, A, B, C, z=z, delta_softplus=True, output_final_state=True)
        (y.square().sum() + h.sum()).backward()
        return [y, h] + [t.grad for t in (u, delta, z, A, B, C)]
    if op == "conv":  # the short causal convolution's native kernel
        torch.manual_seed(seed)
        conv = ShortConvolution(64)
        x = torch.randn(1, 1000, 64).requires_grad_()
        y = conv(x)[0]
        y.square().sum().backward()
        return [y, x.grad, conv.weight.grad]
    if op == "gated_norm":  # the gated RMSNorm's native kernel
        gen = torch.Generator().manual_seed(seed)
        x, z = (torch.randn(1, 1000, 64, generator=gen).requires_grad_() for _ in range(2))
        w = torch.rand(64, generator=gen).requires_grad_()
        y = gated_rms_norm(x, z, w, groups=2, gate_first=True)
        y.square().sum().backward()
        return [y, x.grad, z.grad, w.grad]
    q, k, v, g, beta = (t.requires_grad_() for t in _inputs(seed, channel=channel))
    if op == "gla":
        o, S = gated_linear_attention(q, k, v, g, mode="chunk", output_final_state=True)
    elif op == "gdr":
        o, S = gated_delta_rule(q, k, v, g, beta, mode="chunk", output_final_state=True)
    else:
        A = -torch.ones(q.shape[2])
        o, S = ssd(v, beta, A, k[:, :, :1], q[:, :, :1], mode="chunk", output_final_state=True)
    (o.square().sum() + S.sum()).backward()
    return [o, S] + [t.grad for t in (q, k, v, g, beta) if t.grad is not None]


@pytest.mark.parametrize(
    "op,channel",
    [("gla", False), ("gla", True), ("gdr", False), ("ssd", False)]
    + [("selective_scan", False), ("conv", False), ("gated_norm", False)],
)
def test_results_kept_from_one_call_survive_the_next(op, channel):
    """Outputs and gradients of a first call (views of cached buffers) stay intact while later
    calls run, and every call equals the same call without the cache."""
    ws.set_limit(0)
    ref1, ref2 = _run(op, 1, channel), _run(op, 2, channel)
    ws.set_limit(1 << 30)
    hits = ws.stats()["hits"]
    first = _run(op, 1, channel)
    kept = [t.clone() for t in first]
    second = _run(op, 2, channel)
    _run(op, 3, channel)
    _run(op, 2, channel)
    # (T = 1000: the tensors are 256 KiB, cached; the PyTorch fallbacks of the scan, conv and norm, used
    # without a C compiler, take nothing from the cache)
    from mnemo.ops import _native

    if op not in ("selective_scan", "conv", "gated_norm") or _native.usable(torch.zeros(1)):
        assert ws.stats()["hits"] > hits
    for a, b, r in zip(first, kept, ref1):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6)
    for a, r in zip(second, ref2):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(platform.system() != "Linux", reason="minor page faults are read from getrusage on Linux")
def test_repeated_calls_touch_no_fresh_pages():
    """What the cache is for: after a warm-up, forward+backward of the gated linear attention at
    T = 4096 (4 MiB tensors) faults in almost no pages (without it: thousands per call, measured
    in docs/benchmarks/notes.md)."""
    q, k, v, g, _ = (t.requires_grad_() for t in _inputs(0, T=4096, H=4, D=64))

    def step():
        for t in (q, k, v, g):
            t.grad = None
        gated_linear_attention(q, k, v, g, mode="chunk")[0].sum().backward()

    for _ in range(3):
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        step()
    per_call = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 3
    assert per_call < 256, per_call  # 4 MiB of fresh pages would be 1024 faults


def test_head_groups_take_the_larger_budget_while_the_cache_keeps_memory(monkeypatch):
    from mnemo.ops import _chunked

    monkeypatch.setattr(_chunked, "malloc_tuned", lambda: False)
    per_head = _chunked.GROUP_BYTES  # one head fills the 2 MiB budget; four fit in 8 MiB
    assert len(list(_chunked.head_groups(1, 4, per_head))) == 1
    ws.set_limit(0)
    assert len(list(_chunked.head_groups(1, 4, per_head))) == 4


def test_the_cache_benchmark_script_runs_and_reports_every_variant(tmp_path):
    """scripts/bench_workspace.py (the numbers in docs/benchmarks/notes.md): one tiny round."""
    import importlib.util
    import json
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "bench_workspace.py"
    spec = importlib.util.spec_from_file_location("bench_workspace", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "ws.json"
    args = ["--ops", "gla_scalar", "--length", "128", "--rounds", "1", "--repeats", "1", "--json", str(out)]
    assert mod.main(args) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["op"] == "gla_scalar" and set(row["ms"]) == set(mod.VARIANTS) == set(row["faults_per_call"])
    assert all(v > 0 for v in row["ms"].values()) and len(row["no_cache_over_cache_per_round"]) == 1
