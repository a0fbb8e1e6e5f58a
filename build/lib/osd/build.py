"""Assemble a running system from configs: target, tokenizer, draft registry, engine."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from osd.config import ModelConfig, SpeculationConfig
from osd.drafts import DraftRegistry
from osd.engine import SpeculativeEngine
from osd.errors import InvalidArgument
from osd.memory import trim
from osd.models.loading import gguf_file, load_model, load_tokenizer
from osd.models.prepack import prepack_linears, shared_weights_copy
from osd.models.serving_draft import make_serving_draft
from osd.models.tokenizer import check_same_tokenizer, special_ids
from osd.notice import say
from osd.models.runner import as_runner
from osd.propose import DraftModelProposer
from osd.propose.copy_choice import serving_copy
from osd.propose.ngram import LookupThenDraft, NgramProposer

DEFAULT_DRAFT = "default"


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


def target_backend(models: ModelConfig, target_model=None) -> str:
    """The backend that serves the target: the configured one, or for "auto", a GGUF target on osd's own Q4 kernel
    where that kernel runs it (models/q4_runner.py `serves`: a Qwen2 file of Q4_K/Q6_K matrices, a CPU with AVX2),
    else on llama.cpp; any other target on torch. Why the Q4 kernel first: it decodes the target alone at 1.0-1.4x
    llama.cpp's speed here and verifies k+1 tokens for far less than llama.cpp (BENCHMARKS.md), so speculation pays."""
    if models.target_backend != "auto":
        return models.target_backend
    is_gguf = models.target.startswith("bundled:") or models.target.endswith(".gguf")
    if not is_gguf or target_model is not None:
        return "torch"
    from osd.models.q4_runner import serves

    if serves(models.target):
        return "osd"
    say(f"target backend: llama.cpp, not osd's Q4 kernel ({why_not_q4(models.target)}). It decodes ~1.35x slower here "
        "and verifies several rows at nearly the cost of as many tokens, so speculation gains little "
        "(--target-backend llama.cpp silences this)")
    return "llama.cpp"


def why_not_q4(spec: str) -> str:
    """One line: why osd's Q4 kernel does not serve this GGUF here."""
    from osd.models import q4

    if not q4.available():
        return f"the kernel cannot be built on this machine: {(q4.build_error() or 'unknown').splitlines()[0][:160]}"
    return "the file is not a Qwen2 GGUF of Q4_K/Q6_K matrices"


def check_target_quantize(models: ModelConfig, target_model=None) -> None:
    """InvalidArgument when target quantization is asked of a target served from a GGUF's own quantized weights."""
    backend = target_backend(models, target_model)
    if models.target_quantize != "none" and backend in ("llama.cpp", "osd"):
        raise InvalidArgument(f"--target-quantize {models.target_quantize} quantizes a Hugging Face (torch) target at "
                              f"load; {models.target!r} is a GGUF, served by {backend} from its own quantized weights "
                              "already. Drop --target-quantize (or give --target-backend torch to quantize the GGUF's "
                              "fp32 conversion instead)")


def build_target(models: ModelConfig, target_model=None):
    """The target runner (llama.cpp or osd's Q4 kernel: quantized weights) or torch model (int8-quantized at load
    with models.target_quantize, else maybe prepacked). With prepack_copy, a given target_model stays as it is: the
    served model is a copy sharing its weights (prepacked) or holding its own int8 ones (quantized)."""
    check_target_quantize(models, target_model)
    backend = target_backend(models, target_model)
    if backend in ("llama.cpp", "osd"):
        gguf = gguf_file(models.target)
        if gguf is None:
            raise InvalidArgument(f"the {backend} backend serves GGUF targets; {models.target!r} is not one "
                                  "(give a .gguf file or bundled:<name>, or --target-backend torch)")
        if backend == "osd":
            from osd.models.q4_runner import Q4Runner

            return Q4Runner(gguf, models.n_ctx)
        from osd.models.llama_cpp_runner import LlamaCppRunner

        return LlamaCppRunner(gguf, models.n_ctx, models.threads)
    if target_model is None:
        target_model = load_model(models.target, models.dtype)
    if models.target_quantize != "none":  # every linear int8, row-invariant; the float matrices are freed
        from osd.models.quantized_target import quantize_target

        target = shared_weights_copy(target_model) if models.prepack_copy else target_model
        return quantize_target(target, models.target_quantize, models.allow_kernel_fallback)
    if models.prepack_target:
        target_model = shared_weights_copy(target_model) if models.prepack_copy else target_model
        prepack_linears(target_model, models.allow_kernel_fallback)
    return target_model


def build_system(models: ModelConfig, spec: SpeculationConfig, with_draft: bool | None = None, target_model=None,
                 route=None) -> System:
    """route: a RouteConfig; with drafts named (--drafts a,b), several adapter drafts on the draft model and a router.
    with_draft: load models.draft; by default only where it proposes (k > 0). A target-only system (k = 0) neither
    loads the draft nor times its serving copies; a learner needs its master, so `osd serve --k 0 --learn` asks."""
    with_draft = spec.k > 0 if with_draft is None else with_draft
    routed = route is not None and bool(route.names())
    if routed and spec.lookup:
        raise InvalidArgument("--lookup with --drafts is not supported yet (the lookup's draft label hides the routed draft)")
    set_threads(models.threads)
    check_target_quantize(models, target_model)  # before anything loads
    tokenizer = load_tokenizer(models.target)
    target = build_target(models, target_model)
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
    system.engine = speculative_engine(system, target, spec)
    return system


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
    if spec.lookup and spec.k > 0:
        proposer = LookupThenDraft(NgramProposer(vocab_size), proposer)
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
    if isinstance(proposer, LookupThenDraft):  # the lookup learns continuations from every finished request
        engine.request_observers.append(lambda r: proposer.observe_request(r.prompt_ids + r.token_ids))
    return engine


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
