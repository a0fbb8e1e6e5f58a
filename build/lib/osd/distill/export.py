"""`osd export-draft`: a learned draft as a plain model directory.

An online (or offline trainer) checkpoint holds only the trained part of a draft. Exporting loads the base
draft it was trained on (checked by fingerprint, learn/checkpoint.py), applies the checkpoint, folds LoRA
adapters in, and writes a Hugging Face directory like `osd distill`'s, which `osd eval`, `osd generate --draft`
and `osd serve --draft` take as any other draft. Its osd_config.json records where it came from: checkpoint,
draft version, counters, the learner's config and git revision.
"""
from __future__ import annotations

import json
from pathlib import Path

from osd.distill.trainer import export_draft
from osd.errors import InvalidArgument
from osd.learn.checkpoint import checkpoint_dir, load_checkpoint
from osd.learn.trainable import configure_trainable
from osd.models.loading import load_model


def export_checkpoint(checkpoint: str, base_draft: str, out_dir: str, dtype: str = "float32", tokenizer=None) -> Path:
    """base_draft: the draft spec the checkpoint was trained on; the result is <out_dir>/draft."""
    where = checkpoint_dir(checkpoint)
    if where is None:
        raise InvalidArgument(f"no checkpoint in {checkpoint} (expected state.json and draft.safetensors)")
    state = json.loads((where / "state.json").read_text())
    learned = state.get("config", {})
    draft = load_model(base_draft, dtype)
    configure_trainable(draft, learned.get("trainable", "all"), learned.get("train_layers", 0), learned.get("lora_rank", 8))
    load_checkpoint(checkpoint, draft)  # raises CheckpointMismatch on another base
    draft.requires_grad_(False)
    provenance = {"base_draft": base_draft, "checkpoint": str(checkpoint), "version": state.get("version"),
                  "counters": state.get("counters"), "learn": learned, "git_revision": state.get("git_revision")}
    return export_draft(draft, tokenizer, out_dir, {"exported_from_checkpoint": provenance}, {})
