"""Every architecture on the megatron engine on one H200, as a user runs it: `rlcore run --plugin grpo --use-ray
--config examples/ray/grpo/colocate.yaml train.engine=megatron`, scaled to one GPU, vLLM colocated and sleeping,
the checkpoint's own bf16 (dtype auto), 2 steps; full training for each architecture, LoRA for some. The run's
weight-sync check (rollout and train log-probs after the first sync) must pass, so a wrong mapping, a wrong LoRA
merge or stale weights in vLLM fail here. Then the learning check: the toy task with a high learning rate,
GRPO on megatron (full and LoRA) and on hf from one seed: each raises the reward, and megatron's curve stays
close to hf's. A weight sync that left vLLM on its first weights keeps the reward where it started.

First, cheaply, each architecture's megatron model against the mapping and transformers on megatron-core 0.19
(`test_each_architecture_builds_what_the_mapping_names_and_equals_transformers`); then Qwen3.5 as published
(`Qwen3_5ForConditionalGeneration`) with vLLM, its vision tower carried into `final/`.

Runs only on the GPU machine: `pytest -m gpu tests/gpu/test_megatron_archs_gpu.py`.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from rlcore.testing import ARCHS  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ray" / "grpo" / "colocate.yaml"
# head_dim 64 (vLLM's kernels at 16 failed in warm-up), bf16 weights drawn on the GPU
SHAPE = dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=512, vocab_size=1024,
             max_position_embeddings=1024, dtype="bfloat16")
LORA_ARCHS = ("qwen2", "qwen3", "qwen3_moe")
SCALE = ["train.gpus=1", "rollout.gpus=1", "train.engine=megatron", "rollout.vllm_gpu_memory_utilization=0.25",
         "rollout.vllm_enforce_eager=true", "rollout.vllm_max_model_len=512", "reward_funcs=[toy,format]",
         "num_generations=8", "per_device_train_batch_size=16", "max_completion_length=24", "check_weight_sync=true",
         "logging_steps=1", "save_steps=0"]


def model(arch: str, vision: bool = False) -> str:
    """The tiny `arch` (transformers' default config, sizes changed only); `vision`: as published, with its vision tower."""
    from rlcore.testing import build_tiny_model

    name = f"{arch}-vision" if vision else arch
    return str(build_tiny_model(Path(tempfile.gettempdir()) / "rlcore-gpu-archs" / name, arch=arch, device="cuda",
                                vision=vision, **SHAPE))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "words.jsonl"
    from rlcore.testing import toy_dataset

    path.write_text("".join(json.dumps(row) + "\n" for row in toy_dataset(64)))
    return str(path)


def grpo(arch: str, dataset: str, out: Path, *extra: str, steps: int = 2, timeout: int = 420, scale=SCALE) -> list[dict]:
    cmd = [sys.executable, "-m", "rlcore", "run", "--plugin", "grpo", "--use-ray", "--config", str(EXAMPLE),
           f"model={model(arch)}", f"dataset={dataset}", f"output_dir={out}", f"max_steps={steps}", *scale, *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, "RLCORE_DEBUG": "1"})
    assert done.returncode == 0, f"{arch}: rlcore run exited {done.returncode}\n{done.stderr[-6000:]}"
    engine = next(a.split("=", 1)[1] for a in reversed(cmd) if a.startswith("train.engine="))
    assert f"engine {engine}, bfloat16" in done.stderr, done.stderr[-3000:]  # dtype auto: the checkpoint's bf16
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1)) and all(r["grad_norm"] > 0 for r in rows)
    return rows


TEXT_ONLY = ("qwen3_5", "qwen3_5_moe")  # vLLM 0.26 serves Qwen3.5 only as Qwen3_5ForConditionalGeneration
MLP_CLASSES = {"gemma3": "SandwichMLP", "qwen3_moe": "MoELayer", "qwen3_5_moe": "MoELayer"}  # the others: SwiGLUMLP
BUILT = [(a, False) for a in ARCHS] + [(a, True) for a in TEXT_ONLY]


@pytest.mark.parametrize("arch,vision", BUILT, ids=[f"{a}{'-vision' if v else ''}" for a, v in BUILT])
def test_each_architecture_builds_what_the_mapping_names_and_equals_transformers(arch, vision):
    """The installed megatron-core (0.19 here, 0.16 on the CPU) builds the layers the engine's spec asks for (its MLP
    spec changed form between them: `attention.set_mlp`), their parameters are exactly the mapping's names, and the
    log-probs equal transformers' on the GPU in float32 (TF32 off). Seconds per architecture, no vLLM."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlcore.batch import Batch
    from rlcore.plugins.hf.common import model_outputs
    from rlcore.plugins.megatron import make_forward_engine, mapping
    from rlcore.plugins.megatron.support import SafetensorsReader

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    path = model(arch, vision)
    engine = make_forward_engine(model=path, device="cuda", dtype="float32")
    assert {type(layer.mlp).__name__ for layer in engine.module.decoder.layers} == {MLP_CLASSES.get(arch, "SwiGLUMLP")}
    built = {name for name in engine.module.state_dict() if not name.endswith("_extra_state")}
    with SafetensorsReader(Path(path)) as hf:
        assert built == set(mapping.hf_to_megatron(hf, engine.spec))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 260, (4, 40), generator=g)  # past Gemma 3's window of 16
    mask = torch.ones_like(ids)
    mask[1, 30:] = 0
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        expected = model_outputs(reference, ids.cuda(), mask.cuda(), temperature=1.0).logprobs().cpu()
    got = engine.forward_logprobs(Batch({"input_ids": ids * mask, "attention_mask": mask}))
    torch.testing.assert_close(got[mask.bool()], expected[mask.bool()], atol=2e-4, rtol=0)


@pytest.mark.parametrize("engine,arch,lora", [("megatron", "qwen3_5", 0), ("megatron", "qwen3_5", 8),
                                              ("hf", "qwen3_5", 0), ("megatron", "qwen3_5_moe", 0)])
def test_qwen3_5_as_published_trains_with_vllm_and_keeps_its_vision_tower(engine, arch, lora, dataset, tmp_path):
    """Qwen3_5ForConditionalGeneration (and its MoE sibling) as the GRPO policy with vLLM colocated: the run's
    weight-sync check passes (the causal-LM names mapped into vLLM's conditional model, which builds its language model
    alone), and `final/` holds every tensor of the published checkpoint, the vision tower bit for bit."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    path = Path(model(arch, vision=True))
    extra = [f"train.engine={engine}", "learning_rate=1e-3"] + (
        [f"train.lora_rank={lora}", f"train.lora_alpha={2 * lora}"] if lora else [])
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "rlcore", "run", "--plugin", "grpo", "--use-ray", "--config", str(EXAMPLE),
           f"model={path}", f"dataset={dataset}", f"output_dir={out}", "max_steps=2", *SCALE, *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=480, env={**os.environ, "RLCORE_DEBUG": "1"})
    assert done.returncode == 0, f"{arch} on {engine}: rlcore run exited {done.returncode}\n{done.stderr[-6000:]}"
    source = load_file(str(path / "model.safetensors"))
    final = {}
    for file in sorted((out / "final").glob("*.safetensors")):
        final.update(load_file(file))
    visual = [n for n in source if n.startswith("model.visual.")]
    assert visual and all(torch.equal(final[n].cpu(), source[n]) for n in visual)
    if engine == "megatron":  # the hf engine keeps a MoE's experts fused, as transformers 5 does
        assert final.keys() == source.keys()
    assert type(AutoModelForImageTextToText.from_pretrained(out / "final")).__name__.endswith("ForConditionalGeneration")


@pytest.mark.parametrize("arch", [a for a in ARCHS if a not in TEXT_ONLY])
def test_each_architecture_trains_on_megatron_with_vllm(arch, dataset, tmp_path):
    grpo(arch, dataset, tmp_path / "run", "learning_rate=1e-3")
    final = tmp_path / "run" / "final"
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(final)  # what megatron exported loads back into transformers


@pytest.mark.parametrize("arch", LORA_ARCHS)
def test_lora_on_megatron_syncs_merged_weights_to_vllm(arch, dataset, tmp_path):
    grpo(arch, dataset, tmp_path / "run", "learning_rate=1e-3", "train.lora_rank=8", "train.lora_alpha=16")
    assert (tmp_path / "run" / "final" / "adapter_config.json").is_file()


def test_grpo_learns_on_megatron_full_and_lora_as_on_hf(dataset, tmp_path):
    """The toy task ("write vowels") from one seed, 24 steps; reward: mean of the last 4 steps vs the first 4."""
    runs = {
        "hf": ["train.engine=hf", "learning_rate=5e-3"],
        "megatron": ["train.engine=megatron", "learning_rate=5e-3"],
        "megatron-lora": ["train.engine=megatron", "train.lora_rank=16", "train.lora_alpha=32", "learning_rate=3e-2"],
    }
    curves = {}
    for name, extra in runs.items():
        rows = grpo("qwen2", dataset, tmp_path / name, *extra, steps=24, timeout=560)
        curves[name] = [r["reward"] for r in rows]
    print({k: [round(v, 3) for v in c] for k, c in curves.items()})
    rise = {k: statistics.mean(c[-4:]) - statistics.mean(c[:4]) for k, c in curves.items()}
    assert all(r > 0.05 for r in rise.values()), rise
    assert abs(statistics.mean(curves["megatron"][-4:]) - statistics.mean(curves["hf"][-4:])) < 0.5 * rise["hf"], curves


@pytest.mark.parametrize("arch", TEXT_ONLY)
def test_text_only_qwen3_5_is_refused_by_vllm_in_one_line_and_trains_with_the_hf_rollout(arch, dataset, tmp_path):
    cmd = [sys.executable, "-m", "rlcore", "config", "validate", "--plugin", "grpo", "--config", str(EXAMPLE),
           f"model={model(arch)}", f"dataset={dataset}", *SCALE]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "which vLLM" in done.stderr and len(done.stderr.splitlines()) <= 3, done.stderr
    hf = [k for k in SCALE if not k.startswith("rollout.vllm_")] + ["rollout.engine=hf"]
    grpo(arch, dataset, tmp_path / "run", "learning_rate=1e-3", scale=hf)
