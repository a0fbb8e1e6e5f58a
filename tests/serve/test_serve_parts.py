"""The serving layer's small parts: error table, request translation, Prometheus text, worker, CLI, load generator."""
import asyncio
import json

import pytest
from pydantic import ValidationError
from serve_testing import MODEL, tiny_server

from osd.errors import ContextTooLong, InvalidArgument
from osd.serve import errors
from osd_bench.serve_load import percentile, run_load
from osd.serve.prom import ServeMetrics, kernel_families, learner_families
from osd_bench.serve_report import load_table
from osd.serve.schemas import ChatCompletionRequest, CompletionRequest
from osd.serve.settings import ServeSettings
from osd.serve.translate import sampling_from
from osd.serve.worker import Worker


@pytest.mark.parametrize("exc,status,code", [
    (ContextTooLong("x"), 400, "context_length_exceeded"),
    (InvalidArgument("x"), 400, None),
    (errors.BadParam("x", param="top_p"), 400, None),
    (errors.UnknownModel("x"), 404, "model_not_found"),
    (errors.Unauthorized("x"), 401, "invalid_api_key"),
    (errors.BodyTooLarge("x"), 413, "request_too_large"),
    (errors.BadJSON("x"), 400, "invalid_json"),
    (errors.ShuttingDown("x"), 503, "shutting_down"),
    (KeyError("secret detail"), 500, None),
])
def test_error_table(exc, status, code):
    got_status, body = errors.error_body(exc)
    assert got_status == status and body["error"]["code"] == code
    if status == 500:
        assert "secret" not in body["error"]["message"]  # internals are logged, not sent


@pytest.mark.parametrize("body,param,code", [
    ({"messages": "abc"}, "messages", "invalid_type"),
    ({"model": "m"}, "messages", "missing_required_parameter"),
    ({"messages": [], "stop": 5}, "stop", "invalid_type"),  # the request field, not pydantic's union branch
])
def test_validation_error_is_400_with_the_field(body, param, code):
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate(body)
    status, error = errors.error_body(info.value)
    assert status == 400 and (error["error"]["param"], error["error"]["code"]) == (param, code)  # as OpenAI, not 422


def test_error_response_is_ascii_json_even_for_surrogates():
    response = errors.error_response(errors.BadParam("bad text '\ud800'", param="prompt"))
    assert response.status_code == 400 and response.body.isascii()
    assert json.loads(response.body)["error"]["message"] == "bad text '\ud800'"


def test_sampling_from_defaults_and_field_names():
    settings = ServeSettings(default_max_tokens=17, default_temperature=0.7)
    s = sampling_from(CompletionRequest(prompt="a", stop="x"), settings)
    assert (s.max_new_tokens, s.temperature, s.top_p, s.stop) == (17, 0.7, 1.0, ["x"])
    with pytest.raises(errors.BadParam) as info:
        sampling_from(CompletionRequest(prompt="a", max_tokens=0), settings, 0)
    assert info.value.param == "max_tokens" and "max_tokens" in str(info.value)


def test_settings_validate():
    with pytest.raises(InvalidArgument):
        ServeSettings(max_body_bytes=0)
    assert ServeSettings(api_key="").api_key is None
    with pytest.raises(InvalidArgument, match="api_key"):
        ServeSettings(metrics_require_key=True)  # a key to require is needed
    assert ServeSettings(api_key="k", metrics_require_key=True).metrics_require_key


def test_learner_families_keep_numbers_only_gauges_for_levels():
    families = {f.name: f for f in learner_families({"buffer_positions": 3, "training": True, "loss": float("nan"),
                                                      "name": "x", "updates_published": 4, "train_seconds": 1.5})}
    assert set(families) == {"osd_learner_buffer_positions", "osd_learner_training", "osd_learner_updates_published",
                             "osd_learner_train_seconds"}
    assert families["osd_learner_training"].type == "gauge" and families["osd_learner_training"].samples[0].value == 1
    assert families["osd_learner_updates_published"].type == "counter"
    assert families["osd_learner_updates_published"].samples[0].name == "osd_learner_updates_published_total"


class _Counters:
    def counters(self):
        from osd.metrics import SpecCounters

        c = SpecCounters(requests=1)
        c.add_step(2, 1, 2, [1.0, 0.0], 0.01, 0.02)
        return {("draft", 3): c}


class _BrokenLearner:
    def stats(self):
        raise RuntimeError("learner fault")


def test_two_apps_keep_their_own_registries_and_a_learner_fault_spares_the_rest():
    from prometheus_client.parser import text_string_to_metric_families

    first, second = ServeMetrics(), ServeMetrics()  # the same names twice in one process: no collision
    first.attach(_Counters(), _BrokenLearner(), lambda: 5)
    second.attach(_Counters())
    first.count("/v1/completions", 500)
    first.observe(0.3, 0.1, n_prompt=4, n_new=2, generation_seconds=0.2)
    parsed = lambda m: {(s.name, tuple(sorted(s.labels.items()))): s.value
                        for f in text_string_to_metric_families(m.render().decode()) for s in f.samples}
    one, two = parsed(first), parsed(second)
    assert one[("osd_http_requests_total", (("endpoint", "/v1/completions"), ("status", "500")))] == 1
    assert not any(name == "osd_http_requests_total" for name, _ in two)
    assert one[("osd_queue_depth", ())] == 5 and one[("osd_prompt_tokens_total", ())] == 4
    assert one[("osd_request_duration_seconds_bucket", (("le", "0.5"),))] == 1
    assert one[("osd_request_duration_seconds_bucket", (("le", "0.25"),))] == 0
    assert one[("osd_time_per_output_token_seconds_sum", ())] == pytest.approx(0.1)
    labels = (("draft", "draft"), ("draft_version", "3"))
    assert one[("osd_spec_proposed_total", labels)] == 2 and one[("osd_spec_accepted_total", labels)] == 1
    assert one[("osd_spec_accepted_at_total", labels + (("position", "1"),))] == 0
    assert one[("osd_spec_target_seconds_total", labels)] == pytest.approx(0.02)
    assert not any(name.startswith("osd_learner") for name, _ in one)  # the fault is logged, the rest still served


@pytest.mark.parametrize("compiled,fallback,path", [
    (True, [], "compiled"), (False, ["draft int8 linears: torch dynamic int8"], "torch_fallback"),
    (False, [], "unavailable"), (None, [], "not_loaded"),
])
def test_kernel_status_is_exposed_as_info_with_its_path_and_fallbacks(compiled, fallback, path):
    from prometheus_client.parser import text_string_to_metric_families

    status = {"compiled": compiled, "error": None if compiled else "disabled by OSD_NO_KERNELS\nmore", "fallback": fallback,
              "avx512_vnni": False}
    metrics = ServeMetrics()
    metrics.attach(_Counters(), kernel_status=lambda: status)
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    (info,) = families["osd_kernel_info"].samples  # an Info: in the text format, a gauge of value 1
    assert info.name == "osd_kernel_info" and info.value == 1
    assert info.labels == {"path": path, "fallback": ",".join(fallback), "avx512_vnni": "false",
                           "error": "" if compiled else "disabled by OSD_NO_KERNELS"}
    uses = {s.labels["use"]: s.value for s in families["osd_kernel_fallback"].samples}
    assert uses == {use: 1 for use in fallback}
    status["fallback"] = ["target fp32 linears: oneDNN"]  # read at each scrape, not copied once
    assert [f for f in kernel_families(status) if f.name == "osd_kernel"][0].samples[0].labels["fallback"] == \
        "target fp32 linears: oneDNN"
    assert 'use="target fp32 linears: oneDNN"' in metrics.render().decode()


def _tiny_engine(max_batch: int = 2):
    from conftest import ToyTokenizer, tiny_qwen2
    from helpers import make_engine

    engine, _ = make_engine(tiny_qwen2(seed=0), tiny_qwen2(seed=1, layers=1), ToyTokenizer(), k=2, max_batch=max_batch)
    engine.eos_ids = set()  # never stops early: every answer runs to its max_new_tokens
    return engine


def test_worker_survives_a_failing_request():
    from osd.config import SamplingConfig

    async def main():
        worker = Worker(_tiny_engine())
        try:
            first = worker.submit([5, 10_000], SamplingConfig(max_new_tokens=4))  # outside the vocabulary
            second = worker.submit([5, 6], SamplingConfig(max_new_tokens=4), stream=True)
            events = [await first.next()]
            while (event := await second.next())[0] == "text":
                events.append(event)
            return events, event
        finally:
            await asyncio.to_thread(worker.stop)

    events, last = asyncio.run(main())
    assert events[0][0] == "error" and isinstance(events[0][1], InvalidArgument)
    assert len(events) > 1 and all(kind == "text" for kind, _ in events[1:])
    assert last[0] == "done" and len(last[1].token_ids) == 4 and last[1].text == "".join(t for _, t in events[1:])


def test_worker_refuses_jobs_after_stop():
    async def main():
        worker = Worker(_tiny_engine())
        worker.start()
        await asyncio.to_thread(worker.stop)
        with pytest.raises(errors.ShuttingDown):
            worker.submit([1], None)

    asyncio.run(main())


def test_cli_registers_serve_commands():
    from osd.cli import build_parser

    args = build_parser().parse_args(["serve", "--port", "9001", "--api-key", "k", "--k", "3", "--metrics-require-key"])
    assert (args.port, args.api_key, args.k, args.host) == (9001, "k", 3, "127.0.0.1")
    assert args.metrics_require_key
    args = build_parser().parse_args(["bench", "serve", "--concurrency", "1", "2", "--max-tokens", "8"])
    assert args.concurrency == [1, 2] and args.max_tokens == 8


def test_percentile():
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile([1.0, 2.0], 95) == pytest.approx(1.95)


def test_load_generator_against_live_server(tmp_path, monkeypatch):
    import json

    from osd_bench.serve_report import report_load

    with tiny_server(api_key="k") as served:
        result = run_load(served.url, ["abc", "defg", "hij"], max_tokens=8, concurrency=(1, 2), api_key="k")
    assert result["config"]["model"] == MODEL and result["warmup_ok"]
    for level in result["levels"]:
        assert level["errors"] == 0 and level["requests"] == 3
        assert level["completion_tokens"] > 0 and level["tokens_per_second"] > 0
        assert level["ttft_p50"] > 0 and level["tpot_p95"] >= level["tpot_p50"] >= 0
        assert 0 <= level["acceptance_rate"] <= 1
    assert "TTFT p50" in load_table(result)
    # the recorded result: JSON and a BENCHMARKS.md block with the table and the command, the API key hidden
    monkeypatch.setattr("sys.argv", ["osd", "bench", "serve", "--api-key", "s3cret", "--concurrency", "1", "2"])
    report_load(result, str(tmp_path / "load.json"), str(tmp_path / "B.md"))
    block = (tmp_path / "B.md").read_text()
    assert "## Serving load (`osd bench serve`)" in block and load_table(result) in block
    assert "--api-key ***" in block and "s3cret" not in block and "s3cret" not in (tmp_path / "load.json").read_text()
    assert json.loads((tmp_path / "load.json").read_text())["levels"] == result["levels"]


def test_recorded_command_hides_the_api_key():
    from osd.records import redacted_command

    cmd = redacted_command(["bench", "serve", "--api-key", "s3cret", "--api-key=s3cret", "--limit", "2"])
    assert "s3cret" not in cmd and cmd.endswith("--limit 2")


def test_worker_aborts_a_cancelled_generation_and_the_other_goes_on():
    from osd.config import SamplingConfig

    engine = _tiny_engine()

    async def main():
        worker = Worker(engine)
        job = worker.submit([5], SamplingConfig(max_new_tokens=200), stream=True)
        other = worker.submit([6], SamplingConfig(max_new_tokens=30))
        assert (await job.next())[0] == "text"
        job.cancelled = True  # what the stream does when its client disconnects
        while (event := await job.next())[0] == "text":
            pass
        done = await other.next()
        await asyncio.to_thread(worker.stop)
        return event, done

    (kind, err), (other_kind, other) = asyncio.run(main())
    assert kind == "error" and isinstance(err, errors.ShuttingDown) and not engine.scheduler.running
    assert other_kind == "done" and len(other.token_ids) == 30
    assert engine.scheduler.stats.emitted < 200 + 30  # the cancelled one stopped long before its 200 tokens


def test_a_failed_step_answers_every_running_job_with_its_error_and_the_worker_serves_on():
    """A fault of the shared step (outside any one sequence): each of the jobs running in it gets the error, none is
    left waiting, and the next job is served."""
    from osd.config import SamplingConfig

    engine = _tiny_engine(max_batch=3)
    fault, step, raised = RuntimeError("the step failed"), engine.scheduler.step, []

    def fails_once_all_three_run():
        if len(engine.scheduler.running) == 3 and not raised:
            raised.append(fault)
            raise fault
        return step()

    engine.scheduler.step = fails_once_all_three_run

    async def main():
        worker = Worker(engine)
        try:
            jobs = [worker.submit([5 + i], SamplingConfig(max_new_tokens=150)) for i in range(3)]
            events = [await job.next() for job in jobs]
            after = await worker.submit([9], SamplingConfig(max_new_tokens=4)).next()
            return events, after
        finally:
            await asyncio.to_thread(worker.stop)

    events, after = asyncio.run(main())
    assert [kind for kind, _ in events] == ["error"] * 3 and all(err is fault for _, err in events)
    assert after[0] == "done" and len(after[1].token_ids) == 4 and not engine.scheduler.running
