"""The engine's invariants on tiny seeded models."""
import copy

import pytest
import torch
from conftest import EOS, VOCAB, tiny_qwen2
from helpers import make_engine, plain_greedy

from osd.config import SamplingConfig, SpeculationConfig
from osd.drafts import DraftRegistry
from osd.propose import DraftModelProposer
from osd.engine import SpeculativeEngine
from osd.errors import ContextTooLong, InvalidArgument

PROMPTS = [[5, 6, 7], [10, 11, 12, 13, 14, 15], [20]]


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_equals_target_greedy_with_random_draft(target_model, draft_model, tokenizer, k):
    engine, _ = make_engine(target_model, draft_model, tokenizer, k=k)
    for prompt in PROMPTS:
        result = engine.generate(prompt, SamplingConfig(max_new_tokens=40))
        assert result.token_ids == plain_greedy(target_model, prompt, 40, eos=EOS)


def test_greedy_with_draft_equal_to_target_accepts_everything(target_model, tokenizer):
    engine, _ = make_engine(target_model, copy.deepcopy(target_model), tokenizer, k=4)
    result = engine.generate([5, 6, 7], SamplingConfig(max_new_tokens=31))
    assert result.token_ids == plain_greedy(target_model, [5, 6, 7], 31, eos=EOS)
    summary = result.counters.summary()
    assert summary["acceptance_rate"] == 1.0 and summary["alpha"] == 1.0
    assert summary["tokens_per_step"] > 4.0


def test_adaptive_k_keeps_output_identical(target_model, draft_model, tokenizer):
    engine, _ = make_engine(target_model, draft_model, tokenizer, k=5, adaptive=True)
    engine.calibrate(context_len=16, repeats=1)
    for prompt in PROMPTS:
        assert engine.generate(prompt, SamplingConfig(max_new_tokens=30)).token_ids == plain_greedy(target_model, prompt, 30, eos=EOS)


def test_k_zero_is_plain_target_decoding(target_model, draft_model, tokenizer):
    engine, _ = make_engine(target_model, draft_model, tokenizer, k=0)
    result = engine.generate([5, 6, 7], SamplingConfig(max_new_tokens=20))
    assert result.token_ids == plain_greedy(target_model, [5, 6, 7], 20, eos=EOS)
    assert all(k == 0 for k, _ in result.steps)
    target_only = SpeculativeEngine(target_model, tokenizer, None)
    assert target_only.generate([5, 6, 7], SamplingConfig(max_new_tokens=20)).token_ids == result.token_ids


def test_kv_rollback_matches_fresh_forward_after_many_steps(target_model, draft_model, tokenizer):
    engine, _ = make_engine(target_model, draft_model, tokenizer, k=4)
    prompt = [5, 6, 7]
    records = []
    engine.observers.append(records.append)
    result = engine.generate(prompt, SamplingConfig(max_new_tokens=60))
    assert len(result.steps) > 10 and any(n < k for k, n in result.steps)  # rollbacks happened
    last = records[-1]
    seq = last.context + last.proposed[: last.n_accepted] + [last.next_token]
    assert engine.target.length == len(seq) - 1
    cached = engine.target.feed([seq[-1]], n_logits=1)[0]  # continue on the rolled-back cache
    seq = seq + [0]
    with torch.no_grad():
        fresh = target_model(torch.tensor([seq[: engine.target.length]])).logits[0, -1]
    assert torch.allclose(cached, fresh, atol=1e-4)


def test_the_draft_prefills_the_prompt_inside_the_prefill_phase(target_model, draft_model, tokenizer):
    """As llama.cpp's speculative example: the draft's prompt is fed before decoding starts and timed as prefill,
    so the first proposal feeds one token (the decode tokens/s of `osd bench speed` leaves the prompt out)."""
    engine, _ = make_engine(target_model, draft_model, tokenizer, k=3)
    now, feeds, proposer = [0.0], [], engine.proposer
    engine.clock = lambda: now[0]
    begin = proposer.begin

    def timed_begin(prompt_ids, prefill=True):
        now[0] += 100.0  # what the draft's prefill costs on this fake clock
        begin(prompt_ids, prefill)
        feeds.append(("after begin", proposer.runner.length))
        feed = proposer.runner.feed
        proposer.runner.feed = lambda tokens, *a, **kw: feeds.append(len(tokens)) or feed(tokens, *a, **kw)

    proposer.begin = timed_begin
    prompt = [10, 11, 12, 13, 14, 15]
    result = engine.generate(prompt, SamplingConfig(max_new_tokens=20))
    assert feeds[0] == ("after begin", len(prompt) - 1)  # the prompt but its last token, before the first step
    assert feeds[1] == 1  # the first proposal feeds only the last prompt token
    assert result.prefill_seconds == 100.0 and result.seconds == 100.0
    assert result.token_ids == plain_greedy(target_model, prompt, 20, eos=EOS)


class SlowSpellTarget:
    """A target runner on a fake clock: a forward of n rows takes 10 + 2n ms, 1.5x as long during a slow spell of
    `spell_len` consecutive feeds starting at feed number `spell_at`."""

    max_rows, vocab_size, context_window, eos_ids = 9, VOCAB, 4096, set()

    def __init__(self, spell_at: int, spell_len: int):
        self.now, self.length, self.feeds, self.spell = 0.0, 0, 0, range(spell_at, spell_at + spell_len)

    def reset(self):
        self.length = 0

    def rollback(self, length):
        self.length = min(self.length, length)

    def feed(self, tokens, n_logits=1):
        self.now += (0.010 + 0.002 * len(tokens)) * (1.5 if self.feeds in self.spell else 1.0)
        self.feeds, self.length = self.feeds + 1, self.length + len(tokens)
        return torch.zeros(min(n_logits, len(tokens)), VOCAB)


def test_calibration_is_not_skewed_by_a_slow_spell_on_one_row_count(draft_model, tokenizer):
    """Row counts are timed in rounds, so a slow spell shorter than a round leaves every count a clean timing: the
    verify costs come out exact wherever the spell falls (timed one count after another, a spell over the 1-row
    timings made every other count look cheap)."""
    k = 4
    for spell_at in range(0, 1 + (k + 1) * 4):
        target = SlowSpellTarget(spell_at, spell_len=k + 1)
        registry = DraftRegistry()
        registry.publish("draft", draft_model)
        engine = SpeculativeEngine(target, tokenizer, DraftModelProposer(registry, "draft", VOCAB),
                                   SpeculationConfig(k=k, adaptive=True), clock=lambda: target.now)
        calibration = engine.calibrate(context_len=16, repeats=2)
        want = [(0.010 + 0.002 * n) / 0.012 for n in range(1, k + 2)]
        assert calibration["verify_cost"] == pytest.approx(want, rel=1e-9), spell_at
        assert engine.target_costs.seconds == pytest.approx([0.010 + 0.002 * n for n in range(1, k + 2)], rel=1e-9)


def test_the_calibration_line_says_what_a_pass_costs_by_rows_and_each_draft_token():
    line = SpeculativeEngine.describe_calibration({"t_target": [0.012, 0.014, 0.018], "verify_cost": [1.0, 14 / 12, 1.5],
                                                   "t_draft_by_source": [0.0, 0.0006]})
    assert line == ("calibrated: a target pass of 1 row 12.0 ms, 2 rows 1.17x, 3 rows 1.50x; "
                    "a draft token 0.00 ms (c 0.000), 0.60 ms (c 0.050)")
    assert SpeculativeEngine.describe_calibration({"t_target": [0.02], "verify_cost": [1.0], "t_draft_by_source": []}) \
        == "calibrated: a target pass of 1 row 20.0 ms"
    model = {"per_sequence": 0.0003, "per_sequence_context": 3.1e-6, "per_row_context": 4.1e-6, "base_context": 57}
    assert SpeculativeEngine.describe_calibration({"t_target": [0.02], "verify_cost": [1.0], "t_draft_by_source": [],
                                                   "pass_model": model}) == (
        "calibrated: a target pass of 1 row 20.0 ms; in company, a pass +0.3 ms a sequence, and per 1000 cached "
        "tokens +3.1 ms a sequence, +4.1 ms a row")


def test_calibrating_forgets_what_the_slots_held(target_model, draft_model, tokenizer):
    """The pass model's timed passes write the scheduler's slots: a later request must not reuse a prefix a slot held
    before them (its cache now holds the calibration's tokens, or nothing)."""
    engine, _ = make_engine(target_model, draft_model, tokenizer, k=3, adaptive=True, max_batch=4)
    prompt = list(range(3, 40))
    engine.generate(prompt, SamplingConfig(max_new_tokens=4))
    assert engine.generate(prompt, SamplingConfig(max_new_tokens=4)).cached_tokens > 0  # reused while held
    engine.calibrate(context_len=32, repeats=0)
    assert engine.generate(prompt, SamplingConfig(max_new_tokens=4)).cached_tokens == 0


def test_a_calibration_written_by_one_server_is_what_the_next_one_decides_from(tmp_path, target_model, draft_model,
                                                                                tokenizer):
    """osd serve --calibration FILE: the first engine measures and writes, an engine alike reads the same costs (its
    k policy, its goodput's pass costs) without measuring; a file for another engine, or not a calibration, is a
    clear error."""
    import json

    from osd.engine import calibrate_or_load

    path = tmp_path / "calibration.json"
    first, _ = make_engine(target_model, draft_model, tokenizer, k=3, adaptive=True, max_batch=4)
    measured, source = calibrate_or_load(first, str(path))
    assert source == "measured" and path.exists() and measured["row_seconds"]
    second, _ = make_engine(target_model, draft_model, tokenizer, k=3, adaptive=True, max_batch=4)
    loaded, source = calibrate_or_load(second, str(path))
    assert source == str(path)
    assert second.target_costs.seconds == first.target_costs.seconds
    assert second.row_costs.seconds == first.row_costs.seconds and second.row_costs.seconds
    terms = ("per_sequence", "per_sequence_context", "per_row_context", "base_context")
    assert set(terms) <= set(measured["pass_model"])
    assert [getattr(second.row_costs, t) for t in terms] == [getattr(first.row_costs, t) for t in terms]
    assert all(first.slots.length(slot) == 0 for slot in range(first.slots.n_slots))  # the timed passes left nothing
    assert [p.t_draft for p in second.policies] == [p.t_draft for p in first.policies] != [0.0]
    assert second.describe_calibration(loaded) == first.describe_calibration(measured)

    other, _ = make_engine(target_model, draft_model, tokenizer, k=5, adaptive=True, max_batch=4)
    with pytest.raises(InvalidArgument, match="does not fit this engine"):
        calibrate_or_load(other, str(path))
    path.write_text(json.dumps({"t_target": [0.01]}))
    with pytest.raises(InvalidArgument, match="not a calibration osd wrote"):
        calibrate_or_load(second, str(path))
    path.write_text("{not json")
    with pytest.raises(InvalidArgument, match="could not be read"):
        calibrate_or_load(second, str(path))
    assert calibrate_or_load(second, None)[1] == "measured"


def test_calibration_times_what_a_lagging_draft_feeds_per_token(target_model, draft_model, tokenizer):
    """The draft's policy learns what a catch-up feed costs per token (what the allocation charges a sequence whose
    draft cache lags); a draft-less source (the lookup) costs none."""
    from osd.propose.ngram import LookupThenDraft, NgramProposer

    registry = DraftRegistry()
    registry.publish("draft", draft_model)
    proposer = LookupThenDraft(NgramProposer(VOCAB), DraftModelProposer(registry, "draft", VOCAB))
    engine = SpeculativeEngine(target_model, tokenizer, proposer, SpeculationConfig(k=3, adaptive=True))
    engine.calibrate(context_len=16, repeats=1)
    lookup, draft = engine.policies
    assert draft.t_catch_up > 0 and lookup.t_catch_up < draft.t_catch_up


def test_steps_record_target_distributions_at_proposed_positions(target_model, draft_model, tokenizer):
    engine, _ = make_engine(target_model, draft_model, tokenizer, k=3)
    records = []
    engine.observers.append(records.append)
    engine.generate([5, 6, 7], SamplingConfig(max_new_tokens=20))
    rec = next(r for r in records if r.n_accepted < len(r.proposed))
    seq = rec.context + rec.proposed
    with torch.no_grad():
        full = target_model(torch.tensor([seq])).logits[0]  # (T, V)
    n = len(rec.context)
    assert torch.allclose(rec.target_logits, full[n - 1 : n + len(rec.proposed)], atol=1e-4)
    assert rec.next_token == int(full[n - 1 + rec.n_accepted].argmax())


def test_eos_stop_strings_and_max_new_tokens(target_model, draft_model, tokenizer):
    engine, _ = make_engine(target_model, draft_model, tokenizer, k=3)
    free = engine.generate([5, 6, 7], SamplingConfig(max_new_tokens=12))
    assert len(free.token_ids) <= 12
    if free.finish_reason == "length":
        assert len(free.token_ids) == 12
    stop = free.text[3:5]
    if stop:
        stopped = engine.generate([5, 6, 7], SamplingConfig(max_new_tokens=12, stop=[stop]))
        assert stopped.finish_reason == "stop" and stop not in stopped.text
        assert free.text.startswith(stopped.text)
    streamed = []
    result = engine.generate([5, 6, 7], SamplingConfig(max_new_tokens=12), on_text=streamed.append)
    assert "".join(streamed) == result.text


class _PieceTokenizer:
    """decode = the pieces joined (one token may hold several characters)."""

    def __init__(self, pieces):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.pieces[i] for i in ids)


def test_stop_cuts_at_the_earliest_stop_string_and_streams_nothing_that_may_start_one():
    from osd.stopping import StopChecker

    pieces = ["Hel", "lo", " wor", "ld!", "END"]
    # "ld!" completes both stops at once: "world" (starting earlier) and "!" -> cut before "world"
    checker = StopChecker(_PieceTokenizer(pieces), eos_ids={4}, max_new_tokens=10, stop=["!", "world"])
    assert checker.extend([0, 1, 2]) is None
    assert checker.stable_text() == "Hello "  # "wor" may start "world": held back
    assert checker.extend([3]) == "stop" and checker.text == "Hello " == checker.stable_text()
    eos = StopChecker(_PieceTokenizer(pieces), eos_ids={4}, max_new_tokens=10, stop=[])
    assert eos.extend([0, 4, 1]) == "stop" and eos.token_ids == [0] and eos.text == "Hel"
    length = StopChecker(_PieceTokenizer(pieces), eos_ids={4}, max_new_tokens=2, stop=[])
    assert length.extend([0, 1, 2]) == "length" and length.text == "Hello"


def _exact_two_token_distribution(model, prompt, temperature):
    with torch.no_grad():
        first = torch.softmax(model(torch.tensor([prompt])).logits[0, -1] / temperature, -1)
        joint = torch.zeros(VOCAB, VOCAB)
        for a in range(VOCAB):
            second = torch.softmax(model(torch.tensor([prompt + [a]])).logits[0, -1] / temperature, -1)
            joint[a] = first[a] * second
    return joint


def test_sampled_output_follows_target_distribution(tokenizer):
    target = tiny_qwen2(seed=0, vocab=VOCAB)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.15)  # flatter: many outcomes have visible mass
    draft = tiny_qwen2(seed=3, layers=1)
    engine, _ = make_engine(target, draft, tokenizer, k=2)
    engine.eos_ids = set()  # count every pair, EOS included
    prompt, temperature, n = [5, 6, 7], 1.0, 3000
    exact = _exact_two_token_distribution(target, prompt, temperature)
    counts = torch.zeros(VOCAB, VOCAB)
    for seed in range(n):
        out = engine.generate(prompt, SamplingConfig(temperature=temperature, max_new_tokens=2, seed=seed)).token_ids
        counts[out[0], out[1]] += 1
    tv = 0.5 * (counts / n - exact).abs().sum().item()
    # TV of an n-sample empirical distribution of ~VOCAB^2 support from the truth is ~0.35 here;
    # a wrong sampler (e.g. plain draft sampling) sits far above. Compare marginals tightly too.
    assert (counts.sum(1) / n - exact.sum(1)).abs().max() < 0.03
    draft_exact = _exact_two_token_distribution(draft, prompt, temperature)
    assert tv < 0.5 * 0.5 * (draft_exact - exact).abs().sum().item() + 0.4


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(max_new_tokens=0), dict(top_k=-1)])
def test_bad_sampling_arguments_raise_clear_errors(kwargs):
    with pytest.raises(InvalidArgument, match=next(iter(kwargs))):
        SamplingConfig(**kwargs)


def test_bad_k_raises():
    with pytest.raises(InvalidArgument, match="k"):
        SpeculationConfig(k=-1)


def test_empty_and_too_long_prompts(target_model, draft_model, tokenizer):
    engine, _ = make_engine(target_model, draft_model, tokenizer)
    with pytest.raises(InvalidArgument, match="empty"):
        engine.generate([], SamplingConfig())
    with pytest.raises(ContextTooLong, match="context window"):
        engine.generate([5] * 250, SamplingConfig(max_new_tokens=10))
    with pytest.raises(InvalidArgument, match="vocabulary"):
        engine.generate([VOCAB + 3], SamplingConfig())


def test_truncated_draft_vocabulary_keeps_output_identical(target_model, draft_model, tokenizer):
    from osd.models.serving_draft import make_serving_draft

    serving, vocab_ids = make_serving_draft(draft_model, "int8", draft_vocab=20, keep_ids=[EOS])
    assert vocab_ids.tolist() == list(range(20))
    engine, _ = make_engine(target_model, serving, tokenizer, k=3, vocab_ids=vocab_ids)
    proposed = []
    engine.observers.append(lambda rec: proposed.extend(rec.proposed))
    for prompt in PROMPTS:
        result = engine.generate(prompt, SamplingConfig(max_new_tokens=30))
        assert result.token_ids == plain_greedy(target_model, prompt, 30, eos=EOS)
        engine.generate(prompt, SamplingConfig(temperature=1.0, max_new_tokens=10, seed=0))
    assert proposed and max(proposed) < 20  # the draft only proposes ids its LM head covers
