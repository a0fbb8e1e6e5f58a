"""A draft version on the wire: the serving copy's tensors (int8 weights and scales where the copy is quantized, a
Q4 copy's repacked kernel blocks) of the modules an update changes, as numpy arrays. The learner builds the serving
copy once per version; each replica makes its new serving copy from the one it serves, sharing every unchanged tensor
and swapping in the shipped ones: no requantization per replica, and nothing is applied unless the whole version fits
(names, shapes, dtypes, values).

A Q4 copy (models/q4_draft.py) fuses a layer's q|k|v and gate|up matrices, so it ships whole layers: every kernel
tensor named blk.{i}.* of a layer holding a changed module (`q4_keys`), as `vectors.<name>`, `matrices.<name>.<run>.
<field>` and `embd.table`."""
from __future__ import annotations

import copy
import dataclasses

import numpy as np
import torch
from torch import nn

from osd.errors import OsdError
from osd.models.q4_draft import Q4Draft


# a Q4 copy's tensors of one layer (q4_runner.Q4Weights; the q/k and post norms where the family has them: a key
# naming a tensor the copy lacks selects nothing)
LAYER_TENSORS = ("attn_norm", "ffn_norm", "qkv_bias", "qkv", "attn_output", "gate_up", "ffn_down", "q_norm", "k_norm",
                 "attn_post_norm", "ffn_post_norm")


class DraftLoadError(OsdError):
    """A published draft version does not fit this replica's draft (names, shapes, values): refused, not served."""


def changed_prefixes(master) -> list[str]:
    """The module paths ("model.layers.23.mlp.down_proj.") holding a trainable parameter of the learner's master: the
    serving copy's modules at those paths are what an update changes (a LoRA adapter's path is the merged linear's)."""
    return sorted({name.rpartition(".")[0] + "." for name, p in master.named_parameters() if p.requires_grad})


def serving_arrays(serving, prefixes: list[str]) -> dict[str, np.ndarray]:
    """name -> numpy copy of each serving-copy tensor under one of the prefixes: one version's payload."""
    if isinstance(serving, Q4Draft):
        keys = q4_keys(prefixes, serving.weights.shape.layers)
        return {name: t.numpy().copy() for name, t in q4_tensors(serving.weights).items() if _q4_key(name) in keys}
    out = {}
    for name, t in serving.state_dict().items():
        if any(name.startswith(p) for p in prefixes) and isinstance(t, torch.Tensor) and not t.is_quantized:
            out[name] = t.detach().cpu().numpy().copy()
    return out


def payload_bytes(arrays: dict[str, np.ndarray]) -> int:
    return sum(a.nbytes for a in arrays.values())


def q4_keys(prefixes: list[str], layers: int) -> set[str]:
    """The Hugging Face module paths an update changes -> the Q4 copy's vector and matrix names holding them: a whole
    layer for any module inside it (its matrices are fused), the final norm, the LM head ("output"), the token table
    ("embd"; a tied head is quantized from it, so "output" too)."""
    keys = set()
    for prefix in prefixes:
        parts = prefix.split(".")
        if parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) < layers:
            i = parts[2]
            keys |= {f"blk.{i}.{n}" for n in LAYER_TENSORS}
        elif prefix == "model.norm.":
            keys.add("output_norm")
        elif prefix == "lm_head.":
            keys.add("output")
        elif prefix == "model.embed_tokens.":
            keys |= {"embd", "output"}
        else:
            raise DraftLoadError(f"a changed module {prefix!r} has no place in a Q4 serving copy")
    return keys


def q4_tensors(weights) -> dict[str, torch.Tensor]:
    """A Q4 copy's every tensor by wire name (`vectors.<name>`, `matrices.<name>.<run>.<field>`, `embd.table`; its
    q4_keys key: `_q4_key`). Views, not copies."""
    out = {f"vectors.{name}": v for name, v in weights.vectors.items()}
    for name, runs in weights.matrices.items():
        for j, w in enumerate(runs):
            for field in dataclasses.fields(w):
                if field.name != "n":
                    out[f"matrices.{name}.{j}.{field.name}"] = getattr(w, field.name)
    out["embd.table"] = torch.from_numpy(weights.embd)
    return out


def _q4_key(name: str) -> str:
    """A wire name's q4_keys key: `vectors.<key>`, `matrices.<key>.<run>.<field>`, `embd.table`."""
    kind, rest = name.split(".", 1)
    return rest if kind == "vectors" else rest.rsplit(".", 2)[0] if kind == "matrices" else kind


def _dtype(t) -> str:
    return str(t.dtype).removeprefix("torch.")


def check_arrays(state: dict, arrays: dict[str, np.ndarray]) -> None:
    """DraftLoadError unless every array names a tensor of `state` (a serving copy's tensors by name) with its shape
    and dtype, and float ones are finite."""
    if not arrays:
        raise DraftLoadError("the published version carries no weights")
    for name, array in arrays.items():
        if name not in state:
            raise DraftLoadError(f"the published version has a tensor {name!r} this replica's draft does not have "
                                 "(another base draft, quantization or --trainable layout)")
        here = state[name]
        if tuple(array.shape) != tuple(here.shape) or str(array.dtype) != _dtype(here):
            raise DraftLoadError(f"tensor {name!r}: {array.dtype}{tuple(array.shape)} published, "
                                 f"{_dtype(here)}{tuple(here.shape)} here")
        if array.dtype.kind == "f" and not np.isfinite(array).all():
            raise DraftLoadError(f"tensor {name!r} holds non-finite values")


def with_arrays(model, arrays: dict[str, np.ndarray]):
    """A new serving copy: `model`'s modules, every tensor shared except the shipped ones (checked first; `model` is
    left as it is, so requests holding it finish on it)."""
    if isinstance(model, Q4Draft):
        return _with_q4_arrays(model, arrays)
    check_arrays(model.state_dict(), arrays)
    shared = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    new = copy.deepcopy(model, dict(shared))
    for name, array in arrays.items():
        module_name, _, attr = name.rpartition(".")
        module = new.get_submodule(module_name)
        value = torch.tensor(array)  # a copy: arrays from Ray's object store are read-only views
        if attr in module._parameters:
            module._parameters[attr] = nn.Parameter(value, requires_grad=False)
        else:
            module._buffers[attr] = value
    return new


def _with_q4_arrays(model: Q4Draft, arrays: dict[str, np.ndarray]) -> Q4Draft:
    w = model.weights
    check_arrays(q4_tensors(w), arrays)
    vectors, matrices, embd = dict(w.vectors), {name: list(runs) for name, runs in w.matrices.items()}, w.embd
    for name, array in arrays.items():
        value = torch.tensor(array)  # a copy: arrays from Ray's object store are read-only views
        kind, rest = name.split(".", 1)
        if kind == "vectors":
            vectors[rest] = value
        elif kind == "embd":
            embd = value.numpy()
        else:
            key, run, field = rest.rsplit(".", 2)
            matrices[key][int(run)] = dataclasses.replace(matrices[key][int(run)], **{field: value})
    return Q4Draft(dataclasses.replace(w, vectors=vectors, matrices=matrices, embd=embd))
