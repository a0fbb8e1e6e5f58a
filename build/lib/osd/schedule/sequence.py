"""One request in flight: its tokens, cache slot, proposer state, stopping and counters."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from osd.config import SamplingConfig
from osd.metrics import SpecCounters
from osd.stopping import StopChecker


class LiveAlpha:
    """One sequence's acceptance for one proposal source: its own evidence (EMA), shrunk towards the source's
    shared estimate (`prior`, worth `weight` tokens), so a new sequence starts from what the source does overall."""

    def __init__(self, ema: float = 0.9, weight: float = 10.0):
        self.ema, self.weight = ema, weight
        self.accepted = self.rejected = 0.0

    def observe(self, k: int, n_accepted: int) -> None:
        if k > 0:
            self.accepted = self.ema * self.accepted + n_accepted
            self.rejected = self.ema * self.rejected + (1 if n_accepted < k else 0)

    def value(self, prior: float) -> float:
        return (self.accepted + self.weight * prior) / (self.accepted + self.rejected + self.weight)


@dataclass
class Sequence:
    request_id: str
    prompt: list[int]
    sampling: SamplingConfig
    slot: int
    proposer: object | None  # this sequence's own proposer (the engine's, or a fork of it)
    stopper: StopChecker
    generator: torch.Generator | None
    on_text: Callable[[str], None] | None = None
    started: float = 0.0
    tokens: list[int] = field(default_factory=list)  # prompt + committed output
    draft: tuple[str, int] = ("none", -1)  # (name, version) of the draft that serves it, fixed at admission
    sources: list = field(default_factory=list)  # the proposer's sources, in the order the policies are
    alphas: list[LiveAlpha] = field(default_factory=list)  # per source
    counters: SpecCounters = field(default_factory=lambda: SpecCounters(requests=1))
    steps: list[tuple[int, int]] = field(default_factory=list)  # (k, n_accepted) per step
    prefill_seconds: float = 0.0
    sent: str = ""  # text already streamed
    zero_steps: int = 0  # steps in a row at k = 0 (with company: probes, scheduler.PROBE_EVERY per sequence)
    result: object | None = None  # GenerationResult once finished
    error: BaseException | None = None  # set when it failed (alone: the others went on)

    @property
    def prefill_target(self) -> int:
        """Prompt tokens fed before the first step (the last one goes with the first proposals)."""
        return len(self.prompt) - 1

    @property
    def remaining(self) -> int:
        return self.sampling.max_new_tokens - len(self.stopper.token_ids)

    @property
    def finished(self) -> bool:
        return self.stopper.finish_reason is not None
