"""A content-addressed disk cache of target outputs (PAPER.md section 3: the target is the slow part).

Key = sha256 of (target fingerprint, prompt token ids, decoding settings). An entry holds the response
token ids and the target's compact distribution (top-K + tail, temperature 1) at every response
position, so distillation, evaluation and the greedy fast-path replay never re-run the target.
Each entry is one safetensors file written atomically (tmp + rename): an interrupted fill loses at
most the batch in flight, and the next fill skips what is there.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from osd.errors import InvalidArgument
from osd.learn.compact import CompactDist


@dataclass(frozen=True)
class DecodeSettings:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 64  # target distribution kept per position
    seed: int = 0  # used when temperature > 0

    def __post_init__(self):
        if self.max_new_tokens <= 0 or self.top_k <= 0:
            raise InvalidArgument("max_new_tokens and top_k must be > 0")
        if self.temperature < 0:
            raise InvalidArgument(f"temperature must be >= 0, got {self.temperature}")


@dataclass
class TargetSample:
    prompt_ids: list[int]
    response_ids: list[int]
    target: CompactDist  # (len(response_ids), K): target distribution of each response token's position
    meta: dict = field(default_factory=dict)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.response_ids


def model_fingerprint(spec: str, config) -> str:
    """Identifies a target: its spec and config (bundled models are sha256-checked on assembly)."""
    config = {k: v for k, v in config.to_dict().items() if not k.startswith("_") and k != "transformers_version"}
    return hashlib.sha256(json.dumps([spec, config], sort_keys=True, default=str).encode()).hexdigest()[:16]


def default_cache_root() -> Path:
    from osd.models.bundled import cache_root

    return cache_root() / "teacher"


class TargetCache:
    def __init__(self, root: str | Path, fingerprint: str):
        self.root, self.fingerprint = Path(root) / fingerprint, fingerprint

    def key(self, prompt_ids: list[int], settings: DecodeSettings) -> str:
        blob = json.dumps([self.fingerprint, list(prompt_ids), asdict(settings)], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()

    def path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.safetensors"

    def __contains__(self, args) -> bool:
        return self.path(self.key(*args)).exists()

    def get(self, prompt_ids: list[int], settings: DecodeSettings) -> TargetSample | None:
        path = self.path(self.key(prompt_ids, settings))
        if not path.exists():
            return None
        t = load_file(str(path))
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            meta = json.loads(f.metadata().get("meta", "{}"))
        return TargetSample(t["prompt_ids"].tolist(), t["response_ids"].tolist(),
                             CompactDist(t["top_ids"].long(), t["top_probs"].float()), meta)

    def put(self, sample: TargetSample, settings: DecodeSettings) -> Path:
        path = self.path(self.key(sample.prompt_ids, settings))
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {"prompt_ids": torch.tensor(sample.prompt_ids, dtype=torch.int32),
                   "response_ids": torch.tensor(sample.response_ids, dtype=torch.int32),
                   "top_ids": sample.target.ids.to(torch.int32).contiguous(),
                   "top_probs": sample.target.probs.to(torch.float32).contiguous()}
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        save_file(tensors, str(tmp), metadata={"meta": json.dumps({**sample.meta, "settings": asdict(settings)})})
        os.replace(tmp, path)
        return path
