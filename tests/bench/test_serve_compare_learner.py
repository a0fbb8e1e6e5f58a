"""serve-vs records how many optimizer steps a learning server took during each level (its learning cost's worth)."""
import asyncio

import httpx

from osd_bench.serve_compare import learner_steps


def steps_of(handler) -> int | None:
    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://x") as client:
            return await learner_steps(client)

    return asyncio.run(go())


def test_learner_steps_read_from_the_learner_route_and_none_without_a_learner():
    assert steps_of(lambda r: httpx.Response(200, json={"optimizer_steps": 24, "version": 3})) == 24
    assert steps_of(lambda r: httpx.Response(404, json={"error": {"code": "learner_not_running"}})) is None
    assert steps_of(lambda r: httpx.Response(404, text="Not Found")) is None  # llama-server
    assert steps_of(lambda r: httpx.Response(200, text="not json")) is None


def test_a_level_keeps_each_request_in_prompt_order_so_a_tail_can_be_read():
    from osd_bench.serve_compare import summarise_level
    from osd_bench.serve_load import Sample, percentile

    samples = [Sample(ok=True, ttft=t, seconds=t + 2.0, completion_tokens=64, prompt_tokens=p)
               for t, p in [(0.4, 120), (2.5, 900), (0.6, 150)]] + [Sample(ok=False, error="HTTP 500")]
    record = summarise_level("osd", False, 2, samples, 10.0, None, {})
    rows = record["per_request"]
    assert [r["prompt_tokens"] for r in rows] == [120, 900, 150, 0] and [r["ok"] for r in rows] == [True] * 3 + [False]
    assert record["ttft_p95_s"] == percentile([r["ttft_s"] for r in rows if r["ok"]], 95)
    assert max(rows[:3], key=lambda r: r["ttft_s"])["prompt_tokens"] == 900  # the tail is the long prompt here
