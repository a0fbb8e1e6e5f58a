"""A restore point of the learner's master: its trainable parameters and the optimizer's state (Adam moments and
step counts), taken before an update and put back when the guard rejects the update or an exception cuts it short.

Cheap by construction: only the trainable parameters are copied (the frozen rest never changes; with LoRA only the
adapters), and the optimizer's state holds tensors of the same shapes (two moments per parameter).
Limitation: buffers and frozen parameters are not copied, so an update must change nothing but the trainable
parameters and the optimizer; gradients are cleared on restore, not restored.
"""
from __future__ import annotations

import copy

import torch


class RestorePoint:
    def __init__(self, params: list[torch.Tensor], optimizer: torch.optim.Optimizer):
        self.params, self.optimizer = params, optimizer
        self.weights = [p.detach().clone() for p in params]
        self.optimizer_state = copy.deepcopy(optimizer.state_dict())

    @torch.no_grad()
    def restore(self) -> None:
        """Put the weights and the optimizer's state back as they were; may be called more than once."""
        for p, saved in zip(self.params, self.weights):
            p.copy_(saved)
            p.grad = None
        # load_state_dict keeps the tensors it is given (optimizer steps then change them in place): give it a copy
        self.optimizer.load_state_dict(copy.deepcopy(self.optimizer_state))
