"""The megatron engine on GPUs (nvidia-h200-x2): tensor parallel 2 and pipeline parallel 2, each against tensor
parallel 1 on one GPU: the Hugging Face round trip, the logits (log-probs), vocab-parallel log-probs and top-k,
a train step; then GRPO from the command line with `train.engine=megatron`, colocated with vLLM and separate.

The two-rank cases run as two processes with one visible GPU each, as Ray starts a train group (RANK,
WORLD_SIZE, MASTER_ADDR/PORT set; CUDA_VISIBLE_DEVICES one GPU). Each writes what it computed to a file
that this test compares with a one-GPU engine in the pytest process.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

SHAPE = dict(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2, intermediate_size=512,
             vocab_size=1000, max_position_embeddings=1024, dtype="float32")

WORKER = textwrap.dedent(
    """
    import json, sys, torch
    from rlcore import Batch
    from rlcore.plugins.megatron import make_train_engine

    model, out, tp, pp = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    engine = make_train_engine(model=model, device="cuda", dtype="float32", learning_rate=1e-3,
                               tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, seed=0)
    assert engine.collective and engine.world_size == 2
    weights = {n: t.cpu() for bucket in engine.export_weights(16 << 20) for n, t in bucket}  # every rank takes part
    ids = torch.randint(0, 1000, (4, 24), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids); mask[1, 17:] = 0
    batch = Batch({"input_ids": ids * mask, "attention_mask": mask, "completion_mask": mask})
    logprobs = engine.forward_logprobs(batch)
    top = engine.forward_topk(batch, 8)
    loss_fn = lambda o, m: (-(o.logprobs() * m["completion_mask"]).sum() / mask.sum(), {})
    step = engine.train_step(batch, loss_fn, micro_batch_size=2)
    after = engine.forward_logprobs(batch)
    torch.save({"weights": weights, "logprobs": logprobs, "top_ids": top.ids, "top_values": top.logprobs,
                "step": step, "after": after}, f"{out}/rank{engine.rank}.pt")
    torch.distributed.destroy_process_group()
    """
)


def _needs_gpus(n: int) -> None:
    import torch

    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} GPUs (nvidia-h200-x2); this machine has {torch.cuda.device_count()}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir():
    from rlcore.testing import build_tiny_model

    return str(build_tiny_model(Path(tempfile.gettempdir()) / "rlcore-gpu-tests" / "megatron-qwen2-4l", **SHAPE))


@pytest.fixture(scope="module")
def single(model_dir):
    """Tensor and pipeline size 1 on one GPU: the reference for the two-rank runs."""
    import torch

    from rlcore import Batch
    from rlcore.plugins.megatron import make_train_engine

    engine = make_train_engine(model=model_dir, device="cuda", dtype="float32", learning_rate=1e-3, seed=0)
    ids = torch.randint(0, 1000, (4, 24), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 17:] = 0
    batch = Batch({"input_ids": ids * mask, "attention_mask": mask, "completion_mask": mask})
    top = engine.forward_topk(batch, 8)
    result = {"weights": {n: t.cpu() for b in engine.export_weights() for n, t in b},
              "logprobs": engine.forward_logprobs(batch), "top_ids": top.ids, "top_values": top.logprobs}
    step = engine.train_step(batch, lambda o, m: (-(o.logprobs() * m["completion_mask"]).sum() / mask.sum(), {}), 2)
    result.update(step=step, after=engine.forward_logprobs(batch))
    return result


def _two_ranks(model_dir: str, tmp_path: Path, tp: int, pp: int) -> list[dict]:
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    port, procs = _free_port(), []
    for rank in range(2):
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpus[rank], RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, "-c", WORKER, model_dir, str(tmp_path), str(tp), str(pp)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for rank, proc in enumerate(procs):
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"rank {rank} failed:\n{out[-6000:]}"
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tensor2", "pipeline2"])
def test_two_ranks_equal_one_gpu(model_dir, single, tmp_path, tp, pp):
    import torch
    from transformers import AutoModelForCausalLM

    _needs_gpus(2)
    ranks = _two_ranks(model_dir, tmp_path, tp, pp)
    reference = dict(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).named_parameters())
    for result in ranks:  # the round trip: every rank exports the whole model, bitwise the checkpoint's
        assert result["weights"].keys() == reference.keys()
        for name, tensor in reference.items():
            assert torch.equal(result["weights"][name], tensor.detach()), name
        # vocab-parallel (tp 2) or staged (pp 2) log-probs and top-k: those of one GPU
        torch.testing.assert_close(result["logprobs"], single["logprobs"], atol=2e-4, rtol=0)
        torch.testing.assert_close(result["top_values"], single["top_values"], atol=2e-4, rtol=0)
        assert (result["top_ids"] == single["top_ids"]).float().mean() > 0.99  # near-ties may swap
        assert result["step"]["loss"] == pytest.approx(single["step"]["loss"], abs=1e-4)
        assert result["step"]["grad_norm"] == pytest.approx(single["step"]["grad_norm"], rel=1e-3)
        torch.testing.assert_close(result["after"], single["after"], atol=5e-4, rtol=0)  # the same update


def _bf16_batch(seed: int = 1):
    import torch

    from rlcore import Batch

    ids = torch.randint(0, 1000, (8, 48), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[3, 30:] = 0  # right padding, as the trainers build batches
    return Batch({"input_ids": ids * mask, "attention_mask": mask, "completion_mask": mask})


def _loss(outputs, micro):
    return -(outputs.logprobs() * micro["completion_mask"]).sum() / 400, {}


@pytest.mark.parametrize("distributed,master", [(True, True), (False, True), (False, False)],
                         ids=["distributed-optimizer", "float16-optimizer", "bf16-adamw-no-master-weights"])
def test_bf16_step_offload_reload_save_load(model_dir, tmp_path, distributed, master):
    """Train, offload everything (the engine's GPU memory falls to near zero), reload (weights and optimizer
    state bitwise), train on (the loss keeps falling), save and load (the next step is the same)."""
    import torch

    from rlcore.plugins.megatron import make_train_engine

    options = dict(model=model_dir, device="cuda", dtype="bfloat16", learning_rate=1e-3, max_steps=6,
                   lr_scheduler_type="cosine", use_distributed_optimizer=distributed, master_weights=master, seed=0)
    engine = make_train_engine(**options)
    batch = _bf16_batch()
    first = engine.train_step(batch, _loss, 4)
    weights = {n: t.clone() for n, t in engine.hf_tensors()}
    state = [t.clone() for t in engine._optimizer_tensors()]
    assert len(state) >= 3 * len(list(engine.module.parameters()))  # main params, both Adam moments (and steps)
    moments = [t for t in state if t.dim() > 0]
    assert {t.dtype for t in moments} == ({torch.float32} if master else {torch.bfloat16})  # what the option says
    torch.cuda.synchronize()
    held, owned = torch.cuda.memory_allocated(), engine.gpu_bytes()
    engine.offload()
    torch.cuda.synchronize()
    left = torch.cuda.memory_allocated()
    print(f"GPU memory allocated: {held / 2**20:.1f} MiB trained (the engine's tensors {owned / 2**20:.1f} MiB), "
          f"{left / 2**20:.2f} MiB offloaded")
    # the engine's own memory is gone (what is left is the process's: cuBLAS workspaces, CUDA RNG state)
    assert engine.gpu_bytes() == 0 and held - left >= 0.99 * owned, (held, owned, left)
    engine.offload()  # twice is once
    engine.reload()
    for name, tensor in engine.hf_tensors():
        assert torch.equal(tensor, weights[name]), name
    for before, after in zip(state, engine._optimizer_tensors(), strict=True):
        assert torch.equal(before, after)
    second = engine.train_step(batch, _loss, 4)
    assert second["loss"] < first["loss"] and second["grad_norm"] > 0
    engine.save(str(tmp_path / "ckpt"))
    expected = engine.train_step(batch, _loss, 4)
    resumed = make_train_engine(**options)
    resumed.load(str(tmp_path / "ckpt"))
    got = resumed.train_step(batch, _loss, 4)
    assert got["learning_rate"] == expected["learning_rate"] and got["loss"] == pytest.approx(expected["loss"], abs=1e-2)


def test_a_forward_only_teacher_offloads_and_reloads_bitwise(model_dir):
    import torch

    from rlcore.plugins.megatron import make_forward_engine

    teacher = make_forward_engine(model=model_dir, device="cuda", dtype="bfloat16", seed=0)
    batch = _bf16_batch(2)
    before = teacher.forward_topk(batch, None, on_device=True)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    teacher.offload()
    assert torch.cuda.memory_allocated() <= held - 0.9 * sum(p.numel() * 2 for p in teacher.module.parameters())
    teacher.reload()
    assert torch.equal(teacher.forward_topk(batch, None, on_device=True), before)


def test_bf16_log_probs_match_the_hf_engine(model_dir):
    """SDPA core attention (flash kernel) against transformers' model in bf16 on the same GPU."""
    from rlcore.plugins.hf import make_forward_engine as make_hf_forward
    from rlcore.plugins.megatron import make_forward_engine

    batch = _bf16_batch(3)
    mine = make_forward_engine(model=model_dir, device="cuda", dtype="bfloat16", seed=0).forward_logprobs(batch)
    theirs = make_hf_forward(model=model_dir, device="cuda", dtype="bfloat16", seed=0).forward_logprobs(batch)
    mask = batch["attention_mask"].bool()
    mask[:, 0] = False  # column 0 has no log-prob
    diff = (mine - theirs).abs()[mask]
    print(f"bf16 log-probs, megatron - hf: mean {diff.mean():.4f}, max {diff.max():.4f} (values ~{theirs[mask].mean():.2f})")
    assert diff.mean() < 0.05 and diff.max() < 0.5


@pytest.mark.parametrize("distributed,master,recompute", [(True, True, False), (False, False, False), (True, True, True)],
                         ids=["distributed-optimizer", "bf16-adamw-no-master-weights", "gradient-checkpointing"])
def test_lora_in_bf16_trains_the_adapters_and_exports_base_plus_scaled_b_a(model_dir, tmp_path, distributed, master,
                                                                          recompute):
    """LoRA at tensor size 1 in bf16: the optimizer holds the adapters alone, the loss falls, the base stays bitwise
    through training and export, the export is base + scale * B @ A (in fp32, rounded once to bf16) in Hugging Face
    names, peft loads the adapter onto the transformers model, and save -> load gives the same next step; with
    megatron's full recomputation too (the adapters' hooks run again in the recomputed forward)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rlcore.plugins.megatron import make_train_engine, mapping

    options = dict(model=model_dir, device="cuda", dtype="bfloat16", learning_rate=1e-2, max_steps=8, seed=0,
                   lora_rank=8, lora_alpha=16, use_distributed_optimizer=distributed, master_weights=master,
                   gradient_checkpointing=recompute)
    engine = make_train_engine(**options)

    def base_weights():
        return {n: t.clone() for n, t in engine.module.state_dict().items()
                if torch.is_tensor(t) and ".adapter." not in n and not n.endswith("_extra_state")}

    base = base_weights()
    adapters = [p for p in engine.module.parameters() if p.requires_grad]
    assert {p.dtype for p in adapters} == {torch.bfloat16} and len(adapters) == 2 * 4 * 4  # A, B; 4 linears, 4 layers
    held = [p for group in engine.optimizer.param_groups for p in group["params"]]
    assert sum(p.numel() for p in held) == sum(p.numel() for p in adapters)  # fp32 main params or the bf16 ones
    batch = _bf16_batch()
    losses = [engine.train_step(batch, _loss, 4)["loss"] for _ in range(4)]
    assert losses[-1] < losses[0], losses
    exported = {n: t.clone() for bucket in engine.export_weights() for n, t in bucket}
    assert all(torch.equal(t, base[n]) for n, t in base_weights().items())  # training and export left the base
    expected = dict(base)
    for name, adapter in engine.adapters.items():
        assert adapter.lora_B.abs().max() > 0, name
        delta = 2.0 * (adapter.lora_B.float() @ adapter.lora_A.float())  # alpha 16 / rank 8
        expected[f"{name}.weight"] = (base[f"{name}.weight"].float() + delta).to(torch.bfloat16)
    expected = dict(mapping.megatron_to_hf(expected, engine.spec))
    assert expected.keys() == exported.keys()
    for name, tensor in exported.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, expected[name]), name
    engine.export_adapter(str(tmp_path / "adapter"))
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                          str(tmp_path / "adapter")).merge_and_unload()
    for name, param in reference.named_parameters():  # the checkpoint's fp32 base: one bf16 rounding apart
        torch.testing.assert_close(param.detach().to(torch.bfloat16), exported[name].cpu(), atol=2e-2, rtol=2e-2)
    engine.save(str(tmp_path / "ckpt"))
    trained = {n: p.detach().clone() for n, p in engine.module.named_parameters() if p.requires_grad}
    next_step = engine.train_step(batch, _loss, 4)
    resumed = make_train_engine(**options)
    resumed.load(str(tmp_path / "ckpt"))
    assert all(torch.equal(p, trained[n]) for n, p in resumed.module.named_parameters() if p.requires_grad)
    got = resumed.train_step(batch, _loss, 4)
    assert got["learning_rate"] == next_step["learning_rate"]
    assert got["loss"] == pytest.approx(next_step["loss"], abs=1e-3)


@pytest.fixture(scope="module")
def untied_dir():
    from rlcore.testing import build_tiny_model

    return str(build_tiny_model(Path(tempfile.gettempdir()) / "rlcore-gpu-tests" / "megatron-qwen2-untied-4l",
                                arch="qwen2_untied", **SHAPE))


def test_lora_on_the_output_layer_on_cuda_equals_peft_and_merges_in_bf16(untied_dir, tmp_path):
    """lm_head among the LoRA targets on CUDA: in float32 (TF32 off) the chunked head (the adapter's term per chunk,
    TRL's kernel standing aside) and the module's forward (the hook) each give peft's log-probs with the exported
    adapter on transformers' model after two steps; in bf16 with megatron's distributed optimizer the output layer's
    B trains (its vocabulary padding stays zero) and the exported lm_head is base + scale * B @ A (fp32, rounded once)
    without the padding, bit for bit."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rlcore.plugins.hf.common import model_outputs
    from rlcore.plugins.megatron import make_train_engine

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    lora = dict(lora_rank=8, lora_alpha=16, lora_target_modules=["q_proj", "lm_head"], seed=0, learning_rate=1e-2)
    batch = _bf16_batch()
    ids, mask = batch["input_ids"].cuda(), batch["attention_mask"].cuda()
    for chunked in (True, False):
        engine = make_train_engine(model=untied_dir, device="cuda", dtype="float32", chunked_lm_head=chunked, **lora)
        for _ in range(2):
            engine.train_step(batch, _loss, 4)
        assert engine.adapters["output_layer"].lora_B.abs().max() > 0
        engine.export_adapter(str(tmp_path / f"adapter-{chunked}"))
        reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(untied_dir, dtype=torch.float32),
                                              str(tmp_path / f"adapter-{chunked}")).cuda().eval()
        with torch.no_grad():
            expected = model_outputs(reference, ids, mask, temperature=1.0).logprobs().cpu()
        torch.testing.assert_close(engine.forward_logprobs(batch), expected, atol=1e-4, rtol=0, msg=f"chunked={chunked}")
        del engine, reference
        torch.cuda.empty_cache()
    engine = make_train_engine(model=untied_dir, device="cuda", dtype="bfloat16", use_distributed_optimizer=True, **lora)
    base = engine.module.output_layer.weight.detach().clone()
    losses = [engine.train_step(batch, _loss, 4)["loss"] for _ in range(3)]
    assert losses[-1] < losses[0], losses
    head, vocab = engine.adapters["output_layer"], engine.spec.vocab_size
    assert head.lora_B[:vocab].abs().max() > 0 and not head.lora_B[vocab:].any()
    exported = {n: t for bucket in engine.export_weights() for n, t in bucket}
    merged = (base.float() + 2.0 * (head.lora_B.float() @ head.lora_A.float())).to(torch.bfloat16)[:vocab]
    assert torch.equal(exported["lm_head.weight"], merged)


# -- GRPO from the command line ---------------------------------------------------------------------------

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "ray" / "grpo"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "math.jsonl"
    rows = [{"prompt": f"What is {a} + {b}?", "solution": str(a + b)} for a in range(1, 9) for b in range(1, 9)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.mark.parametrize("example,scale,tp", [
    ("colocate.yaml", ["train.gpus=2", "rollout.gpus=2", "rollout.vllm_tensor_parallel_size=2"], 2),
    ("separate.yaml", ["train.gpus=1", "rollout.gpus=1"], 1),
], ids=["colocate-tp2", "separate"])
def test_grpo_with_the_megatron_engine_from_the_cli(model_dir, dataset, tmp_path, example, scale, tp):
    _needs_gpus(2)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "rlcore", "run", "--plugin", "grpo", "--use-ray", "--config", str(EXAMPLES / example),
           f"model={model_dir}", f"dataset={dataset}", f"output_dir={out}", "max_steps=4", "learning_rate=5e-3",
           "reward_funcs=[toy,format]", "num_generations=4", "per_device_train_batch_size=8",
           "max_completion_length=32", "train.engine=megatron", f"train.tensor_model_parallel_size={tp}",
           "train.dtype=bfloat16", "rollout.dtype=bfloat16", "rollout.vllm_gpu_memory_utilization=0.25",
           "rollout.vllm_enforce_eager=true", "rollout.vllm_max_model_len=512", "check_weight_sync=true", *scale]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "RLCORE_DEBUG": "1"})
    assert done.returncode == 0, f"rlcore run exited {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    assert "engine megatron" in done.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["grad_norm"] > 0 for r in rows)
