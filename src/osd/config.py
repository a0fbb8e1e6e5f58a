"""Configuration: one dataclass per component, validated on construction.

The CLI maps its flags one-to-one onto these fields; checkpoints and benchmark results store
`asdict()` of the resolved configs.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from osd.errors import InvalidArgument


MAX_TOP_LOGPROBS = 20  # the most alternatives a request may ask for per position (as OpenAI's top_logprobs)


@dataclass
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy (token-identical to the target); > 0 = lossless sampling
    top_k: int = 0  # 0 = off; applied to target and draft alike before acceptance
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 = off
    max_new_tokens: int = 128
    stop: list[str] = field(default_factory=list)  # stop strings (not included in the output)
    seed: int | None = None  # seed for sampling; None = nondeterministic
    min_p: float = 0.0  # drop tokens below min_p x the likeliest one's probability (after top-k/top-p); 0 = off
    ignore_eos: bool = False  # keep generating past EOS (it is then an ordinary token, up to max_new_tokens)
    stop_token_ids: list[int] = field(default_factory=list)  # token ids that end generation as EOS does (not output)
    logprobs: int | None = None  # None = off; N >= 0: each emitted token's log-probability under the target, and the
    # N likeliest tokens' at its position (the target's raw log-softmax: verify/logprobs.py)

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
    k: int = 6  # proposal length; with adaptive=True the largest k the policy may pick (the kernel verifies <= 8 rows in one pass)
    adaptive: bool = True  # choose k per step from live acceptance and measured costs (k = 0 allowed)
    alpha_prior: float = 0.7  # acceptance assumed before anything is observed
    alpha_ema: float = 0.98  # smoothing of the live acceptance estimate (per proposed token; ~50 tokens of evidence)
    alpha_upper_z: float = 1.0  # k = 0 within this many standard errors of paying: keep probing, no back-off
    cost_refresh_every: int = 16  # every N-th speculating step re-times a neighbour of the best k (0 = never)
    lookup: bool = False  # propose by n-gram lookup in this request and earlier traffic first (propose/ngram.py)
    max_batch: int = 1  # sequences decoded together, one target pass per step (schedule/scheduler.py; `osd serve`: 8)
    prefill_rows: int = 64  # prompt rows fed per step beside decoding sequences (chunked prefill; at least 16)
    tree: int = 0  # most nodes of a token tree per step: the chain plus the draft's runners-up and the target's recycled top tokens (propose/tree.py); 0 = chains only. A request decoding alone on the osd Q4 backend (greedy and sampled, both lossless)

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
    target: str = "bundled:qwen2.5-coder-1.5b"  # hub id, local dir, .gguf file or bundled:<name>
    # the shipped cheap derived draft (models/derived.py): on the Q4 target it pays where the bundled 0.5B costs
    # too much per token to (BENCHMARKS.md "Speed"); any model sharing the target's tokenizer may be named instead.
    # `auto`: a draft derived from the target itself, built once per target file and cached (distill/auto.py);
    # `none`: no draft model, the n-gram lookup proposes. A target that does not read the shipped draft's tokenizer
    # gets the lookup only unless a draft is named (build.py choose_draft says which and why at startup)
    draft: str = field(default="derived:cheap-0.5b-v3", metadata={"help": (
        "the draft model: a path, hub id, derived:<dir or shipped name>; auto = derive one from the target itself "
        "(once per target file, cached, then learned online); none = n-gram lookup only. Default: the shipped "
        "cheap draft where the target reads its tokenizer (Qwen2.5), else the lookup only")})
    dtype: str = "float32"  # target dtype (the baseline uses the same)
    draft_dtype: str = "float32"  # dtype of the draft's master weights
    draft_quantize: str = field(default="auto", metadata={"choices": DRAFT_QUANTIZE, "help": (
        "the draft's serving copy, rebuilt at each publish from the master weights the learner trains: int8 linears "
        "(models/serving_draft.py; int8_vnni: activations int8 too), q4 = 4-bit on the target's Q4 kernel "
        "(models/q4_draft.py), or auto = whichever of q4 and int8 times faster here for a Qwen2 draft the Q4 kernel "
        "runs, else int8 (propose/copy_choice.py; on Intel the shipped draft's Q4 copy cost ~half its int8 one)")})
    draft_vocab: int = 0  # 0 = full; N = draft proposes only among token ids < N (+ special tokens)
    target_backend: str = "auto"  # "torch" | "llama.cpp" | "osd" (own Q4_K kernel, qwen2/llama/qwen3/gemma3 GGUFs) | "auto" (a GGUF: osd where its kernel runs the file, else llama.cpp; torch otherwise)
    n_ctx: int = 4096  # llama.cpp / osd target: context (KV cache) length
    threads: int = 0  # torch (and llama.cpp) threads; 0 = default (torch's; llama.cpp: the cores we may use)
    prepack_target: bool = True  # fast fp32 linears for the target (models/prepack.py; CPU speed trick)
    prepack_copy: bool = False  # prepack a copy (sharing its weights), keeping the given target model plain (benchmarks)
    target_quantize: str = field(default="none", metadata={"choices": TARGET_QUANTIZE, "help": (
        "quantize a Hugging Face (torch) target at load: int8 = weight-only int8 linears and embedding through osd's "
        "row-invariant kernels, no fp32 matrix kept (models/quantized_target.py). No 4-bit for torch targets: serve a "
        "Q4 GGUF instead (--target-backend osd or llama.cpp), which this option refuses (already quantized)")})
    allow_kernel_fallback: bool = False  # run on torch's kernels where osd's compiled ones cannot be built (else an error; models/kernels.py)

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
