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


# ---- dtype "auto": the model's own precision on a GPU, float32 on the CPU -----------------------------------

@pytest.mark.parametrize("saved", ["bfloat16", "float16", "float32"])
def test_auto_is_the_checkpoints_half_precision_on_a_gpu_and_float32_on_the_cpu(tmp_path, saved):
    from rlcore.engine_checks import checkpoint_dtype, resolve_dtype
    from rlcore.testing import build_tiny_model

    model = build_tiny_model(tmp_path / saved, dtype=saved)
    assert checkpoint_dtype(model) == saved
    assert resolve_dtype("auto", model, cuda=True) == {"float32": "bfloat16"}.get(saved, saved)
    assert resolve_dtype("auto", model, cuda=False) == "float32"
    assert resolve_dtype("float32", model, cuda=True) == "float32"  # asked for: kept, upcast and all


def test_auto_reads_transformers_4s_key_and_a_text_config(tmp_path):
    import json

    from rlcore.engine_checks import checkpoint_dtype, resolve_dtype

    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.json").write_text(json.dumps({"torch_dtype": "float16"}))
    (tmp_path / "vl").mkdir()
    (tmp_path / "vl" / "config.json").write_text(json.dumps({"text_config": {"dtype": "bfloat16"}}))
    assert checkpoint_dtype(tmp_path / "old") == "float16" and checkpoint_dtype(tmp_path / "vl") == "bfloat16"
    assert checkpoint_dtype(tmp_path / "nowhere") is None and checkpoint_dtype("no-such-org/no-such-model") is None
    assert resolve_dtype("auto", tmp_path / "nowhere", cuda=True) == "bfloat16"


def test_every_role_defaults_to_auto_and_a_bf16_checkpoint_loads_in_float32_on_the_cpu(tmp_path):
    """The defaults of every section that loads a model, and the engines built from them on the CPU."""
    from rlcore.manager import load_plugins
    from rlcore.plugins.hf.rollout import HFRolloutEngine
    from rlcore.plugins.hf.train import HFTrainEngine
    from rlcore.testing import build_tiny_model

    plugins = load_plugins()
    seen = {}
    for name in ("grpo", "gkd", "sft", "sample"):
        config = plugins.algorithms.get(name).config
        for key, field in config.model_fields.items():
            section = field.annotation
            if isinstance(section, type) and "dtype" in getattr(section, "model_fields", {}):
                seen[f"{name}.{key}"] = section.model_fields["dtype"].default
        if "dtype" in config.model_fields:
            seen[f"{name}.dtype"] = config.model_fields["dtype"].default
    assert {"grpo.train", "grpo.rollout", "grpo.reference", "grpo.orm", "gkd.train", "gkd.rollout", "gkd.teacher",
            "sft.dtype", "sample.sampler", "sample.prm", "sample.orm"} <= set(seen), sorted(seen)
    assert set(seen.values()) == {"auto"}, seen

    model = build_tiny_model(tmp_path / "bf16", dtype="bfloat16")
    train = HFTrainEngine(model=str(model), device="cpu")
    rollout = HFRolloutEngine(str(model), device="cpu")
    assert next(train.model.parameters()).dtype == torch.float32
    assert next(rollout.model.parameters()).dtype == torch.float32


def test_installed_version_reads_the_metadata_of_what_is_installed(monkeypatch):
    import importlib.metadata

    from rlcore.engines import installed_version

    assert installed_version("torch") == tuple(int(p) for p in torch.__version__.split(".")[:2])
    assert installed_version("no-such-distribution-here") is None
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "nightly")
    assert installed_version("torch") is None  # not numbered: no version to compare


@pytest.mark.parametrize("targets, named", [
    ("all-linear", False), (["all-linear"], False), (["q_proj", "v_proj"], False),
    (["all-linear", "lm_head"], True), (["model.lm_head"], True), (["output_layer"], True),  # megatron's name
    (".*(proj|lm_head)", True), (".*proj", False), ("(", False),  # peft's pattern: matched whole; a broken one: none
])
def test_names_lm_head_reads_lora_target_modules_as_peft_does(targets, named):
    from rlcore.engines import names_lm_head

    assert names_lm_head(targets) is named
