"""The scheduler (schedule/scheduler.py): many sequences per step, each one's output what it gets alone.

Tiny seeded torch models (a CachedModel per slot) and the tiny Q4 GGUF (Q4Slots: one pass over the weights for every
row of every sequence). The reference is always the same engine's `generate`, one request alone, so a row of one
sequence leaking into another's cache, a slot reused without its reset, a wrong pending token or a proposal verified
against another sequence's logits shows as a changed answer.
"""
from __future__ import annotations

import copy

import pytest
import torch
from conftest import EOS, require_glue, require_q4, tiny_qwen2

from osd.config import SamplingConfig, SpeculationConfig
from osd.drafts import DraftRegistry, weights_fingerprint
from osd.engine import SpeculativeEngine
from osd.errors import InvalidArgument
from osd.propose import DraftModelProposer
from osd.propose.ngram import LookupThenDraft, NgramProposer

PROMPTS = [[5, 6, 7], [10, 11, 12, 13, 14, 15], [20], [3, 4, 3, 4, 3, 4, 3], [30, 31, 32, 33] * 5, [8, 9]]
NEW_TOKENS = [24, 9, 30, 16, 12, 20]


def engine_over(target, draft, k=4, adaptive=False, max_batch=4, lookup=False, prefill_rows=64, vocab=None):
    registry = DraftRegistry()
    registry.publish("draft", draft)
    vocab = vocab or target.config.vocab_size
    proposer = DraftModelProposer(registry, "draft", vocab) if draft is not None else None
    if lookup:
        proposer = LookupThenDraft(NgramProposer(vocab), proposer)
    spec = SpeculationConfig(k=k, adaptive=adaptive, max_batch=max_batch, prefill_rows=prefill_rows)
    return SpeculativeEngine(target, _Tok(), proposer, spec), registry


class _Tok:
    eos_token_id = EOS

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


def run_batched(engine, prompts, sampling, join_every=2):
    """Admit the prompts in order, one more every `join_every` steps while there is room; step until all are done.
    -> (request index -> result, the largest number of sequences that shared a step)."""
    sched, pending, results, by_seq, most, steps = engine.scheduler, list(enumerate(prompts)), {}, {}, 0, 0
    while pending or sched.running:
        if pending and len(sched.running) < sched.capacity and steps % join_every == 0:
            i, prompt = pending.pop(0)
            by_seq[id(sched.add(prompt, sampling[i]))] = i
        most = max(most, len(sched.running))
        for seq in sched.step():
            assert seq.error is None, seq.error
            results[by_seq[id(seq)]] = seq.result
        steps += 1
    return results, most


def alone(engine, prompts, sampling):
    return [engine.generate(p, s) for p, s in zip(prompts, sampling)]


@pytest.fixture(scope="module")
def target():
    return tiny_qwen2(seed=0)


@pytest.fixture(scope="module")
def draft():
    return tiny_qwen2(seed=1)


GREEDY = [SamplingConfig(max_new_tokens=n) for n in NEW_TOKENS]


@pytest.mark.parametrize("k, lookup", [(0, False), (3, False), (5, True)])
def test_batched_greedy_equals_each_request_alone_with_joins_and_leaves(target, draft, k, lookup):
    engine, _ = engine_over(target, draft, k=k, lookup=lookup)
    want = [r.token_ids for r in alone(engine, PROMPTS, GREEDY)]
    got, most = run_batched(engine, PROMPTS, GREEDY)
    assert most == engine.scheduler.capacity == 4  # sequences really shared steps
    assert [got[i].token_ids for i in range(len(PROMPTS))] == want


def test_adaptive_batched_greedy_equals_alone(target, draft):
    """The goodput allocation picks other k than the single-request policy: output stays the same."""
    engine, _ = engine_over(target, draft, k=5, adaptive=True)
    engine.calibrate(context_len=16, repeats=1)
    want = [r.token_ids for r in alone(engine, PROMPTS, GREEDY)]
    got, _ = run_batched(engine, PROMPTS, GREEDY, join_every=1)
    assert [got[i].token_ids for i in range(len(PROMPTS))] == want


def test_sampled_output_in_a_batch_is_the_one_the_request_samples_alone(target, draft):
    """Sampling (seeded, fixed k): each sequence's acceptance draws from its own generator over its own logits, so a
    request's sampled tokens in a batch are exactly those it samples alone: its law is the lossless one that
    tests/verify/test_lossless_sampling.py checks for a request alone, whatever shares its steps."""
    engine, _ = engine_over(target, draft, k=3)
    sampling = [SamplingConfig(temperature=t, top_k=tk, top_p=tp, max_new_tokens=n, seed=i)
                for i, (t, tk, tp, n) in enumerate([(1.0, 0, 1.0, 20), (0.7, 5, 1.0, 14), (1.3, 0, 0.8, 25),
                                                     (0.0, 0, 1.0, 10), (1.0, 0, 1.0, 18), (0.9, 3, 0.9, 12)])]
    want = [r.token_ids for r in alone(engine, PROMPTS, sampling)]
    got, _ = run_batched(engine, PROMPTS, sampling, join_every=1)
    assert [got[i].token_ids for i in range(len(PROMPTS))] == want
    assert len({tuple(w) for w in want}) == len(want)


def test_a_cancelled_sequence_leaves_the_others_unchanged(target, draft):
    engine, _ = engine_over(target, draft, k=3, max_batch=3)
    want = alone(engine, PROMPTS[:3], GREEDY[:3])
    sched = engine.scheduler
    seqs = [sched.add(p, s) for p, s in zip(PROMPTS[:3], GREEDY[:3])]
    sched.step(), sched.step()
    sched.cancel(seqs[1])
    assert seqs[1] not in sched.running and len(sched._free) == 1
    done = {}
    while sched.running:
        done.update({id(s): s for s in sched.step()})
    assert [done[id(seqs[i])].result.token_ids for i in (0, 2)] == [want[0].token_ids, want[2].token_ids]


@pytest.mark.parametrize("k", [0, 3])
def test_a_request_admitted_beside_others_feeds_the_draft_its_prompt_only_when_first_asked_to_propose(target, draft, k):
    """Alone, the draft's prompt prefill is part of the request's prefill; beside others (under load often k = 0) it
    waits for the first proposal, which feeds whatever the draft's cache lacks: a request never asked to propose
    (k = 0 here) never runs the draft, and answers stay those of each request alone."""
    order = [1, 3, 4]
    want = alone(engine_over(target, draft, k=k, max_batch=3)[0], [PROMPTS[i] for i in order],
                 [GREEDY[i] for i in order])  # another engine: none of this one's draft caches holds these prompts
    engine, _ = engine_over(target, draft, k=k, max_batch=3)
    sched = engine.scheduler
    first = sched.add(PROMPTS[1], GREEDY[1])
    assert first.proposer.runner.length == len(PROMPTS[1]) - 1  # alone: prefilled at admission
    later = [sched.add(PROMPTS[i], GREEDY[i]) for i in order[1:]]
    assert [s.proposer.runner.length for s in later] == [0, 0]
    # what a first proposal would feed before its one-token forward (the allocation charges it: goodput.py)
    assert [s.proposer.lag(s.tokens) for s in [first] + later] == [0] + [len(PROMPTS[i]) - 1 for i in order[1:]]
    done = {}
    while sched.running:
        done.update({id(s): s for s in sched.step()})
    assert [done[id(s)].result.token_ids for s in [first] + later] == [w.token_ids for w in want]
    if k == 0:
        assert [s.proposer.runner.length for s in later] == [0, 0]
    else:  # caught up at the first proposal, then fed as usual
        assert all(s.proposer.runner.length >= len(s.prompt) for s in later)


def test_a_failed_shared_pass_fails_every_running_sequence_and_the_scheduler_serves_on(target, draft, monkeypatch):
    """The shared target pass fails in a step where one sequence's own proposal failed too: every sequence comes back
    from that step with its error (its own, or the pass's; none left running without one), every slot is free again,
    and the next requests get the answers they get alone."""
    engine, _ = engine_over(target, draft, k=3, max_batch=4)
    want = alone(engine, PROMPTS[:4], GREEDY[:4])
    sched = engine.scheduler
    seqs = [sched.add(p, s) for p, s in zip(PROMPTS[:4], GREEDY[:4])]
    sched.step()
    assert len(sched.running) == 4
    fault, own = RuntimeError("the shared pass failed"), RuntimeError("this draft failed")
    with monkeypatch.context() as m:
        m.setattr(sched.slots, "feed", lambda feeds: (_ for _ in ()).throw(fault))
        m.setattr(sched, "_draft_together", lambda wanted: {})  # each sequence drafts alone: its own failure is its own
        m.setattr(seqs[0].sources[0], "propose", lambda *a, **k: (_ for _ in ()).throw(own))
        done = sched.step()
    assert sorted(map(id, done)) == sorted(map(id, seqs))
    assert seqs[0].error is own and all(seq.error is fault for seq in seqs[1:])
    assert all(seq.result is None for seq in seqs)
    assert not sched.running and sorted(sched._free) == [0, 1, 2, 3]
    again = [sched.add(p, s) for p, s in zip(PROMPTS[:4], GREEDY[:4])]
    while sched.running:
        sched.step()
    assert [seq.result.token_ids for seq in again] == [r.token_ids for r in want]


def test_a_bad_request_fails_alone(target, draft):
    engine, _ = engine_over(target, draft, k=3, max_batch=3)
    want = alone(engine, PROMPTS[:2], GREEDY[:2])
    sched = engine.scheduler
    good = sched.add(PROMPTS[0], GREEDY[0])
    with pytest.raises(InvalidArgument):
        sched.add([5, 10_000], GREEDY[1])  # a token outside the vocabulary: refused at admission, nothing taken
    assert len(sched._free) == 2

    def broken(text):
        raise RuntimeError("the client callback failed")

    bad = sched.add(PROMPTS[2], GREEDY[2], on_text=broken)
    other = sched.add(PROMPTS[1], GREEDY[1])
    finished = []
    while sched.running:
        finished += sched.step()
    assert bad.error is not None and "callback failed" in str(bad.error) and bad.result is None
    assert good.result.token_ids == want[0].token_ids and other.result.token_ids == want[1].token_ids
    assert len(sched._free) == 3


def test_greedy_in_a_batch_on_the_q4_kernel_equals_alone(tiny_q4):
    from tests.models.tiny_gguf import PROMPT, tiny_torch_model

    runner, vocab = tiny_q4
    engine, _ = engine_over(runner, tiny_torch_model(3), k=4, max_batch=4, lookup=True, vocab=vocab,
                            prefill_rows=8)  # small prefill chunks: prompts are fed across steps, beside decoding
    prompts = [PROMPT, PROMPT[:7], PROMPT[3:] + [33, 10], [10], PROMPT[::-1], PROMPT[5:12] * 3]
    sampling = [SamplingConfig(max_new_tokens=n) for n in (12, 5, 20, 9, 15, 7)]
    want = [r.token_ids for r in alone(engine, prompts, sampling)]
    got, most = run_batched(engine, prompts, sampling, join_every=1)
    assert most == 4 and engine.scheduler.stats.prefill_rows > 0
    assert [got[i].token_ids for i in range(len(prompts))] == want


def test_chunked_prefill_beside_decoding_gives_the_logits_of_a_whole_prefill(tiny_q4):
    """Q4Slots: a prompt fed in chunks in the same passes as another slot's decode rows leaves bitwise the cache
    (and so the logits) that feeding it whole leaves."""
    from osd.models.slots import Feed, Q4Slots
    from tests.models.tiny_gguf import PROMPT

    runner, _ = tiny_q4
    slots = Q4Slots(runner, 3)
    prompt = PROMPT + PROMPT[::-1]
    whole = slots.feed([Feed(1, prompt, 1)])[0]
    slots.reset(1)
    slots.feed([Feed(2, PROMPT[:5], 1)])
    for start in range(0, len(prompt) - 1, 5):
        chunk = prompt[start : min(start + 5, len(prompt) - 1)]
        slots.feed([Feed(2, [PROMPT[5 + start % 7]], 1), Feed(1, chunk, 0)])
    chunked = slots.feed([Feed(1, prompt[-1:], 1)])[0]
    assert torch.equal(whole, chunked)




from tests.models.tiny_gguf import tiny, tiny_q4  # noqa: E402,F401  (fixtures)


def test_each_request_sees_one_draft_version_while_the_draft_is_swapped_between_steps(target, draft):
    """A new draft version published in the middle of a batch: sequences admitted before keep the snapshot they
    began with (every step of a request shows one weights fingerprint), sequences admitted after use the new one."""
    engine, registry = engine_over(target, draft, k=3, max_batch=3)
    records = []
    engine.observers.append(records.append)
    sched = engine.scheduler
    first = [sched.add(p, s) for p, s in zip(PROMPTS[:2], GREEDY[:2])]
    sched.step()
    newer = copy.deepcopy(draft)
    with torch.no_grad():
        for p in newer.parameters():
            p.add_(0.01)
    registry.publish("draft", newer)  # between steps, while two requests run
    late = sched.add(PROMPTS[2], GREEDY[2])
    while sched.running:
        sched.step()
    by_request = {}
    for r in records:
        if r.draft_weights:
            by_request.setdefault(r.request_id, set()).add(r.draft_weights)
    for seq in first:
        assert by_request[seq.request_id] == {f"draft@v{seq.draft[1]}:{weights_fingerprint(draft)}"}
    assert late.draft[1] == first[0].draft[1] + 1
    assert by_request[late.request_id] == {f"draft@v{late.draft[1]}:{weights_fingerprint(newer)}"}


def _sequential(engine, prompts, sampling):
    """Each request alone through the engine's scheduler, one after another (slots keep what they cached)."""
    out = []
    for p, s in zip(prompts, sampling):
        seq = engine.scheduler.add(p, s)
        while seq.result is None:
            engine.scheduler.step()
        out.append(seq.result.token_ids)
    return out


SHARED = [7, 8, 9, 10, 11, 12, 13]  # a common head, as a chat template's system prompt gives every request
PREFIXED = [SHARED + [20, 21], SHARED + [22], SHARED[:4] + [30, 31, 32], SHARED + [20, 21, 25], SHARED]


def test_a_slot_reuses_the_cached_prefix_of_the_previous_request_and_answers_stay_the_same(target, draft):
    fresh, _ = engine_over(target, draft, k=3, max_batch=1)  # one slot, the runner's own: never reused
    want = [r.token_ids for r in alone(fresh, PREFIXED, GREEDY)]
    assert fresh.scheduler.stats.reused_rows == 0
    engine, _ = engine_over(target, draft, k=3, max_batch=2)
    assert _sequential(engine, PREFIXED, GREEDY) == want
    assert engine.scheduler.stats.reused_rows >= 3 * len(SHARED) - 3
    got, _ = run_batched(engine, PREFIXED, GREEDY, join_every=1)  # and in a batch
    assert [got[i].token_ids for i in range(len(PREFIXED))] == want


def test_prefix_reuse_on_the_q4_kernel_is_bitwise_a_fresh_prefill(tiny_q4):
    from tests.models.tiny_gguf import PROMPT, tiny_torch_model

    runner, vocab = tiny_q4
    prompts = [PROMPT, PROMPT[:12] + [33, 10], PROMPT + [10, 10], PROMPT[:5]]
    sampling = [SamplingConfig(max_new_tokens=n) for n in (10, 12, 8, 9)]
    fresh, _ = engine_over(runner, tiny_torch_model(3), k=4, max_batch=1, vocab=vocab)
    want = [r.token_ids for r in alone(fresh, prompts, sampling)]
    engine, _ = engine_over(runner, tiny_torch_model(3), k=4, max_batch=2, vocab=vocab)
    assert _sequential(engine, prompts, sampling) == want
    assert engine.scheduler.stats.reused_rows >= 12 + 12 + 4  # PROMPT[:12] twice, PROMPT[:4] once


def test_a_prompt_sharing_a_prefix_with_a_running_request_copies_its_keys_and_values(tiny_q4):
    """A request whose prompt starts like one still running (no free slot holds it) gets that prefix's keys/values
    copied from the running sequence's slot (Q4Slots.copy_prefix), not fed again; both answers stay bitwise those
    of each request alone, the running one's included."""
    from tests.models.tiny_gguf import PROMPT, tiny_torch_model

    runner, vocab = tiny_q4
    prompts = [PROMPT + [10, 10], PROMPT[:12] + [33, 10]]
    sampling = [SamplingConfig(max_new_tokens=n) for n in (14, 10)]
    fresh, _ = engine_over(runner, tiny_torch_model(3), k=4, max_batch=1, vocab=vocab)
    want = [r.token_ids for r in alone(fresh, prompts, sampling)]
    engine, _ = engine_over(runner, tiny_torch_model(3), k=4, max_batch=2, vocab=vocab)
    sched = engine.scheduler
    first = sched.add(prompts[0], sampling[0])
    for _ in range(3):
        sched.step()
    assert sched.running == [first]
    second = sched.add(prompts[1], sampling[1])
    common = next(i for i, (a, b) in enumerate(zip(prompts[0], prompts[1][:-1] + [-1])) if a != b)  # 12 or more
    assert common >= 12 and sched.stats.reused_rows == common and sched.slots.length(second.slot) == common
    while sched.running:
        sched.step()
    assert [first.result.token_ids, second.result.token_ids] == want


def test_a_prompt_sharing_more_than_a_running_prompt_has_fed_yet_is_admitted_and_copies_what_is_fed(tiny_q4):
    """Chunked prefill: a request arrives while a running sequence's prompt is only partly fed, and shares more of that
    prompt than is fed. It is admitted (a valid request, never refused): it copies the positions that sequence's cache
    holds, no more, and every answer stays the one the request gets alone."""
    from tests.models.tiny_gguf import PROMPT, tiny_torch_model

    runner, vocab = tiny_q4
    long = PROMPT + PROMPT[::-1] + [10, 20, 30]  # 45 tokens: fed beside a decoding sequence in chunks of 16
    prompts = [[10], long, long[:32] + [33, 10]]
    sampling = [SamplingConfig(max_new_tokens=n) for n in (30, 6, 8)]
    fresh, _ = engine_over(runner, tiny_torch_model(3), k=4, max_batch=1, vocab=vocab)
    want = [r.token_ids for r in alone(fresh, prompts, sampling)]
    engine, _ = engine_over(runner, tiny_torch_model(3), k=4, max_batch=3, vocab=vocab, prefill_rows=8)
    sched = engine.scheduler
    decoding = sched.add(prompts[0], sampling[0])
    sched.step()
    feeding = sched.add(prompts[1], sampling[1])
    sched.step()
    fed = sched.slots.length(feeding.slot)
    assert 0 < fed < 32 and feeding in sched.running, "the long prompt must be partly fed when the third arrives"
    late = sched.add(prompts[2], sampling[2])  # shares 32 tokens with `feeding`, whose cache holds `fed` of them
    assert sched.slots.length(late.slot) == fed and sched.stats.reused_rows == fed
    while sched.running:
        for seq in sched.step():
            assert seq.error is None, seq.error
    assert [decoding.result.token_ids, feeding.result.token_ids, late.result.token_ids] == want


def test_a_prompt_sharing_only_the_template_head_does_not_overwrite_a_longer_cached_prefix(tiny_q4):
    """Three requests one after another with three slots: the second shares only a 2-token head with the first, the
    third shares 12 or more with the first. The second takes an empty slot (the head copied), so the first's prefix
    is still cached when the third arrives (reused: 2 + those rows; taking the first's slot in place, the head being
    the longest match, gave 2 + 2). Every answer stays the one it gets alone."""
    from tests.models.tiny_gguf import PROMPT, tiny_torch_model

    runner, vocab = tiny_q4
    prompts = [PROMPT + [10, 10], PROMPT[:2] + [33, 34, 35], PROMPT[:12] + [33, 10]]
    sampling = [SamplingConfig(max_new_tokens=n) for n in (8, 6, 7)]
    fresh, _ = engine_over(runner, tiny_torch_model(3), k=4, max_batch=1, vocab=vocab)
    want = [r.token_ids for r in alone(fresh, prompts, sampling)]
    engine, _ = engine_over(runner, tiny_torch_model(3), k=4, max_batch=3, vocab=vocab)
    assert _sequential(engine, prompts, sampling) == want
    shared = next(i for i, (a, b) in enumerate(zip(prompts[0], prompts[2][:-1] + [-1])) if a != b)  # 12 or more
    assert shared >= 12 and engine.scheduler.stats.reused_rows == 2 + shared


def test_a_request_that_fails_after_a_prefix_copy_leaves_no_stale_prefix_behind(tiny_q4):
    """A request whose admission fails after its slot got a running request's prefix copied in: the slot goes back
    free as holding that prefix only, so a later request matching what the slot held before is fed again, not
    answered from the copied keys/values (its answer stays the one it gets alone)."""
    from tests.models.tiny_gguf import PROMPT, tiny_torch_model

    runner, vocab = tiny_q4
    old, running, failing = [7, 8, 9, 10, 11, 12, 13, 14, 15], PROMPT + [10, 10], PROMPT[:12] + [33, 10]
    later = old + [20, 21]
    sampling = SamplingConfig(max_new_tokens=6)
    fresh, _ = engine_over(runner, tiny_torch_model(3), k=4, max_batch=1, vocab=vocab)
    want = alone(fresh, [later], [sampling])[0].token_ids
    engine, _ = engine_over(runner, tiny_torch_model(3), k=4, max_batch=2, vocab=vocab)
    sched = engine.scheduler
    first = sched.add(old, sampling)
    while sched.running:
        sched.step()
    sched.add(running, SamplingConfig(max_new_tokens=30))
    sched.step()
    proposer = sched._proposers[first.slot]
    begin = proposer.begin
    proposer.begin = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("draft unavailable"))
    with pytest.raises(RuntimeError):
        sched.add(failing, sampling)  # takes first's slot (the only free one) and copies running's prefix into it
    proposer.begin = begin
    assert sched._free == [first.slot]
    seq = sched.add(later, sampling)
    assert seq.slot == first.slot
    while sched.running:
        sched.step()
    assert seq.result.token_ids == want


def test_copy_prefix_refuses_what_it_cannot_copy(tiny_q4):
    from osd.models.slots import Feed, Q4Slots

    slots = Q4Slots(tiny_q4[0], 3)
    slots.feed([Feed(0, [5, 6, 7, 8], 1)])
    slots.copy_prefix(0, 1, 3)
    assert slots.length(1) == 3 and slots.length(0) == 4
    for source, slot, n in ((0, 0, 2), (0, 2, 5), (0, 2, -1)):
        with pytest.raises(InvalidArgument):
            slots.copy_prefix(source, slot, n)


def test_the_goodput_costs_learn_only_from_steps_of_decoding_rows(target, draft):
    """A proposal is a decoding row (with its logits); a step that also feeds prompt rows is cheaper per row and would
    make proposals look cheap, so only steps of decoding rows alone feed the allocation's costs."""
    engine, _ = engine_over(target, draft, k=3, adaptive=True, max_batch=3, prefill_rows=4)
    seen = []
    engine.row_costs.observe = lambda rows, seconds, contexts: seen.append(rows)
    sched, stats = engine.scheduler, engine.scheduler.stats
    prompts = [list(range(3, 3 + n)) for n in (9, 14, 6, 11)]
    pending, mixed, pure = list(prompts), 0, 0
    while pending or sched.running:
        if pending and len(sched.running) < sched.capacity:
            sched.add(pending.pop(0), SamplingConfig(max_new_tokens=8))
        before, prefill_before, decode_before = len(seen), stats.prefill_rows, stats.decode_rows
        for seq in sched.step():
            assert seq.error is None, seq.error
        if stats.prefill_rows > prefill_before and stats.decode_rows > decode_before:  # this step mixed both
            mixed += 1
            assert len(seen) == before  # prompt rows in the step: not observed
        elif len(seen) > before:
            pure += 1
            assert seen[-1] == stats.last_rows
    assert mixed > 0 and pure > 0


def test_the_first_of_prompts_arriving_together_gets_its_first_token_without_waiting_for_the_others(target, draft):
    """No sequence decoding: the oldest prompt is fed alone, and short ones share its pass only up to prefill_rows
    rows; so the oldest request's first token comes before a long second prompt is fed (TTFT), and short prompts
    still go in one pass. Answers stay those of each request alone."""
    engine, _ = engine_over(target, draft, k=3, max_batch=3, prefill_rows=8)
    sched = engine.scheduler
    long_prompts = [list(range(3, 23)), list(range(20, 45))]
    first, second = (sched.add(p, SamplingConfig(max_new_tokens=6)) for p in long_prompts)
    sched.step()
    assert sched.slots.length(first.slot) == first.prefill_target and sched.slots.length(second.slot) == 0
    sched.step()
    assert len(first.stopper.token_ids) >= 1 and sched.slots.length(second.slot) < second.prefill_target
    while sched.running:
        sched.step()
    want = alone(engine, long_prompts, [SamplingConfig(max_new_tokens=6)] * 2)
    assert [first.result.token_ids, second.result.token_ids] == [w.token_ids for w in want]
    short = [sched.add(p, SamplingConfig(max_new_tokens=2)) for p in ([5, 6, 7], [8, 9])]
    sched.step()
    assert [sched.slots.length(s.slot) for s in short] == [s.prefill_target for s in short]


def test_a_prompt_beside_more_decode_rows_than_prefill_rows_still_advances_every_step(target, draft):
    """prefill_rows = 4 and three sequences decoding k = 3 (12 decode rows a step): the new prompt is still fed
    MIN_PREFILL_ROWS rows each step (never starved by the decode rows), and its answer is the one it gets alone."""
    from osd.schedule.scheduler import MIN_PREFILL_ROWS

    engine, _ = engine_over(target, draft, k=3, max_batch=4, prefill_rows=4)
    sched = engine.scheduler
    for p in ([5, 6, 7], [8, 9, 10], [11, 12, 13]):
        sched.add(p, SamplingConfig(max_new_tokens=40))
    for _ in range(3):
        sched.step()
    prompt = [int(t) for t in (torch.arange(2 * MIN_PREFILL_ROWS + 5) % 40 + 3)]
    late = sched.add(prompt, SamplingConfig(max_new_tokens=4))
    fed = []
    for _ in range(8):  # bounded: a starved prompt would never finish its prefill
        if sched.slots.length(late.slot) >= late.prefill_target:
            break
        decoding = sum(1 for s in sched.running if s is not late)
        before = sched.slots.length(late.slot)
        sched.step()
        fed.append(sched.slots.length(late.slot) - before)
        assert decoding == 3  # the others were still decoding beside it
    assert sched.slots.length(late.slot) == late.prefill_target and fed
    assert all(n >= min(MIN_PREFILL_ROWS, late.prefill_target - sum(fed[:i])) for i, n in enumerate(fed))
    while sched.running:
        sched.step()
    assert late.result.token_ids == alone(engine, [prompt], [SamplingConfig(max_new_tokens=4)])[0].token_ids


class _Flat:
    """Row costs where a pass costs the same however many rows: every proposal pays (the allocation proposes)."""

    def observe(self, rows, seconds, contexts):
        pass

    def at(self, contexts):
        return self

    def __call__(self, rows):
        return 1.0


def test_the_allocation_charges_a_lagging_draft_its_catch_up(target, draft):
    """A request admitted beside another has no draft prefill: its draft lags by its prompt. Where the catch-up feed
    is dear even shared over the steps the request has left, only the sequence whose draft is in step proposes;
    where it is free, or dear for one step (a whole pass a token) but cheap shared over them, both do."""
    for t_catch_up, second_proposes in ((100.0, False), (0.0, True), (0.05, True)):
        engine, _ = engine_over(target, draft, k=3, adaptive=True, max_batch=2)
        engine.row_costs = _Flat()
        for policy in engine.policies:  # a draft that costs forwards (not asked before the allocation), but cheap
            policy.t_draft, policy.t_catch_up = 1e-3, t_catch_up
        sched = engine.scheduler
        first = sched.add(PROMPTS[1], SamplingConfig(max_new_tokens=12))  # alone: prefilled at admission
        second = sched.add(PROMPTS[4], SamplingConfig(max_new_tokens=12))  # beside it: not prefilled
        while len(sched.running) == 2:  # with company (alone, a sequence follows the single-request policy)
            for seq in sched.step():
                assert seq.error is None, seq.error
        assert any(k for k, _ in first.steps)
        assert any(k for k, _ in second.steps) == second_proposes, t_catch_up


def test_with_company_no_sequence_proposes_in_a_step_that_feeds_prompt_rows(target, draft):
    """Beside prompt rows a step is compute-bound: a proposal row would take a prompt row's place for less than a
    row's worth, so an adaptive batch proposes only in steps of decoding rows alone (while proposals cost nothing,
    there it does). Fixed k (adaptive off) still proposes at its cap in every step. The stats count each step's
    seconds as decoding, and as speculable where a sequence may propose (what the learner's pace reads)."""
    for adaptive in (True, False):
        engine, _ = engine_over(target, draft, k=3, adaptive=adaptive, max_batch=3, prefill_rows=4)
        engine.row_costs = _Flat()
        for policy in engine.policies:
            policy.t_draft = 1e-9  # the draft timed as free: nothing but the rule keeps a proposal out
        sched, stats = engine.scheduler, engine.scheduler.stats
        pending = [list(range(3, 3 + n)) for n in (9, 14, 6, 11)]
        beside_prompts, alone_decoding = [], []
        while pending or sched.running:
            if pending and len(sched.running) < sched.capacity:
                sched.add(pending.pop(0), SamplingConfig(max_new_tokens=10))
            before = (stats.proposed, stats.prefill_rows, stats.decode_rows)
            seconds_before = (stats.decode_seconds, stats.speculable_seconds, stats.seconds)
            company = len(sched.running) > 1
            for seq in sched.step():
                assert seq.error is None, seq.error
            proposed = stats.proposed - before[0]
            decoding, speculable, step = (now - then for now, then in zip(
                (stats.decode_seconds, stats.speculable_seconds, stats.seconds), seconds_before))
            assert decoding == (step if stats.decode_rows > before[2] else 0.0)
            if company and stats.prefill_rows > before[1] and stats.decode_rows > before[2]:
                beside_prompts.append(proposed)
                assert speculable == (0.0 if adaptive else decoding)
            elif company and stats.decode_rows > before[2]:
                alone_decoding.append(proposed)
                assert speculable == decoding > 0
        assert beside_prompts and alone_decoding
        if adaptive:
            assert sum(beside_prompts) == 0 and sum(alone_decoding) > 0
            assert 0 < stats.speculable_seconds < stats.decode_seconds
        else:
            assert sum(beside_prompts) > 0


class _Proportional:
    """Row costs where every row costs the same: a proposal never pays (the allocation keeps k = 0)."""

    def observe(self, rows, seconds, contexts):
        pass

    def at(self, contexts):
        return self

    def __call__(self, rows):
        return float(rows)


def test_with_company_the_batch_probes_about_once_in_probe_every_steps(target, draft):
    """Where speculation does not pay, sequences held at k = 0 still probe now and then (evidence for a better draft),
    but the batch as a whole about once in PROBE_EVERY steps: a probe row beside many decoding rows can cost a whole
    further pass over the weights."""
    from osd.schedule.scheduler import PROBE_EVERY

    engine, _ = engine_over(target, draft, k=3, adaptive=True, max_batch=4, prefill_rows=64)
    engine.row_costs = _Proportional()
    sched = engine.scheduler
    seqs = [sched.add(list(range(3 + i, 9 + i)), SamplingConfig(max_new_tokens=120)) for i in range(4)]
    steps = 0
    while sched.running:
        for seq in sched.step():
            assert seq.error is None, seq.error
        steps += 1
    probes = sum(1 for seq in seqs for k, _ in seq.steps if k)
    assert 1 <= probes <= steps // PROBE_EVERY + 1  # each sequence probing every PROBE_EVERY steps: ~4x as many


def test_target_only_k0_has_no_proposer_and_never_runs_the_draft(tmp_path):
    """`osd serve --k 0` (the target-only arm): the engine gets no proposer, so admission feeds no draft prefill and
    no step runs a draft forward; by default the draft is not even loaded (nor its copies timed). Asked for (a learner
    needs its master: `osd serve --k 0 --learn`), it is loaded and still never runs. With k > 0 the draft runs."""
    from osd_bench.tiny_pair import write_tiny_pair
    from osd.build import build_system
    from osd.config import ModelConfig, SpeculationConfig

    target, draft = write_tiny_pair(tmp_path)
    models = ModelConfig(target=target, draft=draft, target_backend="torch", draft_quantize="none")
    reference = None
    for k, lookup, with_draft in ((0, False, None), (0, True, None), (0, False, True), (0, True, True), (3, True, None)):
        system = build_system(models, SpeculationConfig(k=k, lookup=lookup), with_draft=with_draft)
        calls = []
        if k == 0 and with_draft is None:
            assert system.draft_master is None and system.registry.names() == [] and system.draft_copy_seconds is None
        else:
            serving = system.registry.get("default").model
            serving.register_forward_pre_hook(lambda module, args: calls.append(1))
        result = system.engine.generate([5, 9, 20, 7], SamplingConfig(max_new_tokens=8))
        assert len(result.token_ids) == 8
        reference = reference or result.token_ids
        assert result.token_ids == reference  # greedy: the same answer with or without a draft
        if k == 0:
            assert system.engine.proposer is None and calls == [] and system.engine.k_max == 0
        else:
            assert calls  # the same hook sees the draft's forwards when it serves


def _glue_serving_draft(copy: str = "int8"):
    """A serving copy of a tiny Qwen2 draft (head dim 16) on a compiled runner: int8 on the glue runner, or q4 on the
    Q4 kernel (models/q4_draft.py)."""
    from osd.models.glue_draft import qualifies
    from osd.models.serving_draft import make_serving_draft

    require_glue()
    if copy == "q4":
        require_q4()
    serving, _ = make_serving_draft(tiny_qwen2(seed=1, hidden=64), copy)
    assert copy == "q4" or qualifies(serving) is None
    return serving


@pytest.mark.parametrize("temperature, copy", [(0.0, "int8"), (0.8, "int8"), (0.0, "q4"), (0.8, "q4")])
def test_several_sequences_draft_in_one_forward_and_each_answer_is_the_one_it_gets_alone(target, compiled, monkeypatch,
                                                                                         temperature, copy):
    """A draft on a compiled runner (the int8 copy's glue runner, the Q4 copy's Q4 runner): the scheduler runs the
    draft forwards of every sequence that proposes as one (`propose_together`), and every answer, greedy or sampled
    with its own seed, is the one it gets alone."""
    from osd.propose import draft_model
    from osd.schedule import scheduler as scheduler_module

    serving = _glue_serving_draft(copy)
    rows = []  # rows of each joint draft forward
    name = "q4_feed_together" if copy == "q4" else "feed_together"  # the joint forward propose_together calls
    real_feed = getattr(draft_model, name)
    monkeypatch.setattr(draft_model, name, lambda runners, feeds: rows.append(len(runners)) or real_feed(runners, feeds))
    sampling = [SamplingConfig(max_new_tokens=n, temperature=temperature, seed=i) for i, n in enumerate(NEW_TOKENS)]
    fresh, _ = engine_over(target, serving, k=3, max_batch=1)
    want = [r.token_ids for r in alone(fresh, PROMPTS, sampling)]
    engine, _ = engine_over(target, serving, k=3, max_batch=4)
    joint = []
    real = scheduler_module.propose_together
    monkeypatch.setattr(scheduler_module, "propose_together",
                        lambda proposers, *a: joint.append(len(proposers)) or real(proposers, *a))
    got, most = run_batched(engine, PROMPTS, sampling)
    assert [got[i].token_ids for i in range(len(PROMPTS))] == want
    assert most >= 3 and max(joint) >= 3 and max(rows) >= 3  # several sequences' drafts did run as one forward


def test_a_failed_joint_draft_forward_leaves_every_sequence_drafting_alone_with_its_cache_as_before(target, compiled,
                                                                                                    monkeypatch):
    """The joint draft forward fails after it has fed every sequence's pending tokens: the scheduler rolls each draft
    cache back and each sequence drafts alone, so every answer is still the one it gets alone (without the rollback
    a draft cache would hold tokens that were never committed, and its proposals would come from a wrong context)."""
    from osd.models.glue_draft import feed_together
    from osd.schedule import scheduler as scheduler_module

    serving = _glue_serving_draft()
    sampling = [SamplingConfig(max_new_tokens=n, temperature=0.8, seed=i) for i, n in enumerate(NEW_TOKENS)]
    fresh, _ = engine_over(target, serving, k=3, max_batch=1)
    want = [r.token_ids for r in alone(fresh, PROMPTS, sampling)]
    engine, _ = engine_over(target, serving, k=3, max_batch=4)
    failures = []

    def failing(proposers, tokens, *rest):
        feed_together([p.runner for p in proposers], [t[p.runner.length:] for p, t in zip(proposers, tokens)])
        failures.append(len(proposers))
        raise RuntimeError("joint draft forward failed")

    monkeypatch.setattr(scheduler_module, "propose_together", failing)
    got, _ = run_batched(engine, PROMPTS, sampling)
    assert failures and [got[i].token_ids for i in range(len(PROMPTS))] == want
