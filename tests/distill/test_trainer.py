"""Offline distillation on tiny models: alpha rises, the checkpoint round-trips, an interrupted run resumes."""
import json
import random

import pytest
import torch
from conftest import EOS, tiny_qwen2

from osd.distill.cache import DecodeSettings, TargetCache
from osd.distill.evaluate import position_stats, sample_item, summarize
from osd.distill.target_outputs import target_samples
from osd.distill.trainer import DistillConfig, DistillTrainer, export_draft
from osd.errors import InvalidArgument
from osd.models.loading import load_model

rng = random.Random(0)
TRAIN = [[rng.randrange(2, 40) for _ in range(rng.randrange(2, 6))] for _ in range(48)]
TEST = [[rng.randrange(2, 40) for _ in range(rng.randrange(2, 6))] for _ in range(16)]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    target = tiny_qwen2(seed=0)
    cache = TargetCache(tmp_path_factory.mktemp("teacher"), "tiny")
    settings = DecodeSettings(max_new_tokens=12, top_k=16)
    return (target_samples(cache, target, TRAIN, settings, {EOS}, batch_size=16),
            target_samples(cache, target, TEST, settings, {EOS}, batch_size=16))


def alpha(draft, samples):
    return summarize(position_stats(draft, [sample_item(s) for s in samples], samples), 4)["alpha_greedy"]


@pytest.mark.parametrize("trainable,layers", [("all", 0), ("no_embeddings", 1), ("lora", 0)])
def test_distillation_raises_held_out_alpha(data, trainable, layers):
    train, test = data
    draft = tiny_qwen2(seed=1, layers=2)
    before = alpha(draft, test)
    lr = 3e-2 if trainable == "lora" else 1e-2
    trainer = DistillTrainer(draft, DistillConfig(epochs=6, lr=lr, batch_size=8, trainable=trainable, train_layers=layers))
    losses = trainer.fit(lambda epoch: train, items_cache={})
    assert sum(losses[-6:]) / 6 < sum(losses[:6]) / 6
    after = alpha(draft, test)
    assert after > before + 0.1, (before, after)


def test_checkpoint_round_trip_reproduces_outputs(data, tmp_path):
    train, test = data
    draft = tiny_qwen2(seed=1, layers=2)
    DistillTrainer(draft, DistillConfig(epochs=1, lr=1e-2, trainable="lora")).fit(lambda e: train)
    out = export_draft(draft, None, tmp_path, {"distill": {"loss": "forward_kl"}}, {"steps": 1})
    loaded = load_model(str(out))
    ids = torch.tensor([TEST[0] + TEST[1]])
    assert torch.allclose(loaded(ids).logits, draft(ids).logits, atol=1e-5)
    assert json.loads((out / "osd_config.json").read_text())["distill"]["loss"] == "forward_kl"
    assert (out / "model.safetensors").exists() and (out / "metrics.json").exists()


def test_an_interrupted_run_resumes_where_it_stopped(data, tmp_path):
    train, _ = data
    config = DistillConfig(epochs=2, lr=1e-2, batch_size=8, save_every=2, trainable="all")
    full = tiny_qwen2(seed=1, layers=2)
    DistillTrainer(full, config).fit(lambda e: train)

    class Stop(Exception):
        pass

    draft = tiny_qwen2(seed=1, layers=2)
    first = DistillTrainer(draft, config, tmp_path / "state")
    original_step = first.train_step
    calls = [0]

    def crashing(batch):
        calls[0] += 1
        if calls[0] == 9:  # mid-way through epoch 2 (6 steps per epoch), after the checkpoint at step 8
            raise Stop
        return original_step(batch)

    first.train_step = crashing
    with pytest.raises(Stop):
        first.fit(lambda e: train)
    resumed_draft = tiny_qwen2(seed=1, layers=2)
    second = DistillTrainer(resumed_draft, config, tmp_path / "state")
    assert second.resume() and second.step == 8 and second.epoch == 1
    second.fit(lambda e: train)
    assert second.step == 12
    for a, b in zip(resumed_draft.parameters(), full.parameters()):
        assert torch.allclose(a, b, atol=1e-5)
    with pytest.raises(InvalidArgument, match="other settings"):
        DistillTrainer(tiny_qwen2(seed=1, layers=2), DistillConfig(epochs=3), tmp_path / "state").resume()


def test_bad_distill_arguments_are_named():
    for kwargs, word in [({"loss": "l2"}, "loss"), ({"source": "web"}, "source"), ({"epochs": 0}, "epochs"),
                         ({"teacher_ratio": 2.0}, "teacher_ratio"), ({"trainable": "some"}, "trainable")]:
        with pytest.raises(InvalidArgument, match=word):
            DistillConfig(**kwargs)
