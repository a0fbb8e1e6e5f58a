"""`osd replay --fast --route` on a tiny two-mode stream: the four arms side by side, router accuracy, report."""
import json
import random

import pytest
from conftest import EOS, ToyTokenizer, tiny_qwen2

from osd_bench.replay_routed import label_map, mixed_order, router_accuracy, routed_replay
from osd_bench.replay_routed_report import label_curves, report_routed_replay
from osd.distill.cache import DecodeSettings, TargetCache
from osd.distill.target_outputs import target_samples
from osd.errors import InvalidArgument
from osd.learn.online import LearnConfig
from osd.route.config import RouteConfig
from osd.route.system import featurizer

rng = random.Random(3)
PROMPTS = {"a": [[rng.randrange(2, 12) for _ in range(10)] for _ in range(36)],
           "b": [[rng.randrange(30, 40) for _ in range(10)] for _ in range(36)]}


def test_mixed_order_interleaves_and_keeps_counts():
    order = mixed_order([30, 30], seed=0)
    assert sorted(order) == [0] * 30 + [1] * 30 and order != sorted(order)
    assert 5 <= order[:20].count(0) <= 15


def test_router_accuracy_matches_labels_to_drafts_one_to_one():
    rows = [{"domain": d, "routed_draft": r, "route_reason": why} for d, r, why in
            [("x", "d0", "cold"), ("x", "d0", "routed"), ("x", "d1", "routed"), ("y", "d1", "routed"), ("y", "d0", "explore")]]
    matched = label_map(rows)
    assert matched == {"x": "d0", "y": "d1"}
    assert router_accuracy(rows, matched)["accuracy"] == pytest.approx(3 / 4)  # the explored request is not counted
    collapsed = [{"domain": d, "routed_draft": "d0", "route_reason": "routed"} for d in "xxxyy"]
    assert label_map(collapsed) == {"x": "d0"}  # one draft serving both labels is right for one of them only
    assert router_accuracy(collapsed, label_map(collapsed))["accuracy"] == pytest.approx(3 / 5)


def _stream(tmp_path_factory):
    cache = TargetCache(tmp_path_factory.mktemp("teacher"), "tiny")
    target, settings = tiny_qwen2(seed=0), DecodeSettings(max_new_tokens=10, top_k=16)
    samples = {m: target_samples(cache, target, ps, settings, {EOS}, batch_size=36) for m, ps in PROMPTS.items()}
    stream, held = {m: s[:30] for m, s in samples.items()}, {m: s[30:] for m, s in samples.items()}
    order, cursor, ordered, domains = mixed_order([30, 30], 0), {"a": 0, "b": 0}, [], []
    for j in order:
        m = "ab"[j]
        ordered.append(stream[m][cursor[m]])
        domains.append(m)
        cursor[m] += 1
    return ordered, domains, held


LEARN = LearnConfig(every_requests=4, steps_per_update=4, batch_size=8, lr=1e-2, train_layers=1, guard=False)


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    ordered, domains, held = _stream(tmp_path_factory)
    learn, route = LEARN, RouteConfig(score_share=1.0, explore=0.05, route_warmup=16)
    base = tiny_qwen2(seed=1, layers=2)
    result = routed_replay(ordered, domains, base, learn, route, featurizer(ToyTokenizer(), route), k=3,
                           max_new_tokens=10, heldout=held)
    result["config"] = {"stream": "a,b", "per_segment": 30, "k": 3, "heldout": 6, "learn": vars(learn),
                        "route": vars(route), "models": {"draft": "tiny"}, "exactness": "tiny"}
    return result, domains


def test_every_arm_is_measured_on_every_request_and_each_learns_its_own_traffic(replayed):
    result, domains = replayed
    rows = result["requests"]
    assert len(rows) == 60 and all(f"{arm}_alpha" in r for r in rows for arm in result["arms"])
    learners = result["learners"]
    assert learners["shared"]["requests"] == 60
    assert {d: s["requests"] for d, s in learners["oracle"].items()} == {"a": 30, "b": 30}
    owned = {n: sum(r["routed_owner"] == n for r in rows) for n in result["drafts"]}
    assert {n: s["requests"] for n, s in learners["routed"].items()} == owned  # the owner learns, not the server
    assert sum(r["scored"] for r in rows) == 60  # score_share 1: every routed draft scored on every request


def test_each_mode_gets_its_own_learning_draft(replayed):
    """Drafts created equal: the clustering gives each mode one owner, which learns it (as the oracle split does);
    which draft serves is the scores' call (on this tiny stream the modes differ little, so it is not asserted)."""
    result, _ = replayed
    router = result["router"]
    after = [r for r in result["requests"][16:]]  # after the warm-up (all owned by d0)
    assert router_accuracy(after, label_map(after, "routed_owner"), "routed_owner")["accuracy"] >= 0.9, router
    assert set(router["label_to_owner"].values()) == {"d0", "d1"}
    assert router["explored"] <= 0.05 * router["routed"]
    assert router["served_best_share"] >= 0.6  # served draft scored best (ties included) before learning from it
    assert 0.0 <= result["heldout"]["router_accuracy"] <= 1.0 and result["heldout"]["pooled"]["routed"] > 0


def test_report_writes_json_and_markdown_with_the_targets(replayed, tmp_path):
    result, _ = replayed
    out, md = tmp_path / "routed.json", tmp_path / "B.md"
    report_routed_replay(result, str(out), str(md))
    saved = json.loads(out.read_text())
    assert set(saved["heldout"]["pooled"]) == {"control", "shared", "oracle", "routed"}
    text = md.read_text()
    assert "routed minus shared" in text and "router accuracy" in text and "per-mode drafts, router" in text
    curves = label_curves(result)  # the per-label figure: every arm on exactly its label's requests, in order
    for d in result["labels"]:
        mine = [r for r in result["requests"] if r["domain"] == d]
        assert curves[d]["per-mode drafts, router"] == [r["routed_alpha"] for r in mine] and len(curves[d]) == 4
    assert (tmp_path / "routed.png").stat().st_size > 1000 and "plot: `" in text


def test_a_fork_serves_every_arm_with_the_shared_draft_then_starts_each_draft_as_its_copy(tmp_path_factory):
    """--fork-at: before the split the oracle and router columns are the shared draft's and only it learns; at the
    split every per-mode draft is a copy of the shared draft as it then is (so their first measurements agree)."""
    ordered, domains, held = _stream(tmp_path_factory)
    route = RouteConfig(score_share=1.0, explore=0.0, route_warmup=16)
    base = tiny_qwen2(seed=1, layers=2)
    result = routed_replay(ordered, domains, base, LEARN, route, featurizer(ToyTokenizer(), route), k=3,
                           max_new_tokens=10, heldout=held, fork_at=24)
    rows = result["requests"]
    for r in rows[:24]:
        assert r["oracle_alpha"] == r["routed_alpha"] == r["shared_alpha"] and r["route_reason"] == "before the fork"
    assert rows[24]["oracle_alpha"] == rows[24]["shared_alpha"] == rows[24]["routed_alpha"]  # copies, not yet trained
    assert any(r["shared_alpha"] > r["control_alpha"] for r in rows[:24])  # the shared draft learnt before the split
    learners = result["learners"]
    assert learners["shared"]["requests"] == 60
    assert sum(s["requests"] for s in learners["oracle"].values()) == 36  # each per-label draft: its traffic after
    assert sum(s["requests"] for s in learners["routed"].values()) == 36
    assert result["router"]["explored_share"] == 0.0 and "d0" in result["router"]["label_to_draft"].values()
    with pytest.raises(InvalidArgument, match="fork"):
        routed_replay(ordered, domains, base, LEARN, route, featurizer(ToyTokenizer(), route), fork_at=60)


def test_residual_drafts_carry_the_shared_drafts_learning_and_an_equal_steps_arm_runs_beside(tmp_path_factory, tmp_path):
    """--residual: every per-label and per-mode draft is the shared draft plus its own steps. Here the per-mode drafts
    see 30 requests each and never reach an update of their own (every 40), while the shared draft updates once (at
    request 40): so every arm must read exactly the shared draft's alpha on every request, also after its update
    (measured before any arm learns from the request). Drafts not following it would stay at the control."""
    ordered, domains, held = _stream(tmp_path_factory)
    route = RouteConfig(score_share=1.0, explore=0.0, route_warmup=16)
    learn = LearnConfig(every_requests=40, steps_per_update=4, batch_size=8, lr=1e-2, train_layers=1, guard=False)
    result = routed_replay(ordered, domains, tiny_qwen2(seed=1, layers=2), learn, route,
                           featurizer(ToyTokenizer(), route), k=3, max_new_tokens=10, heldout=held, residual=True)
    rows = result["requests"]
    assert result["arms"] == ["control", "shared", "oracle", "routed", "shared_steps"]
    assert all(r["oracle_alpha"] == r["routed_alpha"] == r["shared_alpha"] for r in rows)
    assert any(r["shared_alpha"] != r["control_alpha"] for r in rows[40:])  # the shared draft did learn
    learners = result["learners"]
    assert learners["shared"]["optimizer_steps"] == 4 and learners["shared_steps"]["optimizer_steps"] == 8
    assert all(s["optimizer_steps"] == 0 for s in learners["routed"].values())
    pooled = result["heldout"]["pooled"]
    assert pooled["oracle"] == pooled["routed"] == pooled["shared"] and "shared_steps" in pooled
    result["config"] = {"stream": "a,b", "per_segment": 30, "k": 3, "heldout": 6, "learn": vars(learn),
                        "route": vars(route), "models": {"draft": "tiny"}, "exactness": "tiny", "residual": True}
    report_routed_replay(result, str(tmp_path / "r.json"), str(tmp_path / "B.md"))
    text = (tmp_path / "B.md").read_text()
    assert "Residual drafts" in text and "equal-steps shared draft 8" in text and "routed vs shared steps" in text


def test_residual_drafts_refuse_lora_factors(tmp_path_factory):
    ordered, domains, _ = _stream(tmp_path_factory)
    route = RouteConfig(score_share=1.0, explore=0.0, route_warmup=16)
    with pytest.raises(InvalidArgument, match="residual"):
        routed_replay(ordered, domains, tiny_qwen2(seed=1, layers=2), LearnConfig(trainable="lora", guard=False), route,
                      featurizer(ToyTokenizer(), route), residual=True)
