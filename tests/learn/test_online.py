"""Replay buffer, triggers, guard, checkpoints and a stream where alpha rises (atomic swaps: test_hot_swap.py)."""
import copy
from types import SimpleNamespace

import pytest
import torch
from conftest import EOS, tiny_qwen2
from helpers import make_engine, plain_greedy

from osd.config import SamplingConfig
from osd.engine import StepRecord
from osd.errors import CheckpointMismatch
from osd.learn.checkpoint import load_checkpoint
from osd.learn.batch import acceptance_on
from osd.learn.buffer import ReplayBuffer, item_from_step
from osd.learn.online import LearnConfig, OnlineLearner
from osd.learn.triggers import UpdateTrigger


def record(context, proposed, n_accepted, target_logits):
    return StepRecord("r1", ("draft", 0), context, proposed, n_accepted, 0, target_logits, None, [], 0.0, 0.0, 0.0)


def test_buffer_stores_rejected_position_and_its_target_distribution():
    logits = torch.randn(4, 10, generator=torch.Generator().manual_seed(0))  # k = 3 proposals + bonus row
    rec = record([5, 6, 7, 8], [1, 2, 3], 1, logits)  # proposal 1 (token 2, position 5) rejected
    item = item_from_step(rec, "mismatch", top_k=10)
    assert item.tokens == [5, 6, 7, 8, 1]  # what the draft saw when it proposed position 5
    assert item.positions == [5]  # draft logits index 4 produced the rejected proposal
    assert torch.allclose(item.target.probs[0].sum(), torch.tensor(1.0))
    assert int(item.target.ids[0, 0]) == int(logits[1].argmax())
    every = item_from_step(rec, "all", top_k=10)
    assert every.positions == [4, 5] and every.tokens == [5, 6, 7, 8, 1]
    assert item_from_step(record([5], [1, 2], 2, logits[:3]), "mismatch") is None  # all accepted: no mismatch
    bonus = item_from_step(record([5], [1, 2], 2, logits[:3]), "all", top_k=10)  # ... but "all" keeps the bonus row
    assert bonus.positions == [1, 2, 3] and bonus.tokens == [5, 1, 2]
    assert int(bonus.target.ids[2, 0]) == int(logits[2].argmax())
    plain = item_from_step(record([5, 6], [], 0, logits[:1]), "all", top_k=10)  # k = 0: the one committed position
    assert plain.positions == [2] and plain.tokens == [5, 6] and int(plain.target.ids[0, 0]) == int(logits[0].argmax())
    assert item_from_step(record([5, 6], [], 0, logits[:1]), "mismatch") is None
    cut = item_from_step(rec, "mismatch", top_k=10, max_context=3)
    assert cut.tokens == [7, 8, 1] and cut.positions == [3]


def test_buffer_fifo_capacity():
    buffer = ReplayBuffer(capacity=3)
    logits = torch.randn(2, 10)
    for i in range(5):
        buffer.add(item_from_step(record([i + 1], [9], 0, logits), "mismatch"))
    assert len(buffer) == 3 and buffer.evicted == 2
    assert [it.tokens[0] for it in buffer.snapshot()] == [3, 4, 5]


def test_triggers_fire_on_count_size_and_age():
    now = [100.0]
    buffer = ReplayBuffer(clock=lambda: now[0])
    logits = torch.randn(2, 10)
    trigger = UpdateTrigger(every_requests=3, min_positions=4, max_age_seconds=60)
    assert trigger.due(0, 0, 0.0) is None
    buffer.add(item_from_step(record([1], [9], 0, logits), "mismatch", now=now[0]))
    assert trigger.due(2, len(buffer), buffer.oldest_age()) is None
    assert trigger.due(3, len(buffer), buffer.oldest_age()) == "requests"
    assert trigger.due(0, 4, 0.0) == "size"
    now[0] += 61
    assert trigger.due(0, len(buffer), buffer.oldest_age()) == "age"


def _learner(system_target, draft, tokenizer, **cfg):
    engine, registry = make_engine(system_target, copy.deepcopy(draft), tokenizer, k=4)
    publish = lambda master, version=None: registry.publish("draft", copy.deepcopy(master).eval(), None, version)
    learner = OnlineLearner(draft, publish, LearnConfig(**cfg)).attach(engine)
    return engine, registry, learner


STREAM = [[5 + i % 7, 9 + i % 5, 20 + i % 3] for i in range(24)]


def test_alpha_rises_on_a_stream_with_online_updates(target_model, tokenizer):
    draft = tiny_qwen2(seed=1, layers=1)
    engine, registry, learner = _learner(target_model, draft, tokenizer, mode="all", every_requests=4, lr=3e-3,
                                         steps_per_update=30, trainable="all", guard=False)
    eval_items = []
    collect = lambda rec: eval_items.append(item_from_step(rec, "all", 64)) if rec.proposed else None
    engine.observers.insert(0, collect)
    sampling = SamplingConfig(max_new_tokens=24)
    for prompt in STREAM:
        result = engine.generate(prompt, sampling)
        assert result.token_ids == plain_greedy(target_model, prompt, 24, eos=EOS)  # learning never changes output
    assert learner.counters["updates_published"] >= 4 and registry.get("draft").version >= 4
    by_version = engine.metrics.snapshot()
    served = sorted(int(key.split("@v")[1]) for key in by_version)
    first, last = by_version["draft@v0"]["alpha"], by_version[f"draft@v{served[-1]}"]["alpha"]
    assert last > first + 0.1, by_version
    original = acceptance_on(tiny_qwen2(seed=1, layers=1), [i for i in eval_items if i])
    trained = acceptance_on(learner.master, [i for i in eval_items if i])
    assert trained["greedy_agreement"] > original["greedy_agreement"] + 0.1


def test_micro_batches_take_the_same_step_and_wait_for_idle_between_them(target_model, tokenizer):
    """A step split into micro-batches (background serving) equals the whole-batch step; before each micro-batch
    the learner checks that the engine is idle, so a decode waits for one item's forward/backward at most."""
    draft = tiny_qwen2(seed=1, layers=1)
    engine, _, learner = _learner(target_model, draft, tokenizer, mode="all", every_requests=0, lr=1e-2,
                                  steps_per_update=2, batch_size=4, trainable="all", guard=False)
    for prompt in STREAM[:6]:
        engine.generate(prompt, SamplingConfig(max_new_tokens=12))
    items = learner.buffer.snapshot()
    assert len(items) >= 4

    def trained(micro_batch, schedule, chunk_positions=128):
        model, busy_checks = copy.deepcopy(draft), []
        config = LearnConfig(mode="all", every_requests=0, lr=1e-2, steps_per_update=2, batch_size=4, trainable="all",
                             guard=False, micro_batch=micro_batch, schedule=schedule, chunk_positions=chunk_positions,
                             keep_unused_seconds=0.0,  # the same batches as sync (background takes unused items first)
                             precision="float32")  # (bf16's rounding would hide a wrong split's difference)
        learner = OnlineLearner(model, lambda master, version=None: SimpleNamespace(version=1), config,
                                engine_busy=lambda: busy_checks.append(1) and False)
        for it in items:
            learner.observe_item(copy.copy(it))
        assert learner.update("manual")["published"] and learner.counters["optimizer_steps"] == 2
        return list(model.parameters()), len(busy_checks)

    whole, checks = trained(0, "sync")  # sync: the whole batch in one forward/backward, no idle checks
    assert checks == 0
    assert any(not torch.equal(a, b) for a, b in zip(whole, draft.parameters()))  # it did train
    # background: micro_batch items per forward/backward, or (0) items up to chunk_positions supervised positions
    for micro_batch, chunk_positions, chunks in ((0, 1, 4), (0, 10**6, 1), (1, 10**6, 4), (3, 1, 2)):
        split, checks = trained(micro_batch, "background", chunk_positions)
        assert checks == 2 * chunks  # one idle check per micro-batch, per step
        for a, b in zip(split, whole):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # float summation order; a wrong split: ~lr


@pytest.mark.parametrize("mode", ["all", "mismatch"])
def test_guard_keeps_old_draft_when_update_hurts(target_model, tokenizer, mode):
    draft = copy.deepcopy(target_model)  # a near-perfect draft: a wild update can only hurt
    with torch.no_grad():
        draft.lm_head.weight.add_(0.05 * torch.randn(draft.lm_head.weight.shape, generator=torch.Generator().manual_seed(3)))
    engine, registry, learner = _learner(target_model, draft, tokenizer, mode=mode, every_requests=0, lr=0.5,
                                         steps_per_update=5, trainable="all", guard=True, guard_holdout=0.5)
    for prompt in STREAM[:8]:
        engine.generate(prompt, SamplingConfig(max_new_tokens=16))
    if mode == "mismatch":  # trained on rejected positions only; the guard still judges every proposed position
        assert 0 < learner.buffer.added < learner.guard_buffer.added
    before = {n: p.clone() for n, p in learner.master.named_parameters()}
    report = learner.update("manual")
    assert not report["published"] and report["rejected_because"] == "guard", report
    assert registry.get("draft").version == 0 and learner.counters["updates_rejected"] == 1
    assert all(torch.equal(before[n], p) for n, p in learner.master.named_parameters())
    states = learner.optimizer.state_dict()["state"].values()  # the rejected steps' Adam moments are gone too:
    assert states and all(float(s["step"]) == 0 and not s["exp_avg"].any() and not s["exp_avg_sq"].any()
                          for s in states)  # back to the zeros reserved at start (learn/memory.py)


def test_nonfinite_losses_are_skipped(target_model, tokenizer):
    draft = tiny_qwen2(seed=1, layers=1)
    engine, registry, learner = _learner(target_model, draft, tokenizer, mode="all", every_requests=0)
    engine.generate(STREAM[0], SamplingConfig(max_new_tokens=16))
    for item in learner.buffer.snapshot():
        item.target.probs[:] = float("nan")
    report = learner.update()
    assert not report["published"] and learner.counters["steps_skipped_nonfinite"] > 0
    assert registry.get("draft").version == 0


@pytest.mark.parametrize("trainable", ["all", "no_embeddings"])
def test_checkpoint_restart_resumes_version_and_counters(target_model, tokenizer, tmp_path, trainable):
    from safetensors import safe_open

    draft = tiny_qwen2(seed=1, layers=1)
    cfg = dict(mode="all", every_requests=2, lr=3e-3, steps_per_update=5, trainable=trainable, guard=False,
               checkpoint_dir=str(tmp_path / "ckpt"))
    engine, registry, learner = _learner(target_model, draft, tokenizer, **cfg)
    for prompt in STREAM[:6]:
        engine.generate(prompt, SamplingConfig(max_new_tokens=12))
    learner.stop()
    assert learner.version >= 2
    fresh = tiny_qwen2(seed=1, layers=1)
    engine2, registry2, learner2 = _learner(target_model, fresh, tokenizer, **cfg)
    assert learner2.resume()
    assert learner2.version == learner.version == registry2.get("draft").version
    assert learner2.counters["requests"] == 6 and learner2.counters["updates_published"] == learner.counters["updates_published"]
    assert all(torch.equal(a, b) for a, b in zip(learner.master.state_dict().values(), learner2.master.state_dict().values()))
    with safe_open(str(tmp_path / "ckpt" / "draft.safetensors"), "pt") as f:
        saved = set(f.keys())
    trainable_names = {n for n, p in learner.master.named_parameters() if p.requires_grad}
    assert saved >= trainable_names and (trainable == "all" or saved == trainable_names)  # frozen weights not copied
    weights_only = tiny_qwen2(seed=1, layers=1)  # a checkpointed draft loaded for evaluation: no optimizer
    assert load_checkpoint(str(tmp_path / "ckpt"), weights_only)["version"] == learner.version
    assert all(torch.equal(p, learner.master.get_parameter(n)) for n, p in weights_only.named_parameters())
    if trainable == "no_embeddings":  # the checkpoint holds the top layer only: another base must be refused
        other = tiny_qwen2(seed=2, layers=1)
        before = copy.deepcopy(other.state_dict())
        with pytest.raises(CheckpointMismatch, match="another base draft"):
            load_checkpoint(str(tmp_path / "ckpt"), other)
        assert all(torch.equal(before[n], t) for n, t in other.state_dict().items())  # and left untouched
        assert load_checkpoint(str(tmp_path / "ckpt"), tiny_qwen2(seed=1, layers=1).to(torch.bfloat16)) is not None
    with pytest.raises(CheckpointMismatch):  # another architecture (an extra layer the checkpoint cannot fill)
        load_checkpoint(str(tmp_path / "ckpt"), tiny_qwen2(seed=1, layers=2))


def test_checkpoint_of_a_tied_draft_trained_whole_resumes_onto_its_base(target_model, tokenizer, tmp_path):
    """Qwen2.5-0.5B ties its LM head to the embeddings; the file keeps one name of the pair, and the other is no
    base weight to check (it was trained too)."""
    draft = tiny_qwen2(seed=1, layers=1, tied=True)
    cfg = dict(mode="all", every_requests=2, lr=3e-2, steps_per_update=3, trainable="all", train_layers=0, guard=False,
               checkpoint_dir=str(tmp_path / "ckpt"))
    engine, registry, learner = _learner(target_model, draft, tokenizer, **cfg)
    for prompt in STREAM[:4]:
        engine.generate(prompt, SamplingConfig(max_new_tokens=12))
    learner.stop()
    fresh = tiny_qwen2(seed=1, layers=1, tied=True)
    assert load_checkpoint(str(tmp_path / "ckpt"), fresh)["version"] == learner.version >= 1
    assert torch.equal(fresh.model.embed_tokens.weight, learner.master.model.embed_tokens.weight)
    assert fresh.lm_head.weight.data_ptr() == fresh.model.embed_tokens.weight.data_ptr()


def test_fingerprint_indices_stay_in_range_for_large_weights():
    from osd.learn.checkpoint import spread_indices

    n = 151_936 * 896  # the 0.5B draft's embedding: past float32's exact integers
    picks = spread_indices(n, 64)
    assert picks[0] == 0 and picks[-1] == n - 1 and len(picks) == 64 and bool((picks[1:] > picks[:-1]).all())
    assert spread_indices(3, 64).tolist() == [0, 1, 2] and spread_indices(1, 64).tolist() == [0]


def test_bad_learn_config():
    from osd.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="loss"):
        LearnConfig(loss="l2")
    with pytest.raises(InvalidArgument, match="mode"):
        LearnConfig(mode="bonus")


def test_position_chunks_bound_each_chunk_and_keep_order():
    """Chunks of a background step: consecutive items, at most the bound's positions each (a larger item alone)."""
    from osd.learn.batch import position_chunks

    items = [SimpleNamespace(positions=list(range(n))) for n in (3, 4, 9, 1, 2, 2, 5)]
    chunks = position_chunks(items, 7)
    assert [[len(it.positions) for it in c] for c in chunks] == [[3, 4], [9], [1, 2, 2], [5]]
    assert [it for c in chunks for it in c] == items
    assert position_chunks([], 7) == []


def test_an_update_reuses_what_the_last_published_one_measured_on_the_same_held_out_requests(target_model, tokenizer):
    """The held-out evaluation of the serving version before an update: requests the last published update measured
    (same positions) are not evaluated again, and the reused figures are what evaluating them gives."""
    draft = tiny_qwen2(seed=1, layers=1)
    engine, _, learner = _learner(target_model, draft, tokenizer, mode="all", every_requests=0, lr=1e-3,
                                  steps_per_update=2, trainable="all", guard=True, guard_holdout=0.5, guard_z=0.0,
                                  guard_tolerance=1.0, drift_guard=False)
    for prompt in STREAM[:8]:
        engine.generate(prompt, SamplingConfig(max_new_tokens=12))
    evaluated, evaluate = [], learner._acceptance
    learner._acceptance = lambda items: evaluated.append([it.request_id for it in items]) or evaluate(items)
    first = learner.update("manual")
    assert first["published"] and len(evaluated) == 2  # before and after, on the same held-out requests
    held = set(evaluated[1])
    engine.generate(STREAM[8], SamplingConfig(max_new_tokens=12))  # one more request: the held-out set moves
    serving = copy.deepcopy(learner.master)  # the weights that serve (the first update published)
    evaluated.clear()
    second = learner.update("manual")
    now_held = set(evaluated[-1])  # the "after" evaluation covers the whole held-out set
    assert now_held & held and now_held - held
    assert set(evaluated[0]) == now_held - held  # "before": only the requests the first update did not measure
    items = [it for it in learner.guard_buffer.snapshot() if it.request_id in now_held]
    assert second["holdout_before"]["greedy_agreement"] == acceptance_on(serving, items)["greedy_agreement"]


def test_steps_of_a_request_longer_than_max_context_merge_into_one_item():
    """Past max_context the context's start moves in steps of half of it, not one token a step: consecutive steps of
    a long request keep one start, nest, and merge in the buffer (one forward for all their positions)."""
    from osd.learn.buffer import stable_cut

    assert [stable_cut(n, 8) for n in (5, 8, 9, 12, 13, 16, 17)] == [0, 0, 4, 4, 8, 8, 12]
    assert all(n - stable_cut(n, 8) <= 8 for n in range(40))
    buffer = ReplayBuffer(capacity=100)
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(0))
    context = list(range(1, 11))  # 10 tokens, max_context 8: cut 4
    for step in range(3):  # each step commits one more token (k = 0)
        buffer.add(item_from_step(record(context + [20 + i for i in range(step)], [], 0, logits[:1]), "all", 10,
                                  max_context=8))
    items = buffer.snapshot()
    assert len(items) == 1 and items[0].positions == [6, 7, 8]  # one item, three supervised positions
    assert items[0].tokens == context[4:] + [20, 21]
    assert [items[0].tokens[p - 1] for p in items[0].positions] == [10, 20, 21]  # logits index P-1 saw these last


def test_pace_backs_off_while_pooled_updates_stop_paying_and_comes_back_when_they_pay():
    from osd.learn.triggers import Pace
    pace = Pace(max_factor=8, window=2)
    assert pace.after_update(True, (5, 1)) == 1  # the window is not full yet
    assert pace.after_update(True, (1, 3)) == 1  # pooled (6, 4): z 0.63, between back_z 0 and keep_z 1: stays
    assert [pace.after_update(True, f) for f in ((2, 2), (3, 4), (0, 0))] == [2, 4, 8]  # z <= 0: doubles
    assert pace.after_update(True, (3, 0)) == 4  # pooled with (0, 0): (3, 0), z 1.73 > keep_z: halves
    assert pace.after_update(True, (9, 1)) == 2 and pace.after_update(True, (5, 1)) == 1  # halves again, down to 1
    assert pace.after_update(True, (9, 0)) == 1
    assert pace.after_update(False, None) == 2  # a rejected update doubles it
    assert pace.after_update(True, None) == 2  # published without a held-out measure: unchanged
    pace.reset()
    assert pace.factor == 1 and pace.recent == []
    fixed = Pace()  # max_factor 1: a fixed pace
    assert [fixed.after_update(False, None), fixed.after_update(True, (0, 9))] == [1, 1]
    trigger = UpdateTrigger(every_requests=3)
    assert trigger.due(11, 5, 0.0, factor=4) is None and trigger.due(12, 5, 0.0, factor=4) == "requests"


def test_learning_pays_when_the_speed_its_held_out_gain_buys_covers_its_work_over_the_horizon():
    from osd.learn.triggers import Pace, learning_pays, speed_at
    assert speed_at(0.0) == 1.0  # nothing accepted: the target alone (k = 0)
    assert 1.0 < speed_at(0.3) < speed_at(0.45) < speed_at(0.8)
    assert speed_at(0.5) == pytest.approx(max((1 - 0.5 ** (k + 1)) / 0.5 / (1 + 0.1 * k) for k in range(5)))
    assert learning_pays(0.30, 0.45, 28.0, 600.0) is True  # code's first updates: +17% speed for 28 s of work
    assert learning_pays(0.21, 0.25, 28.0, 600.0) is False  # chat's: +3%, 18 s of serving saved in 600
    assert learning_pays(0.21, 0.25, 28.0, 1200.0) is True  # ... which a longer horizon pays for
    assert learning_pays(0.50, 0.51, 28.0, 900.0) is False  # a point at 0.5: +1.4%
    assert learning_pays(0.45, 0.40, 1.0, 600.0) is False  # agreement fell
    assert learning_pays(None, 0.4, 1.0, 600.0) is None and learning_pays(0.4, None, 1.0, 600.0) is None
    from osd.learn.triggers import describe_value, learning_value
    assert describe_value(learning_value(0.30, 0.45, 28.0, 600.0)) == \
        "yes (held-out agreement 0.300 -> 0.450: +16.5% speed, 99 s saved over 600 s against 28 s of work)"
    assert describe_value(learning_value(0.21, 0.25, 28.0, 600.0)).startswith("no (") and describe_value(None) == \
        "not judged"
    assert describe_value(learning_value(0.30, 0.45, 28.0, 600.0, speculable=0.4)) == \
        "yes (held-out agreement 0.300 -> 0.450: +16.5% speed where it speculates, 0.40 of decoding: +6.6%, 40 s " \
        "saved over 600 s against 28 s of work)"
    assert learning_pays(0.30, 0.45, 28.0, 600.0, speculable=0.25) is False  # +4.1%: 25 s saved
    pace = Pace(max_factor=8, window=1)
    assert pace.after_update(True, (9, 0), pays=False) == 2  # held-out agreement rose, but not by enough to pay
    assert pace.after_update(True, (9, 0), pays=True) == 1  # it pays: held-out decides (z > keep_z: halves)
    assert pace.after_update(True, (9, 0), pays=None) == 1


def test_a_learner_judges_its_last_updates_by_their_held_out_gain_and_work_amortised_over_the_horizon():
    """The last pace.window updates' work against the speed their held-out gain buys over pace_horizon (or the
    learner's lifetime if longer): a gain of 2 points an update at 0.3 pays for 7 s an update, a third of a point does
    not; before the window is full, no judgement; a rejected update adds work and no gain."""
    from osd.learn.triggers import update_outcome

    def run(gained_each, horizon=600.0, rejected=(), live=True, speculable=None):
        now = [0.0]
        learner = OnlineLearner(tiny_qwen2(seed=1, layers=1), lambda m, version=None: SimpleNamespace(version=1, name="d"),
                                LearnConfig(guard=False, every_requests=8, back_off=8, pace_horizon=horizon),
                                clock=lambda: now[0])
        agreement = [0.30]

        def training(reason):  # 7 s of work in every 26 s of wall time, held-out agreement + gained_each
            now[0] += 26.0
            if speculable is not None:  # 19 s of it decoding, that share in passes where a sequence may propose
                learner.step_stats.decode_seconds += 19.0
                learner.step_stats.speculable_seconds += 19.0 * speculable
            published = len(judged) not in rejected
            before = {"greedy_agreement": agreement[0], "positions": 400}
            if published:
                agreement[0] += gained_each
            flips = (round(400 * gained_each) + 10, 10)
            return {"reason": reason, "train_items": 4, "published": published, "version": 1, "heldout_flips": flips,
                    "holdout_before": before, "holdout_after": {"greedy_agreement": agreement[0], "positions": 400},
                    "losses": [0.1], "work_seconds": {"train": 6.0, "publish": 1.0}}

        learner._update = training
        learner.live = live  # (attach() sets it: a learner beside a serving engine, and its scheduler's stats)
        if speculable is not None:
            learner.step_stats = SimpleNamespace(decode_seconds=0.0, speculable_seconds=0.0)
        judged = []
        for _ in range(6):
            learner.update()
            judged.append(learner.last_update["learning_pays"])
        return judged, learner.pace.factor

    assert run(0.02) == ([None, None, None, True, True, True], 1)  # +8 points in 4: ~+9% speed x 600 s >= 28 s
    assert run(0.0025) == ([None, None, None, False, False, False], 8)  # +1 point in 4: 6 s saved < 28 s
    assert run(0.0025, live=False) == ([None] * 6, 1)  # no serving engine (a fast replay): the held-out z alone
    assert run(0.0025, horizon=7200.0)[0][3:] == [True, True, True]  # +0.8% x 7200 s: 55 s saved
    # prompt chunks fill 3/4 of the decoding seconds (no proposals there): +9% where it speculates is +2% in all
    assert run(0.02, speculable=0.25) == ([None, None, None, False, False, False], 8)
    assert run(0.02, speculable=1.0) == ([None, None, None, True, True, True], 1)
    assert run(0.04, speculable=0.5)[0][3:] == [True, True, True]  # +16 points: +17% where it speculates, +8.5%
    # the last update rejected: its work counts, its gain does not (3 of 4 still pay), and the pace doubles
    assert run(0.02, rejected=(5,)) == ([None, None, None, True, True, True], 2)
    assert update_outcome({"published": False, "heldout_flips": (40, 0), "holdout_before": {"greedy_agreement": 0.3,
                           "positions": 400}, "work_seconds": {"train": 2.0}}) == \
        {"work": 2.0, "agreement": 0.3, "gained": 0.0}
    assert update_outcome({"published": True, "heldout_flips": (50, 10), "holdout_after": {"greedy_agreement": 0.4,
                           "positions": 400}, "work_seconds": {"train": 2.0, "publish": 1.0}}) == \
        {"work": 3.0, "agreement": 0.4, "gained": 0.1}
    assert update_outcome({"published": True, "heldout_flips": None, "work_seconds": {}}) == \
        {"work": 0, "agreement": None, "gained": 0.0}


def test_a_learner_whose_updates_change_nothing_spaces_them_out(target_model, tokenizer):
    """lr 1e-12: no update flips a held-out position, so once four updates pooled show no gain the interval doubles,
    up to back_off x every_requests; with back_off 1 the same stream updates at every interval."""
    def updates(back_off):
        draft = tiny_qwen2(seed=1, layers=1)
        engine, _, learner = _learner(target_model, draft, tokenizer, mode="all", every_requests=2, lr=1e-12,
                                      steps_per_update=1, trainable="all", guard=True, guard_holdout=0.5,
                                      drift_guard=False, back_off=back_off)
        for prompt in STREAM[:24] + STREAM[:6]:
            engine.generate(prompt, SamplingConfig(max_new_tokens=8))
        assert all(h["heldout_flips"] == (0, 0) for h in learner.history[:4])
        return len(learner.history), learner.stats()["update_every_requests"]

    assert updates(1) == (15, 2)
    # after requests 2, 4, 6, 8 (four pooled: x2), 12 (x4), 20 and 28 (x4: the cap)
    assert updates(4) == (7, 8)


def test_requests_that_finish_while_an_update_trains_count_toward_the_next_one():
    """Under load a background update spans ~10-20 requests; resetting the count to 0 when it ended made an update
    "every 8 requests" come every ~25 (88 steps in 300 code requests at 0.5 of capacity, where the recipe means about
    one a request). The requests seen when it started are spent; those that finished meanwhile carry over."""
    learner = OnlineLearner(tiny_qwen2(seed=1, layers=1), lambda m, version=None: SimpleNamespace(version=1),
                            LearnConfig(guard=False, every_requests=8))
    for _ in range(8):
        learner.after_request()

    def training(reason):  # three requests finish while it trains
        for _ in range(3):
            learner.after_request()
        return {"reason": reason, "items": 0, "published": False, "losses": []}

    learner._update = training
    learner.update()
    assert learner.counters["requests_since_update"] == 3 and learner.counters["requests"] == 11


def test_an_update_reports_its_work_by_phase_without_its_waits_for_a_turn(target_model, tokenizer):
    """work_seconds: each phase's wall time less the waits for a turn and the time parked in it (a clock moved only by
    the stand-ins below: held-out evaluations 2 s, a step's gradients 0.25 s, the publish 0.5 s, every wait 5 s, one
    parking 7 s); the counters and
    /metrics' osd_learner_work_seconds_<phase> add them up."""
    draft = tiny_qwen2(seed=1, layers=1)
    engine, registry, _ = _learner(target_model, copy.deepcopy(draft), tokenizer, mode="all", every_requests=0)
    now = [0.0]
    publish = lambda master, version=None: registry.publish("draft", copy.deepcopy(master).eval(), None, version)
    learner = OnlineLearner(draft, publish, LearnConfig(mode="all", every_requests=0, lr=1e-3, steps_per_update=3,
                                                        trainable="all", guard=True, guard_holdout=0.5, guard_z=9.0,
                                                        schedule="background"), clock=lambda: now[0]).attach(engine)
    for prompt in STREAM[:8]:
        engine.generate(prompt, SamplingConfig(max_new_tokens=12))

    def taking(seconds, method):
        def run(*args, **kwargs):
            now[0] += seconds
            return method(*args, **kwargs)
        return run

    real_wait = learner.idle.wait

    def wait():
        now[0] += 5.0
        learner.idle.waited_total += 5.0
        real_wait()

    learner.idle.wait = wait
    parked = []

    def park():  # parked once by pause() (the live bench pauses a learner while the other server serves): 7 s
        if not parked:
            parked.append(1)
            now[0] += 7.0
            learner.counters["parked_seconds"] += 7.0

    learner._park_while_paused = park
    learner._acceptance = taking(2.0, learner._acceptance)
    learner._accumulate_gradients = taking(0.25, learner._accumulate_gradients)
    learner._publish = taking(0.5, learner._publish)
    report = learner.update("manual")
    assert report["published"] and len(report["losses"]) == 3 and parked
    work = report["work_seconds"]
    # the serving version's held-out figures, the candidate's, the base's (the drift guard's first comparison)
    assert work == pytest.approx({"evaluate_serving": 2.0, "train": 0.75, "evaluate_candidate": 2.0,
                                  "publish": 0.5, "drift_guard": 2.0})
    assert learner.counters["work_seconds_train"] == pytest.approx(0.75)
    assert learner.stats()["work_seconds_drift_guard"] == pytest.approx(2.0)
