"""`osd serve` end to end, as a user runs it: the real command in a subprocess on tiny model directories, driven by the
`openai` client (chat and completions, streaming and not, logprobs, errors), plain HTTP and curl.

Greedy answers are checked against the target's own greedy decoding and logprobs against its own log-softmax, both
computed here from the same directories without the server (so a server that answers anything else fails)."""
import json

import openai
import pytest
import torch
from conftest import save_tiny_pair
from helpers import plain_greedy
from osd_process import has_curl, osd_serve, tiny_pair_args

from osd.data import chat_ids

MODEL = "tiny"
N = 12
MESSAGES = [{"role": "user", "content": "add two numbers"}]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e-pair")
    save_tiny_pair(root, draft_layers=1)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(root / "target").eval()
    return root, target, AutoTokenizer.from_pretrained(root / "target")


@pytest.fixture(scope="module")
def server(pair, tmp_path_factory):
    root, _, _ = pair
    args = tiny_pair_args(root) + ["--model-name", MODEL, "--default-max-tokens", str(N), "--max-queue", "8"]
    with osd_serve(args, log=tmp_path_factory.mktemp("e2e-log") / "serve.log") as s:
        yield s


def greedy(pair, prompt_ids: list[int]) -> tuple[str, list[int]]:
    _, target, tokenizer = pair
    tokens = plain_greedy(target, prompt_ids, N, eos=tokenizer.eos_token_id)
    return tokenizer.decode(tokens, skip_special_tokens=True), tokens


@torch.inference_mode()
def target_logprobs(pair, prompt_ids: list[int], tokens: list[int]) -> list[float]:
    _, target, _ = pair
    logits = target(torch.tensor([prompt_ids + tokens])).logits[0, len(prompt_ids) - 1: -1]
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def chat_prompt(pair) -> list[int]:
    return chat_ids(pair[2], MESSAGES)


def test_chat_through_the_openai_client_is_the_targets_greedy_streaming_or_not(server, pair):
    text, tokens = greedy(pair, chat_prompt(pair))
    r = server.client().chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=N)
    assert r.choices[0].message.content == text and r.usage.completion_tokens == len(tokens)
    assert r.usage.prompt_tokens == len(chat_prompt(pair))
    assert r.model_extra["osd"]["proposed"] > 0  # it speculated
    chunks = list(server.client().chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0,
                                                           max_tokens=N, stream=True,
                                                           stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == len(tokens)


def test_completions_through_the_openai_client_streaming_or_not(server, pair):
    prompt = "select all rows"
    ids = pair[2](prompt, add_special_tokens=False)["input_ids"]
    text, _ = greedy(pair, ids)
    r = server.client().completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=N)
    assert r.choices[0].text == text
    stream = server.client().completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=N, stream=True)
    assert "".join(c.choices[0].text for c in stream) == text


def test_logprobs_are_the_targets_in_both_shapes(server, pair):
    prompt = chat_prompt(pair)
    _, tokens = greedy(pair, prompt)
    expected = target_logprobs(pair, prompt, tokens)
    r = server.client().chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=N,
                                                logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(expected, abs=1e-4)
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob == pytest.approx(c.logprob) for c in content)
    stream = server.client().chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=N,
                                                     logprobs=True, stream=True)
    streamed = [c.logprob for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for c in chunk.choices[0].logprobs.content]
    assert streamed == pytest.approx(expected, abs=1e-4)
    ids = pair[2]("count the apples", add_special_tokens=False)["input_ids"]
    _, tokens = greedy(pair, ids)
    c = server.client().completions.create(model=MODEL, prompt="count the apples", temperature=0, max_tokens=N,
                                           logprobs=1)
    assert c.choices[0].logprobs.token_logprobs == pytest.approx(target_logprobs(pair, ids, tokens), abs=1e-4)


@pytest.mark.parametrize("call,status,param,code", [
    (dict(extra_body={"repetition_penalty": 1.3}), 400, "repetition_penalty", None),
    (dict(presence_penalty=0.4), 400, "presence_penalty", None),
    (dict(model="gpt-4o"), 404, "model", "model_not_found"),
    (dict(max_tokens=10_000), 400, None, "context_length_exceeded"),
    (dict(temperature=-1), 400, "temperature", None),
])
def test_errors_reach_the_openai_client_typed_and_named(server, call, status, param, code):
    fields = dict(model=MODEL, messages=MESSAGES, max_tokens=4) | call
    with pytest.raises(openai.APIStatusError) as e:
        server.client().chat.completions.create(**fields)
    assert e.value.status_code == status and e.value.body["param"] == param and e.value.body["code"] == code


def test_plain_http_as_curl_sends_it(server, pair):
    if not has_curl():
        pytest.skip("curl is not installed here (the same requests go through httpx below)")
    text, _ = greedy(pair, chat_prompt(pair))
    status, body = server.curl("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "temperature": 0,
                                                        "max_tokens": N})
    assert status == 200 and json.loads(body)["choices"][0]["message"]["content"] == text
    status, body = server.curl("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "temperature": 0,
                                                        "max_tokens": N, "stream": True}, "-N")
    events = [line.removeprefix("data: ") for line in body.splitlines() if line.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1]) == text
    status, body = server.curl("/v1/completions", {"model": MODEL, "prompt": "abc", "min_tokens": 2})
    error = json.loads(body)["error"]
    assert status == 400 and error["param"] == "min_tokens" and error["type"] == "invalid_request_error"
    status, body = server.curl("/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["id"] == MODEL


def test_plain_http_with_httpx(server, pair):
    text, _ = greedy(pair, chat_prompt(pair))
    with server.http() as http:
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "temperature": 0,
                                                    "max_tokens": N})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == text
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "abc", "logit_bias": {"3": 5}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
        health = http.get("/health").json()
        assert health["status"] == "ok" and health["queue_depth"] == 0
