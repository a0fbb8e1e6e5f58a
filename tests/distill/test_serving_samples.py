"""Greedy target samples of a GGUF target from its serving runner (distill/target_outputs.py).

A tiny seeded Qwen2 written as a Q4_K_M GGUF (tests/models/tiny_gguf.py) is served by llama.cpp and osd's Q4
kernel; references: the runner's own greedy target-only decode through the engine (k = 0), and the cache's files.
dataset_samples is driven end to end on a small JSONL dataset, with the GGUF's fp32 conversion (the twin) under a
temporary OSD_CACHE.
"""
from __future__ import annotations

import json

import pytest
from conftest import require_module, skip_or_fail
import torch

require_module("llama_cpp")  # the tiny GGUF is quantized by llama.cpp

import osd.models.target  # noqa: E402
import osd.models.loading  # noqa: E402
from osd.config import ModelConfig  # noqa: E402
from osd.distill.cache import DecodeSettings, TargetCache, model_fingerprint  # noqa: E402
from osd.distill.target_outputs import cache_fingerprint, dataset_samples, sampling_backend, serving_samples  # noqa: E402
from osd.models import q4  # noqa: E402
from osd.models.llama_cpp_runner import LlamaCppRunner  # noqa: E402
from tests.models.tiny_gguf import EOS, PROMPT, target_only, tiny  # noqa: E402,F401 (tiny: a fixture)

PROMPTS = [PROMPT, PROMPT[:6], PROMPT[9:]]
N = 12  # max new tokens


def _q4_runner(path):
    if not q4.available():
        skip_or_fail("Q4 kernel unavailable on this machine")
    from osd.models.q4_runner import Q4Runner

    return Q4Runner(path, n_ctx=256)


@pytest.fixture(scope="module", params=["llama.cpp", "osd"])
def runner(tiny, request):
    return LlamaCppRunner(tiny[0], n_ctx=256, threads=1) if request.param == "llama.cpp" else _q4_runner(tiny[0])


# ---- serving_samples: the runner's own greedy decode ----------------------------------------------------------

def test_responses_are_the_runners_greedy_decode_and_each_token_is_its_top1(runner, tmp_path):
    settings = DecodeSettings(max_new_tokens=N, top_k=8)
    samples = serving_samples(TargetCache(tmp_path, "fp"), runner, PROMPTS, settings, {EOS})
    assert [s.prompt_ids for s in samples] == PROMPTS
    for prompt, sample in zip(PROMPTS, samples):
        plain = target_only(runner, prompt, N)  # the engine drops EOS from its tokens; the sample keeps it
        assert sample.response_ids == (plain + [EOS] if len(plain) < N else plain)
        dist = sample.target
        assert dist.ids.shape == dist.probs.shape == (len(sample.response_ids), 8)
        assert dist.ids[:, 0].tolist() == sample.response_ids  # greedy: each token is its position's top-1
        assert (dist.probs[:, :-1] >= dist.probs[:, 1:]).all() and (dist.probs.sum(-1) <= 1 + 1e-5).all()
        runner.reset()
        first = torch.softmax(runner.feed(prompt)[0].float(), -1)  # the first position's distribution, as served
        assert torch.allclose(dist.probs[0], first[dist.ids[0]], atol=1e-6)
    assert len({tuple(s.response_ids) for s in samples}) > 1  # the prompts lead to different answers


def test_decoding_stops_at_an_end_token_and_keeps_it(runner, tmp_path):
    plain = target_only(runner, PROMPT, N)
    assert len(plain) == N
    stop = plain[4]  # a token the greedy answer does emit: declared an end token, it ends the answer there
    cut = plain.index(stop) + 1
    sample = serving_samples(TargetCache(tmp_path, "fp"), runner, [PROMPT], DecodeSettings(max_new_tokens=N, top_k=4),
                             {stop})[0]
    assert sample.response_ids == plain[:cut] and len(sample.target) == cut


def test_a_second_call_reads_the_cache_without_a_runner(runner, tmp_path):
    settings = DecodeSettings(max_new_tokens=N, top_k=8)
    cache = TargetCache(tmp_path, "fp")
    first = serving_samples(cache, runner, PROMPTS[:2], settings, {EOS})
    again = serving_samples(cache, None, PROMPTS[:2], settings, {EOS})  # None: any decode would fail
    for a, b in zip(first, again):
        assert a.response_ids == b.response_ids
        assert torch.equal(a.target.ids, b.target.ids) and torch.equal(a.target.probs, b.target.probs)
    with pytest.raises(AttributeError):  # a prompt not yet cached does need the runner
        serving_samples(cache, None, PROMPTS, settings, {EOS})
    mixed = serving_samples(cache, runner, PROMPTS, settings, {EOS})  # only the missing prompt is decoded
    assert [s.response_ids for s in mixed[:2]] == [s.response_ids for s in first]
    assert len(list(tmp_path.rglob("*.safetensors"))) == 3 and not list(tmp_path.rglob("*.tmp*"))


# ---- which path fills the cache, under which fingerprint: pure ------------------------------------------------

class _Config:
    def __init__(self, **values):
        self.values = values

    def to_dict(self):
        return dict(self.values)


def test_greedy_gguf_targets_take_the_serving_path_sampled_or_torch_ones_do_not():
    greedy, sampled = DecodeSettings(), DecodeSettings(temperature=0.7)
    assert sampling_backend(ModelConfig(target="/m/t.gguf"), greedy) == "llama.cpp"  # auto, a GGUF the Q4 kernel cannot read
    assert sampling_backend(ModelConfig(target="/m/t.gguf", target_backend="osd"), greedy) == "osd"
    assert sampling_backend(ModelConfig(target="/m/t.gguf", target_backend="torch"), greedy) is None
    assert sampling_backend(ModelConfig(target="Qwen/Qwen2.5-0.5B"), greedy) is None  # auto, a Hugging Face target
    for backend in ("auto", "llama.cpp", "osd"):  # temperature > 0: the torch path samples
        assert sampling_backend(ModelConfig(target="/m/t.gguf", target_backend=backend), sampled) is None


def test_each_backend_has_its_own_fingerprint_and_the_torch_one_is_unchanged():
    config = _Config(vocab_size=259, hidden_size=256)
    prints = {b: cache_fingerprint("/m/t.gguf", config, b) for b in (None, "llama.cpp", "osd")}
    assert len(set(prints.values())) == 3
    assert prints[None] == model_fingerprint("/m/t.gguf", config)  # caches filled by the fp32 twin stay valid
    assert cache_fingerprint("/m/t.gguf", _Config(vocab_size=260, hidden_size=256), "llama.cpp") != prints["llama.cpp"]


# ---- dataset_samples end to end ------------------------------------------------------------------------------

class ByteChatTokenizer:
    """Byte ids and no chat template (osd.data.chat_ids then writes "user: ...\\nassistant:")."""

    chat_template = None
    eos_token_id = EOS
    pad_token_id = None

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": list(text.encode("latin-1"))}


@pytest.fixture(scope="module")
def osd_cache(tiny, tmp_path_factory):
    """OSD_CACHE in a temporary folder for the module, holding the tiny GGUF's fp32 conversion: its dequantized
    torch twin, saved where resolve_model_dir looks (transformers cannot convert the tiny GGUF's tokenizer)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OSD_CACHE", str(tmp_path_factory.mktemp("osd-cache")))
        tiny[1].save_pretrained(osd.models.loading.converted_dir(str(tiny[0])))
        yield


@pytest.fixture
def env(tiny, osd_cache, tmp_path, monkeypatch):
    """(spec, dataset path, cache root, calls): build_target and load_model counted."""
    dataset = tmp_path / "tiny.jsonl"
    dataset.write_text("".join(json.dumps({"id": f"r{i}", "prompt": p}) + "\n"
                               for i, p in enumerate(["Hello, world!", "This is", "a test of it"])))
    calls = {"build_target": 0, "load_model": 0}

    def counted(name, real):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(osd.models.target, "build_target", counted("build_target", osd.models.target.build_target))
    monkeypatch.setattr(osd.models.loading, "load_model", counted("load_model", osd.models.loading.load_model))
    return str(tiny[0]), str(dataset), tmp_path / "teacher", calls


def _fill(models, env, settings):
    spec, dataset, root, _ = env
    return dataset_samples(models, dataset, None, None, settings, cache_root=root, tokenizer=ByteChatTokenizer())[0]


def _forbid(monkeypatch, *names):
    def refuse(*args, **kwargs):
        raise AssertionError("the target was loaded although every sample is cached")

    for module, name in ((osd.models.target, "build_target"), (osd.models.loading, "load_model")):
        if name in names:
            monkeypatch.setattr(module, name, refuse)


def _dirs(root):
    return {d.name: len(list(d.rglob("*.safetensors"))) for d in root.iterdir()}


def test_dataset_samples_serve_greedy_from_the_runner_then_from_the_cache(env, monkeypatch):
    spec, _, root, calls = env
    settings = DecodeSettings(max_new_tokens=N, top_k=8)
    models = ModelConfig(target=spec, n_ctx=256, threads=1, target_backend="llama.cpp")  # the llama.cpp serving path
    first = _fill(models, env, settings)
    assert calls == {"build_target": 1, "load_model": 0}  # the runner, not the fp32 twin
    assert [s.meta["id"] for s in first] == ["r0", "r1", "r2"]
    runner = LlamaCppRunner(spec, n_ctx=256, threads=1)
    for sample in first:
        assert sample.prompt_ids[:6] == list(b"user: ")
        plain = target_only(runner, sample.prompt_ids, N)
        assert sample.response_ids == (plain + [EOS] if len(plain) < N else plain)
        assert sample.target.ids[:, 0].tolist() == sample.response_ids
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(osd.models.loading.resolve_model_dir(spec))
    assert _dirs(root) == {cache_fingerprint(spec, config, "llama.cpp"): 3}

    _forbid(monkeypatch, "build_target", "load_model")
    again = _fill(models, env, settings)  # every prompt cached: no runner is built
    assert [s.response_ids for s in again] == [s.response_ids for s in first]
    assert all(torch.equal(a.target.probs, b.target.probs) for a, b in zip(first, again))


def test_the_torch_path_and_sampling_never_read_the_served_samples(env, monkeypatch):
    spec, _, root, calls = env
    greedy = DecodeSettings(max_new_tokens=N, top_k=8)
    _fill(ModelConfig(target=spec, n_ctx=256, threads=1), env, greedy)  # the auto backend's samples (the Q4 kernel), cached
    served = set(_dirs(root))
    _forbid(monkeypatch, "build_target")  # from here on, only the fp32 twin may run
    torch_samples = _fill(ModelConfig(target=spec, target_backend="torch", prepack_target=False), env, greedy)
    assert calls["load_model"] == 1  # the served entries were not taken for the torch path's
    torch_dirs = set(_dirs(root)) - served
    assert len(torch_dirs) == 1 and _dirs(root)[torch_dirs.pop()] == 3
    assert all(s.target.ids[:, 0].tolist() == s.response_ids for s in torch_samples)

    sampled = DecodeSettings(max_new_tokens=N, top_k=8, temperature=1.0, seed=1)
    out = _fill(ModelConfig(target=spec, n_ctx=256, threads=1, prepack_target=False), env, sampled)  # auto backend, temperature > 0
    assert calls["load_model"] == 2 and len(out) == 3  # sampled by the torch model (build_target would raise)
    assert len(_dirs(root)) == 2  # into the torch fingerprint's cache, beside its greedy entries
    assert sorted(_dirs(root).values()) == [3, 6]
