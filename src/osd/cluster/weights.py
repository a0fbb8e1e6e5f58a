"""A draft version on the wire: the trainable tensors of the learner's master as numpy arrays (what an update
changes; the frozen rest every replica loads itself), checked whole before any of them is applied."""
from __future__ import annotations

import warnings

import numpy as np
import torch

from osd.errors import OsdError


class DraftLoadError(OsdError):
    """A published draft version does not fit this replica's draft (names, shapes, values): refused, not served."""


def trainable_arrays(model) -> dict[str, np.ndarray]:
    """name -> a numpy copy of each parameter that trains (requires_grad): one draft version's payload."""
    return {name: p.detach().float().numpy().copy() for name, p in model.named_parameters() if p.requires_grad}


def payload_bytes(arrays: dict[str, np.ndarray]) -> int:
    return sum(a.nbytes for a in arrays.values())


def check_arrays(model, arrays: dict[str, np.ndarray]) -> None:
    """DraftLoadError unless every array names a parameter of `model` with its shape and holds finite values."""
    params = dict(model.named_parameters())
    if not arrays:
        raise DraftLoadError("the published version carries no weights")
    for name, array in arrays.items():
        if name not in params:
            raise DraftLoadError(f"the published version has a weight {name!r} this replica's draft does not have "
                                 "(another base draft, or another --trainable layout)")
        if tuple(array.shape) != tuple(params[name].shape):
            raise DraftLoadError(f"weight {name!r}: shape {tuple(array.shape)} published, "
                                 f"{tuple(params[name].shape)} here")
        if not np.isfinite(array).all():
            raise DraftLoadError(f"weight {name!r} holds non-finite values")


def load_arrays(model, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Copy checked arrays into `model`'s parameters; returns the values they replaced (to put back on failure)."""
    check_arrays(model, arrays)
    params, before = dict(model.named_parameters()), {}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # arrays from Ray's object store are read-only views: copied, never written
        for name, array in arrays.items():
            before[name] = params[name].detach().clone()
            params[name].copy_(torch.from_numpy(array))
    return before


def restore(model, before: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in before.items():
            params[name].copy_(value)
