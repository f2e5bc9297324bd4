"""Review 48d of the fla-hub import (``mnemo/hf/fla_hub.py``): a configuration refused although mnemo
computes it exactly.

GLA's ``num_kv_heads`` (grouped key/value heads): fla 0.6's ``GatedLinearAttention`` projects ``k``, ``v``
and the gate ``gk`` for ``num_kv_heads`` heads (``k_proj``, ``v_proj``, ``gk_proj.1`` and the ``k_conv1d`` /
``v_conv1d`` taps have ``num_heads / num_kv_heads`` times fewer rows) and repeats each head to the ``G``
consecutive heads ``h·G … h·G + G − 1`` (``repeat('... (h d) -> ... (h g) d')``). That is mnemo's GLA with
those rows tiled per head; the importer refused the field (fixed: it tiles them). Checked against fla itself
(review 48d, a 2-head GLA with ``num_kv_heads = 1`` built by fla 0.6.0, the rows tiled into a ``num_kv_heads
= null`` checkpoint): max |Δlogits| 9.5e-6 float32. The test builds the grouped checkpoint from the GLA
fixture (head 0's rows kept) and expects the import to equal the fixture with head 1's rows replaced by head
0's (no fla needed). RetNet's ``num_kv_heads`` is the same (fla repeats ``k`` after the rotary and ``v``
likewise; tiled: 1.1e-5 against fla), imported by the same code; one test stands for both.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mnemo.models import LanguageModel

pytestmark = pytest.mark.filterwarnings("ignore:.*holds no tokenizer:UserWarning")

GLA = Path(__file__).resolve().parent.parent / "data" / "fla_hub" / "gla"
#: fla GLA weights that have num_kv_heads heads' rows (the rest have num_heads')
GROUPED = ("attn.k_proj.weight", "attn.v_proj.weight", "attn.gk_proj.1.weight", "attn.gk_proj.1.bias",
           "attn.k_conv1d.weight", "attn.v_conv1d.weight")  # fmt: skip


def _write(folder: Path, sd: dict, **changes) -> Path:
    shutil.copytree(GLA, folder)
    cfg = json.loads((folder / "config.json").read_text()) | changes
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(sd, folder / "model.safetensors", {"format": "pt"})
    return folder


def test_gla_grouped_kv_heads_import_as_tiled_heads(tmp_path):
    H = json.loads((GLA / "config.json").read_text())["num_heads"]
    assert H == 2
    sd = load_file(GLA / "model.safetensors")
    grouped, tiled = dict(sd), dict(sd)
    for name, w in sd.items():
        if name.endswith(GROUPED):
            head0 = w.reshape(H, -1, *w.shape[1:])[0]
            grouped[name] = head0.contiguous()  # num_kv_heads = 1: head 0's rows only
            # fla repeats it to heads 0 and 1
            tiled[name] = head0.repeat(H, *[1] * (head0.ndim - 1)).contiguous()
    ids = load_file(GLA / "reference.safetensors")["input_ids"]
    expected = LanguageModel.from_pretrained(_write(tmp_path / "tiled", tiled)).eval()
    got = LanguageModel.from_pretrained(_write(tmp_path / "grouped", grouped, num_kv_heads=1)).eval()
    with torch.no_grad():
        assert (got(ids)[0] - expected(ids)[0]).abs().max().item() <= 1e-5
