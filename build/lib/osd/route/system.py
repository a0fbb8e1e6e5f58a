"""Several adapter drafts, the router, its feedback and the drafts' learners, wired for one engine.

build.py makes one behind `--drafts a,b,c` (RouteConfig): the drafts are LoRA adapters on the base draft
(drafts_multi.py), the engine's proposer is a RoutedProposer, and after each request the decision is committed
and the feedback scores the drafts on a budgeted share. Drafts can be created (from the base or as a copy)
and retired while serving; the router, the proposer and the learners follow.
"""
from __future__ import annotations

from osd.drafts_multi import AdapterDrafts
from osd.learn.per_draft import DraftLearners, served_draft
from osd.propose.routed import RoutedProposer
from osd.route.config import RouteConfig
from osd.route.feedback import RouteFeedback
from osd.route.features import prompt_features
from osd.route.policy import Router


def featurizer(tokenizer, config: RouteConfig):
    """prompt ids -> features, with the script shares of the decoded prompt tail when a tokenizer is given."""

    def featurize(ids: list[int]):
        tail = ids[-config.route_window:] if config.route_window else ids
        try:
            text = tokenizer.decode(tail) if tokenizer is not None else ""
        except (ValueError, TypeError, KeyError, IndexError):
            text = ""
        return prompt_features(ids, text, config.route_buckets, config.route_window)

    return featurize


class Routing:
    def __init__(self, drafts: AdapterDrafts, config: RouteConfig, vocab_size: int, tokenizer=None):
        self.drafts, self.config = drafts, config
        self.router = Router(drafts.names(), config, featurizer(tokenizer, config))
        self.proposer = RoutedProposer(drafts.registry, self.router, vocab_size)
        self.feedback = RouteFeedback(self.router, drafts, config)
        self.learners: DraftLearners | None = None

    @classmethod
    def build(cls, base, config: RouteConfig, registry=None, tokenizer=None, vocab_size: int | None = None,
              quantize: str = "none", draft_vocab: int = 0, keep_ids=()) -> "Routing":
        drafts = AdapterDrafts(base, config.adapter_config(), registry, quantize, draft_vocab, keep_ids)
        for name in config.names():
            drafts.create(name)
        return cls(drafts, config, vocab_size or int(base.config.vocab_size), tokenizer)

    # --- wiring ---------------------------------------------------------------------------------
    def attach(self, engine) -> "Routing":
        engine.request_observers.append(self.after_request)
        self.feedback.engine_busy = engine.busy
        return self

    def attach_learners(self, learn, engine) -> DraftLearners:
        self.learners = DraftLearners(self.drafts, learn, owner_of=self.owner_of).attach(engine)
        return self.learners

    def owner_of(self, served: str) -> str:
        """The draft that learns from the request in flight: its decision's owner (one worker: `last` is it)."""
        decision = self.proposer.last
        return decision.owner if decision is not None and decision.draft == served and decision.owner else served

    def after_request(self, result) -> None:
        decision = self.proposer.last
        if decision is None or decision.draft != served_draft(result.draft[0]) or decision.prompt_len != len(result.prompt_ids):
            decision = None  # not this request's (cannot happen with one worker; then featurise again)
        else:
            self.router.commit(decision)
        self.feedback.after_request(result, decision)

    def start(self) -> None:
        self.feedback.start()

    def stop(self) -> None:
        self.feedback.stop()

    # --- drafts at runtime ----------------------------------------------------------------------
    def names(self) -> list[str]:
        return self.drafts.names()

    def versions(self) -> dict[str, int]:
        """Published drafts and their versions, from the registry alone: every request asks (to check a pinned
        draft), and the drafts' master lock is held by a learner's update for seconds."""
        registry, names, out = self.drafts.registry, set(self.names()), {}
        for n in registry.names():
            try:
                if n in names:
                    out[n] = registry.get(n).version
            except KeyError:  # retired meanwhile
                pass
        return out

    def create(self, name: str, copy_from: str | None = None) -> None:
        self.drafts.create(name, copy_from)
        self.router.add(name, like=copy_from)
        if self.learners is not None:
            self.learners.add(name).start()

    def retire(self, name: str) -> None:
        if self.learners is not None:
            self.learners.remove(name)
        self.drafts.retire(name)
        self.router.remove(name)
        self.proposer.forget(name)

    def stats(self) -> dict:
        return {"drafts": self.versions(), "router": self.router.stats(), "feedback": self.feedback.stats(),
                "bytes": self.drafts.tensor_bytes()}
