"""The server with several drafts: a pinned draft is honoured, a bad name is an OpenAI-style 404, /v1/models
lists the drafts, /metrics has per-draft and route series."""
import threading
from contextlib import contextmanager

import httpx
import openai
import pytest
from conftest import EOS, ToyTokenizer, tiny_qwen2
from helpers import plain_greedy
from serve_testing import MODEL, live_server, tiny_server

from osd.config import SpeculationConfig
from osd.engine import SpeculativeEngine
from osd.route.config import RouteConfig
from osd.route.system import Routing
from osd.serve.app import create_app
from osd.serve.settings import ServeSettings

N = 8


@contextmanager
def routed_server(**route):
    target, tokenizer = tiny_qwen2(seed=0), ToyTokenizer()
    config = RouteConfig(**{"drafts": "a,b", "adapter_layers": 1, "score_share": 1.0, "score_time_share": 1e9, **route})
    routing = Routing.build(tiny_qwen2(seed=1, layers=2), config, tokenizer=tokenizer)
    engine = SpeculativeEngine(target, tokenizer, routing.proposer, SpeculationConfig(k=4, adaptive=False))
    routing.attach(engine)
    app = create_app(engine, tokenizer, MODEL, settings=ServeSettings(default_max_tokens=N), routing=routing)
    with live_server(app) as url:
        yield url, target, routing


@pytest.fixture(scope="module")
def served():
    with routed_server() as s:
        yield s


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_a_pinned_draft_serves_the_request(served):
    url, target, routing = served
    tokenizer = ToyTokenizer()
    for name in ("b", "a", "b"):
        r = client(url).completions.create(model=MODEL, prompt="abcd", max_tokens=N, temperature=0,
                                           extra_body={"osd": {"draft": name}})
        assert r.model_extra["osd"]["draft"] == name  # the response names the draft that served
        assert r.choices[0].text == tokenizer.decode(plain_greedy(target, tokenizer.encode("abcd"), N, eos=EOS))
    assert routing.router.decisions["pinned"] == {"a": 1, "b": 2}
    chat = client(url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "xy"}], max_tokens=4,
                                               temperature=0, extra_body={"osd": {"draft": "b"}})
    assert chat.model_extra["osd"]["draft"] == "b"


def test_routed_requests_name_their_draft(served):
    url, _, routing = served
    r = client(url).completions.create(model=MODEL, prompt="hello", max_tokens=N, temperature=0)
    assert r.model_extra["osd"]["draft"] in ("a", "b") and r.model_extra["osd"]["draft_version"] == 0


def test_an_unknown_draft_is_an_openai_style_404(served):
    url, _, _ = served
    with pytest.raises(openai.NotFoundError) as caught:
        client(url).completions.create(model=MODEL, prompt="abcd", max_tokens=N, extra_body={"osd": {"draft": "nope"}})
    error = caught.value.body
    assert error["code"] == "draft_not_found" and error["param"] == "osd.draft" and error["type"] == "invalid_request_error"
    assert "nope" in error["message"] and "'a', 'b'" in error["message"]
    r = httpx.post(url + "/v1/completions", json={"prompt": "ab", "osd": {"draft": "nope"}}, timeout=60)
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_a_misspelt_osd_field_is_a_400(served):
    url, _, _ = served
    r = httpx.post(url + "/v1/completions", json={"prompt": "ab", "osd": {"draf": "a"}}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "osd"


def test_models_list_the_target_and_its_drafts(served):
    url, _, _ = served
    models = client(url).models.list().data
    assert [m.id for m in models] == [MODEL]  # only the target is a model a client asks for
    assert models[0].model_extra["osd"]["drafts"] == [{"id": "a", "version": 0}, {"id": "b", "version": 0}]


def test_metrics_give_acceptance_per_draft_version_and_route(served):
    url, _, _ = served
    client(url).completions.create(model=MODEL, prompt="abcd", max_tokens=N, temperature=0,
                                   extra_body={"osd": {"draft": "a"}})
    text = httpx.get(url + "/metrics", timeout=60).text
    assert 'osd_spec_accepted_total{draft="a",draft_version="0"}' in text
    assert 'osd_spec_beta_n_total{draft="a",draft_version="0"}' in text
    assert 'osd_draft_version{draft="b"} 0.0' in text
    assert 'osd_route_decisions_total{draft="a",reason="pinned"}' in text
    assert 'osd_route_owned_total{draft="a"}' in text
    scored = [line for line in text.splitlines() if line.startswith("osd_route_scored_requests_total ")]
    assert scored and float(scored[0].split()[1]) >= 1
    assert 'osd_draft_scored_acceptance_sum_total{draft="b"}' in text


def test_a_server_with_one_draft_takes_its_name_as_a_pin_and_refuses_others():
    with tiny_server(default_max_tokens=4) as s:
        ok = s.client().completions.create(model=MODEL, prompt="ab", max_tokens=4, extra_body={"osd": {"draft": "draft"}})
        assert ok.model_extra["osd"]["draft"] == "draft"
        with pytest.raises(openai.NotFoundError):
            s.client().completions.create(model=MODEL, prompt="ab", max_tokens=4, extra_body={"osd": {"draft": "x"}})
        assert s.client().models.list().data[0].model_extra["osd"]["drafts"] == [{"id": "draft", "version": 0}]


def test_bench_serve_reads_a_routing_servers_seconds_and_drafts_memory(served, tmp_path, monkeypatch):
    """`osd bench serve` against a routing server: routing and scoring seconds per level from /metrics (what the
    router's own counters say the level cost) and the drafts' bytes against one draft's; a plain server has neither."""
    from osd_bench.serve_load import run_load
    from osd_bench.serve_report import report_load

    url, _, routing = served
    before = routing.feedback.stats()["score_seconds"] + routing.router.stats()["route_seconds"]
    result = run_load(url, ["abc", "defg", "hij", "klm"], max_tokens=N, concurrency=(1,))
    level = result["levels"][0]
    spent = level["routing"]["route_seconds"] + level["routing"]["score_seconds"]
    after = routing.feedback.stats()["score_seconds"] + routing.router.stats()["route_seconds"]
    assert 0 < spent <= after - before + 1e-9 and level["routing"]["route_seconds"] > 0
    assert level["routing"]["share"] == pytest.approx(spent / level["wall_seconds"])
    memory, sizes = result["drafts_memory"], routing.drafts.tensor_bytes()
    assert memory["total_bytes"] == sizes["total"] and memory["one_draft_bytes"] == sizes["one_draft"]
    assert 1.0 < memory["ratio"] < 1.5  # two adapter drafts on one base (and its serving copy)
    monkeypatch.setattr("sys.argv", ["osd", "bench", "serve"])
    report_load(result, str(tmp_path / "load.json"), str(tmp_path / "B.md"))
    text = (tmp_path / "B.md").read_text()
    assert "Routing server (from its /metrics)" in text and "x one draft" in text
    with tiny_server() as plain:
        single = run_load(plain.url, ["abc"], max_tokens=4, concurrency=(1,))
    assert "routing" not in single["levels"][0] and "drafts_memory" not in single


def test_requests_do_not_wait_for_a_draft_update():
    """A draft's learner holds the drafts' master lock for a whole update (seconds on a real draft); serving must not
    need it: pinned and routed requests and /v1/models answer while it is held (scoring, background, waits)."""
    with routed_server(score_schedule="background") as (url, _, routing):
        held, release = threading.Event(), threading.Event()

        def update():
            with routing.drafts.lock:
                held.set()
                release.wait(60)

        holder = threading.Thread(target=update)
        holder.start()
        held.wait()
        try:
            for body in ({"prompt": "ab", "max_tokens": 4, "osd": {"draft": "b"}}, {"prompt": "cd", "max_tokens": 4}):
                r = httpx.post(url + "/v1/completions", json=body, timeout=10)
                assert r.status_code == 200 and r.json()["osd"]["draft"] in ("a", "b")
            models = httpx.get(url + "/v1/models", timeout=10).json()
            assert holder.is_alive() and "a" in str(models)
        finally:
            release.set()
            holder.join()
