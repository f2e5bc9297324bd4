"""Three leftovers of earlier sessions (helper 47b), each test failing on the code before its fix:
HOPE's self-modifying memory gives empty maps on 0 tokens, ``mnemo eval`` records the packing it
did, and the time-scale probe reads the input's gates (not Titans' persistent prefix)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from mnemo.models import LanguageModel, build_config

# ------------------------------------------------------------------------------------------------
# 1. capture_maps of HOPE's self-modifying memory on 0 tokens


def test_hope_reconstruction_maps_of_0_tokens_are_empty_and_its_hooks_fire():
    """0 tokens: ``capture_maps`` raised ``input_ids: 0 tokens ... records no hook_q, ...`` (the
    mixer returned before its hook points); now ``[B, 1, 0, 0]`` as every other family gives. The
    hooks pass values of no tokens with the layout of a non-empty call's (the same dtype and the same
    axes after time), the state passes through unchanged, and 1 token's map is still ``[B, 1, 1, 1]``."""
    from mnemo.interp import capture_maps
    from mnemo.interp.maps import mixing

    torch.manual_seed(0)
    model = LanguageModel(build_config("hope_reconstruction", vocab_size=32, d_model=16, n_layers=2)).eval()
    mixer = model.blocks[0].mixer
    for T in (0, 1):
        maps = capture_maps(model, torch.zeros(2, T, dtype=torch.long))
        assert {i: tuple(m.shape) for i, m in maps.items()} == {0: (2, 1, T, T), 1: (2, 1, T, T)}
    assert tuple(mixing(mixer, torch.zeros(3, 0, 16)).maps.shape) == (3, 1, 0, 0)

    names = [f"blocks.0.mixer.{h}" for h in (*mixer.mixing_hooks, "hook_o", "hook_state")]
    _, empty = model.run_with_cache(torch.zeros(2, 0, dtype=torch.long), names=names)
    _, one = model.run_with_cache(torch.zeros(2, 1, dtype=torch.long), names=names)
    assert sorted(empty) == sorted(names)
    for n in names[:-1]:
        assert empty[n].shape[:2] == (2, 0) and empty[n].shape[2:] == one[n].shape[2:], n
        assert empty[n].dtype == one[n].dtype, n
    x = torch.randn(2, 0, 16)
    y, st = mixer(x)
    fresh = mixer.initial_state(2)
    assert y.shape == (2, 0, 16) and st.offset == 0
    assert all(torch.equal(a, b) for a, b in zip(st.memory + st.proj, fresh.memory + fresh.proj))


# ------------------------------------------------------------------------------------------------
# 2. mnemo eval of a packed run on one document


def _docs(path):
    g = torch.Generator().manual_seed(0)
    words = ["the", "king", "queen", "of", "a", "night", "day", "sings", "runs"]
    lines = []
    for _ in range(200):
        n = int(torch.randint(2, 9, (1,), generator=g))
        doc = " ".join(words[int(i)] for i in torch.randint(0, len(words), (n,), generator=g))
        lines.append(json.dumps({"text": doc + "."}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_eval_of_a_packed_run_on_one_document_records_no_packing(tmp_path, capsys):
    """A run trained with ``--pack-documents`` (on JSONL records), evaluated on a plain text file
    (one document, where ``mnemo train`` refuses the flag): the JSON line said
    ``"pack_documents": true``, yet nothing was packed — each window is read as it is. It now says
    false, and its number is that of ``--pack-documents off`` on the same windows; on the run's
    own documents the line still says true (they are packed there)."""
    from mnemo.cli import main

    docs = _docs(tmp_path / "docs.jsonl")
    one = tmp_path / "one.txt"
    one.write_text("the king sings of a night and the queen runs by day. " * 60)
    run = tmp_path / "run"
    argv = ["train", "--model", "gla", "--d-model", "16", "--n-layers", "1", "--data", str(docs)]
    argv += ["--tokenizer", "byte", "--seq-len", "32", "--batch-size", "2", "--steps", "1"]
    argv += ["--eval-interval", "1", "--eval-batches", "1", "--warmup-steps", "1", "--sample-tokens", "0"]
    argv += ["--pack-documents", "--no-progress", "--out", str(run)]
    assert main(argv) == 0
    capsys.readouterr()

    def eval_line(*flags):
        assert main(["eval", "--checkpoint", str(run), *flags]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    inherited = eval_line("--data", str(one))
    off = eval_line("--data", str(one), "--pack-documents", "off")
    assert inherited["pack_documents"] is False and inherited["as_in_training"] is False
    assert inherited["val_loss"] == off["val_loss"] and inherited["tokens"] == off["tokens"] > 0
    own = eval_line()
    assert own["pack_documents"] is True and own["as_in_training"] is True


# ------------------------------------------------------------------------------------------------
# 3. memory time scales and Titans' persistent tokens


def _constant_gate_lmm(half_life: float, prefix_log_decay: float):
    """A 1-layer titans_lmm whose retention gate is ``2^(−1/half_life)`` on every input token
    (``g = −ln 2 / half_life``) and ``exp(prefix_log_decay)`` on its 4 persistent tokens: the gate
    reads channel 0 alone, which the inputs lack (a zero embedding column) and the prefix has."""
    torch.manual_seed(0)
    model = LanguageModel(build_config("titans_lmm", vocab_size=20, d_model=16, n_layers=1)).eval()
    mixer = model.blocks[0].mixer
    H = mixer.n_heads
    sizes = list(mixer.gate_sizes.values())
    at = list(mixer.gate_sizes).index("alpha")
    rows = slice(sum(sizes[:at]), sum(sizes[: at + 1]))
    b = math.log(2 ** (-1 / half_life) / (1 - 2 ** (-1 / half_life)))  # sigmoid(b) = 2^(-1/h)
    with torch.no_grad():
        model.embed.weight[:, 0] = 0.0
        mixer.gate_proj.weight[rows] = 0.0
        mixer.gate_proj.weight[rows, 0] = 1.0
        mixer.gate_proj.bias[rows] = b
        # the prefix's channel 0 makes sigmoid(c + b) = exp(prefix_log_decay)
        p = math.exp(prefix_log_decay)
        mixer.persistent.zero_()
        mixer.persistent[:, 0] = math.log(p / (1 - p)) - b
    assert mixer.persistent.shape[0] == 4 and H == 4
    return model


def test_timescales_read_the_inputs_gates_not_the_persistent_prefix():
    """Titans' persistent tokens are prepended to the stream and decay the memory once, before any
    input is written: their gates are no time scale of the input's memory. With every input gate
    at a half-life of 10 tokens and the prefix's at 0.5, the probe said ``min`` 0.5 and counted
    ``T + 4`` rows a sequence; now every half-life it reports is 10 (``count`` = ``B · T · H``), the
    same as the model without persistent tokens."""
    from mnemo.interp.timescales import timescales

    model = _constant_gate_lmm(10.0, -2 * math.log(2))  # prefix half-life 0.5 tokens
    ids = torch.randint(1, 20, (2, 12), generator=torch.Generator().manual_seed(1))
    _, cache = model.run_with_cache(ids, names="blocks.0.mixer.hook_g")
    g = cache["blocks.0.mixer.hook_g"]
    assert g.shape == (2, 4 + 12, 4)  # (the hook passes the prefix's 4 rows first)
    assert torch.allclose(g[:, :4].double(), torch.full((2, 4, 4), -2 * math.log(2), dtype=torch.float64))
    hl = timescales(model, ids)["0"]["half_life"]
    assert hl["count"] == 2 * 12 * 4 and hl["never_decays"] == 0
    for q in ("min", "p10", "median", "p90", "max"):
        assert hl[q] == pytest.approx(10.0, rel=1e-5), q
    model.blocks[0].mixer.persistent = None  # the same model without persistent tokens
    assert timescales(model, ids)["0"]["half_life"] == hl
