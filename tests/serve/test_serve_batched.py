"""The server with continuous batching: concurrent requests share steps and each gets its own answer."""
from concurrent.futures import ThreadPoolExecutor

from conftest import ToyTokenizer, tiny_qwen2
from helpers import make_engine
from prometheus_client.parser import text_string_to_metric_families
from serve_testing import MODEL, tiny_server

from osd.config import SamplingConfig

PROMPTS = ["hellothere", "abc", "thequickbrownfox", "abcdefg", "zzz", "whatisthis", "ok", "moretexthere"]
MAX_TOKENS = [20, 7, 25, 12, 18, 9, 22, 15]


def metric_values(text: str) -> dict:
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_concurrent_requests_share_steps_and_each_answer_is_the_one_it_gets_alone():
    tokenizer = ToyTokenizer()
    reference, _ = make_engine(tiny_qwen2(seed=0), tiny_qwen2(seed=1, layers=1), tokenizer, k=4)
    want = [tokenizer.decode(reference.generate(tokenizer.encode(p), SamplingConfig(max_new_tokens=n)).token_ids)
            for p, n in zip(PROMPTS, MAX_TOKENS)]
    with tiny_server(max_batch=4) as served:
        client = served.client()

        def ask(i):
            if i % 2:  # half stream, half not
                chunks = client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=MAX_TOKENS[i],
                                                   temperature=0, stream=True)
                return "".join(c.choices[0].text for c in chunks)
            return client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=MAX_TOKENS[i],
                                             temperature=0).choices[0].text

        def bad(_):  # a request the engine refuses (prompt + max_tokens past the context): it fails alone
            try:
                client.completions.create(model=MODEL, prompt="a" * 200, max_tokens=100, temperature=0)
            except Exception as e:  # noqa: BLE001
                return getattr(e, "status_code", None)
            return 200

        with ThreadPoolExecutor(9) as pool:
            bad_status = pool.submit(bad, 0)
            got = list(pool.map(ask, range(len(PROMPTS))))
        assert got == want
        assert bad_status.result() == 400
        with served.http() as http:
            text = http.get("/metrics").text
    values = metric_values(text)
    info = next(s.labels for f in text_string_to_metric_families(text) for s in f.samples if s.name == "osd_engine_info")
    assert info == {"target_backend": "CachedModel", "slots": "RunnerSlots", "draft_runner": "CachedModel",
                    "k_limit": "4", "k_asked": "4", "max_batch": "4", "greedy_identity": "exact", "tree_nodes": "0"}
    assert values["osd_spec_rows_total"] >= values["osd_spec_steps_total"] > 0  # every step verified a row at least
    assert values["osd_sequence_capacity"] == 4 and values["osd_sequences_running"] == 0
    assert values["osd_schedule_sequence_steps_total"] > values["osd_schedule_steps_total"] > 0  # steps were shared
    assert values["osd_schedule_emitted_total"] >= sum(len(w) for w in want)
