"""Assemble a running system from configs: target, tokenizer, draft registry, engine."""
from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import torch

from osd.config import ModelConfig, SpeculationConfig
from osd.drafts import DraftRegistry
from osd.engine import SpeculativeEngine
from osd.errors import InvalidArgument
from osd.memory import trim
from osd.models.loading import load_model, load_tokenizer
from osd.models.serving_draft import make_serving_draft
from osd.models.target import build_target, check_target_quantize, target_backend, why_not_q4  # noqa: F401
from osd.models.tokenizer import check_same_tokenizer, special_ids
from osd.notice import say
from osd.models.runner import as_runner
from osd.propose import DraftModelProposer
from osd.propose.chain import Sources
from osd.propose.copy_choice import serving_copy
from osd.propose.feature_head import FeatureHeadProposer
from osd.propose.ngram import LookupThenDraft, NgramProposer, TrafficLookup

DEFAULT_DRAFT = "default"
HEAD = "head"  # the feature head's name in the draft registry


@dataclass
class System:
    engine: SpeculativeEngine
    tokenizer: object
    registry: DraftRegistry
    target_model: object  # what the engine verifies with: a runner (llama.cpp) or a torch model (maybe prepacked)
    draft_master: object | None  # trainable draft weights (the serving copy lives in the registry)
    models: ModelConfig
    spec: SpeculationConfig
    routing: object | None = None  # several drafts and their router (route/system.py), behind RouteConfig.drafts
    draft_copy_seconds: dict | None = None  # --draft-quantize auto: each candidate copy's timed forward (copy_choice.py)
    head: object | None = None  # --head: the feature head's float weights and map (models/feature_head.py SavedHead)

    def publish_head(self, head=None):
        """Publish the feature head's serving copy (int8 on osd's kernel, else a float copy) as a new version."""
        from osd.models.feature_head import int8_head

        head = head if head is not None else self.head.head
        serving = int8_head(head)
        return self.registry.publish(HEAD, serving if serving is not None else copy.deepcopy(head).eval(),
                                     self.head.vocab_ids)

    def publish_draft(self, master=None, name: str = DEFAULT_DRAFT, version: int | None = None):
        """Build a serving copy of draft weights and publish it under `name`."""
        master = master if master is not None else self.draft_master
        serving, vocab_ids = make_serving_draft(master, self.models.draft_quantize, self.models.draft_vocab,
                                                special_ids(self.tokenizer), self.models.allow_kernel_fallback)
        snapshot = self.registry.publish(name, serving, vocab_ids, version)
        trim()  # building the copy's transients (float temporaries of each matrix) went back to the heap
        return snapshot


def set_threads(threads: int) -> None:
    if threads:
        torch.set_num_threads(threads)


SHIPPED_DRAFT = ModelConfig.draft  # the default: the shipped cheap draft, cut from the bundled 0.5B (Qwen2.5's tokens)
NO_DRAFT = ("", "none")
AUTO_DRAFT = "auto"
QWEN25_TOKENS = 151665  # entries in Qwen2.5's vocabulary (the shipped draft's): any other count is another tokenizer


def choose_draft(models: ModelConfig, spec: SpeculationConfig, tokenizer, target, auto_config=None):
    """Which draft proposes -> (models with the draft resolved, spec, why: one line for the startup notice).
      auto        a draft derived from the target itself (distill/auto.py): built once per target file, cached
      none / ''   no draft model: the n-gram lookup proposes (on when k > 0)
      the default (the shipped cheap draft, SHIPPED_DRAFT): kept for a target that reads its tokenizer (the bundled
                  one, any Qwen2.5); another target gets the n-gram lookup only: --draft auto derives it a draft
      any other   that draft, as given (its tokenizer is checked against the target's when it loads)"""
    from osd.errors import TokenizerMismatch

    if models.draft == AUTO_DRAFT:
        from osd.distill.auto import ensure_auto_draft
        from tqdm import tqdm

        made = ensure_auto_draft(models.target, target, tokenizer, auto_config, models.target_backend, models.threads,
                                 tqdm, say=lambda line: say(line.removeprefix("[osd] ")))
        return replace(models, draft=made.spec), spec, made.why()
    if models.draft in NO_DRAFT:
        return replace(models, draft=""), replace(spec, lookup=spec.k > 0), "--draft none"
    if models.draft != SHIPPED_DRAFT or models.target.startswith("bundled:"):
        return models, spec, "the default for the bundled target" if models.draft == SHIPPED_DRAFT else "given by --draft"
    why_not = None
    if len(tokenizer.get_vocab()) != QWEN25_TOKENS:
        why_not = f"its vocabulary holds {len(tokenizer.get_vocab())} tokens, Qwen2.5's {QWEN25_TOKENS}"
    else:
        try:
            check_same_tokenizer(tokenizer, load_tokenizer(models.draft))
        except TokenizerMismatch as e:
            why_not = str(e).split(". ")[0]
    if why_not is None:
        return models, spec, "the shipped draft: the target reads its tokenizer (Qwen2.5's)"
    return replace(models, draft=""), replace(spec, lookup=spec.k > 0), (
        f"the shipped draft {SHIPPED_DRAFT} reads Qwen2.5's tokens, this target another tokenizer ({why_not}); "
        "--draft auto derives a draft from the target itself, once, cached")


def resolve_draft(models: ModelConfig, spec: SpeculationConfig) -> tuple[ModelConfig, SpeculationConfig]:
    """choose_draft ahead of building, for processes that build their systems elsewhere (`osd serve --replicas`: each
    replica and the learner then load the resolved draft; an auto draft is built here once, its teacher opened here)."""
    models, spec, why = choose_draft(models, spec, load_tokenizer(models.target), None)
    say(f"draft: {models.draft or ('n-gram lookup only' if spec.lookup else 'none')} ({why})")
    return models, spec


def build_system(models: ModelConfig, spec: SpeculationConfig, with_draft: bool | None = None, target_model=None,
                 route=None, auto_draft=None) -> System:
    """route: a RouteConfig; with drafts named (--drafts a,b), several adapter drafts on the draft model and a router.
    The draft is resolved first (choose_draft: `auto`, `none`, the shipped default or a given one; auto_draft: the
    --draft auto recipe, distill/auto.py AutoDraftConfig, default when None) and said in one line.
    with_draft: load models.draft; by default only where it proposes (k > 0). A target-only system (k = 0) neither
    loads the draft nor times its serving copies; a learner needs its master, so `osd serve --k 0 --learn` asks."""
    with_draft = (spec.k > 0 if with_draft is None else with_draft) and not models.head  # a head proposes instead
    routed = route is not None and bool(route.names())
    if routed and models.head:
        raise InvalidArgument("--head with --drafts is not supported yet (the routed proposer drafts alone)")
    if routed and spec.lookup:
        raise InvalidArgument("--lookup with --drafts is not supported yet (the lookup's draft label hides the routed draft)")
    set_threads(models.threads)
    check_target_quantize(models, target_model)  # before anything loads
    tokenizer = load_tokenizer(models.target)
    target = build_target(models, target_model)
    if models.head:
        say("draft: none (the --head feature head proposes)")
    if with_draft:
        models, spec, why = choose_draft(models, spec, tokenizer, target, auto_draft)
        say(f"draft: {models.draft or ('n-gram lookup only' if spec.lookup else 'none')} ({why})")
        if routed and not models.draft:
            raise InvalidArgument(f"--drafts adapts a draft model, and there is none here ({why}): name one with --draft")
    system = System(None, tokenizer, DraftRegistry(), target, None, models, spec)
    if with_draft and models.draft:
        check_same_tokenizer(tokenizer, load_tokenizer(models.draft))
        master = load_model(models.draft, models.draft_dtype)
        system.draft_master = master
        if routed and models.draft_quantize == "auto":  # adapter drafts serve int8 copies
            system.models = models = replace(models, draft_quantize="int8")
        if routed:
            from osd.route.system import Routing

            system.routing = Routing.build(master, route, system.registry, tokenizer, as_runner(target).vocab_size,
                                           models.draft_quantize, models.draft_vocab, special_ids(tokenizer))
        else:  # the copy --draft-quantize names (auto: the faster one here), named for every later publish
            choice = serving_copy(master, models.draft_quantize, models.draft_vocab, special_ids(tokenizer),
                                  models.allow_kernel_fallback)
            system.models = models = replace(models, draft_quantize=choice.quantize)
            system.draft_copy_seconds = choice.seconds or None
            system.registry.publish(DEFAULT_DRAFT, choice.serving, choice.vocab_ids)
            if choice.seconds:
                say(f"draft serving copy: {choice.quantize} (" + ", ".join(
                    f"{q} {t * 1e3:.2f} ms" for q, t in choice.seconds.items()) + " a draft token, measured here)")
            trim()
    if models.head and spec.k > 0:
        publish_head(system, target)
    system.engine = speculative_engine(system, target, spec)
    return system


def publish_head(system: System, target) -> None:
    """Load --head (checked against the target: osd's Q4 backend, its feature width and vocabulary) and publish its
    serving copy under HEAD."""
    from osd.models.feature_head import load_head
    from osd.models.q4_runner import Q4Runner

    runner = as_runner(target)
    if not isinstance(runner, Q4Runner):
        raise InvalidArgument(f"--head reads the target's features, which only osd's Q4 backend hands back "
                              f"(--target-backend osd); this target runs on {type(runner).__name__}")
    system.head = load_head(system.models.head, hidden=runner.shape.hidden, vocab_size=runner.vocab_size)
    snapshot = system.publish_head()
    say(f"feature head: {system.models.head} ({system.head.meta.get('arm', '?')}, {len(system.head.vocab_ids)} map "
        f"rows, {type(snapshot.model.fc).__name__} serving copy)")


def speculative_engine(system: System, target, spec: SpeculationConfig, draft: str = DEFAULT_DRAFT) -> SpeculativeEngine:
    """An engine over `target` with a new proposer of the system's kind: its published draft (if any; `draft`
    names it), behind an n-gram lookup with its own traffic index when spec.lookup (benchmarks build one per
    target backend); with several drafts, the system's one routed proposer (route/system.py), its feedback attached."""
    vocab_size = as_runner(target).vocab_size
    if system.routing is not None:
        engine = SpeculativeEngine(target, system.tokenizer, system.routing.proposer, spec)
        system.routing.attach(engine)
        return engine
    # k = 0 (target-only): no proposer at all, so no draft prefill at admission and no draft forwards
    proposer = DraftModelProposer(system.registry, draft, vocab_size) if system.draft_master is not None and spec.k > 0 \
        else None
    head = FeatureHeadProposer(system.registry, HEAD, as_runner(target).embed, vocab_size) \
        if HEAD in system.registry.names() and spec.k > 0 else None
    # the request's lookup, then the traffic's as a source of its own, its acceptance apart (ngram.py); learning off,
    # its index stays empty (the same sources, so one calibration fits both)
    lookup = NgramProposer(vocab_size, traffic=False) if spec.lookup else None
    traffic = TrafficLookup(vocab_size, learns=spec.lookup_traffic) if spec.lookup else None
    if head is not None:  # the lookup first where asked, then the head (no draft model: build_system loads none)
        sources = [s for s in (lookup, traffic) if s] + [head] + ([proposer] if proposer else [])
        proposer = Sources(sources, versioned=sources.index(head))
    elif lookup and spec.k > 0:
        proposer = LookupThenDraft(lookup, proposer, traffic)
    engine = SpeculativeEngine(target, system.tokenizer, proposer, spec)
    if getattr(engine.target, "greedy_identity", "exact") != "exact" and proposer is not None:
        from osd.models.llama_cpp_runner import IDENTITY_NOTE

        say(IDENTITY_NOTE)
    if engine.k_max < spec.k and proposer is not None:
        say(f"k capped at {engine.k_max} (asked {spec.k}): the {type(engine.target).__name__} backend verifies at most "
            f"{engine.k_max + 1} rows bitwise as one row (greedy identity); longer proposals would change outputs")
    if spec.tree and engine.tree_nodes < spec.tree:
        say(f"token trees of {spec.tree} nodes asked, {engine.tree_nodes} served: the {type(engine.target).__name__} "
            "backend " + ("verifies chains only (trees need osd's Q4 backend, --target-backend osd)" if not
                          engine.tree_nodes else f"verifies at most {engine.tree_nodes + 1} rows in one pass"))
    if isinstance(proposer, Sources):  # the lookup learns continuations from every finished request
        engine.request_observers.append(lambda r: proposer.observe_request(r.prompt_ids + r.token_ids))
    return engine


def attach_head_learner(system: System, config):
    """Create the feature head's online learner (learn/head.py) over the --head weights and hook it into the engine."""
    from osd.learn.head import HeadLearner

    if system.head is None:
        raise InvalidArgument("--learn-head trains a feature head: name one with --head")
    runner = as_runner(system.target_model)
    learner = HeadLearner(system.head.head, system.head.vocab_ids, runner.vocab_size, runner.embed,
                          system.publish_head, config).attach(system.engine)
    learner.start()
    return learner


def attach_learner(system: System, learn):
    """Create the online learner over the system's draft master and hook it into the engine."""
    from osd.learn.online import OnlineLearner

    if system.draft_master is None:
        raise ValueError("online learning needs a draft model")
    if system.routing is not None:  # one learner per draft, each with its own checkpoint under checkpoint_dir/<name>
        learners = system.routing.attach_learners(learn, system.engine)
        learners.resume()
        learners.start()
        return learners
    publish = lambda master, version=None: system.publish_draft(master, version=version)
    learner = OnlineLearner(system.draft_master, publish, learn).attach(system.engine)
    learner.resume()
    learner.start()
    return learner
