"""What bounds hope's training speed against gated DeltaNet's (issue 40 item 4): gated DeltaNet's whole
training step beside hope's four self-modifying Titans mixers alone (forward + backward, one call per
window: their fastest form, no CMS, no embedding, no head), at the main job's size (registry defaults:
d_model 128, 4 layers, T 128, batch 32), one process, interleaved, 5 rounds, medians.

    python scripts/bench_hope_bound.py
"""

import statistics
import time

import torch
import torch.nn.functional as F

from mnemo.layers.self_modifying import SelfModifyingTitans
from mnemo.models import LanguageModel, build_config

torch.set_num_threads(2)
T, B, V, D = 128, 32, 65, 128
ids = torch.randint(0, V, (B, T + 1), generator=torch.Generator().manual_seed(0))
torch.manual_seed(0)
g = LanguageModel(build_config("gated_deltanet", vocab_size=V))
og = torch.optim.AdamW(g.parameters(), 1e-3)
mixers = [SelfModifyingTitans(D, n_heads=4, chunk_size=16, proj_chunk_size=64) for _ in range(4)]
x = torch.randn(B, T, D, requires_grad=True)


def gstep():
    logits, _ = g(ids[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    og.zero_grad(set_to_none=True)
    loss.backward()
    og.step()


def mstep():
    h = x
    for m in mixers:
        h = h + m(h)[0]
    h.square().mean().backward()


fs = {"gated_deltanet whole step": gstep, "4 self-modifying mixers alone, fwd+bwd": mstep}
for f in fs.values():
    f()
t = {k: [] for k in fs}
for r in range(5):
    for k, f in fs.items() if r % 2 == 0 else list(fs.items())[::-1]:
        t0 = time.perf_counter()
        f()
        t[k].append(time.perf_counter() - t0)
for k in t:
    print(f"{k:45s} {statistics.median(t[k]) * 1e3:8.1f} ms")
print("ratio mixers/gdn", statistics.median(b / a for a, b in zip(*t.values())))
