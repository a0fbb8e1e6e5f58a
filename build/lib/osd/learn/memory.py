"""What the online learner holds in memory, and reserving its fixed part at start.

The learner's memory has a fixed part, known when it is built: the optimizer's state (two Adam moments per
trainable parameter), the drift guard's copies of the trainable weights (the never-trained base, the best
version so far) and, when averaging, the optimizer's own trajectory beside the average (learn/average.py). torch allocates the moments at the first optimizer step and the guard copies the best
version when one first beats the base, so a server that starts lean grows by ~3x the trainable weights at its
first updates (~0.7 GB with the top 4 layers of the 0.5B draft): measured as RSS growth by `osd bench soak`,
and an out-of-memory would come then, mid-serving. `reserve_optimizer_state` allocates the moments at start
(zeros, exactly what AdamW's first step would allocate, so training is unchanged), and VersionStore keeps one
preallocated slot for the best version: what the learner needs is taken, or refused, at start.
The rest grows with traffic up to bounds set by the config: the buffers' items (contexts, the target's top-K
distributions and the cached trunk features of the items trained on, bf16), see `OnlineLearner.memory`.
"""
from __future__ import annotations

import torch


def reserve_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Allocate Adam(W)'s per-parameter state now, as its first step would (step 0, zero moments); a parameter
    that already has state keeps it."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if state:
                continue
            state["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _scalar_dtype() -> torch.dtype:
    """The dtype AdamW gives its step counter (float32 unless the default dtype is float64)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(tensor_bytes(state.values()) for state in optimizer.state.values())


def items_bytes(items) -> int:
    """Tensors held by replay items (target distributions, cached features) plus their token lists (~8 bytes
    each as list slots; the small ints themselves are shared)."""
    total = 0
    for it in items:
        total += tensor_bytes((it.target.ids, it.target.probs, it.features)) + 8 * (len(it.tokens) + len(it.positions))
    return total
