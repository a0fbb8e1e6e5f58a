"""Every bad input gets an OpenAI-style error with the right status, and the server keeps serving."""
import json

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
    ("messages missing", CHAT, {"model": MODEL}, 422, "validation_error", "messages"),
    ("messages wrong type", CHAT, {"model": MODEL, "messages": "abc"}, 422, "validation_error", "messages"),
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
