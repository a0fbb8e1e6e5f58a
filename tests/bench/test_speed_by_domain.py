"""`osd bench speed`'s per-domain table: decode tokens/s of each arm over the baseline's, prompt time left out."""
import pytest

from osd_bench.speed import decode_speedup_by_domain


def _timed(tokens, seconds, prompt_seconds):
    return {"tokens": tokens, "seconds": seconds, "prompt_seconds": prompt_seconds, "identical_to_osd_target": True}


def test_each_domain_sums_its_own_prompts_and_leaves_the_prompt_time_out():
    result = {"baseline": "llama_cpp_target", "per_prompt": [
        {"id": "code-0", "domain": "code", "prompt_tokens": 5,
         "llama_cpp_target": _timed(64, 5.0, 1.0), "osd_q4": _timed(64, 3.0, 1.0)},  # decode 16 vs 32 tok/s
        {"id": "code-1", "domain": "code", "prompt_tokens": 5,
         "llama_cpp_target": _timed(32, 2.5, 0.5), "osd_q4": _timed(32, 2.5, 0.5)},  # equal
        {"id": "chat-0", "domain": "chat", "prompt_tokens": 5,
         "llama_cpp_target": _timed(10, 2.0, 0.0), "osd_q4": _timed(10, 4.0, 0.0)},  # half as fast
    ]}
    got = decode_speedup_by_domain(result)
    assert set(got) == {"code", "chat"}
    assert got["code"]["llama_cpp_target"] == pytest.approx(1.0)
    assert got["code"]["osd_q4"] == pytest.approx((96 / 4.0) / (96 / 6.0))  # summed over the domain's prompts: 1.5
    assert got["chat"]["osd_q4"] == pytest.approx(0.5)


def test_spider_prompts_carry_their_schema_and_others_stay_as_they_are():
    from osd_bench.speed import bench_prompts

    spider = bench_prompts(2, domains=("spider",))
    for record in spider:
        assert record["prompt"].startswith("Given this SQLite schema:\nCREATE TABLE ")
        assert record["prompt"].endswith(record["prompt"].split("answers: ", 1)[1])
    first = spider[0]["prompt"]
    assert "CREATE TABLE singer (" in first and "How many singers do we have?" in first
    code = bench_prompts(1, domains=("code",))[0]
    from osd.data import load_records

    assert code["prompt"] == load_records("code", split="test", limit=1)[0]["prompt"]
