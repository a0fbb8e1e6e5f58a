"""Weight averaging (learn/average.py): the draft that serves is an EMA of the learner's weights; the guard judges,
the learner publishes, checkpoints and restores that average, never the last step's weights alone."""
import copy
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_qwen2

from osd.learn.average import WeightAverage
from osd.learn.checkpoint import load_checkpoint
from osd.learn.online import LearnConfig, OnlineLearner
from test_drift_guard import base_draft, item, stream, tasks  # noqa: F401 (tasks: a fixture)


def test_the_average_follows_the_ema_with_a_short_memory_at_first():
    p = torch.zeros(3)
    average = WeightAverage([p], decay=0.9)
    expected = torch.zeros(3)
    with average.training():  # the parameters hold the trajectory: the optimizer's weights
        for n, value in enumerate([1.0, 2.0, 4.0, 8.0] + [1.0] * 100):
            p.fill_(value)
            keep = min(0.9, (1 + n) / (10 + n))  # 0.1, 0.18, ... then 0.9 (from step 80)
            expected = keep * expected + (1 - keep) * value
            average.step()
    assert average.current_decay() == 0.9
    torch.testing.assert_close(p, expected)  # outside training the parameters hold the average ...
    assert torch.equal(average.trajectory[0], torch.ones(3))  # ... and the trajectory is kept beside them
    with average.training():
        assert torch.equal(p, torch.ones(3))  # the next steps continue the trajectory
        p.fill_(3.0)
    torch.testing.assert_close(p, expected)  # no step folded in: the average unchanged
    assert torch.equal(average.trajectory[0], torch.full((3,), 3.0))
    average.reset()
    assert torch.equal(average.trajectory[0], p)
    with pytest.raises(ValueError):
        WeightAverage([p], decay=1.0)


def learner_with(average: float, **cfg):
    """A tiny learner on task A's items; publish keeps a copy of what it was given."""
    published = {}

    def publish(master, version=None):
        version = max(published, default=0) + 1 if version is None else version
        published[version] = [p.detach().clone() for p in master.parameters()]
        return SimpleNamespace(version=version)

    config = LearnConfig(**{**dict(every_requests=0, steps_per_update=4, batch_size=4, lr=1e-3, train_layers=0,
                                   guard=False, average=average), **cfg})
    return OnlineLearner(base_draft(), publish, config), published


def feed(learner, tasks, requests):
    for i in requests:
        learner.observe_item(item(tasks[0][i], i), item(tasks[0][i], i))
        learner.after_request()


def test_the_average_is_published_not_the_last_step(tasks):
    learner, published = learner_with(0.8)
    feed(learner, tasks, range(12))
    for _ in range(3):
        assert learner.update("manual")["published"]
    served = published[learner.version]
    assert all(torch.equal(a, b) for a, b in zip(served, learner.master.parameters()))  # the master holds the average
    plain, plain_published = learner_with(0.0)  # the same updates without averaging serve the last step
    feed(plain, tasks, range(12))
    for _ in range(3):
        plain.update("manual")
    assert all(torch.equal(a, b) for a, b in zip(plain_published[plain.version], plain.master.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(plain.params, learner.average.trajectory))  # same trajectory
    assert any(not torch.equal(a, b) for a, b in zip(learner.params, learner.average.trajectory))  # not what served


def test_a_rejected_update_leaves_the_average_as_it_was(tasks):
    learner, published = learner_with(0.8, guard=True, guard_holdout=0.5, guard_z=0.0, drift_guard=False, lr=0.5)
    feed(learner, tasks, range(12))
    before = [w.clone() for w in learner.params + learner.average.trajectory]
    report = learner.update("manual")  # lr 0.5: the update hurts, and the guard judges the average
    assert not report["published"] and report["rejected_because"] == "guard", report
    assert all(torch.equal(a, b) for a, b in zip(before, learner.params + learner.average.trajectory))
    assert published == {}


def test_a_reset_to_the_base_restarts_the_average_and_the_trajectory_there(tasks, monkeypatch):
    trajectories, publish = {}, OnlineLearner._publish

    def publish_and_record(self):
        publish(self)
        trajectories[self.version] = [w.clone() for w in self.average.trajectory]

    monkeypatch.setattr(OnlineLearner, "_publish", publish_and_record)
    learner, published = stream(tasks, lambda i: 1, average=0.8)  # trains on the harmful task B
    reset = next(u["vs_base"] for u in learner.history if (u.get("vs_base") or {}).get("action") == "reset")
    base = list(base_draft().parameters())
    assert all(torch.equal(a, b) for a, b in zip(published[reset["published_version"]], base))  # the base serves
    index = {p.data_ptr(): i for i, p in enumerate(learner.master.parameters())}
    restarted = trajectories[reset["published_version"]]  # ... and the next steps start from it
    assert all(torch.equal(w, base[index[p.data_ptr()]]) for p, w in zip(learner.params, restarted))


def test_a_checkpoint_holds_the_average_and_resumes_both_weights(tasks, tmp_path):
    learner, published = learner_with(0.8, checkpoint_dir=str(tmp_path / "ckpt"))
    feed(learner, tasks, range(12))
    learner.update("manual")
    learner.update("manual")
    evaluated = base_draft()  # what `osd eval` / `--learned-draft` load: the weights that served
    assert load_checkpoint(str(tmp_path / "ckpt"), evaluated)["version"] == learner.version
    assert all(torch.equal(a, b) for a, b in zip(evaluated.parameters(), published[learner.version]))
    resumed, _ = learner_with(0.8, checkpoint_dir=str(tmp_path / "ckpt"))
    assert resumed.resume() and resumed.average.steps == learner.average.steps == 8
    assert all(torch.equal(a, b) for a, b in zip(resumed.params, learner.params))  # the average
    assert all(torch.equal(a, b) for a, b in zip(resumed.average.trajectory, learner.average.trajectory))
    (tmp_path / "ckpt" / "learner_trajectory.pt").rename(tmp_path / "trajectory.pt")  # a checkpoint without one:
    older, _ = learner_with(0.8, checkpoint_dir=str(tmp_path / "ckpt"))
    assert older.resume() and older.average.steps == 0  # the trajectory restarts from the average that served
    assert all(torch.equal(a, b) for a, b in zip(older.average.trajectory, learner.params))
    feed(resumed, tasks, range(16))  # the same buffer as the learner's below
    feed(learner, tasks, range(12, 16))
    resumed.rng.setstate(learner.rng.getstate())
    resumed.update("manual")
    learner.update("manual")
    assert all(torch.allclose(a, b) for a, b in zip(resumed.params + resumed.average.trajectory,
                                                     learner.params + learner.average.trajectory))


def test_bad_average():
    with pytest.raises(Exception, match="average"):
        LearnConfig(average=1.0)
    with pytest.raises(Exception, match="average"):
        LearnConfig(average=-0.1)


def test_the_offline_baseline_averages_its_steps_the_same_way(tasks):
    """Equal-step baselines take the online learner's averaging too: the recipes then differ only in the data."""
    from osd_bench.baselines import train_equal_steps
    from osd.distill.trainer import DistillConfig, DistillTrainer

    items = [item(tasks[0][i], i) for i in range(16)]
    trainer = lambda: DistillTrainer(base_draft(), DistillConfig(lr=1e-3, batch_size=4, train_layers=0))
    plain, steps = trainer(), []
    step = plain.train_step
    plain.train_step = lambda batch: (step(batch), steps.append([p.detach().clone() for p in plain.params]))[0]
    train_equal_steps(plain, items, 6)
    averaged = trainer()
    expected = [p.detach().clone() for p in averaged.params]
    assert train_equal_steps(averaged, items, 6, average=0.8)["optimizer_steps"] == len(steps) == 6
    for n, weights in enumerate(steps):
        keep = min(0.8, (1 + n) / (10 + n))
        expected = [keep * e + (1 - keep) * w for e, w in zip(expected, weights)]
    for p, e in zip(averaged.params, expected):
        torch.testing.assert_close(p.detach(), e)
    assert any(not torch.equal(p, w) for p, w in zip(averaged.params, steps[-1]))  # not the last step's weights
