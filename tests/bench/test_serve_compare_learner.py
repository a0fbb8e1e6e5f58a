"""serve-vs records how many optimizer steps a learning server took during each level (its learning cost's worth)."""
import asyncio

import httpx

from osd.bench.serve_compare import learner_steps


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
