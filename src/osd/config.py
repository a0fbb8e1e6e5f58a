"""Configuration: one dataclass per component, validated on construction.

The CLI maps its flags one-to-one onto these fields; checkpoints and benchmark results store
`asdict()` of the resolved configs.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from osd.errors import InvalidArgument
from osd.flags import option


MAX_TOP_LOGPROBS = 20  # the most alternatives a request may ask for per position (as OpenAI's top_logprobs)


@dataclass
class SamplingConfig:
    temperature: float = option(0.0, "sampling temperature: 0 = greedy (token-identical to the target), > 0 = "
                                "lossless speculative sampling")
    top_k: int = option(0, "sample among the K most likely tokens (target and draft alike); 0 = off")
    top_p: float = option(1.0, "nucleus sampling: the smallest set of tokens with this probability mass, in (0, 1]; "
                          "1 = off")
    max_new_tokens: int = option(128, "most tokens to generate")
    stop: list[str] = option([], "stop string (not included in the output)")
    seed: int | None = option(None, "sampling seed; none = nondeterministic")
    min_p: float = option(0.0, "drop tokens below min_p x the likeliest one's probability (after top-k / top-p; "
                          "target and draft alike); 0 = off")
    ignore_eos: bool = option(False, "keep generating past EOS (it is then an ordinary token, up to max_new_tokens)")
    stop_token_ids: list[int] = option([], "token id that ends generation as EOS does (not output)")
    logprobs: int | None = option(None, "none = off; N >= 0: each emitted token's log-probability under the target, "
                                  "and the N likeliest tokens' at its position (the target's raw log-softmax: "
                                  "verify/logprobs.py)")

    def __post_init__(self):
        if self.temperature is None or self.temperature < 0:
            raise InvalidArgument(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is None or self.top_k < 0:
            raise InvalidArgument(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.top_p is None or not (0.0 < self.top_p <= 1.0):
            raise InvalidArgument(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens is None or self.max_new_tokens <= 0:
            raise InvalidArgument(f"max_new_tokens must be > 0, got {self.max_new_tokens}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any((not isinstance(s, str)) or s == "" for s in self.stop):
            raise InvalidArgument("stop strings must be non-empty strings")
        if self.seed is not None and not -2**63 <= self.seed < 2**64:  # what torch.Generator.manual_seed takes
            raise InvalidArgument(f"seed must be in [-2**63, 2**64), got {self.seed}")
        if self.min_p is None or not (0.0 <= self.min_p < 1.0):
            raise InvalidArgument(f"min_p must be in [0, 1), got {self.min_p}")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise InvalidArgument("stop_token_ids must be non-negative token ids")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidArgument(f"logprobs (top tokens per position) must be in [0, {MAX_TOP_LOGPROBS}], "
                                  f"got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class SpeculationConfig:
    # with adaptive=True the largest k the policy may pick (the kernel verifies <= 8 rows in one pass)
    k: int = option(6, "proposal length: draft tokens verified per step (with --adaptive the most the policy picks; "
                    "0 = no speculation, the target alone)", aliases=("--num-speculative-tokens", "--draft-max"))
    adaptive: bool = option(True, "choose k each step from the live acceptance and the measured draft and target "
                            "costs (k = 0 when speculation does not pay)")
    alpha_prior: float = option(0.7, "acceptance rate assumed before any is observed (adaptive k)")
    alpha_ema: float = option(0.98, "smoothing of the live acceptance estimate per proposed token (~50 tokens of "
                              "evidence)")
    alpha_upper_z: float = option(1.0, "adaptive k: keep proposing while speculation is within this many standard "
                                  "errors of paying")
    cost_refresh_every: int = option(16, "every N-th speculating step re-times a neighbour of the best k "
                                     "(0 = never)")
    confidence: bool = option(True, "draft first, then verify each sequence's drafted tokens as far as the draft's "
                              "confidence in them says it pays (adaptive k; schedule/confidence.py); off: k from the "
                              "average acceptance alone")
    lookup: bool = option(False, "propose by n-gram lookup in the request and earlier traffic first, where accepted "
                          "at least as often as the draft; the draft model after (propose/ngram.py)")
    # the lookup's traffic index learns from what is served: `osd serve` derives this from --learn / --no-learn
    lookup_traffic: bool = option(True, "with --lookup: also look up continuations in earlier requests' prompts and "
                                  "outputs (the traffic index); off: the request's own tokens only")
    # schedule/scheduler.py; serving() raises it to 8
    max_batch: int = option(1, "sequences decoded together, one target pass per step (continuous batching), "
                            "in [1, 256]")
    prefill_rows: int = option(64, "prompt tokens fed per step beside the decoding sequences (chunked prefill)")
    # the chain plus the draft's runners-up and the target's recycled top tokens (propose/tree.py); a request decoding
    # alone on the osd Q4 backend (greedy and sampled, both lossless)
    tree: int = option(0, "most nodes of a token tree verified per step (a request decoding alone on the osd Q4 "
                       "backend), in [0, 8]; 0 = chains only")

    @classmethod
    def serving(cls, **overrides) -> "SpeculationConfig":
        """`osd serve`'s defaults: continuous batching of up to 8 sequences per step."""
        return cls(**{"max_batch": 8, **overrides})

    def __post_init__(self):
        if self.k is None or self.k < 0:
            raise InvalidArgument(f"k (proposal length) must be >= 0, got {self.k}")
        if self.k > 32:
            raise InvalidArgument(f"k (proposal length) must be <= 32, got {self.k}")
        if not (0.0 <= self.alpha_prior < 1.0):
            raise InvalidArgument(f"alpha_prior must be in [0, 1), got {self.alpha_prior}")
        if not (0.0 <= self.alpha_ema < 1.0):
            raise InvalidArgument(f"alpha_ema must be in [0, 1), got {self.alpha_ema}")
        if self.cost_refresh_every < 0:
            raise InvalidArgument(f"cost_refresh_every must be >= 0, got {self.cost_refresh_every}")
        if not (0.0 <= self.alpha_upper_z <= 5.0):
            raise InvalidArgument(f"alpha_upper_z must be in [0, 5], got {self.alpha_upper_z}")
        if self.max_batch is None or not 1 <= self.max_batch <= 256:
            raise InvalidArgument(f"max_batch must be in [1, 256], got {self.max_batch}")
        if self.tree is None or not 0 <= self.tree <= 8:
            raise InvalidArgument(f"tree (nodes per step) must be in [0, 8] (the kernel verifies 9 rows in one pass), got {self.tree}")
        if self.prefill_rows is None or not 1 <= self.prefill_rows <= 4096:
            raise InvalidArgument(f"prefill_rows must be in [1, 4096], got {self.prefill_rows}")


TARGET_BACKENDS = ("auto", "torch", "llama.cpp", "osd")  # osd: models/q4_runner.py (own Q4_K/Q6_K kernel)
DRAFT_QUANTIZE = ("auto", "none", "int8", "int8_vnni", "q4")  # the draft's serving copy (models/serving_draft.py, q4_draft.py)
TARGET_QUANTIZE = ("none", "int8")  # weight-only quantisation of a torch target at load (models/quantized_target.py)


@dataclass
class ModelConfig:
    target: str = option("bundled:qwen2.5-coder-1.5b", "the model that answers: a Hugging Face hub id, a local "
                         "directory, a .gguf file or bundled:<name>", aliases=("--model",))
    # the shipped cheap derived draft (models/derived.py): on the Q4 target it pays where the bundled 0.5B costs
    # too much per token to (docs/kernels.md); any model sharing the target's tokenizer may be named instead.
    # `auto`: a draft derived from the target itself, built once per target file and cached (distill/auto.py);
    # `none`: no draft model, the n-gram lookup proposes. A target that does not read the shipped draft's tokenizer
    # gets the lookup only unless a draft is named (build.py choose_draft says which and why at startup)
    draft: str = option("derived:cheap-0.5b-v3", (
        "the draft model: a path, hub id, bundled:<name> or derived:<dir or shipped name> sharing the target's "
        "tokenizer; auto = derive one from the target itself (once per target file, cached, then learned online); "
        "none = n-gram lookup only. Default: the shipped cheap draft where the target reads its tokenizer (Qwen2.5), "
        "else the lookup only"))
    dtype: str = option("float32", "the torch target's dtype", choices=("float32", "bfloat16", "float16"))
    draft_dtype: str = option("float32", "dtype of the draft's master weights (what the learner trains)",
                              choices=("float32", "bfloat16", "float16"))
    draft_quantize: str = option("auto", (
        "the draft's serving copy, rebuilt at each publish from the master weights the learner trains: int8 linears "
        "(models/serving_draft.py; int8_vnni: activations int8 too), q4 = 4-bit on the target's Q4 kernel "
        "(models/q4_draft.py), or auto = whichever of q4 and int8 times faster here for a draft the Q4 kernel runs "
        "(qwen2, llama, qwen3, gemma3), else int8 (propose/copy_choice.py; on Intel the shipped draft's Q4 copy cost "
        "~half its int8 one)"),
        choices=DRAFT_QUANTIZE)
    draft_vocab: int = option(0, "the draft proposes only among token ids < N (and special tokens); 0 = the whole "
                              "vocabulary")
    head: str = option("", (
        "a feature head to propose with (a file `osd bench feature-head --save-head` wrote): it reads the target's own "
        "features from each verification, no cache to feed (propose/feature_head.py), in place of the draft model "
        "(none is loaded). Needs osd's Q4 target backend. Default: none"))
    target_backend: str = option("auto", (
        "who runs the target: torch, llama.cpp, osd (own Q4 kernel: qwen2, llama, qwen3, gemma3 GGUFs), or auto = a GGUF on osd "
        "where its kernel runs the file, else llama.cpp; torch otherwise"), choices=TARGET_BACKENDS)
    n_ctx: int = option(4096, "context length in tokens (prompt + output; the KV cache's size) of a GGUF target "
                        "(llama.cpp and osd backends; at most the model's own)",
                        aliases=("--max-model-len", "--ctx-size"))
    threads: int = option(0, "CPU threads for torch and llama.cpp; 0 = their defaults (llama.cpp: the cores this "
                          "process may use)")
    prepack_target: bool = option(True, "repack the torch target's fp32 linears for speed (models/prepack.py)")
    prepack_copy: bool = option(False, "prepack a copy sharing the weights, keeping the given target model plain "
                                "(benchmarks)")
    target_quantize: str = option("none", (
        "quantize a Hugging Face (torch) target at load: int8 = weight-only int8 linears and embedding through osd's "
        "row-invariant kernels, no fp32 matrix kept (models/quantized_target.py). No 4-bit for torch targets: serve a "
        "Q4 GGUF instead (--target-backend osd or llama.cpp), which this option refuses (already quantized)"),
        choices=TARGET_QUANTIZE)
    allow_kernel_fallback: bool = option(False, "run on torch's kernels where osd's compiled ones cannot be built "
                                         "(otherwise an error; models/kernels.py)")

    def __post_init__(self):
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise InvalidArgument(f"dtype must be float32, bfloat16 or float16, got {self.dtype}")
        if self.draft_dtype not in ("float32", "bfloat16", "float16"):
            raise InvalidArgument(f"draft_dtype must be float32, bfloat16 or float16, got {self.draft_dtype}")
        if self.draft_quantize not in DRAFT_QUANTIZE:
            raise InvalidArgument(f"draft_quantize must be one of {', '.join(DRAFT_QUANTIZE)}, got {self.draft_quantize}")
        if self.target_backend not in TARGET_BACKENDS:
            raise InvalidArgument(f"target_backend must be one of {', '.join(TARGET_BACKENDS)}, got {self.target_backend}")
        if self.target_quantize not in TARGET_QUANTIZE:
            four_bit = " (4-bit is not offered for torch targets: serve a Q4 GGUF with --target-backend osd)" \
                if str(self.target_quantize).lower() in ("int4", "4bit", "q4", "nf4") else ""
            raise InvalidArgument(f"target_quantize must be none or int8, got {self.target_quantize!r}{four_bit}")
        if self.target_quantize != "none" and self.target_backend in ("llama.cpp", "osd"):
            raise InvalidArgument(f"target_quantize={self.target_quantize} quantizes a torch target at load; the "
                                  f"{self.target_backend} backend serves a GGUF from its own quantized weights already "
                                  "(drop --target-quantize, or use --target-backend torch)")
        if self.draft_vocab < 0:
            raise InvalidArgument(f"draft_vocab must be >= 0, got {self.draft_vocab}")


def to_dict(*configs) -> dict:
    return {type(c).__name__: asdict(c) for c in configs}
