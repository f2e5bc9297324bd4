"""Truncated BPTT in the trainer (``TrainConfig.carry_state``, ``mnemo train --carry-state``): the
batch is B parallel streams over the text, the model's state goes on from window to window, so
slow CMS levels step on the stream's time scale; a resumed run continues exactly; combinations
that cannot work are refused naming the setting."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

from mnemo.data import load_text
from mnemo.layers.state import snapshot
from mnemo.train import TrainConfig, Trainer
from mnemo.train.batches import CarriedStreams
from mnemo.train.build import check_carry_state

PERIODS = (4, 16, 64)  # hope_long's levels, shortened (16/128/512/2048 would take minutes here)
SHORTEST = PERIODS[0]
T = 16


def _text(tmp_path, chars: int = 220):
    """A short text file: 90 % trains (198 chars: 2 streams of 98 tokens, 6 windows of 16 each)."""
    p = tmp_path / "text.txt"
    p.write_text(load_text("tinyshakespeare")[:chars])
    return str(p)


def _cfg(data, **kw):
    levels = [{"period": p, "objective": "task"} for p in PERIODS]
    base = dict(
        model="hope_long",
        model_overrides={"d_model": 8, "n_layers": 1, "mlp_options": {"levels": levels}},
        data=data,
        seq_len=T,
        batch_size=2,
        steps=8,
        eval_interval=100,
        eval_batches=1,
        warmup_steps=0,
        sample_tokens=0,
        carry_state=True,
    )
    base.update(kw)
    return TrainConfig(**base)


def _updates(state) -> list[int]:
    """Steps taken so far by each CMS level of block 0."""
    return [lv.updates for lv in state[0].mlp.levels]


def _expected_updates(tokens: int) -> list[int]:
    """A level of the task objective steps at a multiple of its period once the next token's label
    is read: after ``tokens`` tokens of a stream the levels have absorbed
    ``S · ⌊(tokens − 1) / S⌋`` tokens (``S`` the shortest period; tests/nested/test_cms.py)."""
    absorbed = SHORTEST * ((tokens - 1) // SHORTEST)
    return [absorbed // p for p in PERIODS]


def test_streams_cut_the_text_into_contiguous_shards_read_window_by_window():
    ids = torch.arange(2 * 50 + 1)
    s = CarriedStreams(ids, batch_size=2, seq_len=16)
    assert (s.shard, s.windows, s.stream_tokens) == (50, 3, 48)
    x, y = s.batch(0)
    assert x.tolist() == [list(range(0, 16)), list(range(50, 66))]
    assert torch.equal(y, x + 1)
    assert s.batch(2)[0][:, 0].tolist() == [32, 82]
    assert [s.restarts(k) for k in range(7)] == [True, False, False, True, False, False, True]
    assert torch.equal(s.batch(4)[0], s.batch(1)[0])  # the next epoch reads the same windows
    with pytest.raises(ValueError, match=r"carry_state.*batch_size = 8.*seq_len = 16"):
        CarriedStreams(ids, batch_size=8, seq_len=16)


def test_slow_level_steps_across_windows_as_the_stream_position_says(tmp_path):
    """Known answer: with carry_state, after window ``w`` of an epoch every stream has read
    ``16 (w + 1)`` tokens and each level has taken :func:`_expected_updates` steps: the slow level
    (period 64 > the window of 16) takes its first step in window 5 (tokens 64-80), and all
    streams restart at the epoch's end. Without carry_state every window starts fresh: the levels of
    period 16 and 64 never step, and the trainer warns about them naming --carry-state."""
    data = _text(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no period warning with carry_state (64 < 96 tokens a stream)
        tr = Trainer(_cfg(data), tmp_path / "carry", progress=False)
    windows = tr.data.streams.windows
    assert windows == 6 and tr.data.streams.shard == 98
    seen = []
    for step in range(8):
        tr.train_step()
        tokens = T * (step % windows + 1)
        assert _updates(tr.carried_state) == _expected_updates(tokens), (step, tokens)
        seen.append(_updates(tr.carried_state)[-1])
    assert seen == [0, 0, 0, 0, 1, 1, 0, 0]  # steps in window 5; fresh again after the restart

    with pytest.warns(UserWarning, match=r"period (16|64) >= the window of 16.*--carry-state") as rec:
        fresh = Trainer(_cfg(data, carry_state=False), tmp_path / "fresh", progress=False)
    assert sum("--carry-state" in str(w.message) for w in rec) == 2  # periods 16 and 64
    out = []
    fresh.model.register_forward_hook(lambda m, args, output: out.append(_updates(output[1])))
    for _ in range(6):
        fresh.train_step()
    assert out and all(u == _expected_updates(T) == [3, 0, 0] for u in out)


def test_one_step_equals_a_hand_written_tbptt_loop(tmp_path):
    """The trainer's losses and weights over 3 steps equal a hand-written loop on the documented
    layout (2 contiguous shards, consecutive windows): ``model(x_w, state)`` → cross-entropy →
    backward → AdamW step, the state carried as a snapshot (detached, copied) taken right after the
    forward: it holds the parameters it aliases (a level that has not stepped, a chunk's anchor) as
    they were in that window, not as the optimizer step leaves them."""
    cfg = _cfg(_text(tmp_path), weight_decay=0.0, grad_clip=0.0, min_lr_ratio=1.0, lr=1e-2)
    tr = Trainer(cfg, tmp_path / "run", progress=False)
    model = copy.deepcopy(tr.model)
    ids = tr.data.train_data.ids
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    shard = (ids.numel() - 1) // 2
    state, hand = None, []
    for w in range(3):
        rows = [ids[b * shard + w * T : b * shard + (w + 1) * T + 1] for b in (0, 1)]
        window = torch.stack(rows)
        logits, state = model(window[:, :-1], state)
        state = snapshot(state)  # the value the window ended with (before the update changes it)
        loss = F.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        hand.append(loss.item())
    losses = [tr.train_step() for _ in range(3)]
    print("trainer", losses, "hand", hand)
    assert losses == pytest.approx(hand, rel=1e-6, abs=0)
    for (name, a), b in zip(tr.model.named_parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=name)
    assert _updates(tr.carried_state) == _updates(state) == [11, 2, 0]


def test_grad_accum_splits_the_streams_and_keeps_the_step(tmp_path):
    """grad_accum = 2 feeds each micro-batch its own streams' states: the same losses as one batch."""
    data = _text(tmp_path, 400)
    one = Trainer(_cfg(data, batch_size=4), tmp_path / "a", progress=False)
    two = Trainer(_cfg(data, batch_size=4, grad_accum=2), tmp_path / "b", progress=False)
    a = [one.train_step() for _ in range(3)]
    b = [two.train_step() for _ in range(3)]
    assert b == pytest.approx(a, rel=1e-6)
    assert _updates(two.carried_state) == _updates(one.carried_state)
    assert two.carried_state[0].mlp.levels[0].weights[0].shape[0] == 4


def test_resume_continues_the_streams_exactly(tmp_path):
    """8 steps in one go equal 3 steps, a resume, and 5 more (through an epoch's restart at step 6):
    the same losses bit for bit and the same weights and carried state."""
    data = _text(tmp_path)
    full = Trainer(_cfg(data), tmp_path / "a", progress=False)
    ref = [full.train_step() for _ in range(8)]

    first = Trainer(_cfg(data), tmp_path / "b", progress=False)
    first.fit(until=3)
    again = Trainer(_cfg(data), tmp_path / "b", resume=True, progress=False)
    assert again.step == 3 and _updates(again.carried_state) == _expected_updates(3 * T)
    assert [again.train_step() for _ in range(5)] == ref[3:]
    for a, b in zip(full.model.parameters(), again.model.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(
        torch.utils._pytree.tree_leaves(full.carried_state),
        torch.utils._pytree.tree_leaves(again.carried_state),
    ):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


@pytest.mark.parametrize(
    "field, value",
    [
        ("task", "mqar"),
        ("pack_documents", True),
        ("context_parallel", True),
        ("fsdp", True),
        ("compile", True),
        ("activation_checkpointing", True),
    ],
)
def test_settings_that_cannot_carry_state_are_named(field, value):
    with pytest.raises(ValueError, match=rf"TrainConfig.carry_state: expected {field} = .*got {field} = "):
        _cfg("tinyshakespeare", **{field: value}).validate()


def test_models_and_runs_that_cannot_carry_state_are_named(tmp_path):
    data = _text(tmp_path)
    with pytest.raises(ValueError, match="TrainConfig.carry_state: expected true or false"):
        _cfg(data, carry_state="yes").validate()
    with pytest.raises(
        ValueError, match=r"carry_state: expected a state of fixed size.*block 0 \(Attention\)"
    ):
        Trainer(
            _cfg(data, model="transformer", model_overrides={"d_model": 16, "n_layers": 1}), tmp_path / "t"
        )
    gla = {"d_model": 16, "n_layers": 1, "pos_embedding": "learned", "max_position": 64}
    with pytest.raises(ValueError, match=r"carry_state: expected a stream of at most max_position = 64.*96"):
        Trainer(_cfg(data, model="gla", model_overrides=gla), tmp_path / "g")
    with pytest.raises(
        ValueError, match=r"carry_state: the training text .* batch_size = 16 .* seq_len = 16"
    ):
        Trainer(_cfg(data, batch_size=16), tmp_path / "s")
    tr = Trainer(_cfg(data), tmp_path / "ok", progress=False)
    with pytest.raises(ValueError, match="carry_state: expected one process.*got 2 processes"):
        check_carry_state(tr.model, tr.cfg, tr.data.streams.stream_tokens, world=2)
    with pytest.warns(UserWarning, match=r"CMS level 2 has period 64 >= the 48 tokens each of the 4 streams"):
        Trainer(_cfg(data, batch_size=4), tmp_path / "w", progress=False)


def test_mnemo_train_carry_state_says_the_streams_and_warns_about_longer_periods(tmp_path, capsys):
    """hope_long's own periods (16/128/512/2048) on 2 streams of 96 tokens: the three slow levels
    never step before the restart, and the command says so."""
    from mnemo.cli import main

    argv = ["train", "--model", "hope_long", "--d-model", "8", "--n-layers", "1", "--carry-state"]
    argv += ["--data", _text(tmp_path), "--seq-len", "16", "--batch-size", "2", "--steps", "2"]
    argv += ["--warmup-steps", "0", "--eval-batches", "1", "--sample-tokens", "0", "--no-progress"]
    argv += ["--out", str(tmp_path / "run")]
    with pytest.warns(
        UserWarning, match=r"period (128|512|2048) >= the 96 tokens each of the 2 streams"
    ) as rec:
        assert main(argv) == 0
    assert sum("tokens each of the 2 streams" in str(w.message) for w in rec) == 3
    out = capsys.readouterr().out
    assert "carried state: 2 streams of 6 windows = 96 tokens each, then all restart" in out


def test_snapshot_copies_what_detach_leaves_aliased_to_the_parameters():
    """A fresh CMS level's weights in the state are its parameters: after ``detach`` an optimizer
    step changes the carried state in place; a snapshot keeps the values the window ended with."""
    from mnemo.layers.state import detach, tensors
    from mnemo.models import LanguageModel, build_config

    levels = [{"period": p, "objective": "task"} for p in PERIODS]
    torch.manual_seed(0)
    m = LanguageModel(
        build_config("hope_long", vocab_size=11, d_model=8, n_layers=1, mlp_options={"levels": levels})
    )
    _, state = m(torch.randint(0, 11, (2, T)))
    storages = {p.untyped_storage().data_ptr() for p in m.parameters()}
    aliased = [t for t in tensors(detach(state)) if t.untyped_storage().data_ptr() in storages]
    assert aliased  # (levels 1 and 2 have not stepped: their weights are W_in, W_out)
    snap = snapshot(state)
    assert not any(t.untyped_storage().data_ptr() in storages for t in tensors(snap))
    assert all(torch.equal(a, b) for a, b in zip(tensors(state), tensors(snap)))
    assert not any(t.requires_grad for t in tensors(snap))
