"""Every bad input gets an OpenAI-style error with the right status, and the server keeps serving."""
import json
from collections import Counter

import httpx
import openai
import pytest
from serve_testing import MODEL, tiny_server

KEY = "secret-key"
MAX_BODY = 20_000
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
USER = [{"role": "user", "content": "abc"}]


@pytest.fixture(scope="module")
def served():
    with tiny_server(api_key=KEY, max_body_bytes=MAX_BODY) as s:
        yield s


BAD = [  # (id, path, JSON body or raw bytes, status, code, param)
    ("empty messages", CHAT, {"model": MODEL, "messages": []}, 400, None, "messages"),
    ("message not an object", CHAT, {"model": MODEL, "messages": ["hi"]}, 400, None, "messages"),
    ("message without role", CHAT, {"model": MODEL, "messages": [{"content": "abc"}]}, 400, None, "messages"),
    ("content not text", CHAT, {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, None, "messages"),
    ("messages missing", CHAT, {"model": MODEL}, 400, "missing_required_parameter", "messages"),
    ("messages wrong type", CHAT, {"model": MODEL, "messages": "abc"}, 400, "invalid_type", "messages"),
    ("max_tokens wrong type", COMPLETIONS, {"model": MODEL, "prompt": "abc", "max_tokens": "ten"}, 400, "invalid_type",
     "max_tokens"),
    ("stop wrong type", COMPLETIONS, {"model": MODEL, "prompt": "abc", "stop": 5}, 400, "invalid_type", "stop"),
    ("unknown role", CHAT, {"model": MODEL, "messages": [{"role": "wizard", "content": "abc"}]}, 400, None,
     "messages[0].role"),
    ("tool role (no tools here)", CHAT, {"model": MODEL, "messages": USER + [{"role": "tool", "content": "x"}]}, 400,
     None, "messages[1].role"),
    ("lone surrogate in content", CHAT, b'{"messages": [{"role": "user", "content": "ab\\ud800c"}]}', 400, None,
     "messages[0].content"),
    ("lone surrogate in a text part", CHAT,
     b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}', 400, None,
     "messages[0].content"),
    ("lone surrogate in prompt", COMPLETIONS, b'{"prompt": ["a\\udbff"]}', 400, None, "prompt"),
    ("NUL in content", CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "a\x00b"}]}, 400, None,
     "messages[0].content"),
    ("NUL in prompt", COMPLETIONS, {"model": MODEL, "prompt": "\x00"}, 400, None, "prompt"),
    ("text outside the tokenizer", COMPLETIONS, {"model": MODEL, "prompt": "a b"}, 400, None, "prompt"),  # toy: no space
    ("NaN temperature", COMPLETIONS, b'{"prompt": "abc", "temperature": NaN}', 400, "invalid_json", None),
    ("Infinity top_p", COMPLETIONS, b'{"prompt": "abc", "top_p": -Infinity}', 400, "invalid_json", None),
    ("seed out of range", COMPLETIONS, {"model": MODEL, "prompt": "abc", "temperature": 1, "seed": 2**80}, 400, None,
     "seed"),
    ("JSON nested too deep", COMPLETIONS, b'{"prompt": ' + b"[" * 5_000 + b"]" * 5_000 + b"}", 400, "invalid_json",
     None),
    ("unknown model", CHAT, {"model": "gpt-4o", "messages": USER}, 404, "model_not_found", "model"),
    ("unknown model (completions)", COMPLETIONS, {"model": "nope", "prompt": "abc"}, 404, "model_not_found", "model"),
    ("max_tokens 0", CHAT, {"model": MODEL, "messages": USER, "max_tokens": 0}, 400, None, "max_tokens"),
    ("max_tokens negative", COMPLETIONS, {"model": MODEL, "prompt": "abc", "max_tokens": -3}, 400, None, "max_tokens"),
    ("max_tokens beyond context", CHAT, {"model": MODEL, "messages": USER, "max_tokens": 300}, 400,
     "context_length_exceeded", None),
    ("prompt beyond context", COMPLETIONS, {"model": MODEL, "prompt": "a" * 250, "max_tokens": 10}, 400,
     "context_length_exceeded", None),
    ("temperature negative", CHAT, {"model": MODEL, "messages": USER, "temperature": -0.5}, 400, None, "temperature"),
    ("top_p zero", CHAT, {"model": MODEL, "messages": USER, "top_p": 0}, 400, None, "top_p"),
    ("top_p 1.5", COMPLETIONS, {"model": MODEL, "prompt": "abc", "top_p": 1.5}, 400, None, "top_p"),
    ("n 2", CHAT, {"model": MODEL, "messages": USER, "n": 2}, 400, None, "n"),
    ("empty stop string", COMPLETIONS, {"model": MODEL, "prompt": "abc", "stop": [""]}, 400, None, "stop"),
    ("empty prompt", COMPLETIONS, {"model": MODEL, "prompt": ""}, 400, None, None),
    ("token id outside vocab", COMPLETIONS, {"model": MODEL, "prompt": [5, 10_000]}, 400, None, None),
    ("unsupported penalty", CHAT, {"model": MODEL, "messages": USER, "presence_penalty": 1.0}, 400, None,
     "presence_penalty"),
    ("malformed JSON", CHAT, b'{"model": "tiny-target", "messages": [', 400, "invalid_json", None),
    ("JSON not an object", COMPLETIONS, b"[1, 2]", 400, "invalid_json", None),
    ("oversized body", CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "a" * MAX_BODY}]}, 413,
     "request_too_large", None),
]


@pytest.mark.parametrize("path,body,status,code,param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_request_gets_openai_error(served, path, body, status, code, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    with served.http() as http:
        r = http.post(path, content=content, headers={"Content-Type": "application/json"})
        error = r.json()["error"]
        assert r.status_code == status, error
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert error["type"] == "invalid_request_error"
        assert (error["code"], error["param"]) == (code, param)
        assert http.get("/health").status_code == 200  # still serving


def test_oversized_chunked_body_is_refused(served):
    chunks = (b"x" * 4096 for _ in range(2 * MAX_BODY // 4096))  # no Content-Length: counted while read
    with served.http() as http:
        r = http.post(CHAT, content=chunks, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_wrong_api_key_is_refused_and_right_key_served(served):
    with pytest.raises(openai.AuthenticationError) as info:
        served.client(api_key="wrong").chat.completions.create(model=MODEL, messages=USER, max_tokens=3)
    assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
    with served.http() as http:
        assert http.post(CHAT, json={"messages": USER}, headers={"Authorization": ""}).status_code == 401
        assert http.get("/health").status_code == 200  # health and metrics need no key
    r = served.client().chat.completions.create(model=MODEL, messages=USER, max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_openai_client_sees_typed_errors(served):
    client = served.client()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=USER)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=300)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):  # a streaming request fails before its stream starts
        client.completions.create(model=MODEL, prompt="abc", temperature=-1, stream=True)


def test_server_keeps_serving_after_all_errors(served):
    before = served.client().completions.create(model=MODEL, prompt="abc", temperature=0, max_tokens=6)
    with served.http() as http:
        for _, path, body, *_ in BAD:
            http.post(path, content=body if isinstance(body, bytes) else json.dumps(body).encode(),
                      headers={"Content-Type": "application/json"})
    after = served.client().completions.create(model=MODEL, prompt="abc", temperature=0, max_tokens=6)
    assert after.choices[0].text == before.choices[0].text


def test_unknown_route_is_an_openai_error(served):
    with served.http() as http:
        r = http.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


def status_counts(http) -> Counter:
    from prometheus_client.parser import text_string_to_metric_families

    counts = Counter()
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for s in family.samples:
            if s.name == "osd_http_requests_total":
                counts[(s.labels["endpoint"], int(s.labels["status"]))] += s.value
    return counts


def test_every_response_status_is_counted(served):
    sent = Counter()
    with served.http() as http:
        before = status_counts(http)
        for _, path, body, status, *_ in BAD:
            http.post(path, content=body if isinstance(body, bytes) else json.dumps(body).encode(),
                      headers={"Content-Type": "application/json"})
            sent[(path, status)] += 1
        http.post(CHAT, json={"messages": USER}, headers={"Authorization": "Bearer wrong"})
        http.get("/v1/nothing")
        sent[(CHAT, 401)] += 1
        sent[("other", 404)] += 1
        sent[("/metrics", 200)] += 1  # the first scrape
        after = status_counts(http)
    assert after - before == sent


def _broken_engine(where: str):
    """A real tiny engine whose scheduler fails in a way no table entry knows: in the shared target pass (every
    sequence in the step gets the error) or in the step's planning (the worker catches it): the server's 500 path."""
    from conftest import ToyTokenizer, tiny_qwen2
    from helpers import make_engine

    engine, _ = make_engine(tiny_qwen2(seed=0), tiny_qwen2(seed=1, layers=1), ToyTokenizer(), k=2, max_batch=2)

    def fault(*args, **kwargs):
        raise RuntimeError("engine fault")

    if where == "pass":
        engine.slots.feed = fault
    else:
        engine.scheduler._propose = fault
    return engine


@pytest.mark.parametrize("where", ["pass", "planning"])
def test_unexpected_error_is_a_counted_500_and_the_connection_survives(where):
    from conftest import ToyTokenizer
    from serve_testing import live_server

    from osd.serve.app import create_app

    app = create_app(_broken_engine(where), ToyTokenizer(), MODEL)
    with live_server(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        for _ in range(2):  # the same keep-alive connection answers again after a 500
            r = http.post(COMPLETIONS, json={"prompt": "abc", "max_tokens": 2})
            assert r.status_code == 500 and r.json()["error"] == {
                "message": "internal server error", "type": "server_error", "param": None, "code": None}
        assert http.get("/health").status_code == 200  # the worker survived
        assert status_counts(http)[(COMPLETIONS, 500)] == 2


def test_metrics_behind_the_key_when_asked():
    with tiny_server(api_key=KEY, metrics_require_key=True) as s:
        assert httpx.get(s.url + "/metrics").status_code == 401
        assert httpx.get(s.url + "/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
        with s.http() as http:  # sends the key
            r = http.get("/metrics")
            assert r.status_code == 200 and "osd_http_requests_total" in r.text
            assert status_counts(http)[("/metrics", 401)] == 2
