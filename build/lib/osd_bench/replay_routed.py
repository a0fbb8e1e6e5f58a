"""`osd replay --fast --route`: per-mode drafts and a router on a mixed stream, in one run (issue 18, item 4).

On one interleaved stream of several datasets (each request keeps its dataset label), side by side, each
measured on a request before it learns from it (the fast replay's teacher-forced greedy acceptance):
- control: the never-trained draft;
- shared:  one online draft learning from every request (the one-draft system);
- oracle:  one online draft per dataset; each request is served and learnt by its label's draft (the paper's
           offline split by a classifier, here by the true label);
- routed:  as many online drafts (or --drafts names), created equal; per request the router (route/policy.py)
           names the owner (the mode by online clustering of the prompts), which learns from it, and the draft
           that serves it (predicted best from full-information scoring on a budgeted share, RouteConfig.
           score_share: every routed draft measured on that request; bounded exploration; the owner on ties).
At the end every arm is measured on each dataset's held-out requests (routed: the router's choice without
exploration), paired position by position with the shared draft. Router accuracy against the label: labels
are matched one-to-one to drafts (greedily, by how many of a label's requests each draft served), and a
request counts as right when its draft is its label's match; the same for the owners (clustering accuracy).
With fewer drafts than labels, the unmatched labels' requests all count as wrong.

Drafts here are copies of the learn config's trainable set on the shared frozen trunk (as in the fast replay),
not peft adapters; `--trainable lora` makes them LoRA adapters (the same math as served adapter drafts).
Exactness: as the fast replay (bench/replay_fast.py EXACTNESS).
"""
from __future__ import annotations

import random
import time
from dataclasses import asdict, replace

import torch

from osd_bench.replay_fast import EXACTNESS, _alpha_columns, learn_item, paired_difference, stream_parts
from osd_bench.baselines import draft_copy
from osd.distill.evaluate import position_stats, sample_item
from osd.errors import InvalidArgument
from osd.learn.online import LearnConfig, OnlineLearner
from osd.learn.residual import Residuals
from osd.learn.trainable import split_index
from osd.route.config import RouteConfig
from osd.route.feedback import ScoreBudget, acceptance
from osd.route.policy import Router

ARMS = ("control", "shared", "oracle", "routed")
BEFORE_FORK = "before the fork"  # route_reason of requests the shared draft served for every arm (fork_at)
UNROUTED = ("explore", BEFORE_FORK)  # requests router accuracy does not count


class _Published:
    def __init__(self, version: int):
        self.version = version


def mixed_order(lengths: list[int], seed: int = 0) -> list[int]:
    """Segment index of each request of an interleaved stream: a seeded shuffle of the labels (each dataset's
    requests keep their file order)."""
    labels = [j for j, n in enumerate(lengths) for _ in range(n)]
    random.Random(seed).shuffle(labels)
    return labels


def online_learner(base, learn: LearnConfig, seed: int) -> OnlineLearner:
    with torch.random.fork_rng():  # LoRA adapters drawn from a seeded generator
        torch.manual_seed(seed)
        held = []
        publish = lambda master, version=None: _Published(held[0].version + 1 if version is None else version)
        held.append(OnlineLearner(draft_copy(base, learn), publish, learn))
        return held[0]


def _learn(learner: OnlineLearner, sample, item, matches, k: int, request_id: str, max_new_tokens) -> None:
    made = {mode: learn_item(sample, item, matches, k, mode, request_id, learner.version, max_new_tokens)
            for mode in {learner.config.mode, "all"}}
    learner.observe_item(made[learner.config.mode], made["all"])
    learner.after_request()


def per_mode_learners(start, learn: LearnConfig, labels: list[str], names: list[str]) -> tuple[dict, dict]:
    """The oracle's per-label and the router's per-mode learners, each a copy of `start` (the base draft, or at a
    fork the shared draft as it is then)."""
    oracle = {d: online_learner(start, learn, learn.seed + 1 + j) for j, d in enumerate(labels)}
    routed = {n: online_learner(start, learn, learn.seed + 101 + j) for j, n in enumerate(names)}
    return oracle, routed


class _Arms:
    """The learning arms' drafts: the shared draft (and with `residual` its equal-steps twin), the oracle's per-label
    and the router's per-mode drafts (empty before a fork), and the residual sync between them."""

    def __init__(self, base, learn: LearnConfig, labels: list[str], names: list[str], residual: bool, forked: bool):
        self.learn, self.labels, self.names, self.residual = learn, labels, names, residual
        self.shared = online_learner(base, learn, learn.seed)
        # residual: the per-mode drafts' own steps come on top of the shared draft's; the same number of steps in one
        # shared draft is the control of what the split adds (steps_per_update doubled: each mode draft updates as
        # often on its mode as the shared draft does on the stream)
        self.shared_steps = online_learner(base, replace(learn, steps_per_update=2 * learn.steps_per_update),
                                           learn.seed) if residual else None
        self.oracle, self.routed, self.residuals = {}, {}, None
        if forked:
            self.fork(base)

    def fork(self, start) -> None:
        """Every per-label and per-mode draft starts as a copy of `start`."""
        self.oracle, self.routed = per_mode_learners(start, self.learn, self.labels, self.names)
        self.residuals = Residuals(self.shared) if self.residual else None

    def singles(self) -> dict[str, OnlineLearner]:
        """The one-draft arms by name."""
        return {"shared": self.shared, **({"shared_steps": self.shared_steps} if self.residual else {})}

    def arm_names(self) -> list[str]:
        """The report's arms: the four of every run, then the one-draft arms only this run has (shared_steps)."""
        return list(ARMS) + [name for name in self.singles() if name not in ARMS]

    def measure(self, matches, domain: str, draft: str) -> dict[str, list]:
        """Each arm's matches on the request, before any arm learns from it; `draft`: the routed draft serving it."""
        shared = matches(self.shared.master)
        got = {"shared": shared, "oracle": shared, "routed": shared}  # before the fork the shared draft serves all
        if self.routed:
            got.update(oracle=matches(self.oracle[domain].master), routed=matches(self.routed[draft].master))
        if self.shared_steps is not None:
            got["shared_steps"] = matches(self.shared_steps.master)
        return got

    def learn_from(self, sample, item, got: dict, owned, domain: str, owner: str, k: int, rid: str,
                   max_new_tokens) -> None:
        """The one-draft arms, then (after syncing residuals with the shared draft's update) the request's label
        draft and its owner learn from the request; before the fork only the one-draft arms learn."""
        for arm, learner in self.singles().items():
            _learn(learner, sample, item, got[arm], k, rid, max_new_tokens)
        if not self.routed:
            return
        if self.residuals is not None:
            self.residuals.sync([*self.oracle.values(), *self.routed.values()])
        _learn(self.oracle[domain], sample, item, got["oracle"], k, rid, max_new_tokens)
        _learn(self.routed[owner], sample, item, owned, k, rid, max_new_tokens)

    def stats(self) -> dict:
        return {**{arm: learner.stats() for arm, learner in self.singles().items()},
                "oracle": {d: l.stats() for d, l in self.oracle.items()},
                "routed": {n: l.stats() for n, l in self.routed.items()}}


def _score(router: Router, decision, every: dict, routed: dict, matches) -> bool:
    """Full-information feedback: every routed draft measured on the request (`every` gains the missing ones), the
    router learns each one's acceptance; whether the served draft scored best (before learning from it)."""
    every.update({n: matches(m.master) for n, m in routed.items() if n not in every})
    rewards = {n: acceptance(m) for n, m in every.items()}
    router.learn(decision.features, rewards)
    return rewards[decision.draft] >= max(rewards.values())


def routed_replay(samples: list, domains: list[str], base, learn: LearnConfig, route: RouteConfig, featurize,
                  k: int = 4, max_new_tokens: int | None = None, heldout: dict[str, list] | None = None,
                  progress=None, on_row=None, fork_at: int = 0, residual: bool = False) -> dict:
    """The four arms over target samples in stream order; `base` is left unchanged.

    residual: the per-label and per-mode drafts are residuals on the shared draft (learn/residual.py): each is the
    shared draft plus its own steps on its traffic; adds the arm "shared_steps", one shared draft with as many
    optimizer steps as the shared draft and a mode draft together.

    fork_at > 0: a split instead of drafts created equal. The first `fork_at` requests are served by the one shared
    draft in every arm (the oracle's and the router's columns are the shared draft's; only it learns; the router
    still sees the prompts, so its clustering warms up); then every per-label and per-mode draft starts as a copy
    of the shared draft as it is at that request (the server's "create a draft as a copy of another") and learns
    its own traffic from there. The control of what a split adds is the shared draft, which goes on alone."""
    if fork_at >= len(samples):
        raise InvalidArgument(f"--fork-at {fork_at}: the stream has {len(samples)} requests; fork before its end")
    if fork_at > 0 and learn.trainable == "lora":
        raise InvalidArgument("--fork-at copies the shared draft's trainable layers; with --trainable lora that would "
                              "stack adapters on adapters: use a layer trainable set (no_embeddings)")
    if residual and learn.trainable == "lora":
        raise InvalidArgument("--residual adds the shared draft's weight changes to each draft's; LoRA factors do not "
                              "add that way: use a layer trainable set (no_embeddings)")
    split = split_index(base, learn.train_layers)
    items = [sample_item(s) for s in samples]
    labels = list(dict.fromkeys(domains))
    names = route.names() or [f"d{j}" for j in range(len(labels))]
    arms = _Arms(base, learn, labels, names, residual, forked=fork_at <= 0)
    router, budget = Router(names, route, featurize), ScoreBudget(route.score_share, route.route_seed + 1)
    rows, seconds = [], {"route": 0.0, "score": 0.0, "replay": 0.0}
    start = time.perf_counter()
    iterator = progress(range(len(samples)), desc="routed replay", unit="req") if progress else range(len(samples))
    for i in iterator:
        sample, item, domain, rid = samples[i], items[i], domains[i], f"req-{i}"
        matches = lambda model: position_stats(model, [item], [sample], split)[0]["matches"]
        row = {"i": i, "domain": domain, "positions": len(sample.response_ids)}
        control = matches(base)
        row.update(_alpha_columns("control", control, k, max_new_tokens))
        if fork_at > 0 and i == fork_at:
            arms.fork(arms.shared.master)
        t0 = time.perf_counter()
        decision = router.route(sample.prompt_ids)  # before the fork too: the clustering warms up on the prompts
        router.commit(decision)
        seconds["route"] += time.perf_counter() - t0
        got = arms.measure(matches, domain, decision.draft)  # every arm before any learns from the request
        for arm, m in got.items():
            row.update(_alpha_columns(arm, m, k, max_new_tokens, control))
        owned = None
        if not arms.routed:
            row.update(routed_draft="shared", routed_owner=decision.owner, route_reason=BEFORE_FORK, scored=False)
        else:
            every = {decision.draft: got["routed"]}
            row.update(routed_draft=decision.draft, routed_owner=decision.owner, route_reason=decision.reason,
                       scored=budget.take())
            if row["scored"]:
                t0 = time.perf_counter()
                row["served_best"] = _score(router, decision, every, arms.routed, matches)
                seconds["score"] += time.perf_counter() - t0
            owned = every[decision.owner] if decision.owner in every else matches(arms.routed[decision.owner].master)
        arms.learn_from(sample, item, got, owned, domain, decision.owner, k, rid, max_new_tokens)
        rows.append(row)
        if on_row:
            on_row(row)
    seconds["replay"] = time.perf_counter() - start
    matched = label_map(rows, "routed_draft")
    held = _heldout(heldout or {}, base, arms.singles(), arms.oracle, arms.routed, router, matched, split)
    routing = {"label_to_draft": matched, **router_accuracy(rows, matched), "label_to_owner": label_map(rows, "routed_owner"),
               "owner_accuracy": router_accuracy(rows, label_map(rows, "routed_owner"), "routed_owner")["accuracy"],
               **router.stats()}
    names_of_arms = arms.arm_names()
    return {"requests": rows, "arms": names_of_arms, "drafts": names, "labels": labels, "residual": residual,
            "stream_alpha": stream_alpha(rows, names_of_arms), "router": routing, "heldout": held,
            "learners": arms.stats(), "timings": seconds}


def label_map(rows: list[dict], key: str = "routed_draft") -> dict[str, str]:
    """label -> draft, one-to-one: pairs taken greedily by how many of the label's routed requests (not explored,
    not before a fork) the draft got under `key`; a label left without a draft is absent."""
    counts: dict[tuple[str, str], int] = {}
    for r in rows:
        if r["route_reason"] not in UNROUTED:
            pair = (r["domain"], r[key])
            counts[pair] = counts.get(pair, 0) + 1
    out, taken = {}, set()
    for (label, draft), _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if label not in out and draft not in taken:
            out[label] = draft
            taken.add(draft)
    return out


def router_accuracy(rows: list[dict], matched: dict[str, str], key: str = "routed_draft") -> dict:
    """Share of routed requests (not explored, not before a fork) whose draft under `key` is their label's match:
    over the stream and its second half; explored_share: of the requests after the fork."""
    routed = [r for r in rows if r["route_reason"] not in UNROUTED]
    after_fork = [r for r in rows if r["route_reason"] != BEFORE_FORK]
    hit = lambda part: sum(r[key] == matched.get(r["domain"]) for r in part) / max(1, len(part))
    scored = [r for r in routed if "served_best" in r]
    return {"accuracy": hit(routed), "accuracy_second_half": hit(routed[len(routed) // 2:]),
            "explored_share": 1 - len(routed) / max(1, len(after_fork)),
            "served_best_share": sum(r["served_best"] for r in scored) / len(scored) if scored else None}


def stream_alpha(rows: list[dict], arms=ARMS) -> dict:
    """Per arm: position-weighted alpha over the stream and its second half."""
    out = {}
    for arm in arms:
        for name, part in (("all", rows), ("second_half", rows[len(rows) // 2:])):
            positions = sum(r["positions"] for r in part)
            out.setdefault(arm, {})[name] = sum(r[f"{arm}_alpha"] * r["positions"] for r in part) / max(1, positions)
    return out


def _heldout(unseen: dict[str, list], base, singles: dict, oracle, routed, router, matched, split) -> dict:
    """Every arm on each label's held-out requests; pooled; paired differences routed - shared, oracle - routed
    (and routed - shared_steps when that arm runs). singles: the one-draft arms' learners by arm name."""
    arms = ("control", *singles, "oracle", "routed")
    per, pooled = {}, {arm: [] for arm in arms}
    hits = total = 0
    for domain, samples in unseen.items():
        got = {arm: [] for arm in arms}
        for s in samples:
            item = sample_item(s)
            stats = lambda model: position_stats(model, [item], [s], split)[0]["matches"]
            choice = router.choose(router.featurize(s.prompt_ids), explore=False).draft
            hits += choice == matched.get(domain)
            total += 1
            models = {"control": base, **{arm: learner.master for arm, learner in singles.items()},
                      "oracle": oracle[domain].master, "routed": routed[choice].master}
            for arm, model in models.items():
                got[arm] += stats(model)
        per[domain] = {arm: acceptance(m) for arm, m in got.items()}
        for arm in arms:
            pooled[arm] += got[arm]
    if not total:
        return {}
    out = {"by_label": per, "pooled": {arm: acceptance(m) for arm, m in pooled.items()},
           "routed_vs_shared": paired_difference(pooled["shared"], pooled["routed"]),
           "oracle_vs_routed": paired_difference(pooled["routed"], pooled["oracle"]),
           "router_accuracy": hits / total,
           "targets": {"routed_minus_shared": acceptance(pooled["routed"]) - acceptance(pooled["shared"]),
                       "oracle_minus_routed": acceptance(pooled["oracle"]) - acceptance(pooled["routed"])}}
    if "shared_steps" in pooled:
        out["routed_vs_shared_steps"] = paired_difference(pooled["shared_steps"], pooled["routed"])
        out["targets"]["routed_minus_shared_steps"] = acceptance(pooled["routed"]) - acceptance(pooled["shared_steps"])
    return out


def run_routed_replay(models, learn: LearnConfig, route: RouteConfig, stream: str, split: str, per_segment: int,
                      settings, k: int = 4, heldout: int = 0, heldout_split: str = "test", batch_size_generate: int = 16,
                      cache_dir=None, progress=None, seed: int = 0, on_row=None, fork_at: int = 0,
                      residual: bool = False) -> dict:
    """Target outputs from the teacher cache (filled once), the stream interleaved, the four arms."""
    from osd.distill.target_outputs import dataset_samples
    from osd.models.loading import load_model
    from osd.route.system import featurizer

    parts = stream_parts(stream, split)
    if len(parts) < 2:
        raise InvalidArgument(f"a routed replay needs a mixed stream of at least two datasets, got {stream!r}")
    segments, tokenizer = [], None
    for name, s in parts:
        samples, tokenizer = dataset_samples(models, name, s, per_segment, settings, 0, batch_size_generate, cache_dir,
                                             progress, tokenizer)
        if not samples:
            raise InvalidArgument(f"no requests of {name} in split {s!r} (a dataset with one split: {name}:test)")
        segments.append(samples)
    unseen = {n: dataset_samples(models, n, heldout_split, heldout, settings, per_segment if heldout_split == s else 0,
                                 batch_size_generate, cache_dir, progress, tokenizer)[0]
              for n, s in parts} if heldout > 0 else {}
    cursor, samples, domains = [0] * len(segments), [], []
    for j in mixed_order([len(s) for s in segments], seed):
        samples.append(segments[j][cursor[j]])
        domains.append(parts[j][0])
        cursor[j] += 1
    base = load_model(models.draft, models.draft_dtype)
    result = routed_replay(samples, domains, base, learn, route, featurizer(tokenizer, route), k,
                           settings.max_new_tokens, unseen, progress, on_row, fork_at, residual)
    return {"config": {"models": asdict(models), "learn": asdict(learn), "route": asdict(route),
                       "teacher": asdict(settings), "stream": stream, "split": split, "per_segment": per_segment,
                       "k": k, "heldout": heldout, "heldout_split": heldout_split, "order": "interleaved",
                       "order_seed": seed, "fork_at": fork_at, "residual": residual, "mode": "fast (greedy), routed",
                       "exactness": EXACTNESS}, **result}
