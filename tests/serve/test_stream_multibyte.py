"""Streamed text on the real tokenizers (the bundled Qwen2.5 and SmolLM2 ones, both byte-level BPEs): the concatenated
stream equals the final text, and no U+FFFD appears that the final text does not hold, for texts in several scripts
whose characters' UTF-8 bytes are split across tokens; with and without stop strings and length limits, with
speculation accepting several tokens a step.

The target is scripted (it continues prompt + text exactly) and the proposer drafts the text with a mistake now and
then, so steps emit 1 to k + 1 tokens at random places; only the tokenizer is real."""
import random

import pytest
import torch
from serve_testing import live_server

from osd.config import SamplingConfig, SpeculationConfig
from osd.engine import SpeculativeEngine
from osd.models.loading import load_tokenizer
from osd.propose.base import Proposal
from osd.serve.app import create_app

pytestmark = pytest.mark.real

TEXTS = [
    "日本語のテキスト：東京は日本の首都です。😀🎉",
    "中文文本，包含标点符号。我爱北京天安门！",
    "Русский текст: съешь же ещё этих мягких французских булок.",
    "Ελληνικά, العربية, हिन्दी और 한국어 문장.",
    "Emoji: 👩‍👩‍👧‍👦 🇯🇵 🏳️‍🌈 ✨ café naïve Zürich — “quoted” …",
    "def f(x):\n    return x ** 2  # 平方 (квадрат)\n",
    "They said : do n't go , it ' s late ! Wait ... ok ? f(a , b) -- they 're here 've 'm",  # what HF's clean-up rewrites
]
TOKENIZERS = ["bundled:qwen2.5-coder-0.5b", "bundled:smollm2-135m"]  # SmolLM2's package: files read, never imported
K = 4


@pytest.fixture(scope="module", params=TOKENIZERS)
def tokenizer(request):
    return load_tokenizer(request.param)


class ScriptedTarget:
    """A target runner whose next token at every position is the script's (prompt + text), whatever it was fed."""

    max_rows, context_window, eos_ids = K + 1, 4096, set()

    def __init__(self, script: list[int], vocab_size: int):
        self.script, self.vocab_size, self.length = script, vocab_size, 0

    def reset(self):
        self.length = 0

    def rollback(self, length):
        self.length = min(self.length, length)

    def feed(self, tokens, n_logits=1):
        self.length += len(tokens)
        positions = range(self.length - min(n_logits, len(tokens)), self.length)
        logits = torch.zeros(len(positions), self.vocab_size)
        for row, p in enumerate(positions):
            logits[row, self.script[min(p + 1, len(self.script) - 1)]] = 1.0
        return logits


class FlakyOracle:
    """Drafts the script's next tokens, with a wrong token at a random depth half the time: steps emit 1 to k + 1."""

    name, version, runner = "oracle", 0, None

    def __init__(self, script: list[int], seed: int):
        self.script, self.rng = script, random.Random(seed)

    def begin(self, prompt_ids, prefill=True):
        pass

    def propose(self, tokens, k, sampling, generator=None):
        draft = list(self.script[len(tokens) : len(tokens) + k])
        if draft and self.rng.random() < 0.5:
            i = self.rng.randrange(len(draft))
            draft[i] = (draft[i] + 1) % 256
        return Proposal(draft)

    def rollback(self, length):
        pass


def scripted_engine(tokenizer, prompt: list[int], text_ids: list[int], seed: int) -> SpeculativeEngine:
    script = prompt + text_ids
    return SpeculativeEngine(ScriptedTarget(script, len(tokenizer)), tokenizer, FlakyOracle(script, seed),
                             SpeculationConfig(k=K, adaptive=False))


def stream_and_result(engine, prompt, sampling):
    deltas = []
    result = engine.generate(prompt, sampling, on_text=deltas.append)
    return deltas, result


def split_characters(tokenizer, ids: list[int]) -> int:
    """How many tokens of `ids` end inside a character (their prefix decodes to a trailing U+FFFD)."""
    return sum(tokenizer.decode(ids[:i]).endswith("\ufffd") for i in range(1, len(ids)))


def test_the_texts_split_characters_across_tokens(tokenizer):
    """The property below is only worth something where characters do straddle tokens: check that they do."""
    assert sum(split_characters(tokenizer, tokenizer.encode(t, add_special_tokens=False)) for t in TEXTS) >= 5


@pytest.mark.parametrize("seed", range(3))
def test_the_stream_is_the_final_text_in_every_script(tokenizer, seed):
    rng = random.Random(seed)
    prompt = tokenizer.encode("Say something:", add_special_tokens=False)
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        full = tokenizer.decode(ids, clean_up_tokenization_spaces=False)
        assert full == text  # byte-level BPE: the text comes back as it went in (no clean-up rewrites it)
        cases = [SamplingConfig(max_new_tokens=len(ids) + 3)]  # the whole text (then the script repeats its end)
        cut = rng.randrange(1, len(ids))  # a length limit anywhere, inside a character or not
        cases.append(SamplingConfig(max_new_tokens=cut))
        start = rng.randrange(len(full) - 3)
        stop = full[start : start + rng.randint(1, 3)]  # a stop string of 1 to 3 characters, multibyte or not
        cases.append(SamplingConfig(max_new_tokens=len(ids) + 3, stop=[stop, "never seen"]))
        for sampling in cases:
            engine = scripted_engine(tokenizer, prompt, ids, seed)
            deltas, result = stream_and_result(engine, prompt, sampling)
            what = f"{text!r} with {sampling}"
            assert "".join(deltas) == result.text, what
            assert "".join(deltas).count("\ufffd") <= result.text.count("\ufffd"), what
            if sampling.stop:
                assert result.finish_reason == "stop" and result.text == full[: full.find(stop)], what
            elif sampling.max_new_tokens == cut:
                assert result.finish_reason == "length", what
                assert result.text == tokenizer.decode(ids[:cut], clean_up_tokenization_spaces=False), what
            else:
                assert result.text.startswith(full), what
                assert max(n for k, n in result.steps) >= 2, "speculation must accept several tokens in some step"


def test_a_streaming_client_gets_every_character_whole(tokenizer):
    """Through the `openai` client: the streamed chunks join into the final text, none carries a U+FFFD."""
    from openai import OpenAI

    prompt_text = "Say something:"
    prompt = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    text = TEXTS[0] + TEXTS[4] + TEXTS[-1]
    ids = tokenizer.encode(text, add_special_tokens=False)
    engine = scripted_engine(tokenizer, list(prompt), ids, seed=0)
    app = create_app(engine, tokenizer, "scripted")
    with live_server(app) as url:
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        chunks = [c.choices[0].text for c in client.completions.create(
            model="scripted", prompt=prompt_text, temperature=0, max_tokens=len(ids), stream=True)]
        whole = client.completions.create(model="scripted", prompt=prompt_text, temperature=0, max_tokens=len(ids))
    assert "".join(chunks) == whole.choices[0].text == text
    assert not any("\ufffd" in chunk for chunk in chunks)
