"""Plain models: a spec that names weights on disk (`bundled:<name>`, a local Hugging Face directory, a local `.gguf`
file converted once to a cached safetensors dir, or a hub id used from the local HF cache), resolved and loaded.

Derived drafts are built on these (models/derived.py); models/loading.py dispatches every kind of spec.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from osd.errors import ModelNotFound
from osd.models.bundled import bundled_model_dir, cache_root, convert_gguf_to_dir

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_dir(spec: str) -> str:
    """Spec -> something `from_pretrained` accepts (a local dir, or a hub id)."""
    if not spec or not isinstance(spec, str):
        raise ModelNotFound("empty model spec: give a hub id, a local directory, a .gguf file or bundled:<name>")
    if spec.startswith("bundled:"):
        return str(bundled_model_dir(spec.split(":", 1)[1]))
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.exists():
            raise ModelNotFound(f"GGUF file not found: {path}")
        out = converted_dir(spec)
        if not (out / "model.safetensors").exists():
            convert_gguf_to_dir(path, out)
        return str(out)
    if path.exists():
        if not (path / "config.json").exists():
            raise ModelNotFound(f"{path} exists but holds no config.json: not a Hugging Face model directory")
        return str(path)
    if spec.startswith((".", "/", "~")) or spec.count("/") > 1:
        raise ModelNotFound(f"model directory not found: {spec}")
    return spec  # hub id


MISTRAL_TYPES = ("mistral", "mistral3", "voxtral", "ministral", "pixtral")


def tokenizer_kwargs(where: str) -> dict:
    """transformers 4.57.3+ (before 5) flags every local tokenizer saved by those versions as a Mistral one with
    a broken pre-tokenizer regex, whatever its family, and warns; its "fix" would install Mistral's regex. For a
    local non-Mistral model say no explicitly: the tokenizer stays as saved, and the false warning goes."""
    import json

    try:
        model_type = json.loads((Path(where) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return {}
    return {"fix_mistral_regex": False} if model_type and model_type not in MISTRAL_TYPES else {}


def gguf_file(spec: str) -> Path | None:
    """The GGUF file behind a spec (bundled:<name> or a .gguf path), assembled if need be; None otherwise."""
    from osd.models.bundled import BUNDLED, assemble_gguf

    if isinstance(spec, str) and spec.startswith("bundled:"):
        name = spec.split(":", 1)[1]
        if name not in BUNDLED:
            raise ModelNotFound(f"unknown bundled model {name!r}; known: {', '.join(BUNDLED)}")
        return assemble_gguf(BUNDLED[name])
    path = Path(spec).expanduser() if isinstance(spec, str) and spec else None
    if path is not None and path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFound(f"GGUF file not found: {path}")
        return path
    return None


def _gguf_tokenizer_dir(gguf: Path) -> Path:
    """The tokenizer of a GGUF, saved once as a Hugging Face tokenizer (no weights converted)."""
    from transformers import AutoTokenizer

    digest = hashlib.sha256(f"{gguf.resolve()}:{gguf.stat().st_size}".encode()).hexdigest()[:16]
    out = cache_root() / "tokenizers" / f"{gguf.stem}-{digest}"
    if not (out / "tokenizer_config.json").exists():
        tmp = out.with_name(out.name + ".partial")
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
        if not out.exists():
            tmp.replace(out)
    return out


def converted_dir(spec: str) -> Path:
    """Where a GGUF spec (bundled:<name> or a .gguf path) is converted to a Hugging Face directory."""
    if spec.startswith("bundled:"):
        return cache_root() / "hf" / spec.split(":", 1)[1]
    path = Path(spec).expanduser()
    digest = hashlib.sha256(f"{path.resolve()}:{path.stat().st_size}:{path.stat().st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root() / "hf" / f"{path.stem}-{digest}"


def load_plain_tokenizer(spec: str):
    """The tokenizer of a plain model spec (a GGUF's own, without converting its weights)."""
    from transformers import AutoTokenizer

    is_gguf = isinstance(spec, str) and (spec.startswith("bundled:") or spec.endswith(".gguf"))
    if is_gguf and not (converted_dir(spec) / "model.safetensors").exists():
        where = str(_gguf_tokenizer_dir(gguf_file(spec)))  # a GGUF target served by llama.cpp needs no fp32 conversion
    else:
        where = resolve_model_dir(spec)
    try:
        return AutoTokenizer.from_pretrained(where, **tokenizer_kwargs(where))
    except OSError as e:
        raise ModelNotFound(f"cannot load tokenizer for {spec!r}: {e}") from e


def load_plain_model(spec: str, dtype: str = "float32", where: str | None = None):
    """A plain causal LM (from_pretrained) in eval mode, no grad, with the given dtype; `where`: the spec already
    resolved (resolve_model_dir), so a caller that resolved it does not resolve it again."""
    from transformers import AutoModelForCausalLM

    where = where or resolve_model_dir(spec)
    try:
        model = AutoModelForCausalLM.from_pretrained(where, dtype=DTYPES[dtype])
    except OSError as e:
        raise ModelNotFound(
            f"cannot load model {spec!r}: {e}\n(the Hugging Face hub is used only if reachable; "
            "give a local directory or .gguf file otherwise)"
        ) from e
    missing = [name for name, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ModelNotFound(f"model {spec!r} loaded without weights for {', '.join(missing[:3])}: the files are "
                            "incomplete (for a converted GGUF, delete its cache dir under ~/.cache/osd/hf to rebuild)")
    model.eval().requires_grad_(False)
    return model
