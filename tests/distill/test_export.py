"""`osd export-draft`'s library: an online checkpoint (trained top layers only, or LoRA adapters) onto its base draft
-> a plain model directory that loads like any draft and computes what the learner's master computes."""
import copy
import json

import pytest
import torch
from conftest import tiny_qwen2
from helpers import make_engine

from osd.config import SamplingConfig
from osd.distill.export import export_checkpoint
from osd.errors import CheckpointMismatch, InvalidArgument
from osd.learn.online import LearnConfig, OnlineLearner
from osd.models.loading import load_model


@pytest.mark.parametrize("trainable", ["no_embeddings", "lora"])
def test_exported_checkpoint_is_the_learned_draft(target_model, tokenizer, tmp_path, trainable):
    base = tiny_qwen2(seed=1, layers=2)
    base.save_pretrained(tmp_path / "base")
    engine, registry = make_engine(target_model, copy.deepcopy(base), tokenizer, k=4)
    publish = lambda master, version=None: registry.publish("draft", copy.deepcopy(master).eval(), None, version)
    config = LearnConfig(mode="all", every_requests=2, lr=3e-2, steps_per_update=3, trainable=trainable, train_layers=1,
                         guard=False, checkpoint_dir=str(tmp_path / "ckpt"))
    learner = OnlineLearner(copy.deepcopy(base), publish, config).attach(engine)
    for i in range(4):
        engine.generate([5 + i, 9, 20], SamplingConfig(max_new_tokens=10))
    learner.stop()
    assert learner.version >= 1

    out = export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "base"), str(tmp_path / "exported"))
    exported = load_model(str(out))
    ids = torch.tensor([[5, 9, 20, 7, 11, 3]])
    with torch.no_grad():
        learned, original = learner.master(ids).logits, base(ids).logits
        assert torch.allclose(exported(ids).logits, learned, atol=1e-4)  # the learner's draft, LoRA folded in
        assert not torch.allclose(exported(ids).logits, original, atol=1e-4)  # and not the base it started from
    provenance = json.loads((out / "osd_config.json").read_text())["exported_from_checkpoint"]
    assert provenance["version"] == learner.version and provenance["learn"]["trainable"] == trainable

    tiny_qwen2(seed=2, layers=2).save_pretrained(tmp_path / "other")
    with pytest.raises(CheckpointMismatch):  # the checkpoint only holds the top layer: refuse another base
        export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "other"), str(tmp_path / "bad"))
    assert not (tmp_path / "bad" / "draft").exists()
    with pytest.raises(InvalidArgument, match="no checkpoint"):
        export_checkpoint(str(tmp_path / "nothing"), str(tmp_path / "base"), str(tmp_path / "bad"))
