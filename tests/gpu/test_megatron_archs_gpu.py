"""Every architecture on the megatron engine on one H200, as a user runs it: `rlcore run --plugin grpo --use-ray
--config examples/ray/grpo/colocate.yaml train.engine=megatron`, scaled to one GPU, vLLM colocated and sleeping,
the checkpoint's own bf16 (dtype auto), 2 steps; full training for each architecture, LoRA for some. The run's
weight-sync check (rollout and train log-probs after the first sync) must pass, so a wrong mapping, a wrong LoRA
merge or stale weights in vLLM fail here. Then the learning check, 24 steps a run, the runs side by side
on the GPU: GRPO on the toy task (hf, megatron, and LoRA on both with the output layer adapted, on the untied model)
raises the reward, GKD (hf, megatron) lowers the JSD to a random wider teacher, SFT lowers the loss; megatron's
curves stay close to hf's; and the same GRPO run with the weight sync switched off
(tests/gpu/grpo_without_weight_sync.py) does not raise the reward, so the check fails where vLLM keeps generating
from its first weights.

First, cheaply, each architecture's megatron model against the mapping and transformers on megatron-core 0.19
(`test_each_architecture_builds_what_the_mapping_names_and_equals_transformers`); then Qwen3.5 as published
(`Qwen3_5ForConditionalGeneration`) with vLLM, its vision tower carried into `final/`.

Runs only on the GPU machine: `pytest -m gpu tests/gpu/test_megatron_archs_gpu.py`.
"""

from __future__ import annotations

import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
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


def grpo_command(arch: str, dataset: str, out: Path, *extra: str, steps: int = 2, scale=SCALE) -> list[str]:
    return [sys.executable, "-m", "rlcore", "run", "--plugin", "grpo", "--use-ray", "--config", str(EXAMPLE),
            f"model={model(arch)}", f"dataset={dataset}", f"output_dir={out}", f"max_steps={steps}", *scale, *extra]


def metrics(name: str, cmd: list[str], code: int, stderr: str, out: Path, steps: int) -> list[dict]:
    """A finished run's metrics.jsonl: steps 1..`steps`, a finite loss and grad norm every step, and some step with
    a gradient (a step whose groups all had equal rewards has none, as in any run that learns)."""
    assert code == 0, f"{name}: rlcore run exited {code}\n{stderr[-6000:]}"
    engine = next((a.split("=", 1)[1] for a in reversed(cmd) if a.startswith("train.engine=")), "hf")
    if "--plugin" in cmd and cmd[cmd.index("--plugin") + 1] != "sft":
        assert f"engine {engine}, bfloat16" in stderr, f"{name}: {stderr[-3000:]}"  # dtype auto: the checkpoint's bf16
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), f"{name}: steps {[r['step'] for r in rows]}"
    norms = [r["grad_norm"] for r in rows]
    assert all(math.isfinite(r["loss"]) for r in rows) and all(math.isfinite(g) and g >= 0 for g in norms), rows
    assert any(g > 0 for g in norms), f"{name}: no step had a gradient: {norms}"
    return rows


def grpo(arch: str, dataset: str, out: Path, *extra: str, steps: int = 2, timeout: int = 420, scale=SCALE) -> list[dict]:
    cmd = grpo_command(arch, dataset, out, *extra, steps=steps, scale=scale)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, "RLCORE_DEBUG": "1"})
    return metrics(arch, cmd, done.returncode, done.stderr, out, steps)


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
    assert (tmp_path / "run" / "final" / "adapter" / "adapter_config.json").is_file()  # docs/outputs.md: final/adapter


LEARN_STEPS = 24
# LoRA on every linear but the LM head cannot teach a random tiny model the toy task: the frozen head bounds what the
# adapters reach (direct supervision raised P(vowel) from 0.006 to 0.16 only; full training to 0.996). With lm_head
# adapted too (an untied model: a tied head is refused) GRPO learns in 24 steps on the CPU (float32, hf rollout): hf
# 0.032 -> 1.0 (rising from step 11), megatron 0.032 -> 0.5 (rising from step 5; from step 15 every completion alike);
# at 5e-3 hf rose by 0.08 only, at 2e-2 it settled at 0.5 by step 13
LORA_LEARN = ["train.lora_rank=16", "train.lora_alpha=32", "learning_rate=1e-2",
              "train.lora_target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head]"]
# Eight runs share the GPU: each vLLM engine takes a fixed KV cache instead of sizing one from the memory it sees
# free (a profile beside the other runs' allocations counts them as its own)
FIXED_KV = "vllm_engine_kwargs={kv_cache_memory_bytes: 1073741824, enable_flashinfer_autotune: false}"
WITHOUT_SYNC = Path(__file__).with_name("grpo_without_weight_sync.py")


def side_by_side(runs: dict[str, list[str]], root: Path, timeout: int, env: dict[str, dict]) -> dict[str, list[dict]]:
    """Start every run at once, wait for all (each within `timeout`), and return each one's metrics rows."""
    procs = {}
    for name, cmd in runs.items():
        (root / name).mkdir(parents=True)
        log = open(root / name / "console.log", "w")
        procs[name] = (subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True, start_new_session=True,
                                        env={**os.environ, "RLCORE_DEBUG": "1", **env.get(name, {})}), log)
    deadline = time.monotonic() + timeout
    codes = {}
    try:
        for name, (proc, log) in procs.items():
            try:
                codes[name] = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[name] = "timed out"
            log.close()
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    return {name: metrics(name, runs[name], codes[name], (root / name / "console.log").read_text(errors="replace"),
                          root / name / "out", LEARN_STEPS) for name in runs}


def test_grpo_gkd_and_sft_learn_on_hf_and_megatron_and_grpo_does_not_without_the_weight_sync(dataset, tmp_path):
    """Mean of the last 4 steps against the first 4: GRPO's reward rises (full and LoRA, hf and megatron), GKD's JSD
    and SFT's loss fall, megatron's full-training curve stays near hf's while both climb, and the run without the
    weight sync does not learn."""
    from rlcore.testing import build_tiny_model

    root = tmp_path / "models"
    teacher = str(build_tiny_model(root / "teacher", device="cuda", **{**SHAPE, "hidden_size": 384, "num_heads": 6,
                                                                         "intermediate_size": 768, "seed": 3}))
    words = "the a model learns to answer questions about numbers and words with care".split()
    chats = [{"messages": [{"role": "user", "content": f"{i}: " + " ".join(words[i % 5:i % 5 + 6]) + "?"},
                           {"role": "assistant", "content": " ".join(words[::1 + i % 3] * (1 + i % 4))}]}
             for i in range(128)]
    (root / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chats))
    pairs = [{"prompt": f"Say {i}:", "completion": f"number {i}"} for i in range(64)]
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs))
    learn = [*SCALE, f"rollout.{FIXED_KV}"]
    grpo_runs = {
        "grpo-hf": ("qwen2", ["train.engine=hf", "learning_rate=5e-3"]),
        "grpo-megatron": ("qwen2", ["train.engine=megatron", "learning_rate=5e-3"]),
        "grpo-hf-lora": ("qwen2_untied", ["train.engine=hf", *LORA_LEARN]),
        "grpo-megatron-lora": ("qwen2_untied", ["train.engine=megatron", *LORA_LEARN]),
        "grpo-hf-without-sync": ("qwen2", ["train.engine=hf", "learning_rate=5e-3"]),
    }
    runs = {name: grpo_command(arch, dataset, tmp_path / name / "out", *extra, steps=LEARN_STEPS, scale=learn)
            for name, (arch, extra) in grpo_runs.items()}
    gkd = [sys.executable, "-m", "rlcore", "run", "--plugin", "gkd", "--use-ray", "--config",
           str(EXAMPLE.parents[1] / "gkd" / "teacher_colocated.yaml"), f"model={model('qwen2')}",
           f"teacher_model={teacher}", f"dataset={root / 'pairs.jsonl'}", f"max_steps={LEARN_STEPS}",
           "max_completion_length=24", "learning_rate=1e-3", "train.gpus=1", "rollout.gpus=1",
           *(a for a in learn if a.startswith("rollout.vllm_"))]
    for engine in ("hf", "megatron"):
        runs[f"gkd-{engine}"] = [*gkd, f"train.engine={engine}", f"output_dir={tmp_path / f'gkd-{engine}' / 'out'}"]
    runs["sft"] = [sys.executable, "-m", "rlcore", "run", "--plugin", "sft", "--use-ray", "--config",
                   str(EXAMPLE.parents[1] / "sft" / "multi_node.yaml"), f"model={model('qwen2')}",
                   f"dataset={root / 'chats.jsonl'}", f"max_steps={LEARN_STEPS}", "learning_rate=1e-3",
                   "lr_scheduler_type=constant", "warmup_steps=0", "per_device_train_batch_size=4",
                   "gradient_accumulation_steps=1", "save_steps=0", "max_length=256", "bf16=true",
                   "device_groups.nproc_per_node=1", "device_groups.nnodes=1", "gradient_checkpointing=false",
                   "ray_address=null", "device_groups.default.ranks=[0]", f"output_dir={tmp_path / 'sft' / 'out'}"]
    rows = side_by_side(runs, tmp_path, timeout=480, env={"grpo-hf-without-sync": {"RLCORE_PLUGINS": str(WITHOUT_SYNC)}})
    curve = {name: [r["reward" if name.startswith("grpo") else "jsd" if name.startswith("gkd") else "loss"] for r in got]
             for name, got in rows.items()}
    print({k: [round(v, 3) for v in c] for k, c in curve.items()})
    change = {k: statistics.mean(c[-4:]) - statistics.mean(c[:4]) for k, c in curve.items()}
    for name in ("grpo-hf", "grpo-megatron", "grpo-hf-lora", "grpo-megatron-lora"):
        assert change[name] > 0.05, (name, change)
    # LoRA: each engine draws its own adapter A (peft's, megatron's from the seed), so their curves are two runs, not
    # one (on the CPU they settled at 1.0 and 0.5): each must rise, and check_weight_sync's second check (after step
    # 1, where B left zero) holds the merged adapter in vLLM to the train engine's
    assert change["grpo-hf-without-sync"] < 0.5 * change["grpo-hf"], change  # vLLM kept its first weights
    # megatron against hf while both still climb (steps 9-16): past that a bf16 run can settle on a policy whose
    # completions are all alike (equal rewards, no gradient: megatron held 0.333 from step 17 on an H200 while hf
    # went on to 1.0), which is GRPO's dynamics, not the engine's; on the CPU in float32 both give the same rewards
    rising = slice(8, 16)
    assert abs(statistics.mean(curve["grpo-megatron"][rising]) - statistics.mean(curve["grpo-hf"][rising])) \
        < 0.5 * change["grpo-hf"], curve
    for name in ("gkd-hf", "gkd-megatron", "sft"):
        assert statistics.mean(curve[name][-4:]) < 0.7 * statistics.mean(curve[name][:4]), (name, curve[name])
    assert abs(statistics.mean(curve["gkd-megatron"][-4:]) - statistics.mean(curve["gkd-hf"][-4:])) < 0.5 * -change["gkd-hf"]


@pytest.mark.parametrize("arch", TEXT_ONLY)
def test_text_only_qwen3_5_is_refused_by_vllm_in_one_line_and_trains_with_the_hf_rollout(arch, dataset, tmp_path):
    cmd = [sys.executable, "-m", "rlcore", "config", "validate", "--plugin", "grpo", "--config", str(EXAMPLE),
           f"model={model(arch)}", f"dataset={dataset}", *SCALE]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "which vLLM" in done.stderr and len(done.stderr.splitlines()) <= 3, done.stderr
    hf = [k for k in SCALE if not k.startswith("rollout.vllm_")] + ["rollout.engine=hf"]
    grpo(arch, dataset, tmp_path / "run", "learning_rate=1e-3", scale=hf)
