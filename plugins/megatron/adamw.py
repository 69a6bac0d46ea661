"""`TorchAdamW`: torch's AdamW with gradient clipping, behind the part of megatron's `MegatronOptimizer`
interface the engine uses (`step()` -> (ok, grad_norm, zeros) after clipping, `zero_grad`, `scale_loss`,
`param_groups` for megatron's `OptimizerParamScheduler`, state dicts, the torch optimizer as `.optimizer`).

The engine steps with it where megatron-core's own optimizers do not fit:
- on the CPU, where megatron's optimizers keep flags in `device="cuda"` tensors;
- on CUDA with `master_weights=false`: AdamW on the bf16 params with bf16 moments, as the hf engine trains.
  megatron's `FP32Optimizer` would take those params but its clipping asserts fp32 grads
  (`clip_grad_by_total_norm_fp32`), and its precision-aware optimizer needs Transformer Engine. megatron's DDP
  reduces the gradients into each param's `main_grad` (bf16 here); `step` hands them to torch as `.grad`.
  One tensor and pipeline rank (the norm is not reduced over a model-parallel group).
"""

from __future__ import annotations

import math
from typing import Any

import torch


class TorchAdamW:
    def __init__(self, params: list[torch.nn.Parameter], *, lr: float, weight_decay: float, betas: tuple[float, float],
                 eps: float, clip_grad: float):
        self.params = [p for p in params if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.clip_grad = clip_grad

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:  # no loss scale: bf16 and fp32 only
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> tuple[bool, float, None]:
        for p in self.params:
            main = getattr(p, "main_grad", None)  # megatron DDP's reduced gradient
            if main is not None:
                p.grad = main
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.clip_grad or math.inf)
        self.optimizer.step()
        return True, float(norm), None

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)
