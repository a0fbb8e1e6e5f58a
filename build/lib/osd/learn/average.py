"""Weight averaging: the draft that serves is an exponential moving average (EMA) of the learner's weights over its
optimizer steps, not the weights of the last step (Polyak averaging).

Why: online, the last steps' batches lean on the newest requests (the FIFO half of each batch), so the last
iterate is fit to the latest few dozen requests; an offline draft trained on the whole stream with the same
number of steps sees every request evenly to the end, and measured higher on held-out requests on every stream
(BENCHMARKS.md, "online vs offline-100%"). Averaging the iterates keeps the learning and damps that recency noise.

`decay` is per optimizer step. Early on the average would drag the never-trained weights along, so the decay
used at step n is min(decay, (1 + n) / (10 + n)) (a short memory while few steps exist).

Where the weights live: outside training the parameters hold the average, which is what serves, is judged by the
guard, published, checkpointed (draft.safetensors) and measured; `trajectory` holds the learner's own weights,
the ones the optimizer steps. `training()` swaps the two for the optimizer steps and back. Memory: one more copy
of the trainable weights.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch


class WeightAverage:
    def __init__(self, params: list[torch.Tensor], decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"average decay must be in (0, 1), got {decay}")
        self.params, self.decay = params, decay
        self.other = [p.detach().clone() for p in params]  # the trajectory outside training(), the average inside
        self.steps = 0
        self.inside = False

    @property
    def trajectory(self) -> list[torch.Tensor]:
        """The learner's own weights (outside `training()`)."""
        assert not self.inside
        return self.other

    def current_decay(self) -> float:
        return min(self.decay, (1 + self.steps) / (10 + self.steps))

    @contextmanager
    def training(self):
        """Inside: the parameters hold the learner's own weights, for the optimizer; after (also after an exception):
        the average again, with the trajectory kept aside."""
        _swap(self.params, self.other)
        self.inside = True
        try:
            yield
        finally:
            self.inside = False
            _swap(self.params, self.other)

    @torch.no_grad()
    def step(self) -> None:
        """Inside `training()`, after an optimizer step: fold the parameters as they are now into the average."""
        assert self.inside, "WeightAverage.step outside training()"
        keep = self.current_decay()
        for avg, p in zip(self.other, self.params):
            avg.mul_(keep).add_(p.detach(), alpha=1.0 - keep)
        self.steps += 1

    @torch.no_grad()
    def reset(self) -> None:
        """Outside `training()`: the trajectory restarts from the parameters as they are (the average); after a
        rollback or a reset to the base, or a resume from weights only."""
        assert not self.inside
        _load(self.other, self.params)

    def state_dict(self) -> dict:
        return {"trajectory": [w.clone() for w in self.trajectory], "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        _load(self.trajectory, state["trajectory"])
        self.steps = state["steps"]


@torch.no_grad()
def _load(params, weights) -> None:
    for p, w in zip(params, weights):
        p.copy_(w)


@torch.no_grad()
def _swap(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b):
        held = x.detach().clone()
        x.copy_(y)
        y.copy_(held)
