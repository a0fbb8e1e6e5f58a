"""The target as it serves: which backend runs it (osd's Q4 kernel, llama.cpp or torch) and building it.

Below osd.build (which assembles target + draft + engine) so that draft building (distill/heal.py, distill/auto.py)
can open the target without importing the assembly that calls it.
"""
from __future__ import annotations

from osd.config import ModelConfig
from osd.errors import InvalidArgument
from osd.models.loading import gguf_file, load_model
from osd.models.prepack import prepack_linears, shared_weights_copy
from osd.notice import say


def target_backend(models: ModelConfig, target_model=None) -> str:
    """The backend that serves the target: the configured one, or for "auto", a GGUF target on osd's own Q4 kernel
    where that kernel runs it (models/q4_runner.py `serves`: a qwen2/llama/qwen3/gemma3 file of matrix types the
    kernel runs, a CPU with AVX2), else on llama.cpp; any other target on torch. Why the Q4 kernel first: it decodes
    the target alone at 1.0-1.4x llama.cpp's speed here and verifies k+1 tokens for far less than llama.cpp
    (docs/kernels.md), so speculation pays."""
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
    from osd.models.q4_runner import why_not_served

    return why_not_served(spec) or "unknown"


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
