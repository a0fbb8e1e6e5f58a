"""Hot swaps are atomic per request, by a test that can fail.

A publisher thread swaps the draft's weights (new values each time) as fast as it can while several client
threads' requests decode. Every propose call records a fingerprint of the weights its forwards ran with
(StepRecord.draft_weights); every step of a request must show the same one. The same check run on a proposer
that re-reads the registry at every propose call (the bug) must see a request mix two weight sets: it does.
Output equality alone could not tell them apart (verification keeps both lossless), which the test shows too.
"""
import copy
import sys
import threading
import time
from collections import defaultdict

import pytest
import torch
from conftest import EOS, tiny_qwen2
from helpers import plain_greedy

from osd.config import SamplingConfig, SpeculationConfig
from osd.drafts import DraftRegistry, weights_fingerprint
from osd.engine import SpeculativeEngine
from osd.models.cached import CachedModel
from osd.propose import DraftModelProposer

PROMPTS = [[5 + i % 7, 9 + i % 5, 20 + i % 3] for i in range(12)]
NEW_TOKENS = 16


@pytest.fixture
def fair_threads():
    """One torch thread and a short GIL switch interval while the publisher races the decoders: with the defaults
    every torch op of a decoder hands the GIL to the publisher for 5 ms (a convoy), and 2-thread tiny matmuls on
    a loaded 2-core machine spin; neither changes what is tested, both made it ~10x slower."""
    threads, interval = torch.get_num_threads(), sys.getswitchinterval()
    torch.set_num_threads(1)
    sys.setswitchinterval(1e-4)
    yield
    torch.set_num_threads(threads)
    sys.setswitchinterval(interval)


class ReReadingProposer(DraftModelProposer):
    """The bug to catch: takes the latest snapshot at every propose call instead of once per request."""

    def propose(self, tokens, k, sampling, generator=None):
        snap = self.registry.get(self.name)
        if snap.model is not self.runner.model:
            self.runner, self.version, self.vocab_ids = CachedModel(snap.model), snap.version, snap.vocab_ids
        return super().propose(tokens, k, sampling, generator)


class Publisher:
    """Publishes the draft with fresh random noise on its weights, as fast as it can, until stopped."""

    def __init__(self, registry: DraftRegistry, draft):
        self.registry, self.draft, self.published = registry, draft, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        g = torch.Generator().manual_seed(0)
        while not self._stop.is_set():
            new = copy.deepcopy(self.draft)
            with torch.no_grad():
                for p in new.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * 0.5)
            self.registry.publish("draft", new)
            self.published += 1

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(30)


def wait_for_a_swap(registry: DraftRegistry, timeout: float = 30.0):
    """An observer that holds each step until the publisher has swapped the draft at least once more, so every
    request with two proposing steps spans a swap (whatever the thread scheduling)."""

    def observe(record):
        seen, deadline = registry.get("draft").version, time.monotonic() + timeout
        while registry.get("draft").version == seen:
            assert time.monotonic() < deadline, "the publisher thread stopped publishing"
            time.sleep(0.0005)

    return observe


def spanning(weights, results) -> list:
    """The requests with at least two proposing steps: each spans a swap (wait_for_a_swap holds every step)."""
    return [r for r in results if len(weights[r.request_id]) >= 2]


def decode_while_swapping(proposer_cls, target, draft, tokenizer, clients: int = 3):
    """Several client threads decode PROMPTS (split between them) while the publisher swaps weights.
    -> ({request_id: [fingerprint per proposing step]}, [GenerationResult])."""
    registry = DraftRegistry()
    registry.publish("draft", copy.deepcopy(draft))
    engine = SpeculativeEngine(target, tokenizer, proposer_cls(registry, "draft", target.config.vocab_size),
                               SpeculationConfig(k=3, adaptive=False))
    weights, results = defaultdict(list), []
    engine.observers += [lambda rec: weights[rec.request_id].append(rec.draft_weights) if rec.proposed else None,
                         wait_for_a_swap(registry)]
    engine.request_observers.append(results.append)
    errors = []

    def client(prompts):
        try:
            for prompt in prompts:
                engine.generate(prompt, SamplingConfig(max_new_tokens=NEW_TOKENS))
        except Exception as e:  # surfaced in the main thread below
            errors.append(e)

    with Publisher(registry, draft) as publisher:
        threads = [threading.Thread(target=client, args=(PROMPTS[i::clients],)) for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert not errors, errors
    assert len(results) == len(PROMPTS) and publisher.published > len(PROMPTS)
    return weights, results


def test_every_step_of_a_request_proposes_with_one_weight_set(target_model, tokenizer, fair_threads):
    draft = tiny_qwen2(seed=1, layers=1)
    weights, results = decode_while_swapping(DraftModelProposer, target_model, draft, tokenizer)
    # a request that ends after one proposing step (all proposals accepted up to EOS) cannot span a swap; every one
    # with two or more does (wait_for_a_swap), and most requests have several
    assert len(spanning(weights, results)) >= len(results) // 2
    for result in results:
        steps = weights[result.request_id]
        assert len(set(steps)) == 1, f"request {result.request_id} mixed weights: {steps}"
        name, version = result.draft
        assert steps[0].startswith(f"{name}@v{version}:")  # the version the response reports is the one that ran
        assert result.token_ids == plain_greedy(target_model, result.prompt_ids, NEW_TOKENS, eos=EOS)
    per_request = {weights[r.request_id][0] for r in results}
    assert len(per_request) > 1  # requests did pick up new versions (and new values: the checksums differ)
    assert len({w.split(":")[1] for w in per_request}) == len(per_request)


def test_the_check_catches_a_proposer_that_rereads_the_registry_every_step(target_model, tokenizer, fair_threads):
    draft = tiny_qwen2(seed=1, layers=1)
    weights, results = decode_while_swapping(ReReadingProposer, target_model, draft, tokenizer)
    mixed = [r for r in results if len(set(weights[r.request_id])) > 1]
    several = spanning(weights, results)
    assert several and mixed == several  # every request with two proposing steps spans a swap, and this proposer
    # follows it mid-request
    for result in results:  # ... which the output alone cannot show: verification keeps it lossless anyway
        assert result.token_ids == plain_greedy(target_model, result.prompt_ids, NEW_TOKENS, eos=EOS)


def int8_copies(model):
    """The two int8 serving forms (models/serving_draft.py) of the probed layer, built without the compiled kernel:
    our weight-only Int8Linear (its buffers) and torch's dynamic int8 (packed parameters)."""
    from osd.models.serving_draft import Int8Linear

    ours = copy.deepcopy(model)
    layer = ours.model.layers[-1].mlp
    layer.down_proj = Int8Linear(layer.down_proj, kernel=None)
    dynamic = torch.ao.quantization.quantize_dynamic(copy.deepcopy(model), {torch.nn.Linear}, dtype=torch.qint8)
    return ours, dynamic


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore:torch.quantize_per_tensor:UserWarning")
def test_weights_fingerprint_follows_values_not_objects():
    draft = tiny_qwen2(seed=1, layers=2)
    same = copy.deepcopy(draft)
    assert weights_fingerprint(same) == weights_fingerprint(draft)
    with torch.no_grad():
        same.model.layers[-1].mlp.down_proj.weight.mul_(1.01)  # an optimizer step moves every value a little
    assert weights_fingerprint(same) != weights_fingerprint(draft)
    assert weights_fingerprint(copy.deepcopy(draft).to(torch.bfloat16))  # bfloat16 is read too
    trained_top = copy.deepcopy(draft)  # what "no_embeddings" training changes: the top layer, not the embeddings
    with torch.no_grad():
        for p in trained_top.model.layers[-1].parameters():
            p.mul_(1.05)
    for form in range(2):  # int8 serving copies: same weights -> same fingerprint; trained top layer -> another
        a, b, c = (int8_copies(m)[form] for m in (draft, copy.deepcopy(draft), trained_top))
        assert weights_fingerprint(a) == weights_fingerprint(b) != weights_fingerprint(c)
        assert weights_fingerprint(a) != weights_fingerprint(draft)


@pytest.mark.parametrize("k", [0, 2])
def test_steps_without_draft_forwards_carry_no_fingerprint(target_model, draft_model, tokenizer, k):
    registry = DraftRegistry()
    registry.publish("draft", draft_model)
    engine = SpeculativeEngine(target_model, tokenizer, DraftModelProposer(registry, "draft", 48),
                               SpeculationConfig(k=k, adaptive=False))
    records = []
    engine.observers.append(records.append)
    engine.generate([5, 6, 7], SamplingConfig(max_new_tokens=6))
    expected = {None} if k == 0 else {f"draft@v0:{weights_fingerprint(draft_model)}"}
    assert {r.draft_weights for r in records if r.proposed or k == 0} == expected
