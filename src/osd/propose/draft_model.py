"""Draft-model proposer: k autoregressive draft forwards over a KV cache kept across steps."""
from __future__ import annotations

import time

import torch

from osd.config import SamplingConfig
from osd.drafts import DraftRegistry, weights_fingerprint
from osd.models.cached import CachedModel
from osd.models.glue_draft import GlueDraftRunner, feed_together, glue_draft_runner, qualifies
from osd.models.q4_draft import Q4Draft
from osd.models.q4_runner import Q4Runner, feed_together as q4_feed_together
from osd.notice import say
from osd.propose.base import Proposal
from osd.schedule.prefix import common_prefix
from osd.verify.sampling import sample_from, warp


class DraftModelProposer:
    """Proposes with the latest published snapshot of one named draft.

    The snapshot is taken in `begin` (once per request): a newer version is picked up by the next
    request, and its KV cache starts empty (caches built with old weights are never reused); `begin` then feeds
    the prompt but its last token, so the draft's prompt prefill is part of the request's prefill (the engine
    times it there, as llama.cpp's speculative example does) and the first proposal feeds one token. With
    `prefill=False` (a request admitted beside others, which under load may never speculate) the first proposal
    feeds everything the cache lacks instead, and a request that never proposes never runs the draft.
    Every proposal names the weights its forwards ran with (`Proposal.weights`: the snapshot's version and a
    checksum of the serving copy taken at that propose call), so a swap inside a request would show per step.

    Prefix reuse, as the target's slots do it (schedule/prefix.py): `held` lists the tokens whose keys/values the
    runner holds, and `begin` starts a prompt from the longest prefix of it that this proposer or one of its forks
    (the drafts of the other sequences: `family`) holds under the same snapshot, in place or copied
    (`copy_prefix_from`), so only the rest is fed. The keys/values are bitwise those feeding would write (rows are
    computed alone on the draft runners), so the proposals are those without reuse; a shared system prompt, a
    schema, a conversation's earlier turns cost the draft nothing again. `reused_rows` counts the positions reused.
    """

    runners_up = 0  # proposals also name the draft's next-best tokens at each depth (token trees: the engine sets it)

    def __init__(self, registry: DraftRegistry, name: str, vocab_size: int):
        self.registry, self.name, self.vocab_size = registry, name, vocab_size
        self.version = -1
        self.runner = None  # the glue runner over the snapshot's serving copy where it qualifies, else CachedModel
        self.vocab_ids: torch.Tensor | None = None
        self.held: list[int] = []  # the tokens at the runner's cached positions 0.. (at most runner.length of them)
        self.family = [self]  # this proposer and its forks: whose cached prefixes a new prompt may start from
        self.reused_rows = 0  # prompt positions begin took from a cache instead of feeding them

    def fork(self) -> "DraftModelProposer":
        """A proposer for another sequence: the same draft (its latest snapshot at each begin), its own cache."""
        fork = DraftModelProposer(self.registry, self.name, self.vocab_size)
        fork.runners_up = self.runners_up
        fork.family = self.family
        self.family.append(fork)
        return fork

    def begin(self, prompt_ids: list[int], prefill: bool = True) -> None:
        snap = self.registry.get(self.name)
        if self.runner is None or snap.version != self.version or self.runner.model is not snap.model:
            self.runner = serving_runner(snap.model) or self._transformers_runner(snap.model)
            self.version, self.vocab_ids = snap.version, snap.vocab_ids
            self._increasing = self.vocab_ids is None or bool((self.vocab_ids[1:] > self.vocab_ids[:-1]).all())
            self.held = []
        self._prefill(prompt_ids, prefill)

    def _prefill(self, prompt_ids: list[int], prefill: bool) -> None:
        """The prompt but its last token, from the longest prefix cached (`_start_from`) on: fed now where `prefill`,
        inside the engine's prefill as llama.cpp's speculative example does (else the first proposal feeds it)."""
        head = list(prompt_ids[:-1])
        self._start_from(head)
        if prefill and len(head) > self.runner.length:
            self.runner.feed(head[self.runner.length :])
            self.held = head

    def _start_from(self, head: list[int]) -> None:
        """Hold the longest prefix of `head` that this proposer or a fork on the same serving copy has cached."""
        def shares(p) -> bool:  # a fork on the same serving copy, where this runner can copy from another
            return p is self or (p.runner is not None and p.runner.model is self.runner.model
                                 and p.version == self.version and hasattr(self.runner, "copy_prefix_from"))
        donor, n = max(((p, common_prefix(p.held[: p.runner.length], head)) for p in self.family if shares(p)),
                       key=lambda pair: (pair[1], pair[0] is self))
        if n == 0:
            self.runner.reset()
        elif donor is self:
            self.runner.rollback(n)
        else:
            self.runner.copy_prefix_from(donor.runner, n)
        self.held, self.reused_rows = head[:n], self.reused_rows + n

    def _transformers_runner(self, model) -> CachedModel:
        """The fallback draft runner, said once: the glue runner costs ~1.6x less per draft token."""
        why = qualifies(model) or "the glue kernels cannot be built here"
        say(f"draft {self.name!r} runs on transformers, not the compiled glue runner ({why}): each draft token costs "
            "~1.6x more, so speculation pays less")
        return CachedModel(model)

    def _full_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """(V',) draft logits -> (V,) logits over the target's vocabulary (-inf where not covered)."""
        if self.vocab_ids is None and logits.shape[-1] == self.vocab_size:
            return logits
        full = torch.full((self.vocab_size,), float("-inf"))
        ids = self.vocab_ids if self.vocab_ids is not None else torch.arange(min(logits.shape[-1], self.vocab_size))
        full[ids] = logits[: len(ids)]
        return full

    def _runners_up(self, logits: torch.Tensor, token: int) -> list[int]:
        """The draft's next-best target ids after its argmax `token`, best first."""
        n = self.vocab_size if self.vocab_ids is None else len(self.vocab_ids)
        top = logits[:n].topk(self.runners_up + 1).indices
        ids = top.tolist() if self.vocab_ids is None else self.vocab_ids[top].tolist()
        return [t for t in ids if t != token][: self.runners_up]

    def _greedy(self, logits: torch.Tensor) -> int:
        """The target id of the draft's argmax, taken in the draft's own vocabulary (no (V,) scatter per token);
        the same id as the argmax over _full_vocab (first maximum) where the map is increasing."""
        if self.vocab_ids is None:
            return int(logits[: self.vocab_size].argmax())
        if not self._increasing:
            return int(self._full_vocab(logits).argmax())
        return int(self.vocab_ids[int(logits[: len(self.vocab_ids)].argmax())])

    def _confidence(self, logits: torch.Tensor) -> float:
        """The draft's probability of its argmax, from its logits over its own vocabulary."""
        head = logits[: self.vocab_size if self.vocab_ids is None else len(self.vocab_ids)]
        return float((head.max() - head.logsumexp(0)).exp())

    def propose(self, tokens: list[int], k: int, sampling: SamplingConfig, generator=None, go_on=None) -> Proposal:
        """Up to k tokens; go_on(confidences so far) -> False stops drafting early (schedule/confidence.py)."""
        drafting = _Drafting(self, sampling, generator)
        runner, start = self.runner, self.runner.length
        pending = tokens[start:]
        for _ in range(k):
            t0 = time.perf_counter()
            logits = runner.feed(pending)[0]  # (V',): the draft's own vocabulary (a map's, or a prefix of V)
            if len(pending) == 1:  # catch-up forwards (several pending tokens) would skew the cost model
                drafting.timings.append(time.perf_counter() - t0)
            pending = [drafting.pick(logits)]
            if go_on is not None and not go_on(drafting.confidence):
                break
        self._note(tokens, drafting.tokens, start)
        return drafting.proposal()

    def _note(self, tokens: list[int], proposed: list[int], start: int) -> None:
        """After a proposal that fed from cache position `start` on: the runner holds the sequence and the proposals it
        fed (all but the last). Only what was fed is appended (no copy of the whole sequence a step); `held` shorter
        than `start` (a feed that failed before) stays as it is, a shorter but true prefix."""
        if len(self.held) >= start:  # held[:start] is tokens[:start]: the runner's cache is the sequence up to start
            del self.held[start:]
            self.held += (tokens[start:] + proposed)[: self.runner.length - start]

    def fingerprint(self, runner) -> str:
        """'<name>@v<version>:<checksum of the weights `runner` holds now>' (no checksum for a non-torch runner)."""
        model = getattr(runner, "model", None)
        checksum = weights_fingerprint(model) if isinstance(model, torch.nn.Module) else "frozen"
        return f"{self.name}@v{self.version}:{checksum}"

    def rollback(self, length: int) -> None:
        self.runner.rollback(length)
        del self.held[self.runner.length :]

    def lag(self, tokens: list[int]) -> int:
        """Tokens of `tokens` the next proposal must feed before its first forward of one token: the prompt a lazy
        `begin` left unfed, the tokens committed while this source did not propose."""
        return max(0, len(tokens) - 1 - (self.runner.length if self.runner is not None else 0))


def serving_runner(model):
    """The fast runner over a published serving copy: a Q4 copy's own runner (models/q4_draft.py), the glue runner
    over an int8 copy, else None (the transformers runner serves)."""
    return model.runner() if isinstance(model, Q4Draft) else glue_draft_runner(model)


class _Drafting:
    """One sequence's proposal as it grows: the tokens picked so far and what each pick noted."""

    def __init__(self, proposer: DraftModelProposer, sampling: SamplingConfig, generator):
        self.proposer, self.sampling, self.generator = proposer, sampling, generator
        self.tokens, self.probs, self.timings, self.runners_up, self.confidence = [], [], [], [], []

    def pick(self, logits: torch.Tensor) -> int:
        """The next proposed token from the draft's logits at one position (its probabilities and runners-up noted)."""
        p, sampling = self.proposer, self.sampling
        if sampling.greedy:
            token = p._greedy(logits)
            self.confidence.append(p._confidence(logits))
            if p.runners_up:
                self.runners_up.append(p._runners_up(logits, token))
        else:
            q = warp(p._full_vocab(logits), sampling)
            token = sample_from(q, self.generator)
            self.probs.append(q)
            self.confidence.append(float(q[token]))
            if p.runners_up:  # the likeliest other tokens under q (deterministic given the context)
                top = q.topk(p.runners_up + 1).indices.tolist()
                self.runners_up.append([t for t in top if t != token and q[t] > 0][: p.runners_up])
        self.tokens.append(token)
        return token

    def proposal(self) -> Proposal:
        p = self.proposer
        return Proposal(self.tokens, torch.stack(self.probs) if self.probs else None, single_token_seconds=self.timings,
                        weights=p.fingerprint(p.runner), runners_up=self.runners_up or None,
                        confidence=self.confidence)


def propose_together(proposers: list[DraftModelProposer], tokens: list[list[int]], ks: list[int],
                     samplings: list[SamplingConfig], generators: list, go_on: list | None = None) -> list[Proposal]:
    """Each proposer's proposal of ks[i] tokens for its own sequence, the draft forwards of every sequence still
    drafting at a depth run as one (`feed_together`: one pass over the draft's weights for all of them). The same
    proposals as each proposer's `propose` alone: each row's logits are bitwise those of its own forward, and each
    sequence picks from them with its own sampling and generator, in the same order. Proposers whose runners are not
    glue runners over one serving copy propose one after another. A sequence's per-token seconds are its share of the
    forwards it was in (timed where every row fed was a single token, as `propose` times). Q4 runners over one Q4
    copy (models/q4_draft.py) batch the same way (q4_runner.feed_together). go_on[i] (or None): as in `propose`,
    stops sequence i's drafting early."""
    runners = [p.runner for p in proposers]
    go_on = go_on or [None] * len(proposers)
    together = _feed_together(runners)
    if together is None:
        return [p.propose(t, k, s, g, stop) for p, t, k, s, g, stop in zip(proposers, tokens, ks, samplings, generators,
                                                                         go_on)]
    drafting = [_Drafting(p, s, g) for p, s, g in zip(proposers, samplings, generators)]
    starts = [r.length for r in runners]
    pending = [t[start:] for t, start in zip(tokens, starts)]
    ks = list(ks)
    for depth in range(max(ks, default=0)):
        active = [i for i, k in enumerate(ks) if k > depth]
        if not active:
            break
        t0 = time.perf_counter()
        logits = together([runners[i] for i in active], [pending[i] for i in active])  # (len(active), V')
        share = (time.perf_counter() - t0) / len(active)
        single = all(len(pending[i]) == 1 for i in active)
        for row, i in enumerate(active):
            if single:
                drafting[i].timings.append(share)
            pending[i] = [drafting[i].pick(logits[row])]
            if go_on[i] is not None and not go_on[i](drafting[i].confidence):
                ks[i] = depth + 1  # this sequence drafts no further
    for p, t, d, start in zip(proposers, tokens, drafting, starts):
        p._note(t, d.tokens, start)
    return [d.proposal() for d in drafting]


def _feed_together(runners: list):
    """The batched feed of these runners (glue runners over one int8 copy, or Q4 runners over one Q4 copy), or None
    where they must feed one after another."""
    if len(runners) < 2 or len({id(getattr(r, "model", None)) for r in runners}) != 1:
        return None
    if all(isinstance(r, GlueDraftRunner) for r in runners):
        return feed_together
    if all(isinstance(r, Q4Runner) for r in runners) and getattr(runners[0], "model", None) is not None:
        return q4_feed_together
    return None


class RunnerProposer(DraftModelProposer):
    """Proposes with a fixed, frozen draft runner, e.g. a GGUF draft on llama.cpp (models/llama_cpp_runner.py).

    The same drafting loop as the learned draft; nothing publishes to it (version stays 0). It holds one cache, so
    it serves one sequence at a time (not forkable).
    """

    forkable = False

    def __init__(self, runner, name: str, vocab_size: int):
        self.runner, self.name, self.vocab_size = runner, name, vocab_size
        self.version, self.vocab_ids = 0, None
        self.held, self.family, self.reused_rows = [], [self], 0

    def begin(self, prompt_ids: list[int], prefill: bool = True) -> None:
        self._prefill(prompt_ids, prefill)  # as DraftModelProposer.begin: from the prefix its cache holds
