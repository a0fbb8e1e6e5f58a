"""A proposer that routes each request to one of several named drafts, then drafts with it.

`begin` (once per request, before decoding) asks the router for a draft (a pin set with osd.route.pinned
wins) and hands the request to that draft's DraftModelProposer, which takes the draft's latest snapshot.
`name` / `version` are then the chosen draft's, so the engine's results, metrics and learner records name the
draft that served. The decision is kept in `last` for the request observer (route/system.py) to commit.
Limitation: the engine keeps one k policy per proposer, so the adaptive k's acceptance estimate mixes drafts.
"""
from __future__ import annotations

from osd.config import SamplingConfig
from osd.drafts import DraftRegistry
from osd.errors import DraftNotFound
from osd.propose.base import Proposal
from osd.propose.draft_model import DraftModelProposer
from osd.route import current_pin


class RoutedProposer:
    def __init__(self, registry: DraftRegistry, router, vocab_size: int):
        self.registry, self.router, self.vocab_size = registry, router, vocab_size
        self.proposers: dict[str, DraftModelProposer] = {}
        self.current: DraftModelProposer | None = None
        self.name, self.version = "routed", -1
        self.last = None  # the Decision of the request in flight (or just finished)

    def begin(self, prompt_ids: list[int], prefill: bool = True) -> None:
        decision = self.router.route(prompt_ids, pinned=current_pin())
        proposer = self.proposers.get(decision.draft)
        if proposer is None:
            proposer = self.proposers[decision.draft] = DraftModelProposer(self.registry, decision.draft, self.vocab_size)
        try:
            proposer.begin(prompt_ids, prefill)
        except KeyError as e:  # retired between the decision and now
            raise DraftNotFound(f"draft {decision.draft!r} is not published (retired?)") from e
        self.current, self.last = proposer, decision
        self.name, self.version = decision.draft, proposer.version

    def propose(self, tokens: list[int], k: int, sampling: SamplingConfig, generator=None) -> Proposal:
        return self.current.propose(tokens, k, sampling, generator)

    def rollback(self, length: int) -> None:
        if self.current is not None:
            self.current.rollback(length)

    def forget(self, name: str) -> None:
        """Drop a retired draft's proposer (and its cache)."""
        self.proposers.pop(name, None)
