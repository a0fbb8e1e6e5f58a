"""The greedy fast-path replay: the items it learns from equal the engine's, and online alpha rises."""
import random

import pytest
import torch
from conftest import EOS, tiny_qwen2
from helpers import make_engine

from osd_bench.replay_fast import drift_order, fast_replay, frozen_trunk_copy, learn_item
from osd_bench.replay_fast_report import (LABELS, baselines_note, forgetting_rows, heldout_rows, recovery, recovery_notes,
                                          recovery_verdict, report_fast_replay, summary)
from osd.config import SamplingConfig
from osd.distill.cache import DecodeSettings, TargetCache
from osd.distill.evaluate import position_stats, sample_item
from osd.distill.target_outputs import target_samples
from osd.learn.buffer import ReplayBuffer, item_from_step
from osd.learn.online import LearnConfig

rng = random.Random(1)
STREAM_A = [[rng.randrange(2, 20) for _ in range(rng.randrange(2, 5))] for _ in range(40)]
STREAM_B = [[rng.randrange(20, 40) for _ in range(rng.randrange(2, 5))] for _ in range(40)]
HELD_A = [[rng.randrange(2, 20) for _ in range(rng.randrange(2, 5))] for _ in range(5)]  # never streamed
HELD_B = [[rng.randrange(20, 40) for _ in range(rng.randrange(2, 5))] for _ in range(5)]


@pytest.fixture(scope="module")
def samples(tmp_path_factory):
    cache = TargetCache(tmp_path_factory.mktemp("teacher"), "tiny")
    target = tiny_qwen2(seed=0)
    settings = DecodeSettings(max_new_tokens=12, top_k=16)
    return (target_samples(cache, target, STREAM_A, settings, {EOS}, batch_size=20),
            target_samples(cache, target, STREAM_B, settings, {EOS}, batch_size=20), target,
            {"a": target_samples(cache, target, HELD_A, settings, {EOS}), "b": target_samples(cache, target, HELD_B, settings, {EOS})})


@pytest.mark.parametrize("mode", ["mismatch", "all"])
def test_learn_items_equal_what_the_engine_buffers(samples, tokenizer, mode):
    train, _, target, _ = samples
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


@pytest.fixture(scope="module")
def replayed(samples, tmp_path_factory):
    """One shifting stream a -> b with every baseline and held-out requests of both, reported to files."""
    a, b, _, held = samples
    base = tiny_qwen2(seed=1, layers=2)
    before = {n: p.clone() for n, p in base.named_parameters()}
    learn = LearnConfig(every_requests=4, steps_per_update=6, batch_size=8, lr=1e-2, train_layers=1, guard=False)
    seen = []
    result = fast_replay(a + b, ["a"] * len(a) + ["b"] * len(b), base, learn, k=3, probe=10, max_new_tokens=12,
                         heldout=held, on_row=lambda row: seen.append(dict(row)))
    result["config"] = {"stream": "a,b", "k": 3, "overlap": 0.0, "learn": vars(learn), "baseline_epochs": 0,
                        "baseline_lr": 1e-2, "heldout": 5, "heldout_split": "test", "exactness": "bf16 features"}
    tmp = tmp_path_factory.mktemp("report")
    report_fast_replay(result, str(tmp / "replay.json"), str(tmp / "BENCH.md"), window=5)
    return result, seen, base, before, tmp


def test_fast_replay_online_alpha_rises_and_beats_the_control_on_a_shifting_stream(replayed):
    result, seen, base, before, tmp = replayed
    rows = result["requests"]
    assert [r["i"] for r in seen] == list(range(80))  # each row handed out in stream order, as measured
    assert all(seen[i].items() <= rows[i].items() for i in range(80))  # the baselines' columns join them later
    mean = lambda part, key: sum(r[key] for r in part) / len(part)
    for part in (rows[20:40], rows[60:80]):  # second half of each segment
        assert mean(part, "online_alpha") > mean(part, "original_alpha") + 0.05
        assert mean(part, "offline_100pct_alpha") > mean(part, "original_alpha")
    assert result["learner"]["updates_published"] >= 15
    assert all(torch.equal(p, before[n]) for n, p in base.named_parameters())  # the control stays never trained
    assert set(result["end_of_stream_alpha_on_segment_probes"]) == {"a", "b"}
    assert set(result["end_of_stream_alpha_on_heldout"]["b"]) == {"original", "offline_10pct", "offline_100pct", "online"}
    assert result["end_of_stream_alpha_on_heldout"]["a"]["online"] > result["end_of_stream_alpha_on_heldout"]["a"]["original"]
    bench = (tmp / "BENCH.md").read_text()
    assert (tmp / "replay.png").stat().st_size > 1000 and "offline 100% (equal steps)" in bench
    assert "5 held-out requests" in bench


def test_offline_baselines_take_as_many_optimizer_steps_as_the_online_draft(replayed):
    result = replayed[0]
    online_steps = result["learner"]["optimizer_steps"]
    assert online_steps == 20 * 6  # 80 requests, an update every 4, 6 steps each (no guard here)
    for name in ("offline_10pct", "offline_100pct"):
        b = result["baselines"][name]
        assert b["optimizer_steps"] == online_steps and b["adam_steps"] == online_steps  # AdamW's own count agrees
        assert b["lr"] == 1e-2 and b["recipe"] == "equal steps"
    assert result["baselines"]["offline_10pct"]["items"] == 8 and result["baselines"]["offline_100pct"]["items"] == 80


def test_the_control_row_is_in_every_table_and_improvements_are_paired_with_it(replayed):
    result, _, _, _, tmp = replayed
    table_rows, header = summary(result, window=5)
    assert len(header) == len(table_rows[0])
    assert [(r[0], r[2]) for r in table_rows if r[2].startswith("control")] == [("a", "control (never trained)"),
                                                                                 ("b", "control (never trained)")]
    assert [r[2] for r in table_rows[:4]] == ["control (never trained)", "offline 10% (equal steps)",
                                              "offline 100% (equal steps)", "online"]
    rows_b = result["requests"][40:]
    gained = sum(r["online_gained"] for r in rows_b)
    lost = sum(r["online_lost"] for r in rows_b)
    online_b = next(r for r in table_rows if r[0] == "b" and r[2] == "online")
    assert online_b[6:9] == [gained, lost, (gained - lost) / (gained + lost) ** 0.5]
    assert gained - lost == round(sum(r["positions"] * (r["online_alpha"] - r["original_alpha"]) for r in rows_b))
    held = [r for r in heldout_rows(result) if r[0] == "b"]
    assert held[0][:2] == ["b", "control (never trained)"] and held[0][3:] == [None, None, None, None]
    paired = result["heldout_vs_control"]["b"]
    assert set(paired) == {"offline_10pct", "offline_100pct", "online"}
    for row in held[1:]:
        d = paired[{v: k for k, v in LABELS.items()}[row[1]]]
        assert row[4:] == [d["gained"], d["lost"], d["z"]] and (d["gained"] > d["lost"]) == (row[3] > 0)
    bench = (tmp / "BENCH.md").read_text()
    assert bench.count("control (never trained)") >= 4  # per segment (2), held-out (1), forgetting header (1)


def test_held_out_alpha_after_each_segment_shows_forgetting_against_the_control(replayed):
    result, _, _, _, tmp = replayed
    points = result["heldout_after_each_segment"]
    assert [(p["at_request"], p["last_domain"]) for p in points] == [(40, "a"), (80, "b")]
    end = result["end_of_stream_alpha_on_heldout"]
    for d in ("a", "b"):  # the last point is the end of the stream; the control's figure never moves
        assert points[1]["heldout"][d]["online"] == end[d]["online"]
        assert points[0]["heldout"][d]["control"] == points[1]["heldout"][d]["control"] == end[d]["original"]
    rows = forgetting_rows(result)
    a_late = next(r for r in rows if r[0] == 80 and r[2] == "a")
    assert a_late[9] == points[1]["heldout"]["a"]["online"] - points[0]["heldout"]["a"]["online"]  # change since a's end
    assert next(r for r in rows if r[0] == 40 and r[2] == "b")[9] is None  # b had no segment of its own yet
    assert "after each segment (forgetting)" in (tmp / "BENCH.md").read_text()


def test_without_offline_baselines_the_control_row_stays():
    rows = [{"domain": "x", "positions": 4, "original_alpha": 0.5, "online_alpha": 0.75, "online_gained": 1,
             "online_lost": 0}] * 4
    table_rows, _ = summary({"variants": ["original", "online"], "requests": rows}, window=2)
    assert [r[2] for r in table_rows] == ["control (never trained)", "online"]
    assert table_rows[1][5] == 0.25 and table_rows[1][6:9] == [4, 0, 2.0] and table_rows[1][9] is None


def test_stream_parts_let_a_dataset_name_its_split():
    from osd_bench.replay_fast import stream_parts

    assert stream_parts("gsm8k, spider,finance:test", "train") == [("gsm8k", "train"), ("spider", "train"),
                                                                    ("finance", "test")]
    assert stream_parts("/data/x:y.jsonl", "test") == [("/data/x:y.jsonl", "test")]  # not a split: part of the name


def test_recovery_is_applied_to_the_control_too():
    rows = [{"online_alpha": o, "original_alpha": c} for o, c in ((0.1, 0.1), (0.5, 0.1), (0.9, 0.2), (0.9, 0.88))]
    assert recovery(rows, 0.9, window=1) == 3 and recovery(rows, 0.9, window=1, key="original_alpha") == 4
    assert recovery_verdict(3, None) == "learning closed a gap the control leaves open"
    assert recovery_verdict(3, 4) == "online 1 request before the control"
    assert recovery_verdict(3, 9) == "online 6 requests before the control"
    assert recovery_verdict(5, 2).startswith("no gap to close") and recovery_verdict(None, 2).startswith("online never")
    result = {"variants": ["original", "offline_100pct", "online"],
              "requests": [{**r, "domain": "x", "offline_100pct_alpha": 0.9} for r in rows]}
    (note,) = recovery_notes(result, window=1)
    assert "online after 3 requests, the control after 4 requests" in note


def test_paired_difference_counts_gained_and_lost_positions():
    from osd_bench.replay_fast import paired_difference

    base, other = [True, True, False, False, True], [True, False, True, True, True]
    assert paired_difference(base, other) == {"gained": 2, "lost": 1, "z": 1 / 3 ** 0.5}
    assert paired_difference(base, base)["z"] == 0.0


def test_the_report_header_names_offline_baselines_only_when_the_run_measured_them(replayed):
    result = replayed[0]
    assert "optimizer steps" in baselines_note(result)
    assert baselines_note({**result, "baselines": {}}) == "none in this run (--no-baseline)"
    assert "offline baselines: the online draft's optimizer steps" in (replayed[4] / "BENCH.md").read_text()


def test_evidence_reads_a_replays_json_and_pairs_every_number_with_its_source(replayed, tmp_path):
    """`osd bench evidence` re-measures nothing: its rows are the replay JSON's held-out figures and paired z."""
    from osd_bench.evidence import ARMS, report_evidence

    result, tmp = replayed[0], replayed[4]
    out = report_evidence([str(tmp / "replay.json")], str(tmp_path / "ev.json"), str(tmp_path / "B.md"))
    rows = {r["dataset"]: r for r in out["rows"]}
    assert set(rows) == {"a", "b"}
    for d, row in rows.items():
        end = result["end_of_stream_alpha_on_heldout"][d]
        assert row["alpha"] == {arm: end.get(arm) for arm in ARMS} and row["alpha"]["offline_arrival"] is None
        assert row["gain"] == end["online"] - end["original"] and row["gap"] == end["online"] - end["offline_100pct"]
        assert row["z_vs_control"]["online"] == result["heldout_vs_control"][d]["online"]["z"]
        assert row["online_vs_offline_z"] == result["heldout_online_vs_offline_100pct"][d]["z"]
        assert row["steps"]["online"] == row["steps"]["offline_100pct"] == result["learner"]["optimizer_steps"]
    assert out["verdicts"]["streams"] == 0  # a shift (a,b) is not a single-domain stream
    text = (tmp_path / "B.md").read_text()
    assert "online - offline 100% (z)" in text and "| replay " in text and (tmp_path / "ev.png").stat().st_size > 1000
    assert row["online_vs_arrival_z"] is None and out["verdicts"]["arrival_measured"] == 0  # no --baseline-arrival


def test_evidence_verdicts_apply_the_issues_targets():
    from osd_bench.evidence import Evidence, verdicts

    def row(stream, control, online, offline, z):
        return Evidence("r", stream, "d", 500, stream, {"original": control, "offline_10pct": None,
                                                          "offline_100pct": offline, "online": online},
                        {"offline_10pct": None, "offline_100pct": None, "online": z}, None,
                        {"online": 8, "offline_100pct": 8 if offline is not None else None})

    rows = [row("code", 0.2, 0.35, 0.355, 9.0), row("gsm8k", 0.5, 0.59, 0.62, 5.0), row("chat", 0.3, 0.28, None, -2.0),
            row("a,b", 0.1, 0.05, None, -3.0)]
    v = verdicts(rows)
    assert v == {"streams": 3, "gain_met": 1, "gap_met": 1, "gap_measured": 2, "arrival_not_below": 0,
                 "arrival_measured": 0, "worse_than_control": ["r:chat", "r:a,b"]}


def test_evidence_pairs_the_online_draft_with_the_arrival_order_draft_when_the_replay_trained_it(tmp_path):
    from osd_bench.evidence import evidence_of, evidence_table, verdicts

    def result(arrival, z):
        alpha = {"original": 0.24, "offline_10pct": 0.44, "offline_100pct": 0.61, "online": 0.58,
                 **({"offline_arrival": arrival} if arrival is not None else {})}
        pair = {"gained": 1, "lost": 1, "z": -1.0}
        return {"config": {"stream": "code", "models": {"draft": "d"}}, "requests": [{}] * 4,
                "learner": {"optimizer_steps": 8}, "baselines": {"offline_100pct": {"optimizer_steps": 8}},
                "end_of_stream_alpha_on_heldout": {"code": alpha},
                "heldout_vs_control": {"code": {arm: pair for arm in alpha if arm != "original"}},
                "heldout_online_vs_offline_100pct": {"code": {"z": -4.0}},
                **({"heldout_online_vs_offline_arrival": {"code": {"z": z}}} if arrival is not None else {})}

    above, = evidence_of(result(0.56, 1.9), "above")
    below, = evidence_of(result(0.62, -2.5), "below")
    plain, = evidence_of(result(None, None), "plain")
    assert above.alpha["offline_arrival"] == 0.56 and above.online_vs_arrival_z == 1.9
    assert round(above.gap_to_arrival, 6) == 0.02 and round(below.gap_to_arrival, 6) == -0.04
    assert plain.gap_to_arrival is None and plain.online_vs_arrival_z is None
    v = verdicts([above, below, plain])
    assert (v["arrival_not_below"], v["arrival_measured"], v["gap_measured"]) == (1, 2, 3)
    table = evidence_table([above, plain])
    assert "online - offline arrival (z)" in table and "+0.020 (1.9)" in table


def test_recovery_is_measured_against_the_offline_drafts_held_out_level_when_the_run_has_one():
    """In-stream the offline-100% draft is measured on requests it trained on (0.9 here); the online draft only ever on
    requests it has not seen. With held-out requests the bound is the offline draft on those (0.5)."""
    rows = [{"online_alpha": o, "original_alpha": 0.1, "offline_100pct_alpha": 0.9, "domain": "x", "positions": 4}
            for o in (0.1, 0.46, 0.5, 0.9)]
    result = {"variants": ["original", "offline_100pct", "online"], "requests": rows}
    assert "(0.900, in-stream, on requests it trained on): online after 4 requests" in recovery_notes(result, window=1)[0]
    result["end_of_stream_alpha_on_heldout"] = {"x": {"original": 0.1, "offline_100pct": 0.5, "online": 0.48}}
    assert "(0.500, held-out): online after 2 requests, the control never" in recovery_notes(result, window=1)[0]
    table_rows, _ = summary(result, window=1)
    assert [r[9] for r in table_rows if r[2] in ("online", "control (never trained)")] == ["never", 2]


def test_recovery_counts_only_a_return_that_lasts():
    """A noisy curve that touches the bound once and falls back has not recovered; one that dips after reaching it
    recovers from its last return."""
    touch = [{"online_alpha": a} for a in (0.2, 0.9, 0.2, 0.2, 0.2)]
    assert recovery(touch, 0.9, window=1) is None
    dip = [{"online_alpha": a} for a in (0.2, 0.9, 0.3, 0.9, 0.95)]
    assert recovery(dip, 0.9, window=1) == 4
    assert recovery(dip, 0.9, window=2) == 5  # averages 0.55, 0.6, 0.6, 0.925 from request 2: the last is within
    assert recovery(dip + [{"online_alpha": 0.5}], 0.9, window=2) is None  # then 0.725: fell back out
