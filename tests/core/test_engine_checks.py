"""An engine's device (rlcore.engine_checks): "cuda" always gets an explicit index, from what the process sees and LOCAL_RANK.

Regression: under Ray each actor sees only its own GPU, so `torch.cuda.device_count()` is 1 and the engine
kept torch.device("cuda") without an index; `torch.cuda.set_device` then raised "Expected a torch.device
with a specified index" and every train group of more than one GPU died.
"""

from __future__ import annotations

import pytest
import torch

from rlcore import ConfigError
from rlcore.engine_checks import resolve_device, torch_device


@pytest.mark.parametrize(
    ("device", "visible", "local_rank", "want"),
    [
        ("cuda", 1, None, "cuda:0"),
        ("cuda", 1, "3", "cuda:0"),  # Ray: LOCAL_RANK 3 of the group, but the actor sees its own GPU only
        ("cuda", 1, 0, "cuda:0"),
        ("cuda", 4, "2", "cuda:2"),  # torchrun: every GPU of the node visible, one process each
        ("cuda", 4, None, "cuda:0"),
        ("cuda", 4, "", "cuda:0"),
        ("cuda:1", 2, "0", "cuda:1"),  # named: kept
        ("cpu", 0, "5", "cpu"),
    ],
)
def test_cuda_resolves_to_an_explicit_index(device, visible, local_rank, want):
    assert resolve_device(device, visible, local_rank) == want
    assert torch.device(want).index is not None or want == "cpu"


@pytest.mark.parametrize(
    ("device", "visible", "local_rank", "message"),
    [
        ("cuda", 2, "3", r"LOCAL_RANK=3, but this process sees 2 GPUs .*device='cuda:0'"),
        ("cuda", 0, None, "no CUDA device is visible"),
        ("cuda:2", 2, None, r"sees 2 GPU\(s\), cuda:0..cuda:1"),
    ],
)
def test_an_impossible_gpu_is_a_config_error(device, visible, local_rank, message):
    with pytest.raises(ConfigError, match=message):
        resolve_device(device, visible, local_rank)


def test_torch_device_on_the_cpu(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert torch_device("cpu") == torch.device("cpu")
