"""The API gaps of issue 61, each through the real `openai` client against a live server on 127.0.0.1: logprobs
(chat and completions, streaming and not: the target's own), sampling fields refused by name, min_p / stop_token_ids
/ ignore_eos, the default max_tokens (what the context has left), cached prompt tokens, and the bounded queue (503
with Retry-After)."""
import threading

import httpx
import openai
import pytest
import torch
from conftest import EOS, ToyTokenizer, tiny_qwen2
from helpers import make_engine, plain_greedy
from serve_testing import MODEL, live_server, tiny_server

from osd.data import chat_ids
from osd.serve.app import create_app
from osd.serve.settings import ServeSettings

N = 16
WINDOW = 256  # the tiny target's context (test_serve_api.test_tiny_model_window_is_what_the_error_tests_assume)


@pytest.fixture(scope="module")
def served():
    with tiny_server(default_max_tokens=N, max_batch=2) as s:  # 2 slots: each keeps its cache (prefix reuse)
        yield s


@torch.inference_mode()
def target_logprobs(served, prompt_ids, tokens) -> list[float]:
    """The target's raw log-softmax at each output token, one full forward without a cache."""
    logits = served.target(torch.tensor([prompt_ids + tokens])).logits[0, len(prompt_ids) - 1: -1]  # (n, V)
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def ids_of(served, text: str) -> list[int]:
    return served.tokenizer.encode(text)  # toy tokenizer: one token per character


def user(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


# --- logprobs ---------------------------------------------------------------------------------------------------

def test_chat_logprobs_are_the_targets_own_at_every_output_token(served):
    r = served.client().chat.completions.create(model=MODEL, messages=user("abc"), temperature=0, max_tokens=N,
                                                 logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    text = r.choices[0].message.content
    assert len(content) == r.usage.completion_tokens == len(text) > 0
    assert "".join(c.token for c in content) == text
    prompt = chat_ids(served.tokenizer, user("abc"))
    assert [c.logprob for c in content] == pytest.approx(target_logprobs(served, prompt, ids_of(served, text)),
                                                         abs=1e-4)
    for c in content:
        assert c.bytes == list(c.token.encode()) and len(c.top_logprobs) == 3
        assert c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == pytest.approx(c.logprob)  # greedy
        assert [t.logprob for t in c.top_logprobs] == sorted((t.logprob for t in c.top_logprobs), reverse=True)
    assert r.model_extra["osd"]["proposed"] > 0  # speculation ran: the figures came from verify rows


def test_chat_streaming_logprobs_are_the_non_streaming_ones_chunk_by_chunk(served):
    ask = dict(model=MODEL, messages=user("hello"), temperature=0, max_tokens=N, logprobs=True, top_logprobs=2)
    whole = served.client().chat.completions.create(**ask).choices[0].logprobs.content
    chunks = list(served.client().chat.completions.create(**ask, stream=True))
    streamed = [c for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
                for c in chunk.choices[0].logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in whole]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in whole], abs=1e-6)
    assert [[t.token for t in c.top_logprobs] for c in streamed] == [[t.token for t in c.top_logprobs] for c in whole]
    texts = [chunk for chunk in chunks if chunk.choices and chunk.choices[0].delta.content]
    assert all(chunk.choices[0].logprobs.content for chunk in texts[:1])  # they travel with the text, not only at the end


def test_completion_logprobs_in_the_legacy_shape_streaming_and_not(served):
    ask = dict(model=MODEL, prompt="abc", temperature=0, max_tokens=N, logprobs=2)
    r = served.client().completions.create(**ask)
    lp, text = r.choices[0].logprobs, r.choices[0].text
    assert "".join(lp.tokens) == text and len(lp.tokens) == r.usage.completion_tokens
    assert lp.text_offset == list(range(len(text)))  # one character per token
    assert lp.token_logprobs == pytest.approx(target_logprobs(served, ids_of(served, "abc"), ids_of(served, text)),
                                              abs=1e-4)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == pytest.approx(logprob) and len(top) == 2 and max(top.values()) == pytest.approx(logprob)
    chunks = list(served.client().completions.create(**ask, stream=True))
    streamed = [(t, v) for c in chunks if c.choices[0].logprobs for t, v in
                zip(c.choices[0].logprobs.tokens, c.choices[0].logprobs.token_logprobs)]
    assert [t for t, _ in streamed] == lp.tokens
    assert [v for _, v in streamed] == pytest.approx(lp.token_logprobs, abs=1e-6)
    offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert offsets == lp.text_offset


def test_sampled_logprobs_are_the_targets_raw_ones_not_the_warped(served):
    r = served.client().completions.create(model=MODEL, prompt="xyz", temperature=1.5, top_p=0.9, seed=3,
                                           max_tokens=N, logprobs=0)
    lp, text = r.choices[0].logprobs, r.choices[0].text
    assert lp.token_logprobs == pytest.approx(target_logprobs(served, ids_of(served, "xyz"), ids_of(served, text)),
                                              abs=1e-4)
    assert [list(top) for top in lp.top_logprobs] == [[t] for t in lp.tokens]  # logprobs=0: the chosen token only


def test_no_logprobs_unless_asked(served):
    r = served.client().chat.completions.create(model=MODEL, messages=user("abc"), temperature=0, max_tokens=4)
    assert r.choices[0].logprobs is None


# --- refused by name --------------------------------------------------------------------------------------------

REFUSED = [  # (endpoint, field, value)
    ("chat", "repetition_penalty", 1.2), ("completions", "repetition_penalty", 0.8),
    ("chat", "presence_penalty", 0.5), ("chat", "frequency_penalty", -0.5), ("chat", "logit_bias", {"5": 10}),
    ("completions", "min_tokens", 3), ("chat", "tools", [{"type": "function", "function": {"name": "f"}}]),
    ("chat", "tool_choice", "required"), ("completions", "best_of", 2), ("completions", "echo", True),
    ("completions", "use_beam_search", True), ("chat", "guided_json", {"type": "object"}),
    ("chat", "response_format", {"type": "json_object"}), ("completions", "prompt_logprobs", 1),
    ("chat", "include_stop_str_in_output", True), ("chat", "typical_p", 0.5),
]


def create(served, endpoint: str, **fields):
    client, fields = served.client(), {"max_tokens": 4} | fields
    if endpoint == "chat":
        return client.chat.completions.create(model=MODEL, messages=user("abc"), **fields)
    return client.completions.create(model=MODEL, prompt="abc", **fields)


@pytest.mark.parametrize("endpoint,field,value", REFUSED, ids=[f"{e}-{f}" for e, f, _ in REFUSED])
def test_unsupported_fields_are_refused_by_name(served, endpoint, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        create(served, endpoint, extra_body={field: value})
    error = e.value.body
    assert e.value.status_code == 400 and error["param"] == field and field in error["message"]
    assert error["type"] == "invalid_request_error"


NEUTRAL = [("chat", "repetition_penalty", 1.0), ("completions", "presence_penalty", 0), ("chat", "logit_bias", {}),
           ("completions", "best_of", 1), ("chat", "tool_choice", "none"), ("chat", "skip_special_tokens", True),
           ("completions", "top_k", -1), ("chat", "parallel_tool_calls", True), ("chat", "some_future_field", 3)]


@pytest.mark.parametrize("endpoint,field,value", NEUTRAL, ids=[f"{e}-{f}" for e, f, _ in NEUTRAL])
def test_neutral_values_and_unknown_fields_are_served(served, endpoint, field, value):
    assert create(served, endpoint, temperature=0, extra_body={field: value}).usage.completion_tokens > 0


@pytest.mark.parametrize("fields,param", [
    (dict(logprobs=True, top_logprobs=21), "top_logprobs"), (dict(top_logprobs=2), "top_logprobs"),
    (dict(logprobs=True, top_logprobs=-1), "top_logprobs"), (dict(extra_body={"min_p": 1.0}), "min_p"),
    (dict(extra_body={"stop_token_ids": [10_000]}), None), (dict(extra_body={"stop_token_ids": [-3]}), "stop_token_ids"),
])
def test_out_of_range_values_are_400_with_the_field(served, fields, param):
    with pytest.raises(openai.BadRequestError) as e:
        create(served, "chat", **fields)
    assert e.value.body["param"] == param


def test_completions_logprobs_out_of_range_is_400(served):
    with pytest.raises(openai.BadRequestError) as e:
        create(served, "completions", logprobs=21)
    assert e.value.body["param"] == "logprobs"


# --- min_p, stop_token_ids, ignore_eos --------------------------------------------------------------------------

def test_min_p_is_applied_to_sampling(served):
    """min_p = 0.999 leaves only the likeliest token at each position: sampling at temperature 2 is then greedy,
    where without it the same seeds wander off."""
    greedy = create(served, "completions", temperature=0, max_tokens=N).choices[0].text
    sampled = lambda seed, **extra: create(served, "completions", temperature=2.0, seed=seed, max_tokens=N,
                                           **extra).choices[0].text
    assert all(sampled(seed, extra_body={"min_p": 0.999}) == greedy for seed in range(4))
    assert any(sampled(seed) != greedy for seed in range(4))


def test_stop_token_ids_end_the_output_before_the_token(served):
    full = create(served, "completions", temperature=0, max_tokens=N).choices[0].text
    stop_char = full[4]
    r = create(served, "completions", temperature=0, max_tokens=N,
               extra_body={"stop_token_ids": ids_of(served, stop_char)})
    assert r.choices[0].text == full[: full.index(stop_char)] and r.choices[0].finish_reason == "stop"


def prompt_reaching_eos(served) -> tuple[list[int], list[int]]:
    """Token ids whose greedy continuation (the target's own) reaches EOS within N tokens -> (prompt, continuation)."""
    for first in range(2, 40):
        for second in range(2, 40, 7):
            prompt = [first, second, 4]
            tokens = plain_greedy(served.target, prompt, N)
            if EOS in tokens[1:]:
                return prompt, tokens
    raise AssertionError("no prompt of the search reaches EOS: the tiny target changed")


def test_ignore_eos_generates_through_eos(served):
    prompt, tokens = prompt_reaching_eos(served)
    plain = served.client().completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=N)
    assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens == tokens.index(EOS)
    r = served.client().completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=N,
                                           extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == N
    assert r.choices[0].text == served.tokenizer.decode(tokens)  # the EOS is not text; what follows it is


# --- default max_tokens, cached tokens --------------------------------------------------------------------------

def test_without_max_tokens_a_long_prompt_gets_what_the_context_has_left(served):
    long = served.client().completions.create(model=MODEL, prompt="a" * (WINDOW - 6), temperature=0,
                                              extra_body={"ignore_eos": True})
    assert long.usage.completion_tokens == 6 and long.choices[0].finish_reason == "length"
    short = served.client().completions.create(model=MODEL, prompt="abc", temperature=0,
                                               extra_body={"ignore_eos": True})
    assert short.usage.completion_tokens == N  # capped at default_max_tokens
    with pytest.raises(openai.BadRequestError) as e:  # a prompt that fills the context is still too long
        served.client().completions.create(model=MODEL, prompt="a" * WINDOW)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:  # and an explicit max_tokens is not shortened
        served.client().completions.create(model=MODEL, prompt="a" * (WINDOW - 6), max_tokens=7)
    assert e.value.body["code"] == "context_length_exceeded"


def test_cached_tokens_report_the_prompt_prefix_reuse_served(served):
    messages = user("qrstuvwxyzqrstuvwxyz")  # a conversation no other test sends
    ask = lambda: served.client().chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=4)
    first, second = ask(), ask()
    prompt = len(chat_ids(served.tokenizer, messages))
    assert first.usage.prompt_tokens == second.usage.prompt_tokens == prompt
    assert first.usage.prompt_tokens_details.cached_tokens < prompt - 1  # at most the template's head was cached
    assert second.usage.prompt_tokens_details.cached_tokens == prompt - 1  # all but the last (fed for its logits)
    assert second.choices[0].message.content == first.choices[0].message.content


# --- the bounded queue ------------------------------------------------------------------------------------------

def test_a_full_queue_is_a_503_with_retry_after_and_the_queued_requests_are_served():
    """The worker is not running yet (worker_thread=False, its loop started by hand below), so requests stay queued:
    the third one past max_queue = 2 is refused at once; once the worker runs, the two queued are answered."""
    target, draft, tokenizer = tiny_qwen2(seed=0), tiny_qwen2(seed=1, layers=1), ToyTokenizer()
    engine, _ = make_engine(target, draft, tokenizer, k=3)
    app = create_app(engine, tokenizer, MODEL, settings=ServeSettings(max_queue=2, default_max_tokens=4),
                     worker_thread=False)
    worker = app.state.worker
    with live_server(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        answers = []
        waiting = [threading.Thread(target=lambda: answers.append(
            client.completions.create(model=MODEL, prompt="abc", temperature=0).choices[0].text)) for _ in range(2)]
        for t in waiting:
            t.start()
        for _ in range(6000):  # a readiness poll: both are queued (nothing takes them off the queue yet)
            if worker.depth == 2:
                break
            threading.Event().wait(0.01)
        assert worker.depth == 2
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model=MODEL, prompt="abc", temperature=0)
        assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "1"
        assert e.value.body["code"] == "queue_full" and "max-queue" in e.value.body["message"]
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "abc"}, timeout=60)
        assert r.status_code == 503 and r.headers["Retry-After"] == "1" and r.json()["error"]["code"] == "queue_full"
        runner = threading.Thread(target=worker.run_here, daemon=True)
        runner.start()
        for t in waiting:
            t.join(120)
        expected = tokenizer.decode(plain_greedy(target, tokenizer.encode("abc"), 4, eos=EOS))
        assert answers == [expected, expected]
        assert client.completions.create(model=MODEL, prompt="abc", temperature=0).choices[0].text == expected
    runner.join(60)
    assert not runner.is_alive()  # the lifespan's shutdown stopped the worker's loop


def test_max_queue_is_validated_and_0_means_no_bound():
    from osd.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="max_queue"):
        ServeSettings(max_queue=-1)
    assert ServeSettings().max_queue == 64 and ServeSettings(max_queue=0).max_queue == 0
