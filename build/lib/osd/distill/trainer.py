"""Offline distillation of the draft on target samples (PAPER.md section 3): epochs of mini-batches.

Resumable: the trainable weights, optimizer and position (epoch, step) are checkpointed atomically
every `save_every` steps and at each epoch's end under <out>/trainer-state; a rerun with the same
output directory continues from there. The result is a plain Hugging Face model directory.
"""
from __future__ import annotations

import json
import math
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from osd.distill.evaluate import sample_item
from osd.distill.generate import SOURCES
from osd.errors import InvalidArgument
from osd.learn.batch import items_loss
from osd.learn.checkpoint import load_checkpoint, save_checkpoint, saved_state
from osd.learn.losses import LOSSES
from osd.learn.trainable import TRAINABLE, configure_trainable, merge_lora, split_index


@dataclass
class DistillConfig:
    loss: str = "forward_kl"  # forward_kl | reverse_kl | jsd | tv | reference_mix
    beta: float = 0.5  # JSD beta
    source: str = "teacher"  # teacher | student | mix_token | mix_request (student samples are redrawn each epoch)
    teacher_ratio: float = 0.5  # mix_token / mix_request: share of teacher tokens / requests
    epochs: int = 1
    lr: float = 1e-5  # AdamW, no warmup: 1e-4 diverges on the 0.5B draft (loss 0.16 -> 0.9 within 5 steps)
    batch_size: int = 4  # samples per optimizer step
    trainable: str = "no_embeddings"  # all | no_embeddings | lora
    train_layers: int = 4  # 0 = all decoder layers; N = only the top N (lower layers frozen, outputs cached)
    lora_rank: int = 8
    loss_temperature: float = 1.0  # tempers target and draft alike (a compact target: approximate tail, learn/compact.py)
    save_every: int = 50  # optimizer steps between resumable checkpoints
    shuffle_seed: int = 0

    def __post_init__(self):
        if self.loss not in LOSSES:
            raise InvalidArgument(f"loss must be one of {LOSSES}, got {self.loss!r}")
        if self.source not in SOURCES:
            raise InvalidArgument(f"source must be one of {SOURCES}, got {self.source!r}")
        if self.trainable not in TRAINABLE:
            raise InvalidArgument(f"trainable must be one of {TRAINABLE}, got {self.trainable!r}")
        if self.epochs <= 0 or self.batch_size <= 0 or self.lr <= 0 or self.lora_rank <= 0 or self.save_every <= 0:
            raise InvalidArgument("epochs, batch_size, lr, lora_rank and save_every must be > 0")
        if not 0.0 <= self.beta <= 1.0 or not 0.0 <= self.teacher_ratio <= 1.0:
            raise InvalidArgument("beta and teacher_ratio must be in [0, 1]")
        if self.loss_temperature <= 0:
            raise InvalidArgument(f"loss_temperature must be > 0, got {self.loss_temperature}")


class DistillTrainer:
    """Trains a draft in place on samples from `sample_source(epoch) -> list[TargetSample]`."""

    def __init__(self, draft, config: DistillConfig, state_dir: str | Path | None = None, params: list | None = None):
        """params: the trainable parameters, when the caller opened them itself (distill/heal.py); else
        config.trainable / train_layers decide (learn/trainable.py)."""
        self.draft, self.config = draft, config
        self.params = params if params is not None else configure_trainable(draft, config.trainable, config.train_layers,
                                                                             config.lora_rank)
        self.split = split_index(draft, config.train_layers)
        self.optimizer = torch.optim.AdamW(self.params, lr=config.lr, weight_decay=0.0)
        self.state_dir = str(state_dir) if state_dir else None
        self.epoch, self.step, self.history = 0, 0, []
        self.skipped_nonfinite = 0

    def resume(self) -> bool:
        saved = saved_state(self.state_dir) if self.state_dir else None
        if saved is None:
            return False
        if saved.get("config") != asdict(self.config):  # before loading: other settings are the clearer error
            raise InvalidArgument(f"{self.state_dir} holds a run with other settings; use another output directory")
        state = load_checkpoint(self.state_dir, self.draft, self.optimizer)
        self.epoch, self.step, self.history = state["epoch"], state["step"], state["history"]
        return True

    def save(self) -> None:
        if self.state_dir:
            save_checkpoint(self.state_dir, self.draft, self.optimizer,
                            {"epoch": self.epoch, "step": self.step, "history": self.history, "config": asdict(self.config)})

    def batches(self, items: list, epoch: int) -> list[list]:
        order = list(range(len(items)))
        random.Random(self.config.shuffle_seed * 1000 + epoch).shuffle(order)
        size = self.config.batch_size
        return [[items[i] for i in order[s : s + size]] for s in range(0, len(order), size)]

    def train_step(self, batch) -> float | None:
        cfg = self.config
        self.draft.train()
        loss = items_loss(self.draft, batch, cfg.loss, cfg.beta, cfg.loss_temperature, split=self.split)
        if not math.isfinite(loss.item()):
            self.skipped_nonfinite += 1
            return None
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if not all(p.grad is None or torch.isfinite(p.grad).all() for p in self.params):
            self.skipped_nonfinite += 1
            return None
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        return loss.item()

    def fit(self, sample_source, progress=None, items_cache: dict | None = None) -> list[float]:
        """Run the remaining epochs; returns per-step losses. items_cache keeps frozen-trunk features across epochs."""
        for epoch in range(self.epoch, self.config.epochs):
            samples = sample_source(epoch)
            items = [_cached_item(s, items_cache) for s in samples]
            batches = self.batches(items, epoch)
            if epoch >= len(self.history):
                self.history.append({"epoch": epoch, "losses": []})
            losses = self.history[epoch]["losses"]
            done_in_epoch = len(losses)  # > 0 when resuming mid-epoch
            bar = progress(total=len(batches), initial=done_in_epoch, desc=f"distill epoch {epoch + 1}/{self.config.epochs}") if progress else None
            for batch in batches[done_in_epoch:]:
                loss = self.train_step(batch)
                losses.append(loss if loss is not None else float("nan"))
                self.step += 1
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{loss:.4f}" if loss is not None else "skipped")
                if self.step % self.config.save_every == 0:
                    self.save()
            if bar is not None:
                bar.close()
            self.epoch = epoch + 1
            self.save()
        self.draft.eval()
        return [l for h in self.history for l in h["losses"]]


def _cached_item(sample, items_cache: dict | None):
    if items_cache is None:
        return sample_item(sample)
    key = (tuple(sample.prompt_ids), tuple(sample.response_ids))
    if key not in items_cache:
        items_cache[key] = sample_item(sample)
    return items_cache[key]


def export_draft(draft, tokenizer, out_dir: str | Path, osd_config: dict, metrics: dict) -> Path:
    """A plain HF model dir (safetensors, config, tokenizer) + osd_config.json + metrics.json, swapped in atomically."""
    out = Path(out_dir)
    tmp = out / "draft.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    merge_lora(draft)
    draft.save_pretrained(tmp, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    (tmp / "osd_config.json").write_text(json.dumps(osd_config, indent=2, default=str))
    (tmp / "metrics.json").write_text(json.dumps(metrics, indent=2, default=str))
    final = out / "draft"
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    return final

