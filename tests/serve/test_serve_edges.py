"""Behaviours at the API's edges, through the real `openai` client against a live server (issue 63): a stop string
completed by the last allowed token, OpenAI's newer field and role names, and a streaming client that goes away.
Each test is written so that the wrong behaviour fails it (scripts/mutants.json plants each)."""
import threading
import time

import pytest
from conftest import EOS, ToyTokenizer, tiny_qwen2
from helpers import make_engine, plain_greedy
from serve_testing import MODEL, live_server, tiny_server

from osd.data import chat_ids
from osd.serve.app import create_app

N = 20


@pytest.fixture(scope="module")
def served():
    with tiny_server(default_max_tokens=N) as s:
        yield s


def greedy_text(served, prompt_ids, n=N):
    return served.tokenizer.decode(plain_greedy(served.target, prompt_ids, n, eos=EOS))


def chat_text(served, messages, n=N):
    return greedy_text(served, chat_ids(served.tokenizer, messages), n)


def stop_ending_at_the_last_token(full: str) -> tuple[int, str]:
    """(m, stop): a 2-character stop string whose first occurrence in `full` ends exactly at character m (the toy
    tokenizer: one character per token, so at the m-th token)."""
    for m in range(len(full), 2, -1):
        stop = full[m - 2 : m]
        if full.find(stop) == m - 2:
            return m, stop
    raise AssertionError(f"no stop string ends a prefix of {full!r} at its first occurrence")


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_completed_by_the_max_tokens_th_token_stops_not_lengths(served, stream):
    """OpenAI and vLLM: the stop string wins over the length limit reached by the same token: text cut before the
    stop string, finish_reason "stop"."""
    full = greedy_text(served, served.tokenizer.encode("abc"))
    assert len(full) == N, "the toy greedy text must not end early for this test"
    m, stop = stop_ending_at_the_last_token(full)
    r = served.client().completions.create(model=MODEL, prompt="abc", temperature=0, max_tokens=m, stop=[stop],
                                           stream=stream)
    if stream:
        chunks = list(r)
        text, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    else:
        text, finish = r.choices[0].text, r.choices[0].finish_reason
    assert (text, finish) == (full[: m - 2], "stop")
    # one token fewer: the stop string is not complete, the limit ends it
    r = served.client().completions.create(model=MODEL, prompt="abc", temperature=0, max_tokens=m - 1, stop=[stop])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (full[: m - 1], "length")


def test_max_completion_tokens_limits_a_chat_answer(served):
    """OpenAI's current name for the limit (max_tokens is deprecated on chat): honoured, not the server's default."""
    messages = [{"role": "user", "content": "abc"}]
    assert len(chat_text(served, messages)) == N > 5  # the default would give more than the limit asked for
    r = served.client().chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                 max_completion_tokens=5)
    assert r.choices[0].message.content == chat_text(served, messages, 5) and r.usage.completion_tokens == 5
    assert r.choices[0].finish_reason == "length"
    stream = served.client().chat.completions.create(model=MODEL, messages=messages, temperature=0, stream=True,
                                                      max_completion_tokens=5, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat_text(served, messages, 5)
    assert chunks[-1].usage.completion_tokens == 5


def test_the_developer_role_reaches_the_template_as_system(served):
    """OpenAI's `developer` role is its newer name for `system`: the template gets "system" (templates such as
    Qwen2.5's drop a role they do not know, and the instructions vanish)."""
    as_developer = [{"role": "developer", "content": "xyz"}, {"role": "user", "content": "abc"}]
    as_system = [{"role": "system", "content": "xyz"}, {"role": "user", "content": "abc"}]
    want = chat_text(served, as_system)
    assert want != chat_text(served, as_developer), "the toy template must tell the two roles apart for this test"
    r = served.client().chat.completions.create(model=MODEL, messages=as_developer, temperature=0)
    assert r.choices[0].message.content == want
    assert r.usage.prompt_tokens == len(chat_ids(served.tokenizer, as_system))


def test_content_as_text_parts_and_stop_as_a_string_mean_what_their_plain_forms_mean(served):
    """OpenAI's other spellings: a message content given as a list of text parts is their concatenation, and `stop`
    given as one string is that one stop string."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "ab"}, {"type": "text", "text": "c"}]}]
    r = served.client().chat.completions.create(model=MODEL, messages=parts, temperature=0)
    assert r.choices[0].message.content == chat_text(served, [{"role": "user", "content": "abc"}])
    full = greedy_text(served, served.tokenizer.encode("abc"))
    m, stop = stop_ending_at_the_last_token(full)
    r = served.client().completions.create(model=MODEL, prompt="abc", temperature=0, stop=stop)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (full[: m - 2], "stop")


class StepGate:
    """Holds the scheduler's steps until the test lets them run (`allow`), so what happens between two steps does not
    depend on how fast the machine is. `open()` lets every step through (teardown)."""

    def __init__(self, scheduler):
        self._permits, self._open, self.steps = threading.Semaphore(0), threading.Event(), 0
        run = scheduler.step

        def step():
            while not self._open.is_set() and not self._permits.acquire(timeout=0.05):
                pass
            self.steps += 1
            return run()

        scheduler.step = step

    def allow(self, n: int = 1) -> None:
        self._permits.release(n)

    def open(self) -> None:
        self._open.set()


def wait_for(what: str, predicate, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {timeout} s: {what}")
        time.sleep(0.01)


def test_a_streaming_client_that_disconnects_cancels_its_generation():
    """The abandoned request leaves the scheduler at the next step instead of holding its slot to max_tokens."""
    target, draft, tokenizer = tiny_qwen2(seed=0), tiny_qwen2(seed=1, layers=1), ToyTokenizer()
    engine, _ = make_engine(target, draft, tokenizer, k=2)
    engine.eos_ids = set()  # never stops early: without cancellation it runs to its 200 tokens
    app = create_app(engine, tokenizer, MODEL)
    worker, gate = app.state.worker, StepGate(engine.scheduler)
    try:
        with live_server(app) as url:
            from openai import OpenAI

            client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
            gate.allow(2)  # the response starts with the first text: two steps for it
            stream = client.completions.create(model=MODEL, prompt="abc", temperature=0, max_tokens=200, stream=True)
            first = next(iter(stream))
            assert first.choices[0].text
            wait_for("the request running", lambda: worker.running == 1)
            stream.close()  # the client goes away mid-answer
            job = next(iter(worker._jobs.values()))
            wait_for("the disconnected stream's job marked cancelled", lambda: job.cancelled)
            before = gate.steps
            gate.allow(3)
            wait_for("the cancelled request out of the scheduler", lambda: worker.running == 0
                     and not engine.scheduler.running)
            assert gate.steps - before <= 1  # it left at the next step
            assert engine.scheduler.stats.emitted < 200 // 3
    finally:
        gate.open()
