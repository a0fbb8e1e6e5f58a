"""`--draft auto`: a draft for any target, cut from the target itself, healed briefly, built once and cached.

The recipe is `osd draft build`'s (models/derived.py + distill/heal.py) with the target as its own base:
  layers  the target's first and last decoder layers (`keep` = 2: the first keep//2 and the last keep - keep//2).
          Why: the recipe's measured default for the 24-layer 0.5B ("0,23": the head expects the last layer's
          features; two layers is what a draft token can cost, models/derived.py), applied to any depth.
  head    16,384 rows: every special token, then the tokens the public datasets' train splits use most, then the
          lowest ids (choose_vocab); the target's whole head when its vocabulary is smaller.
  heal    LoRA (rank 16) + RMSNorm scales on the target's own greedy answers to 16 train prompts of each of gsm8k,
          spider and code (48 prompts, answers cut at 64 tokens), 4 epochs of batch 8 (24 optimizer steps). The cost
          scales with the target: ~3,000 target tokens decoded (8 at once on osd's Q4 kernel) and 24 small steps; a
          1.5B target takes minutes, a tiny test model seconds. The online learner then goes on from there.
Cache: <cache root>/drafts/auto-<key>, key = sha256 of the target's bytes (files hashed once, remembered by path,
size and mtime) and of the recipe, so a new file or a new recipe builds anew and a restart reuses the draft. A build
cut short resumes (heal.py's checkpoints); a lock keeps two processes from building the same draft at once.

Limitations: Llama/Qwen2/Qwen3/Gemma3-shaped decoders only (models/derived.py cuts model.model.layers); the whole
target is loaded in fp32 once to cut it (a GGUF is first converted to a cached Hugging Face directory, models/plain.py).
"""
from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from osd.distill.heal import HealConfig, run_heal
from osd.errors import InvalidArgument
from osd.models.bundled import cache_root
from osd.models.derived import RECIPE, TENSORS, DeriveConfig
from osd.models.gguf_meta import gguf_metadata
from osd.models.plain import gguf_file, resolve_model_dir

RECIPE_VERSION = 1  # bump when the recipe's code changes what a cached draft holds
# what derive_model can cut (tested on tiny models of each): GGUF architecture names and Hugging Face model types (a
# gemma3 GGUF converts to gemma3_text; an HF "gemma3" is the multimodal wrapper, not cut)
GGUF_ARCHITECTURES = ("qwen2", "llama", "qwen3", "gemma3")
HF_MODEL_TYPES = ("qwen2", "llama", "qwen3", "gemma3_text", "mistral")


def default_heal() -> HealConfig:
    return HealConfig(datasets="gsm8k,spider,code", limit=16, answers="target", max_answer_tokens=64, epochs=4,
                      lr=2e-3, batch_size=8, eval_datasets="code,gsm8k,spider,chat", eval_limit=1, eval_tokens=32)


@dataclass
class AutoDraftConfig:
    keep: int = 2  # decoder layers kept: the first keep // 2 and the last keep - keep // 2
    vocab: int = 16384  # LM head rows (models/derived.py choose_vocab)
    vocab_datasets: str = "gsm8k,spider,code,support"  # train splits counted for the head's tokens
    heal: HealConfig = field(default_factory=default_heal)

    def __post_init__(self):
        if self.keep < 1:
            raise InvalidArgument(f"keep (layers of an auto draft) must be >= 1, got {self.keep}")
        if self.vocab < 1:
            raise InvalidArgument(f"vocab must be >= 1, got {self.vocab}")


def kept_layers(depth: int, keep: int) -> list[int]:
    """The first keep // 2 and the last keep - keep // 2 of `depth` layers (all of them when keep >= depth)."""
    if keep >= depth:
        return list(range(depth))
    return list(range(keep // 2)) + list(range(depth - (keep - keep // 2), depth))


# ---- what the target is ------------------------------------------------------------------------------------------

def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes, computed once per (path, size, mtime) and remembered under <cache>/sha256."""
    path = Path(path).resolve()
    stat = path.stat()
    memo = cache_root() / "sha256" / hashlib.sha256(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    if memo.exists():
        return memo.read_text().strip()
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    memo.parent.mkdir(parents=True, exist_ok=True)
    memo.write_text(digest.hexdigest())
    return digest.hexdigest()


def target_identity(spec: str) -> str:
    """The target's content: the GGUF's sha256, or a Hugging Face directory's config and weight files' sha256s; a hub
    id by its name (its snapshot in the local cache is what loads)."""
    gguf = gguf_file(spec)
    if gguf is not None:
        return file_sha256(gguf)
    where = Path(resolve_model_dir(spec))
    if not where.is_dir():
        return f"hub:{spec}"
    files = sorted(p for p in where.iterdir() if p.suffix in (".safetensors", ".bin", ".json") and p.is_file())
    return hashlib.sha256(json.dumps([[p.name, file_sha256(p)] for p in files]).encode()).hexdigest()


def target_architecture(spec: str) -> tuple[str, int]:
    """(architecture, decoder layers) from the file's metadata, before any weights load."""
    gguf = gguf_file(spec)
    if gguf is not None:
        arch = gguf_metadata(gguf, ["general.architecture"]).get("general.architecture")
        if arch is None:
            raise InvalidArgument(f"{gguf}: no general.architecture in its metadata")
        return str(arch), int(gguf_metadata(gguf, [f"{arch}.block_count"]).get(f"{arch}.block_count", 0))
    where = resolve_model_dir(spec)
    if Path(where).is_dir():
        config = json.loads((Path(where) / "config.json").read_text())
    else:  # a hub id, from the local Hugging Face cache
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(where).to_dict()
    return str(config.get("model_type")), int(config.get("num_hidden_layers") or 0)


def check_architecture(spec: str) -> int:
    """The target's depth, or InvalidArgument naming the architecture when the derived recipe cannot cut it."""
    arch, depth = target_architecture(spec)
    known = GGUF_ARCHITECTURES if gguf_file(spec) is not None else HF_MODEL_TYPES
    if arch not in known:
        raise InvalidArgument(f"--draft auto cannot derive a draft from a {arch!r} target: the derived recipe cuts "
                              f"{', '.join(known)} decoders. Give a draft (--draft PATH) or none (--draft none: "
                              "n-gram lookup only)")
    if depth < 1:
        raise InvalidArgument(f"{spec!r}: its metadata gives no decoder layers")
    return depth


# ---- build once, reuse -------------------------------------------------------------------------------------------

def recipe_for(spec: str, depth: int, config: AutoDraftConfig) -> tuple[DeriveConfig, HealConfig]:
    derive = DeriveConfig(base=spec, layers=",".join(map(str, kept_layers(depth, config.keep))), vocab=config.vocab,
                          vocab_datasets=config.vocab_datasets)
    return derive, config.heal


def draft_key(identity: str, derive: DeriveConfig, heal: HealConfig) -> str:
    recipe = {**asdict(derive), "base": None}  # the target's content names it, not its path
    blob = json.dumps([RECIPE_VERSION, identity, recipe, asdict(heal)], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def auto_dir(spec: str, config: AutoDraftConfig | None = None) -> tuple[Path, DeriveConfig, HealConfig]:
    config = config or AutoDraftConfig()
    derive, heal = recipe_for(spec, check_architecture(spec), config)
    return cache_root() / "drafts" / f"auto-{draft_key(target_identity(spec), derive, heal)}", derive, heal


def is_built(out: Path) -> bool:
    try:
        return json.loads((out / RECIPE).read_text()).get("trained") is not None
    except (OSError, ValueError):
        return False


@dataclass
class AutoDraft:
    spec: str  # derived:<dir>: what --draft resolves to
    built: bool  # True: healed in this call; False: reused from the cache
    seconds: float
    layers: str
    depth: int
    vocab: int
    metrics: dict | None = None  # the heal's (heal-metrics.json)

    def why(self) -> str:
        how = f"built and healed in {self.seconds:.0f} s" if self.built else "reused from the cache"
        return (f"--draft auto: layers {self.layers} of the target's {self.depth} and a {self.vocab}-token head, "
                f"LoRA-healed on the target's own answers; {how}")


def ensure_auto_draft(spec: str, target=None, tokenizer=None, config: AutoDraftConfig | None = None,
                      target_backend: str = "auto", threads: int = 0, progress=None, say=print) -> AutoDraft:
    """The auto draft of target `spec`: from the cache, else derived and healed now (the teacher is `target`, the
    target as it serves, when given; else it is opened from `spec`)."""
    import fcntl

    start = time.perf_counter()
    out, derive, heal = auto_dir(spec, config)
    depth = check_architecture(spec)
    built = False
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second process waits here, then finds the draft built
        if (out / RECIPE).exists():
            _rebase(out, spec)  # the key is the target's content: the file may have moved since
        if not is_built(out):
            say(f"[osd] --draft auto: deriving a draft from the target (layers {derive.layers} of {depth}) and healing it on "
                f"its own answers to {heal.limit} prompts of each of {heal.datasets}; once, into {out}")
            run_heal(out, heal, spec, derive, threads, out / "teacher", progress, target=target,
                     tokenizer=tokenizer, say=say, teacher_backend=target_backend)
            shutil.rmtree(out / "heal-state", ignore_errors=True)  # the healed delta is in derived.safetensors
            built = True
    metrics = (json.loads((out / RECIPE).read_text()).get("trained") or {}).get("metrics")
    return AutoDraft(f"derived:{out}", built, time.perf_counter() - start, derive.layers, depth, _vocab_rows(out),
                     metrics)


def _vocab_rows(out: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(out / TENSORS), "pt") as f:
        return int(f.get_slice("vocab_ids").get_shape()[0])


def _rebase(out: Path, spec: str) -> None:
    """Point a cached draft at the target's current path (same content, found under its key)."""
    path = out / RECIPE
    recipe = json.loads(path.read_text())
    if recipe["derive"]["base"] != spec:
        recipe["derive"]["base"] = spec
        tmp = path.with_suffix(".partial")
        tmp.write_text(json.dumps(recipe, indent=2, default=str))
        tmp.replace(path)
