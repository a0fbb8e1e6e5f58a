"""A draft version on the wire: the serving copy's tensors (int8 weights and scales where the copy is quantized) of
the modules an update changes, as numpy arrays. The learner builds the serving copy once per version; each replica
makes its new serving copy from the one it serves, sharing every unchanged tensor and swapping in the shipped ones:
no requantization per replica, and nothing is applied unless the whole version fits (names, shapes, dtypes, values)."""
from __future__ import annotations

import copy

import numpy as np
import torch
from torch import nn

from osd.errors import OsdError


class DraftLoadError(OsdError):
    """A published draft version does not fit this replica's draft (names, shapes, values): refused, not served."""


def changed_prefixes(master) -> list[str]:
    """The module paths ("model.layers.23.mlp.down_proj.") holding a trainable parameter of the learner's master: the
    serving copy's modules at those paths are what an update changes (a LoRA adapter's path is the merged linear's)."""
    return sorted({name.rpartition(".")[0] + "." for name, p in master.named_parameters() if p.requires_grad})


def serving_arrays(serving, prefixes: list[str]) -> dict[str, np.ndarray]:
    """name -> numpy copy of each serving-copy tensor under one of the prefixes: one version's payload."""
    out = {}
    for name, t in serving.state_dict().items():
        if any(name.startswith(p) for p in prefixes) and isinstance(t, torch.Tensor) and not t.is_quantized:
            out[name] = t.detach().cpu().numpy().copy()
    return out


def payload_bytes(arrays: dict[str, np.ndarray]) -> int:
    return sum(a.nbytes for a in arrays.values())


def check_arrays(model, arrays: dict[str, np.ndarray]) -> None:
    """DraftLoadError unless every array names a tensor of `model` with its shape and dtype, and float ones are finite."""
    state = model.state_dict()
    if not arrays:
        raise DraftLoadError("the published version carries no weights")
    for name, array in arrays.items():
        if name not in state:
            raise DraftLoadError(f"the published version has a tensor {name!r} this replica's draft does not have "
                                 "(another base draft, quantization or --trainable layout)")
        here = state[name]
        if tuple(array.shape) != tuple(here.shape) or str(array.dtype) != str(here.dtype).removeprefix("torch."):
            raise DraftLoadError(f"tensor {name!r}: {array.dtype}{tuple(array.shape)} published, "
                                 f"{str(here.dtype).removeprefix('torch.')}{tuple(here.shape)} here")
        if array.dtype.kind == "f" and not np.isfinite(array).all():
            raise DraftLoadError(f"tensor {name!r} holds non-finite values")


def with_arrays(model, arrays: dict[str, np.ndarray]):
    """A new serving copy: `model`'s modules, every tensor shared except the shipped ones (checked first; `model` is
    left as it is, so requests holding it finish on it)."""
    check_arrays(model, arrays)
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
