"""The hf engines on CUDA: bf16, offload/reload of params and optimizer, sleep/wake, DDP over NCCL (every GPU
visible, as torchrun runs it, and one GPU per process, as Ray runs it).

Runs only on the GPU machine: `pytest -m gpu tests/gpu/test_hf_cuda.py`.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

from rlcore import Batch, SamplingParams
from rlcore.testing import build_tiny_model
from rlcore.plugins.hf.rollout import HFRolloutEngine
from rlcore.plugins.hf.train import HFTrainEngine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

PROMPTS = [[265, 84, 82, 260, 198], [5, 6, 7, 8, 9, 10, 11, 12, 13]]
LINEAR_ADAM = dict(learning_rate=1e3, adam_epsilon=1e3, max_grad_norm=0)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.getbasetemp() / "tiny-qwen2")


def make_batch(rows: int = 4, width: int = 12) -> Batch:
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 256, (rows, width), generator=g)
    return Batch(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), weight=torch.full((rows,), 1 / rows))


def nll(outputs, micro):
    logprobs = outputs.logprobs()
    return -(logprobs.sum(dim=1) * micro["weight"].to(logprobs.device)).sum(), {}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_train_step_offload_reload(tiny_model, dtype):
    engine = HFTrainEngine(tiny_model, device="cuda", dtype=dtype, learning_rate=1e-2)
    assert engine.state()["dtype"] == dtype and engine.state()["device"].startswith("cuda")
    batch = make_batch()
    first = engine.train_step(batch, nll, micro_batch_size=2)["loss"]
    engine.offload()
    assert all(p.device.type == "cpu" for p in engine.model.parameters())
    assert all(t.device.type == "cpu" for s in engine.optimizer.state.values() for k, t in s.items() if k != "step")
    engine.reload()
    assert all(p.device.type == "cuda" for p in engine.model.parameters())
    assert all(t.device.type == "cuda" for s in engine.optimizer.state.values() for k, t in s.items() if k != "step")
    second = engine.train_step(batch, nll, micro_batch_size=2)["loss"]
    assert second < first
    assert all(t.device.type == "cuda" for bucket in engine.export_weights() for _, t in bucket)
    assert engine.forward_logprobs(batch).device.type == "cpu"


def test_forward_topk_on_device_equals_the_cpu_answer(tiny_model):
    """A colocated teacher's answer stays on the GPU (`on_device`), with the values that travel on CPU."""
    engine = HFTrainEngine(tiny_model, device="cuda", forward_only=True)
    batch = make_batch()
    full, here = engine.forward_topk(batch, None), engine.forward_topk(batch, None, on_device=True)
    assert full.device.type == "cpu" and here.device.type == "cuda"
    torch.testing.assert_close(here.cpu(), full)
    top, top_here = engine.forward_topk(batch, 4), engine.forward_topk(batch, 4, on_device=True)
    assert top_here.ids.device.type == "cuda" and torch.equal(top_here.ids.cpu(), top.ids)


def test_rollout_matches_train_and_sleeps(tiny_model):
    trainer = HFTrainEngine(tiny_model, device="cuda")
    rollout = HFRolloutEngine(tiny_model, device="cuda")
    params = SamplingParams(n=2, max_tokens=8, temperature=0.7, seed=0)
    before = rollout.generate(PROMPTS, params)
    for i, g in enumerate(before):
        seq = torch.tensor([PROMPTS[g.prompt_index] + g.token_ids])
        want = trainer.forward_logprobs(Batch(input_ids=seq, attention_mask=torch.ones_like(seq)), 0.7)
        torch.testing.assert_close(torch.tensor(g.logprobs), want[0, len(PROMPTS[g.prompt_index]):], atol=1e-3, rtol=1e-3)

    used = torch.cuda.memory_allocated()
    rollout.sleep(level=1)
    assert all(p.device.type == "cpu" for p in rollout.model.parameters())
    assert torch.cuda.memory_allocated() < used
    rollout.wake_up()
    assert [g.token_ids for g in rollout.generate(PROMPTS, params)] == [g.token_ids for g in before]

    rollout.sleep(level=2)
    rollout.wake_up()
    for bucket in trainer.export_weights():
        rollout.update_weights(bucket)
    assert [g.token_ids for g in rollout.generate(PROMPTS, params)] == [g.token_ids for g in before]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_worker(rank: int, model: str, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    engine = HFTrainEngine(model, device="cuda", **LINEAR_ADAM)
    shard = make_batch(rows=4).split(2)[rank]
    shard["weight"] = torch.full((len(shard),), 1.0 / len(shard))
    engine.train_step(shard, nll, micro_batch_size=1)
    torch.save({n: p.detach().cpu() for n, p in engine.model.named_parameters()}, f"{out}/rank{rank}.pt")
    torch.distributed.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_ddp_over_nccl(tiny_model, tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_ddp_worker, args=(str(tiny_model), _free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    single = HFTrainEngine(tiny_model, device="cuda", **LINEAR_ADAM)
    before = {n: p.detach().cpu().clone() for n, p in single.model.named_parameters()}
    single.train_step(make_batch(rows=4), nll, micro_batch_size=4)
    for name, value in single.model.named_parameters():
        assert torch.equal(ranks[0][name], ranks[1][name]), name
        torch.testing.assert_close(ranks[0][name] - before[name], value.detach().cpu() - before[name], atol=1e-5, rtol=1e-3)


# One process of a train group as Ray starts it: CUDA_VISIBLE_DEVICES holds its own GPU only, while RANK and
# LOCAL_RANK count the group. device="cuda" must become cuda:0 in each, or set_device raises.
RAY_LIKE_WORKER = textwrap.dedent(
    """
    import sys, torch
    from rlcore import Batch
    from rlcore.plugins.hf.train import HFTrainEngine

    model, out = sys.argv[1], sys.argv[2]
    assert torch.cuda.device_count() == 1
    engine = HFTrainEngine(model, device="cuda", learning_rate=1e3, adam_epsilon=1e3, max_grad_norm=0)
    assert engine.device == torch.device("cuda", 0) and torch.cuda.current_device() == 0
    assert (engine.rank, engine.world_size) == (int(sys.argv[3]), 2) and engine.ddp is not None
    ids = torch.randint(0, 256, (4, 12), generator=torch.Generator().manual_seed(0))
    shard = Batch(input_ids=ids, attention_mask=torch.ones_like(ids)).split(2)[engine.rank]
    engine.train_step(shard, lambda outputs, micro: (-outputs.logprobs().sum() / 4, {}), micro_batch_size=1)
    torch.save({n: p.detach().cpu() for n, p in engine.model.named_parameters()}, f"{out}/rank{engine.rank}.pt")
    torch.distributed.destroy_process_group()
    """
)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_ddp_over_nccl_with_one_visible_gpu_per_process_as_on_ray(tiny_model, tmp_path):
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpus[rank], RANK=str(rank), WORLD_SIZE="2",
                   LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(
            [sys.executable, "-c", RAY_LIKE_WORKER, str(tiny_model), str(tmp_path), str(rank)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        ))
    for rank, proc in enumerate(procs):
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"rank {rank} failed:\n{out[-4000:]}"
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    initial = HFTrainEngine(tiny_model).model.state_dict()
    moved = 0
    for name, value in ranks[0].items():
        assert torch.equal(value, ranks[1][name]), name  # one DDP step: both ranks hold the same weights
        moved += not torch.equal(value, initial[name])
    assert moved > 0
