"""Per-request options through the engine: logprobs (the target's, exact under speculation), stop_token_ids,
ignore_eos, and the prompt tokens prefix reuse served from a cache (cached_tokens)."""
import pytest
import torch
from conftest import EOS, ToyTokenizer, tiny_qwen2
from helpers import make_engine, plain_greedy

from osd.config import SamplingConfig, SpeculationConfig
from osd.engine import SpeculativeEngine
from osd.errors import InvalidArgument
from osd.verify.logprobs import token_logprobs

PROMPT = [5, 9, 14, 3, 22, 7]
N = 24


@pytest.fixture(scope="module")
def models():
    return tiny_qwen2(seed=0), tiny_qwen2(seed=1, layers=1), ToyTokenizer()


def speculating(models, k=4, max_batch=1):
    target, draft, tokenizer = models
    return make_engine(target, draft, tokenizer, k=k, max_batch=max_batch)[0]


def target_only(models):
    target, _, tokenizer = models
    return SpeculativeEngine(target, tokenizer, None, SpeculationConfig(k=0, adaptive=False))


@torch.inference_mode()
def reference_logprobs(target, prompt, tokens) -> torch.Tensor:
    """The target's log-softmax at each output position, from one full forward without a cache: (n, V)."""
    logits = target(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1: len(prompt) - 1 + len(tokens)]
    return torch.log_softmax(logits.float(), dim=-1)


def test_token_logprobs_is_the_log_softmax_with_the_top_tokens_best_first():
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0], [0.0, 0.0, 3.0, 1.0]])
    out = token_logprobs(logits, [1, 2], n_top=2)
    logp = torch.log_softmax(logits, dim=-1)
    assert [e.token for e in out] == [1, 2]
    assert out[0].logprob == pytest.approx(float(logp[0, 1])) and out[1].logprob == pytest.approx(float(logp[1, 2]))
    assert [t for t, _ in out[0].top] == [0, 2] and [t for t, _ in out[1].top] == [2, 3]
    assert out[1].top[0][1] == pytest.approx(float(logp[1, 2]))
    assert token_logprobs(logits, [1, 2], n_top=0)[0].top == []


def test_greedy_logprobs_under_speculation_equal_target_only_and_the_targets_own(models):
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=N, logprobs=5)
    spec = speculating(models).generate(PROMPT, sampling)
    alone = target_only(models).generate(PROMPT, sampling)
    assert spec.token_ids == alone.token_ids and len(spec.token_ids) > 3
    assert sum(n for _, n in spec.steps) > 0  # drafted tokens were accepted: their logprobs came from verify rows
    assert [e.token for e in spec.logprobs] == spec.token_ids
    for a, b in zip(spec.logprobs, alone.logprobs):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert [lp for _, lp in a.top] == pytest.approx([lp for _, lp in b.top], abs=1e-5)
    ref = reference_logprobs(models[0], PROMPT, spec.token_ids)  # (n, V)
    got = torch.tensor([e.logprob for e in spec.logprobs])
    assert torch.allclose(got, ref.gather(-1, torch.tensor(spec.token_ids)[:, None])[:, 0], atol=1e-4)
    assert all(e.top[0][0] == e.token for e in spec.logprobs)  # greedy: the chosen token is the likeliest
    assert [len(e.top) for e in spec.logprobs] == [5] * len(spec.token_ids)


def test_sampled_logprobs_under_speculation_are_the_targets_raw_ones_along_the_output(models):
    sampling = SamplingConfig(temperature=1.3, top_k=8, min_p=0.05, max_new_tokens=N, seed=7, logprobs=0)
    result = speculating(models).generate(PROMPT, sampling)
    assert result.counters.proposed > 0
    ref = reference_logprobs(models[0], PROMPT, result.token_ids)
    got = torch.tensor([e.logprob for e in result.logprobs])
    # raw: not the warped (temperature 1.3, top-k, min-p) distribution the tokens were drawn from
    assert torch.allclose(got, ref.gather(-1, torch.tensor(result.token_ids)[:, None])[:, 0], atol=1e-4)
    assert all(e.top == [] for e in result.logprobs)


def test_no_logprobs_unless_asked(models):
    assert speculating(models).generate(PROMPT, SamplingConfig(max_new_tokens=4)).logprobs is None


def greedy_ending_in_eos(target) -> tuple[list[int], list[int]]:
    """A prompt whose greedy continuation reaches EOS within N tokens -> (prompt, continuation up to the EOS)."""
    for first in range(2, 40):
        for second in range(2, 40, 7):
            prompt = [first, second, 4]
            tokens = plain_greedy(target, prompt, N)
            if EOS in tokens[1:]:
                return prompt, tokens[: tokens.index(EOS)]
    raise AssertionError("no prompt of the search reaches EOS: the tiny target changed")


def test_ignore_eos_generates_past_eos_as_target_greedy_does(models):
    prompt, before = greedy_ending_in_eos(models[0])
    engine = speculating(models)
    plain = engine.generate(prompt, SamplingConfig(max_new_tokens=N))
    assert plain.token_ids == before and plain.finish_reason == "stop"
    ignoring = engine.generate(prompt, SamplingConfig(max_new_tokens=N, ignore_eos=True, logprobs=0))
    assert ignoring.token_ids == plain_greedy(models[0], prompt, N)  # EOS included, then what the target says next
    assert EOS in ignoring.token_ids and ignoring.finish_reason == "length" and len(ignoring.token_ids) == N
    assert len(ignoring.logprobs) == N


def test_stop_token_ids_end_generation_without_the_token(models):
    engine = speculating(models)
    full = engine.generate(PROMPT, SamplingConfig(max_new_tokens=N, logprobs=0)).token_ids
    stop = full[5]
    cut = full[: full.index(stop)]
    result = engine.generate(PROMPT, SamplingConfig(max_new_tokens=N, stop_token_ids=[stop], logprobs=0))
    assert result.token_ids == cut and result.finish_reason == "stop"
    assert [e.token for e in result.logprobs] == cut  # the stop token is not an output token
    with pytest.raises(InvalidArgument, match="stop_token_ids"):
        engine.generate(PROMPT, SamplingConfig(stop_token_ids=[10_000]))
    with pytest.raises(InvalidArgument, match="stop_token_ids"):
        SamplingConfig(stop_token_ids=[-1])


def test_cached_tokens_count_the_prompt_a_slot_held_already(models):
    engine = speculating(models, max_batch=2)  # several slots: each keeps its cache for the next request
    first = engine.generate(PROMPT, SamplingConfig(max_new_tokens=4))
    assert first.cached_tokens == 0
    again = engine.generate(PROMPT + first.token_ids + [11, 12], SamplingConfig(max_new_tokens=4))
    assert again.cached_tokens == len(PROMPT) + len(first.token_ids) - 1  # what the slot held (its last token pending)
    assert again.token_ids == plain_greedy(models[0], PROMPT + first.token_ids + [11, 12], 4, eos=EOS)  # unchanged
    other = engine.generate([30, 31, 32, 33], SamplingConfig(max_new_tokens=4))
    assert other.cached_tokens == 0
