"""Assemble a running system from configs: target, tokenizer, draft registry, engine."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from osd.config import ModelConfig, SpeculationConfig
from osd.drafts import DraftRegistry
from osd.engine import SpeculativeEngine
from osd.models.loading import load_model, load_tokenizer
from osd.models.prepack import prepack_linears, shared_weights_copy
from osd.models.serving_draft import make_serving_draft
from osd.models.tokenizer import check_same_tokenizer
from osd.propose import DraftModelProposer

DEFAULT_DRAFT = "default"


@dataclass
class System:
    engine: SpeculativeEngine
    tokenizer: object
    registry: DraftRegistry
    target_model: object  # the model the engine verifies with (maybe prepacked)
    draft_master: object | None  # trainable draft weights (the serving copy lives in the registry)
    models: ModelConfig
    spec: SpeculationConfig

    def publish_draft(self, master=None, name: str = DEFAULT_DRAFT, version: int | None = None):
        """Build a serving copy of draft weights and publish it under `name`."""
        master = master if master is not None else self.draft_master
        serving, vocab_ids = make_serving_draft(master, self.models.draft_quantize, self.models.draft_vocab,
                                                special_ids(self.tokenizer))
        return self.registry.publish(name, serving, vocab_ids, version)


def special_ids(tokenizer) -> list[int]:
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids |= set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    return sorted(int(i) for i in ids)


def set_threads(threads: int) -> None:
    if threads:
        torch.set_num_threads(threads)


def build_system(models: ModelConfig, spec: SpeculationConfig, with_draft: bool = True, target_model=None) -> System:
    set_threads(models.threads)
    tokenizer = load_tokenizer(models.target)
    if target_model is None:
        target_model = load_model(models.target, models.dtype)
    if models.prepack_target:
        target_model = shared_weights_copy(target_model) if models.prepack_copy else target_model
        prepack_linears(target_model)
    registry, master, proposer = DraftRegistry(), None, None
    system = System(None, tokenizer, registry, target_model, None, models, spec)
    if with_draft and models.draft:
        check_same_tokenizer(tokenizer, load_tokenizer(models.draft))
        master = load_model(models.draft, models.draft_dtype)
        system.draft_master = master
        system.publish_draft(master)
        proposer = DraftModelProposer(registry, DEFAULT_DRAFT, target_model.config.vocab_size)
    system.engine = SpeculativeEngine(target_model, tokenizer, proposer, spec)
    return system


def attach_learner(system: System, learn):
    """Create the online learner over the system's draft master and hook it into the engine."""
    from osd.learn.online import OnlineLearner

    if system.draft_master is None:
        raise ValueError("online learning needs a draft model")
    publish = lambda master, version=None: system.publish_draft(master, version=version)
    learner = OnlineLearner(system.draft_master, publish, learn).attach(system.engine)
    learner.resume()
    learner.start()
    return learner
