"""`osd bench soak`, short: concurrent clients against a live in-process server on tiny models."""
import os

import pytest
from conftest import save_tiny_pair
from serve_testing import MODEL, FakeLearner, learning_server, tiny_server

from osd_bench.soak import (Case, GreedyKey, Outcome, SoakConfig, build_cases, error_body_ok, greedy_mismatches,
                            run_soak, summarise)
from osd_bench.soak_server import target_only_references
from osd.engine import SpeculativeEngine

KEY = "soak-key"
PROMPTS = ["abc", "hello", "xyzzy"]  # the toy tokenizer's alphabet only
MAX_BODY = 20_000


@pytest.fixture(scope="module")
def soaked(tmp_path_factory):
    """The short soak against what `osd serve` runs: the real online learner and the scheduler (4 sequences per
    step) on the tiny pair, until the learner has published an update (warm-up) and then 2 s of mixed load."""
    root = tmp_path_factory.mktemp("soak")
    save_tiny_pair(root, draft_layers=1)
    with learning_server(root, root / "ckpt", api_key=KEY, max_body_bytes=MAX_BODY) as (served, system):
        cases = build_cases(MODEL, PROMPTS, max_tokens=8, context=served.engine.context_window,
                            max_body_bytes=MAX_BODY, api_key=KEY)
        target_only = SpeculativeEngine(served.target, served.tokenizer, proposer=None)  # k = 0
        references = target_only_references(target_only, served.tokenizer, cases)
        config = SoakConfig(clients=4, seconds=2.0, min_requests=2 * len(cases), seed=1, sample_every=0.5,
                            warmup_updates=1, warmup_max_rounds=20)
        result = run_soak(served.url, cases, config, references, api_key=KEY, pid=os.getpid())
    return cases, references, result


def test_every_kind_was_sent_and_every_answer_is_right(soaked):
    cases, _, result = soaked
    assert set(result["kinds"]) == {c.kind for c in cases}  # malformed JSON ... wrong key, disconnects
    assert result["requests"] >= 2 * len(cases) and result["warmup_ok"]
    for kind, k in result["kinds"].items():
        assert k["ok"] == k["sent"], (kind, k)  # the expected status, a full answer or an OpenAI-style error
        assert k["got"] == {str(k["expected"]): k["sent"]}, (kind, k)
    assert result["valid"]["ok"] == result["valid"]["sent"] > 0
    assert result["invalid"]["ok"] == result["invalid"]["sent"] > 0
    assert result["disconnects"]["sent"] > 0 and result["valid"]["latency_p95"] >= result["valid"]["latency_p50"] > 0


def test_greedy_answers_equal_target_only(soaked):
    cases, references, result = soaked
    assert len(references) == len({c.greedy for c in cases if c.greedy})  # once per distinct greedy request
    assert result["greedy"]["checked"] > 0 and result["greedy"]["identical"] == result["greedy"]["checked"]
    assert result["targets"]["greedy_identical_to_target_only"] is True


def test_server_counted_every_response_and_reported_the_learner(soaked):
    _, _, result = soaked
    assert result["metrics_match_responses"] is True
    assert result["metrics_counted"]["/v1/chat/completions 413"] > 0
    learner = result["learner"]  # the real learner's stats, read back from /metrics
    assert learner["updates_published_start"] >= 1 and learner["updates_published_end"] >= learner["updates_published_start"]
    server = result["server"]
    assert server["rss_start_bytes"] > 0 and server["threads_end"] > 0 and server["rss_growth_pct"] is not None
    assert server["rss_peak_bytes"] >= server["rss_mid_bytes"] > 0
    series = server["rss_series_mib"]["mib"]  # every sample, first = after the warm-up: a plateau tells from a leak
    assert series[0] == round(server["rss_start_bytes"] / 2**20, 1)
    assert max(series) <= round(server["rss_peak_bytes"] / 2**20, 1)  # both rounded to 0.1 MiB
    assert server["rss_after_serial_warmup_bytes"] > 0 and server["rss_growth_from_serial_warmup_pct"] is not None
    halves = sorted(series[: len(series) // 2]), sorted(series[len(series) // 2 :])
    assert [round(server[f"rss_median_{h}_half_bytes"] / 2**20, 1) for h in ("first", "second")] == \
        [h[len(h) // 2] for h in halves]
    assert all(result["targets"][t] for t in ("all_valid_answered", "all_invalid_rejected_right",
                                              "disconnects_survived", "every_status_counted"))


def test_checks_catch_wrong_answers():
    key = GreedyKey(True, "abc", 8)
    right = Outcome("chat", 200, status=200, ok=True, text="xyz", greedy=key)
    assert greedy_mismatches([right], {key: "xyz"}) == (1, [])
    checked, bad = greedy_mismatches([right], {key: "xyy"})
    assert checked == 1 and bad[0]["got"] == "xyz" and bad[0]["target_only"] == "xyy"
    summary = summarise([right, Outcome("unknown_model", 404, status=400, ok=False, error="expected 404")], {key: "xyy"})
    assert summary["invalid"] == {"sent": 1, "ok": 0} and summary["kinds"]["unknown_model"]["got"] == {"400": 1}
    assert summary["greedy"]["identical"] == 0


@pytest.mark.parametrize("body,code,ok", [
    ({"error": {"message": "m", "type": "invalid_request_error", "param": None, "code": "invalid_json"}}, "invalid_json", True),
    ({"error": {"message": "m", "type": "invalid_request_error", "param": None, "code": None}}, "invalid_json", False),
    ({"error": {"message": "", "type": "invalid_request_error", "param": None, "code": None}}, None, False),
    ({"error": {"message": "m", "type": "x", "code": None}}, None, False),
    ({"detail": "Not Found"}, None, False),
    (["not", "an", "object"], None, False),
])
def test_error_body_shape(body, code, ok):
    assert error_body_ok(body, code) is ok


def test_error_body_type_and_param_are_checked_where_given():
    body = {"error": {"message": "m", "type": "invalid_request_error", "param": "messages[0].content", "code": None}}
    assert error_body_ok(body, None, "invalid_request_error", "messages[0].content")
    assert not error_body_ok(body, None, "invalid_request_error", "messages")  # another field named
    assert not error_body_ok(body, None, "server_error", ...)  # another type
    assert not error_body_ok(body, None, "invalid_request_error", None)


def test_every_invalid_case_states_the_param_it_expects():
    cases = build_cases(MODEL, ["abc"], 4, context=256, max_body_bytes=100, api_key="k")
    assert all(c.param is not ... for c in cases if not c.valid)
    params = {c.kind: c.param for c in cases}
    assert params["nul_character"] == params["lone_surrogate"] == "messages[0].content"
    assert params["wrong_type_max_tokens"] == "max_tokens" and params["unknown_model"] == "model"


def test_cli_registers_soak():
    from osd.cli import build_parser

    args = build_parser().parse_args(["bench", "soak", "--clients", "8", "--minutes", "10", "--models", "tiny"])
    assert (args.clients, args.minutes, args.models, args.url) == (8, 10.0, "tiny", None)


def test_case_expectations_cover_the_issue():
    cases = build_cases(MODEL, ["abc"], 4, context=256, max_body_bytes=100, api_key="k")
    expect = {c.kind: (c.expect, c.code) for c in cases}
    assert expect["oversized_body"] == (413, "request_too_large") and expect["wrong_key"] == (401, "invalid_api_key")
    assert expect["prompt_past_context"] == (400, "context_length_exceeded")
    assert expect["unknown_model"] == (404, "model_not_found") and expect["malformed_json"] == (400, "invalid_json")
    assert {"lone_surrogate", "nul_character", "unknown_role", "stop_wrong_type", "wrong_type_messages",
            "disconnect_mid_stream", "chat_stream", "completion"} <= set(expect)
    assert all(isinstance(c, Case) for c in cases)


def test_tiny_pair_on_disk_loads_as_osd_serve_would(tmp_path):
    from osd_bench.soak_server import ServerProcess
    from osd_bench.tiny_pair import write_tiny_pair
    from osd.data import chat_ids
    from osd.models.loading import load_model, load_tokenizer
    from osd.models.tokenizer import check_same_tokenizer

    target_dir, draft_dir = write_tiny_pair(tmp_path)
    assert write_tiny_pair(tmp_path) == (target_dir, draft_dir)  # written once
    tokenizer = load_tokenizer(target_dir)
    check_same_tokenizer(tokenizer, load_tokenizer(draft_dir))
    ids = tokenizer("def f(x):\n  return x", add_special_tokens=False)["input_ids"]
    assert len(ids) == 20 and tokenizer.decode(ids) == "def f(x):\n  return x"  # one token per character
    assert tokenizer.decode(chat_ids(tokenizer, [{"role": "user", "content": "hi"}])) == "<user>hi\n<assistant>"
    target, draft = load_model(target_dir), load_model(draft_dir)
    assert target.config.vocab_size == draft.config.vocab_size == len(tokenizer)
    assert (target.config.num_hidden_layers, draft.config.num_hidden_layers) == (2, 1)
    command = ServerProcess(target_dir, draft_dir, 1000).command()
    assert ["--target", target_dir, "--draft", draft_dir] == command[command.index("--target"):command.index("--target") + 4]
    assert "--api-key" not in command  # the key goes by environment, not argv


def test_rss_plot_is_drawn_from_the_series(soaked, tmp_path):
    from osd_bench.soak_report import plot_rss

    _, _, result = soaked
    path = plot_rss(result, str(tmp_path / "rss.png"))
    assert path is not None and (tmp_path / "rss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class WarmingLearner(FakeLearner):
    """Publishes its first update only after /metrics has read it a few times (a learner still warming up)."""

    def __init__(self, first_after: int):
        super().__init__()
        self.reads, self.first_after = 0, first_after

    def stats(self) -> dict:
        self.reads += 1
        return super().stats() | {"updates_published": int(self.reads > self.first_after)}


@pytest.mark.parametrize("first_after, max_rounds, rounds", [(3, 50, 3), (100, 2, 2)])
def test_warm_up_waits_for_the_learners_first_update(first_after, max_rounds, rounds):
    learner = WarmingLearner(first_after)
    with tiny_server(learner=learner, stats_interval=0) as served:  # no stats line: only /metrics reads the learner
        cases = [c for c in build_cases(MODEL, PROMPTS[:1], max_tokens=4, context=served.engine.context_window,
                                        max_body_bytes=1_000_000, api_key=None) if c.valid][:2]
        config = SoakConfig(clients=2, seconds=0.0, min_requests=len(cases), warmup_rounds=1, warmup_max_rounds=max_rounds)
        result = run_soak(served.url, cases, config, {}, pid=os.getpid())
    assert result["warmup_rounds"] == rounds  # one scrape before the rounds, one after each
    assert result["learner"]["updates_published_start"] == (1 if rounds < max_rounds else 0)
    assert result["warmup_requests"] == len(cases) + rounds * len(cases) * config.clients


def test_warm_up_without_a_learner_sends_the_asked_rounds_only():
    with tiny_server(learner=None) as served:
        cases = [c for c in build_cases(MODEL, PROMPTS[:1], max_tokens=4, context=served.engine.context_window,
                                        max_body_bytes=1_000_000, api_key=None) if c.valid][:2]
        config = SoakConfig(clients=2, seconds=0.0, min_requests=len(cases), warmup_rounds=2)
        result = run_soak(served.url, cases, config, {}, pid=os.getpid())
    assert result["warmup_rounds"] == 2 and result["learner"]["updates_published_start"] is None
