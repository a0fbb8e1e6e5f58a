"""The greedy fast-path replay: the items it learns from equal the engine's, and online alpha rises."""
import random

import pytest
import torch
from conftest import EOS, tiny_qwen2
from helpers import make_engine

from osd.bench.replay_fast import drift_order, fast_replay, frozen_trunk_copy, learn_item
from osd.bench.replay_fast_report import recovery, report_fast_replay, summary
from osd.config import SamplingConfig
from osd.distill.cache import DecodeSettings, TargetCache
from osd.distill.evaluate import position_stats, sample_item
from osd.distill.target_outputs import target_samples
from osd.learn.buffer import ReplayBuffer, item_from_step
from osd.learn.online import LearnConfig

rng = random.Random(1)
STREAM_A = [[rng.randrange(2, 20) for _ in range(rng.randrange(2, 5))] for _ in range(40)]
STREAM_B = [[rng.randrange(20, 40) for _ in range(rng.randrange(2, 5))] for _ in range(40)]


@pytest.fixture(scope="module")
def samples(tmp_path_factory):
    cache = TargetCache(tmp_path_factory.mktemp("teacher"), "tiny")
    target = tiny_qwen2(seed=0)
    settings = DecodeSettings(max_new_tokens=12, top_k=16)
    return (target_samples(cache, target, STREAM_A, settings, {EOS}, batch_size=20),
            target_samples(cache, target, STREAM_B, settings, {EOS}, batch_size=20), target)


@pytest.mark.parametrize("mode", ["mismatch", "all"])
def test_learn_items_equal_what_the_engine_buffers(samples, tokenizer, mode):
    train, _, target = samples
    draft = tiny_qwen2(seed=1, layers=1)
    engine, _ = make_engine(target, draft, tokenizer, k=3)
    for n, sample in enumerate(train[:6]):
        buffer = ReplayBuffer()
        engine.observers.append(lambda r: buffer.add(item) if (item := item_from_step(r, mode, top_k=16)) else None)
        engine.generate(sample.prompt_ids, SamplingConfig(max_new_tokens=12))
        engine.observers.clear()
        stats = position_stats(draft, [sample_item(sample)], [sample])[0]
        fast = learn_item(sample, sample_item(sample), stats["matches"], 3, mode, "x", 0, max_new_tokens=12)
        engine_items = buffer.snapshot()
        if fast is None:
            assert not engine_items
            continue
        assert len(engine_items) == 1  # one request -> one merged item
        assert fast.positions == engine_items[0].positions and fast.tokens == engine_items[0].tokens
        assert torch.equal(fast.target.ids, engine_items[0].target.ids)


def test_drift_order_keeps_segment_order_and_blends():
    sharp = drift_order([3, 2], 0.0)
    assert sharp == [0, 0, 0, 1, 1]
    drift = drift_order([50, 50], 1.0, seed=1)
    assert sorted(drift) == [0] * 50 + [1] * 50 and drift[:10].count(0) == 10 and drift[-10:].count(1) == 10
    assert 0 < drift[40:60].count(1) < 20


def test_frozen_trunk_copy_shares_lower_layers_only():
    base = tiny_qwen2(seed=1, layers=3)
    copy_ = frozen_trunk_copy(base, 2)
    assert copy_.model.layers[0].mlp.up_proj.weight is base.model.layers[0].mlp.up_proj.weight
    assert copy_.model.embed_tokens.weight is base.model.embed_tokens.weight
    assert copy_.model.layers[2].mlp.up_proj.weight is not base.model.layers[2].mlp.up_proj.weight


def test_fast_replay_online_alpha_rises_and_beats_the_original_on_a_shifting_stream(samples, tmp_path):
    a, b, _ = samples
    base = tiny_qwen2(seed=1, layers=2)
    before = {n: p.clone() for n, p in base.named_parameters()}
    learn = LearnConfig(every_requests=4, steps_per_update=6, batch_size=8, lr=1e-2, train_layers=1, guard=False)
    seen = []
    result = fast_replay(a + b, ["a"] * len(a) + ["b"] * len(b), base, learn, k=3, baseline_epochs=4, baseline_lr=1e-2,
                         probe=10, max_new_tokens=12, heldout={"b": b[-5:]}, on_row=seen.append)
    rows = result["requests"]
    assert [r["i"] for r in seen] == list(range(len(a + b))) and seen == rows  # each row handed out in stream order
    mean = lambda part, key: sum(r[key] for r in part) / len(part)
    for part in (rows[20:40], rows[60:80]):  # second half of each segment
        assert mean(part, "online_alpha") > mean(part, "original_alpha") + 0.05
        assert mean(part, "offline_100pct_alpha") > mean(part, "original_alpha")
    assert result["learner"]["updates_published"] >= 15
    assert all(torch.equal(p, before[n]) for n, p in base.named_parameters())  # the original draft stays original
    table_rows, header = summary(result, window=5)
    assert [r[0] for r in table_rows] == ["a", "b"] and len(header) == len(table_rows[0])
    assert set(result["end_of_stream_alpha_on_segment_probes"]) == {"a", "b"}
    assert set(result["end_of_stream_alpha_on_heldout"]["b"]) == {"original", "offline_10pct", "offline_100pct", "online"}
    assert recovery([{"online_alpha": x} for x in (0.1, 0.5, 0.9, 0.9)], 0.9, window=1) == 3
    result["config"] = {"stream": "a,b", "k": 3, "overlap": 0.0, "learn": vars(learn), "baseline_epochs": 4, "baseline_lr": 1e-2,
                        "heldout": 5, "heldout_split": "test"}
    report_fast_replay(result, str(tmp_path / "replay.json"), str(tmp_path / "BENCH.md"), window=5)
    bench = (tmp_path / "BENCH.md").read_text()
    assert (tmp_path / "replay.png").stat().st_size > 1000 and "offline_100pct" in bench and "5 held-out requests" in bench


def test_paired_difference_counts_gained_and_lost_positions():
    from osd.bench.replay_fast import paired_difference

    base, other = [True, True, False, False, True], [True, False, True, True, True]
    assert paired_difference(base, other) == {"gained": 2, "lost": 1, "z": 1 / 3 ** 0.5}
    assert paired_difference(base, base)["z"] == 0.0
