"""What megatron-core needs from CUDA, done on the CPU: used by the megatron engine only when CUDA is absent
(tests and CI; one worker, tensor and pipeline size 1). Each piece names the megatron code it stands in for.

- `cpu_current_device()`: megatron-core places helper tensors with `torch.cuda.current_device()` (the
  rotary embedding's `inv_freq` in `RotaryEmbedding.get_emb`, the global memory buffer); inside this
  context that answers the CPU. Only entered around the engine's own forward/backward calls.
- `use_cpu_rng_tracker()`: megatron forks a CUDA RNG state around dropout (`get_cuda_rng_tracker().fork()`);
  megatron's own inference tracker forks nothing, so dropout draws from the CPU generator.
- `forward_backward_local`: the no-pipelining schedule (`forward_backward_no_pipelining`, which counts
  tokens in a `device="cuda"` tensor) with the same arguments and results: per micro-batch, forward, the
  loss function's (loss, metrics), loss / num_microbatches backward.
- megatron's optimizers keep flags in `device="cuda"` tensors: on the CPU the engine steps with
  `adamw.TorchAdamW` instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch


@contextlib.contextmanager
def cpu_current_device() -> Iterator[None]:
    """`torch.cuda.current_device()` answers the CPU inside the block (only where CUDA is absent)."""
    if torch.cuda.is_available():
        yield
        return
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: torch.device("cpu")
    try:
        yield
    finally:
        torch.cuda.current_device = original


def use_cpu_rng_tracker() -> None:
    """Install megatron's inference RNG tracker, whose `fork()` leaves the (CPU) generator as it is."""
    from megatron.core.tensor_parallel import random

    random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def forward_backward_local(
    *, forward_step_func: Callable, data_iterator: Any, model: Any, num_microbatches: int,
    forward_only: bool = False, **_: Any,
) -> list[dict[str, Any]]:
    """megatron's `forward_backward_no_pipelining` on the CPU: returns the loss functions' metric dicts."""
    module = model[0] if isinstance(model, list) else model
    store = []
    for _ in range(num_microbatches):
        with cpu_current_device():
            output, loss_func = forward_step_func(data_iterator, module)
            loss, metrics = loss_func(output)
            if not forward_only:
                (loss / num_microbatches).backward()
        store.append(metrics)
    return store
