"""Model loading (hub id / local dir / GGUF / bundled pair), tokenizer checks, KV-cached runners."""
from osd.models.cached import CachedModel
from osd.models.loading import load_model, load_tokenizer, resolve_model_dir
from osd.models.tokenizer import check_same_tokenizer

__all__ = ["CachedModel", "load_model", "load_tokenizer", "resolve_model_dir", "check_same_tokenizer"]
