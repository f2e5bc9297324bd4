"""Session 38's leftovers mended by the lead in session 39 (each test fails on the code before)."""

import math

import torch

from mnemo.models import LanguageModel, build_config
from mnemo.train.batches import IGNORE_INDEX, _Logits, summed_cross_entropy


def test_the_summed_training_loss_of_a_float64_model_is_float64():
    """The sparse-task and packed training paths sum their loss with ``summed_cross_entropy``,
    which cast float64 logits to float32 (about 1e-7 off), where the fused head (``targets=``) of
    the same model keeps float64: both now agree with a hand float64 sum of -log softmax."""
    torch.manual_seed(0)
    model = LanguageModel(build_config("transformer", vocab_size=11, d_model=16, n_layers=1)).double()
    x = torch.randint(0, 11, (2, 7))
    y = torch.randint(0, 11, (2, 7))
    y[0, 3] = IGNORE_INDEX
    logits = model(x)[0]
    ce = summed_cross_entropy(logits, y)
    assert ce.dtype == torch.float64
    hand = 0.0
    for b in range(2):
        for t in range(7):
            if int(y[b, t]) == IGNORE_INDEX:
                continue
            row = logits[b, t].tolist()
            top = max(row)
            hand += top + math.log(math.fsum(math.exp(v - top) for v in row)) - row[int(y[b, t])]
    assert abs(ce.item() - hand) <= 1e-12 * abs(hand)
    fused = _Logits(model)(x, targets=y, ignore_index=IGNORE_INDEX)
    assert fused.dtype == torch.float64 and abs(fused.item() - ce.item()) <= 1e-12 * abs(hand)
