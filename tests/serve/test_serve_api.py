"""The OpenAI-compatible server, through the real `openai` client against a live uvicorn server."""
import copy
import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import EOS, tiny_qwen2
from helpers import plain_greedy
from serve_testing import MODEL, FakeLearner, tiny_server

from osd.data import chat_ids
from osd.models import kernels
from osd.serve.prom import kernel_path

N = 20


@pytest.fixture(scope="module")
def served():
    with tiny_server(learner=FakeLearner(), default_max_tokens=N) as s:
        yield s


def expected_text(served, prompt_ids, n=N):
    return served.tokenizer.decode(plain_greedy(served.target, prompt_ids, n, eos=EOS))


def chat_expected(served, content, n=N):
    return expected_text(served, chat_ids(served.tokenizer, [{"role": "user", "content": content}]), n)


def test_chat_greedy_equals_target_greedy(served):
    r = served.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "abc"}],
                                                 temperature=0, max_tokens=N)
    assert r.choices[0].message.content == chat_expected(served, "abc")
    assert r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == len(r.choices[0].message.content)  # toy tokenizer: 1 char per token
    assert r.usage.prompt_tokens == len(chat_ids(served.tokenizer, [{"role": "user", "content": "abc"}]))
    osd = r.model_extra["osd"]
    assert osd["draft"] == "draft" and osd["draft_version"] >= 0
    assert 0 <= osd["accepted"] <= osd["proposed"] and osd["tokens_per_step"] >= 1


def test_completion_greedy_equals_target_greedy(served):
    r = served.client().completions.create(model=MODEL, prompt="hello", temperature=0, max_tokens=N)
    assert r.choices[0].text == expected_text(served, served.tokenizer.encode("hello"))
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.model_extra["osd"]["proposed"] > 0


def test_chat_streaming_matches_non_streaming(served):
    stream = served.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "xyz"}],
                                                      temperature=0, stream=True,
                                                      stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat_expected(served, "xyz")
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].model_extra["osd"]["proposed"] > 0
    assert chunks[-1].usage.completion_tokens == len(text)


def test_completion_streaming_and_stop_string(served):
    full = expected_text(served, served.tokenizer.encode("abc"))
    stop = full[5:7]
    cut = full[: full.find(stop)]
    stream = served.client().completions.create(model=MODEL, prompt="abc", temperature=0, stream=True, stop=[stop])
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(served):
    ask = lambda: served.client().completions.create(model=MODEL, prompt="abc", temperature=1.0, top_p=0.9,
                                                     seed=123, max_tokens=12).choices[0].text
    assert ask() == ask()


def test_four_concurrent_clients_all_answered_correctly(served):
    contents = ["abc", "defg", "hij", "klmno"]

    def ask(content):
        stream = content in ("defg", "klmno")
        r = served.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                                     temperature=0, max_tokens=N, stream=stream)
        if stream:
            return "".join(c.choices[0].delta.content or "" for c in r if c.choices)
        return r.choices[0].message.content

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, contents))
    assert answers == [chat_expected(served, c) for c in contents]


def test_slow_streaming_client_does_not_stall_others(served):
    body = {"model": MODEL, "prompt": "abc", "temperature": 0, "max_tokens": 60, "stream": True}
    with served.http() as http, http.stream("POST", "/v1/completions", json=body) as slow:
        lines = slow.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["text"]
        # the slow client reads nothing more; another request still completes
        r = served.client().completions.create(model=MODEL, prompt="def", temperature=0, max_tokens=5)
        assert r.choices[0].text == expected_text(served, served.tokenizer.encode("def"), 5)
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"


def test_models_and_health(served):
    assert [m.id for m in served.client().models.list()] == [MODEL]
    with served.http() as http:
        health = http.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_metrics_count_per_draft_version(served):
    client = served.client()
    client.completions.create(model=MODEL, prompt="abc", temperature=0, max_tokens=8)
    served.registry.publish("draft", copy.deepcopy(served.target))  # a new draft version, as the learner would
    client.completions.create(model=MODEL, prompt="abc", temperature=0, max_tokens=8)
    with served.http() as http:
        r = http.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    samples = metric_samples(r.text)
    draft = lambda version: (("draft", "draft"), ("draft_version", str(version)))
    for version in (0, 1):
        assert samples[("osd_spec_proposed_total", draft(version))] > 0
        assert (("osd_spec_accepted_at_total", draft(version) + (("position", "0"),))) in samples
    # the draft equal to the target accepts everything it proposes
    v1 = {n: samples[(f"osd_spec_{n}_total", draft(1))] for n in ("proposed", "accepted")}
    assert v1["accepted"] == v1["proposed"]
    assert samples[("osd_http_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))] >= 2
    assert samples[("osd_completion_tokens_total", ())] >= 16
    assert samples[("osd_request_duration_seconds_count", ())] >= 2
    assert ("osd_time_per_output_token_seconds_bucket", (("le", "+Inf"),)) in samples
    assert samples[("osd_queue_depth", ())] == 0
    # the learner's stats: levels as gauges, running counts as counters (FakeLearner.stats)
    assert samples[("osd_learner_buffer_positions", ())] == 7 and samples[("osd_learner_training", ())] == 1
    assert samples[("osd_learner_version", ())] == 2 and samples[("osd_learner_updates_published_total", ())] == 2
    assert not any(name.startswith("osd_learner_note") for name, _ in samples)
    # the kernels' path (serve/prom.py kernel_path), as kernels.status() says now
    kernel = [labels for name, labels in samples if name == "osd_kernel_info"]
    assert len(kernel) == 1 and dict(kernel[0])["path"] == kernel_path(kernels.status())


def metric_samples(text: str) -> dict:
    """Prometheus exposition -> {(sample name, sorted label pairs): value}, parsed by prometheus_client."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_graceful_shutdown_stops_the_learner():
    learner = FakeLearner()
    with tiny_server(learner=learner) as s:
        assert learner.started == 1
        with s.http() as http:
            assert http.get("/health").status_code == 200
    assert learner.stopped == 1


def test_tiny_model_window_is_what_the_error_tests_assume():
    assert tiny_qwen2(seed=0).config.max_position_embeddings == 256
