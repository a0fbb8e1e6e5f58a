"""`osd bench train-step`: seconds per distillation step of the draft, with and without the rows-only last layer.

Online learning on a 2-core CPU is bounded by the training step, so its cost is worth a benchmark of its own.
Items are cached target outputs (every response position supervised, like `--mode all`); the frozen trunk's
features are computed once in a warm-up that is not counted. Then, for each repeat, the same batch runs
forward + backward through both paths back to back (the machine's noise hits both alike):
  whole_layer   every trainable layer over every position, LM head at the supervised positions
  rows_only     the last layer at the supervised positions only (learn/trainable.py)
  rows_only_bf16  rows_only with its matrix products in bf16 (autocast, learn/precision.py: what --learn-precision
                auto picks where the CPU has native bf16)
Also reported: the largest difference between the two fp32 paths' losses and gradients (the same up to rounding),
bf16's gradient difference from fp32 (relative L2), and the optimizer step's seconds (gradient clipping + AdamW)
as a per-tensor loop and fused (what the learner runs).
"""
from __future__ import annotations

import random
import statistics
import time

import torch

from osd.config import ModelConfig
from osd.distill.cache import DecodeSettings
from osd.distill.evaluate import sample_item
from osd.distill.target_outputs import dataset_samples
from osd.learn.batch import items_loss
from osd.learn.precision import compute_in, native_bf16
from osd.learn.trainable import configure_trainable, rows_only_supported, split_index
from osd.models.loading import load_model

PATHS = {"whole_layer": (False, torch.float32), "rows_only": (True, torch.float32),
         "rows_only_bf16": (True, torch.bfloat16)}  # (rows_only, dtype of the matrix products)


def forward_backward(model, params, batch, split: int, rows_only: bool,
                     dtype=torch.float32) -> tuple[float, float, list[torch.Tensor]]:
    """(seconds, loss, gradients) of one forward + backward of the forward-KL loss on the batch."""
    for p in params:
        p.grad = None
    start = time.perf_counter()
    with compute_in(dtype):
        loss = items_loss(model, batch, "forward_kl", split=split, rows_only=rows_only)
    loss.backward()
    return time.perf_counter() - start, loss.item(), [p.grad.clone() for p in params]


def run_train_step(models: ModelConfig, dataset: str, split: str, requests: int, settings: DecodeSettings,
                   train_layers: int = 2, trainable: str = "no_embeddings", batch_size: int = 8, repeats: int = 5,
                   seed: int = 0, cache_dir=None, progress=None) -> dict:
    samples, _ = dataset_samples(models, dataset, split, requests, settings, cache_root=cache_dir, progress=progress)
    items = [sample_item(s) for s in samples]
    draft = load_model(models.draft, models.draft_dtype)
    params = configure_trainable(draft, trainable, train_layers)
    cut = split_index(draft, train_layers)
    draft.train()
    rng = random.Random(seed)
    forward_backward(draft, params, items[:batch_size], cut, True)  # warm-up: trunk features of these items
    for i in range(batch_size, len(items), batch_size):  # ... and of the rest, not counted either
        forward_backward(draft, params, items[i : i + batch_size], cut, True)
    seconds = {name: [] for name in PATHS}
    loss_diff = grad_diff = bf16_diff = 0.0
    forward_backward(draft, params, items[:batch_size], cut, True, torch.bfloat16)  # warm-up of the bf16 kernels
    for _ in (progress or (lambda x, **kw: x))(range(repeats), desc="train steps"):
        batch = rng.sample(items, min(batch_size, len(items)))
        runs = {name: forward_backward(draft, params, batch, cut, *how) for name, how in PATHS.items()}
        for name, (secs, _, _) in runs.items():
            seconds[name].append(secs)
        (_, loss_w, grads_w), (_, loss_r, grads_r) = runs["whole_layer"], runs["rows_only"]
        loss_diff = max(loss_diff, abs(loss_w - loss_r))
        grad_diff = max(grad_diff, max((a - b).abs().max().item() / (a.abs().max().item() or 1.0)
                                       for a, b in zip(grads_w, grads_r)))
        fp32 = _flat(grads_r)
        bf16_diff = max(bf16_diff, ((_flat(runs["rows_only_bf16"][2]) - fp32).norm() / fp32.norm()).item())
    median = {name: statistics.median(v) for name, v in seconds.items()}
    optimizer = optimizer_seconds(params, repeats)
    return {"config": {"models": models.__dict__, "dataset": dataset, "split": split, "requests": len(items),
                       "max_new_tokens": settings.max_new_tokens, "train_layers": train_layers, "trainable": trainable,
                       "batch_size": batch_size, "repeats": repeats, "seed": seed},
            "rows_only_supported": rows_only_supported(draft, draft.model.layers[-1]),
            "mean_context_tokens": sum(len(it.tokens) for it in items) / len(items),
            "mean_supervised_positions": sum(len(it.positions) for it in items) / len(items),
            "seconds_per_forward_backward": seconds, "median_seconds": median,
            "speedup_rows_only": median["whole_layer"] / median["rows_only"],
            "speedup_bf16": median["rows_only"] / median["rows_only_bf16"], "native_bf16": native_bf16(),
            "max_loss_difference": loss_diff, "max_relative_gradient_difference": grad_diff,
            "max_bf16_gradient_difference_l2": bf16_diff, "optimizer_step_seconds": optimizer}


def _flat(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.flatten() for g in grads])


def optimizer_seconds(params: list[torch.Tensor], repeats: int) -> dict:
    """Median seconds of gradient clipping + one AdamW step over `params` (their current gradients), as torch's
    per-tensor loop and fused; the weights are put back afterwards."""
    saved = [p.detach().clone() for p in params]
    out = {}
    for name, fused in (("adamw_loop", False), ("adamw_fused", True)):
        optimizer, times = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0, foreach=False, fused=fused or None), []
        for _ in range(repeats + 1):  # the first allocates the moments: not counted
            start = time.perf_counter()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times[1:])
    with torch.no_grad():
        for p, w in zip(params, saved):
            p.copy_(w)
    return out
