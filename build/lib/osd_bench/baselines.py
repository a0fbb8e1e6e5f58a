"""The drafts every replay compares the online one with, built the same way for the fast and the live replay.

- control ("original"): the draft as a fresh install serves it, never trained.
- offline_10pct / offline_100pct: distilled offline on the first 10% / all of the stream's requests with the
  SAME number of optimizer steps as the online draft took, the same trainable set, learning rate, batch
  size, loss and weight averaging (`train_equal_steps`). The online learner's count is every optimizer step it
  took, including those of updates the guard rejected or rolled back, so the offline drafts get at least the
  online draft's effective training: a comparison that favours them.
- offline_arrival (optional, labelled): all of the stream with the same steps, but step t draws only from the
  requests that had arrived by then (`arrival_batches`), as the online learner must. It separates what the online
  setting costs (data arrives over time) from what the online learner's own recipe costs (buffer, guard, batches).
- offline_100pct_epochs (optional, labelled): the older recipe, whole epochs at its own learning rate;
  its step count differs from the online draft's.
"""
from __future__ import annotations

import copy
import math
import random
import time
from contextlib import nullcontext

import torch

from osd.distill.trainer import DistillConfig, DistillTrainer
from osd.learn.average import WeightAverage
from osd.learn.trainable import split_index

SHARES = (("offline_10pct", 0.1), ("offline_100pct", 1.0))
EPOCHS_RECIPE = "offline_100pct_epochs"
ARRIVAL = "offline_arrival"


def frozen_trunk_copy(model, split: int, share_embeddings: bool = True):
    """A copy whose frozen lower layers (and embeddings / LM head when they are frozen too) are shared with `model`,
    not duplicated. share_embeddings=False (trainable="all": they train) copies them."""
    shared = [model.model.rotary_emb, *model.model.layers[:split]]
    shared += [model.model.embed_tokens, model.lm_head] if share_embeddings else []
    memo = {id(p): p for m in shared for p in list(m.parameters()) + list(m.buffers())}
    memo.update({id(m): m for m in shared})
    return copy.deepcopy(model, memo)


def draft_copy(base, learn):
    """A trainable copy of the base draft for the learn config's trainable set (the base stays unchanged)."""
    return frozen_trunk_copy(base, split_index(base, learn.train_layers), share_embeddings=learn.trainable != "all")


def offline_trainer(base, learn, seed: int = 0, epochs: int = 1, lr: float | None = None) -> DistillTrainer:
    """A DistillTrainer on a fresh copy of the base with the online learner's recipe (LoRA adapters drawn from a
    seeded generator, so a resumed replay rebuilds the same ones)."""
    cfg = DistillConfig(epochs=epochs, lr=lr or learn.lr, batch_size=learn.batch_size, trainable=learn.trainable,
                        train_layers=learn.train_layers, lora_rank=learn.lora_rank, loss=learn.loss, beta=learn.beta,
                        shuffle_seed=seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return DistillTrainer(draft_copy(base, learn), cfg)


def arrival_batches(n_items: int, steps: int, batch_size: int, seed: int = 0) -> list[list[int]]:
    """Step t's batch (indices into the stream) drawn uniformly without replacement from the requests that had
    arrived by step t, the first ceil(n_items * (t + 1) / steps): the online learner's steps are spread evenly over
    the stream the same way. The last step may draw the last request; no step draws one that had not arrived."""
    rng = random.Random(seed)
    out = []
    for t in range(steps):
        arrived = max(1, math.ceil(n_items * (t + 1) / steps))
        out.append(rng.sample(range(arrived), min(batch_size, arrived)))
    return out


def train_equal_steps(trainer: DistillTrainer, items: list, steps: int, progress=None, average: float = 0.0,
                      arrival: bool = False) -> dict:
    """Exactly `steps` optimizer steps over shuffled epochs of `items` (the last epoch partial), or, arrival=True,
    over `arrival_batches` (each step only from the requests that had arrived). A step whose loss or gradients are
    not finite is skipped and not counted; after 2 * steps + 10 skipped ones it gives up.
    average > 0: the draft ends with the average of the steps' weights, as the online learner's does (its
    --average; learn/average.py), so the recipes differ only in the data each step sees."""
    start, taken, skipped, losses, epoch = time.perf_counter(), 0, 0, [], 0
    bar = progress(total=steps, desc="offline in arrival order" if arrival else "offline (equal steps)") \
        if progress and steps else None
    averaged = WeightAverage(trainer.params, average) if average else None
    arrived = arrival_batches(len(items), steps, trainer.config.batch_size, trainer.config.shuffle_seed) if arrival else []
    with averaged.training() if averaged is not None else nullcontext():
        while taken < steps and skipped <= 2 * steps + 10 and items:
            if arrival:  # step `taken`'s batch, drawn again when that step is skipped (non-finite)
                batches = [[items[i] for i in arrived[taken]]]
            else:
                batches, epoch = trainer.batches(items, epoch), epoch + 1
            for batch in batches:
                if taken == steps or skipped > 2 * steps + 10:
                    break
                loss = trainer.train_step(batch)
                if loss is None:
                    skipped += 1
                    continue
                taken += 1
                losses.append(loss)
                if averaged is not None:
                    averaged.step()
                if bar is not None:
                    bar.update(1)
    if bar is not None:
        bar.close()
    trainer.draft.eval()
    return {"optimizer_steps": taken, "adam_steps": adam_steps(trainer.optimizer), "skipped_nonfinite": skipped,
            "epochs": epoch, "items": len(items), "mean_loss": sum(losses) / len(losses) if losses else None,
            "seconds": time.perf_counter() - start, **({"order": "arrival"} if arrival else {})}


def adam_steps(optimizer) -> int:
    """Steps the optimizer itself counted (its per-parameter "step"): evidence independent of our counters."""
    counts = [int(s["step"]) for s in optimizer.state.values() if "step" in s]
    return max(counts) if counts else 0


def trainable_weights(trainer: DistillTrainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.params]


@torch.no_grad()
def load_trainable_weights(trainer: DistillTrainer, weights: list[torch.Tensor]) -> None:
    for p, w in zip(trainer.params, weights):
        p.copy_(w)
    trainer.draft.eval()
