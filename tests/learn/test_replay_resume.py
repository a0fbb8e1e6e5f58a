"""`osd replay --fast` cut short and resumed gives what an uncut run gives (bench/replay_state.py)."""
import random

import pytest
from conftest import EOS, tiny_qwen2

import osd_bench.replay_fast as replay_fast
from osd_bench.replay_fast import EPOCHS_RECIPE, fast_replay
from osd.distill.cache import DecodeSettings, TargetCache
from osd.distill.target_outputs import target_samples
from osd.errors import InvalidArgument
from osd.learn.online import LearnConfig

rng = random.Random(2)
PROMPTS = [[rng.randrange(2, 20) for _ in range(rng.randrange(2, 5))] for _ in range(16)]
PROMPTS += [[rng.randrange(20, 40) for _ in range(rng.randrange(2, 5))] for _ in range(19)]
LEARN = LearnConfig(every_requests=4, steps_per_update=3, batch_size=4, lr=1e-2, train_layers=1, mode="mismatch",
                    guard=True, guard_holdout=0.3, guard_z=0.5, capacity=40, guard_capacity=40, rehearsal=0.5,
                    rehearsal_capacity=6)
#   (a small buffer: it evicts, so the rehearsal sample, its generator included, must survive the cut too)


class Cut(Exception):
    pass


@pytest.fixture(scope="module")
def stream(tmp_path_factory):
    cache = TargetCache(tmp_path_factory.mktemp("teacher"), "tiny")
    samples = target_samples(cache, tiny_qwen2(seed=0), PROMPTS, DecodeSettings(max_new_tokens=10, top_k=16), {EOS},
                             batch_size=35)
    return samples[:32], ["a"] * 16 + ["b"] * 16, {"b": samples[32:]}


def replay(stream, **kw):
    samples, domains, heldout = stream
    return fast_replay(samples, domains, tiny_qwen2(seed=1, layers=2), LEARN, k=3, probe=4, max_new_tokens=10,
                       heldout=heldout, **kw)


def comparable(result: dict) -> dict:
    """Everything but wall-clock seconds."""
    drop = lambda d: {k: v for k, v in d.items() if "seconds" not in k}
    return {**{k: v for k, v in result.items() if k not in ("timings", "learner", "updates", "baselines")},
            "learner": drop(result["learner"]), "updates": [drop(u) for u in result["updates"]],
            "baselines": {n: drop(b) for n, b in result["baselines"].items()}}


def test_a_cut_replay_resumes_to_the_rows_of_an_uncut_one(stream, tmp_path, monkeypatch):
    uncut = replay(stream)
    assert uncut["learner"]["updates_published"] + uncut["learner"]["updates_rejected"] == 8
    assert uncut["learner"]["buffer_evicted"] > 0 and uncut["learner"]["rehearsal_items"] == 6  # it rehearsed
    state = tmp_path / "replay.state.pt"

    def cut_at(n):
        def on_row(row):
            if row["i"] == n:
                raise Cut
        return on_row

    with pytest.raises(Cut):  # cut during the stream: the state holds requests 0..9
        replay(stream, on_row=cut_at(12), state_path=state, save_every=5)
    train = replay_fast.train_equal_steps
    calls = []

    def cut_second_baseline(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise Cut
        return train(*args, **kw)

    monkeypatch.setattr(replay_fast, "train_equal_steps", cut_second_baseline)
    seen = []
    with pytest.raises(Cut):  # resumed at request 10; cut again while the second offline draft trains
        replay(stream, on_row=seen.append, state_path=state, save_every=5)
    assert [r["i"] for r in seen] == list(range(32))  # the restored rows are handed out first, then the new ones
    monkeypatch.setattr(replay_fast, "train_equal_steps", train)
    resumed = replay(stream, state_path=state, save_every=5)  # the first offline draft comes from the state
    assert comparable(resumed) == comparable(uncut)
    assert resumed["requests"] == uncut["requests"] and len(resumed["requests"]) == 32


def test_a_state_of_other_settings_is_refused(stream, tmp_path):
    state = tmp_path / "s.pt"
    with pytest.raises(Cut):
        replay(stream, on_row=lambda row: (_ for _ in ()).throw(Cut) if row["i"] == 3 else None, state_path=state,
               save_every=2)
    samples, domains, heldout = stream
    with pytest.raises(InvalidArgument, match="other settings or requests"):
        fast_replay(samples, domains, tiny_qwen2(seed=1, layers=2), LEARN, k=4, probe=4, max_new_tokens=10,
                    state_path=state)


def test_baseline_settings_change_only_the_baselines_of_a_resumed_replay(stream, tmp_path, monkeypatch):
    state = tmp_path / "s.pt"
    without = replay(stream, state_path=state, baselines=False)
    assert without["baselines"] == {} and without["variants"] == ["original", "online"]
    resumed = replay(stream, state_path=state)  # the same stream, now with baselines: rows and learner from the state
    assert comparable(resumed) == comparable(replay(stream))

    def must_not_train(*args, **kw):
        raise AssertionError("an equal-step baseline whose recipe did not change was trained again")

    monkeypatch.setattr(replay_fast, "train_equal_steps", must_not_train)
    one = replay(stream, state_path=state, baseline_epochs=1, baseline_lr=1e-3)  # adds the epochs recipe only
    assert one["baselines"][EPOCHS_RECIPE]["epochs"] == 1
    assert all(a[c] == b[c] for a, b in zip(one["requests"], resumed["requests"]) for c in b)  # kept, a column added
    assert any(f"{EPOCHS_RECIPE}_alpha" in r for r in one["requests"])
    two = replay(stream, state_path=state, baseline_epochs=2, baseline_lr=1e-3)  # its recipe changed: trained again
    assert two["baselines"][EPOCHS_RECIPE]["epochs"] == 2
    assert two["baselines"][EPOCHS_RECIPE]["optimizer_steps"] == 2 * one["baselines"][EPOCHS_RECIPE]["optimizer_steps"]
    dropped = replay(stream, state_path=state)  # without the epochs recipe, the report does not carry a stale one
    assert set(dropped["baselines"]) == set(resumed["baselines"]) and EPOCHS_RECIPE not in dropped["variants"]
    assert not any(c.startswith(EPOCHS_RECIPE) for r in dropped["requests"] for c in r)
    assert comparable(dropped) == comparable(resumed)
