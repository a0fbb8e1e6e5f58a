"""The offline draft trained in arrival order (`--baseline-arrival`): each step draws only from the requests that had
arrived by then, with the online draft's step count; it separates what the online setting costs from what the
online learner's recipe costs."""
import math
from types import SimpleNamespace

import pytest
import torch
from test_replay_resume import comparable, replay, stream  # noqa: F401  (the tiny stream fixture)

import osd_bench.replay_fast as replay_fast
from osd_bench.baselines import ARRIVAL, arrival_batches, train_equal_steps
from osd_bench.replay_fast_report import _notes, heldout_rows
from osd.distill.trainer import DistillTrainer


def test_each_step_draws_only_requests_that_had_arrived():
    n, steps, size = 50, 20, 4
    batches = arrival_batches(n, steps, size, seed=3)
    assert len(batches) == steps
    for t, batch in enumerate(batches):
        arrived = math.ceil(n * (t + 1) / steps)
        assert len(batch) == min(size, arrived) == len(set(batch))  # without replacement within a step
        assert max(batch) < arrived
    assert max(batches[0]) < 3 and max(batches[-1]) >= 30  # the pace of the stream, not all of it from step 0
    assert batches == arrival_batches(n, steps, size, seed=3) != arrival_batches(n, steps, size, seed=4)


def test_a_batch_larger_than_what_arrived_takes_all_of_it():
    assert [sorted(b) for b in arrival_batches(5, 5, 8)] == [list(range(t + 1)) for t in range(5)]


class RecordingTrainer:
    """What train_equal_steps needs of a DistillTrainer; step `fail_at` is not finite once."""

    def __init__(self, fail_at=None):
        self.weight = torch.nn.Parameter(torch.zeros(2))
        self.params = [self.weight]
        self.optimizer = torch.optim.AdamW(self.params, lr=0.1)
        self.config = SimpleNamespace(batch_size=3, shuffle_seed=7)
        self.draft = torch.nn.Linear(1, 1)
        self.seen, self.fail_at = [], fail_at

    batches = DistillTrainer.batches  # shuffled epochs, as the real trainer makes them

    def train_step(self, batch):
        self.seen.append(list(batch))
        if len(self.seen) == self.fail_at:
            return None
        self.optimizer.zero_grad()
        self.weight.sum().backward()
        self.optimizer.step()
        return 1.0


def test_arrival_training_takes_exactly_the_steps_and_repeats_a_skipped_draw():
    items = [f"req-{i}" for i in range(12)]
    trainer = RecordingTrainer(fail_at=4)
    report = train_equal_steps(trainer, items, 6, arrival=True)
    assert report["optimizer_steps"] == 6 and report["adam_steps"] == 6 and report["skipped_nonfinite"] == 1
    assert report["order"] == "arrival" and report["items"] == 12
    assert trainer.seen[3] == trainer.seen[4]  # the skipped step's batch, drawn again
    taken = trainer.seen[:3] + trainer.seen[4:]
    expected = arrival_batches(12, 6, 3, seed=7)
    assert taken == [[items[i] for i in b] for b in expected]
    for t, batch in enumerate(taken):
        assert all(int(r.split("-")[1]) < 2 * (t + 1) for r in batch)  # 12 requests over 6 steps: 2 arrive per step


def test_epoch_training_is_unchanged_by_the_option():
    items = [f"req-{i}" for i in range(12)]
    trainer = RecordingTrainer()
    report = train_equal_steps(trainer, items, 6)
    assert "order" not in report and report["epochs"] == 2
    assert sorted(r for b in trainer.seen[:4] for r in b) == sorted(items)  # a whole shuffled epoch first


def test_a_replay_with_the_arrival_baseline_reports_it_against_the_online_draft(stream, tmp_path, monkeypatch):  # noqa: F811
    state = tmp_path / "s.pt"
    plain = replay(stream, state_path=state)
    assert ARRIVAL not in plain["variants"] and "heldout_online_vs_offline_arrival" not in plain
    calls = []
    train = replay_fast.train_equal_steps

    def only_arrival(*args, **kw):
        calls.append(args[-1] if len(args) > 5 else kw.get("arrival"))
        return train(*args, **kw)

    monkeypatch.setattr(replay_fast, "train_equal_steps", only_arrival)
    result = replay(stream, state_path=state, baseline_arrival=True)  # resumed: only the new draft trains
    assert calls == [True]
    steps = result["learner"]["optimizer_steps"]
    assert result["baselines"][ARRIVAL]["optimizer_steps"] == steps == result["baselines"]["offline_100pct"]["optimizer_steps"]
    assert result["baselines"][ARRIVAL]["items"] == 32 and result["baselines"][ARRIVAL]["recipe"] == "equal steps, arrival order"
    assert result["variants"] == ["original", "offline_10pct", "offline_100pct", ARRIVAL, "online"]
    assert all(f"{ARRIVAL}_alpha" in r for r in result["requests"])
    pair = result["heldout_online_vs_offline_arrival"]["b"]
    online, arrival = (result["end_of_stream_alpha_on_heldout"]["b"][v] for v in ("online", ARRIVAL))
    assert (pair["gained"] - pair["lost"] > 0) == (online > arrival)
    rows = heldout_rows(result)
    assert ["b", "offline 100%, arrival order (equal steps)"] in [r[:2] for r in rows]
    assert "online vs offline_arrival on the same positions" in _notes(result)
    # the other drafts and the rows are those of the run without it
    kept = {k: v for k, v in comparable(result).items() if k not in ("variants", "baselines", "requests")
            and "heldout" not in k and "end_of_stream" not in k}
    assert kept == {k: v for k, v in comparable(plain).items() if k in kept}
    assert [r["online_alpha"] for r in result["requests"]] == [r["online_alpha"] for r in plain["requests"]]


def test_the_cli_offers_the_arrival_baseline():
    from osd.cli import build_parser

    args = build_parser().parse_args(["replay", "--fast", "--baseline-arrival"])
    assert args.baseline_arrival is True
    with pytest.raises(SystemExit):
        build_parser().parse_args(["replay", "--fast", "--baseline-arrival=yes"])
