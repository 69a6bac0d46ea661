"""The megatron engine's CPU stand-ins (`cpu_shim`) and its vocabulary-parallel log-probs: two real gloo
processes, each holding half the vocabulary, give what one process with the whole vocabulary gives,
values and gradients."""

from __future__ import annotations

import math
import os

import pytest
import torch

from rlcore.plugins.megatron import cpu_shim
from rlcore.plugins.megatron.adamw import TorchAdamW
from rlcore.plugins.megatron.vocab_parallel import VocabParallelOutputs

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the shim is for machines without CUDA")


def test_current_device_answers_the_cpu_only_inside_the_block():
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.current_device()
    with cpu_shim.cpu_current_device():
        assert torch.cuda.current_device() == torch.device("cpu")
        assert torch.zeros(1, device=torch.cuda.current_device()).device.type == "cpu"
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.current_device()


def test_cpu_rng_tracker_forks_without_cuda():
    pytest.importorskip("megatron.core")
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    cpu_shim.use_cpu_rng_tracker()
    torch.manual_seed(3)
    with get_cuda_rng_tracker().fork():
        inside = torch.rand(2)
    torch.manual_seed(3)
    assert torch.equal(inside, torch.rand(2))  # dropout inside a fork draws from the CPU generator


def test_forward_backward_local_is_megatrons_no_pipelining_contract():
    """Per micro-batch: forward, the loss function's (loss, metrics), loss / num_microbatches backward."""
    weight = torch.nn.Parameter(torch.tensor(2.0))

    def step(data, model):
        x = next(data)
        return model * x, lambda out: (out * 3, {"x": float(x)})

    stored = cpu_shim.forward_backward_local(forward_step_func=step, data_iterator=iter([torch.tensor(1.0), torch.tensor(5.0)]),
                                             model=[weight], num_microbatches=2, seq_length=1, micro_batch_size=1)
    assert stored == [{"x": 1.0}, {"x": 5.0}]
    assert weight.grad.item() == pytest.approx((3 * 1 + 3 * 5) / 2)
    seen = cpu_shim.forward_backward_local(forward_step_func=step, data_iterator=iter([torch.tensor(1.0)]),
                                           model=[weight], num_microbatches=1, forward_only=True)
    assert seen == [{"x": 1.0}] and weight.grad.item() == pytest.approx(9.0)  # forward_only: no backward


def test_torch_adamw_clips_steps_and_restores():
    p = torch.nn.Parameter(torch.zeros(4))
    opt = TorchAdamW([p], lr=0.1, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, clip_grad=1.0)
    p.grad = torch.full((4,), 3.0)
    ok, norm, zeros = opt.step()
    assert ok and norm == pytest.approx(6.0) and zeros is None
    assert torch.allclose(p.detach(), torch.full((4,), -0.1), atol=1e-6)  # Adam's first step: lr * sign
    state = opt.state_dict()
    other = TorchAdamW([torch.nn.Parameter(torch.zeros(4))], lr=0.1, weight_decay=0.0, betas=(0.9, 0.999),
                       eps=1e-8, clip_grad=0.0)
    other.load_state_dict(state)
    assert other.optimizer.state_dict()["state"][0]["exp_avg"].equal(state["state"][0]["exp_avg"])
    assert opt.param_groups[0]["lr"] == 0.1


def test_torch_adamw_steps_on_megatron_ddp_main_grad():
    """Under megatron's DDP the reduced gradient is in `main_grad` (a bf16 buffer without master weights), not
    `.grad`: the step takes it from there, clipped like any other."""
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    p.main_grad = torch.full((4,), 3.0, dtype=torch.bfloat16)
    opt = TorchAdamW([p], lr=0.1, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, clip_grad=1.0)
    ok, norm, _ = opt.step()
    assert ok and norm == pytest.approx(6.0)
    assert torch.allclose(p.detach().float(), torch.full((4,), -0.1), atol=1e-3)
    assert opt.optimizer.state[p]["exp_avg"].dtype == torch.bfloat16  # bf16 moments: no fp32 copy anywhere
    assert opt.scale_loss(torch.tensor(2.0)) == 2.0


# -- vocab-parallel log-probs over two gloo ranks -------------------------------------------------------------

B, T, V, PADDED, K = 3, 6, 37, 40, 4


def _inputs():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, T, PADDED, generator=g) * 3
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 4:] = 0
    at = torch.randint(0, V, (B, T, K), generator=g)
    target = torch.log_softmax(torch.randn(B, T, V, generator=g), dim=-1)
    return logits, ids, mask, at, target


def _results(outputs, logits):
    _, _, _, at, target = _inputs()
    loss = outputs.logprobs().sum() + outputs.logprobs_at(at).sum() + outputs.kl_to(target).sum()
    loss = loss + (outputs.full_logprobs() * target.exp()).sum()  # through the gather
    loss.backward()
    top = outputs.topk(K)
    return {"logprobs": outputs.logprobs().detach(), "at": outputs.logprobs_at(at).detach(),
            "kl": outputs.kl_to(target).detach(), "full": outputs.full_logprobs().detach(),
            "top_ids": top.ids, "top_values": top.logprobs.detach(), "grad": logits.grad}


def _rank(rank: int, init: str, queue) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    logits, ids, mask, _, _ = _inputs()
    shard = logits[..., rank * PADDED // 2:(rank + 1) * PADDED // 2].clone().requires_grad_(True)
    results = _results(VocabParallelOutputs(shard, ids, mask, V, dist.group.WORLD, temperature=0.8), shard)
    queue.put((rank, {key: value.tolist() for key, value in results.items()}))
    dist.barrier()
    dist.destroy_process_group()
    queue.close()
    queue.join_thread()  # the result is in the pipe; then leave without the interpreter's teardown, where
    os._exit(0)  # gloo's threads have aborted a child ("terminate called without an active exception")


def test_two_vocab_shards_give_what_the_whole_vocabulary_gives(tmp_path):
    import torch.multiprocessing as mp

    logits, ids, mask, _, _ = _inputs()
    whole = logits.clone().requires_grad_(True)
    expected = _results(VocabParallelOutputs(whole, ids, mask, V, None, temperature=0.8), whole)
    reference = torch.log_softmax(logits[:, :-1, :V] / 0.8, dim=-1)  # plain single-process reference
    picked = reference.gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert torch.allclose(expected["logprobs"][:, 1:][mask[:, 1:].bool()], picked[mask[:, 1:].bool()], atol=1e-5)
    assert not expected["grad"][..., V:].any()  # the padded vocabulary gets no gradient

    ctx = mp.get_context("spawn")  # fork after torch's thread pools started can hang the child
    queue = ctx.Queue()
    init = f"file://{tmp_path / 'store'}"
    procs = [ctx.Process(target=_rank, args=(r, init, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = {rank: {k: torch.tensor(v) for k, v in results.items()}
               for rank, results in (queue.get(timeout=120) for _ in procs)}
    finally:  # every child is reaped, whatever happened, so none is left to later tests as a zombie
        for p in procs:
            p.join(timeout=60)
            if p.exitcode is None:
                p.kill()
                p.join()
    assert [p.exitcode for p in procs] == [0, 0]
    for rank in range(2):
        for key in ("logprobs", "at", "kl", "full", "top_values"):
            torch.testing.assert_close(got[rank][key], expected[key], atol=1e-5, rtol=1e-5, msg=key)
        assert torch.equal(got[rank]["top_ids"], expected["top_ids"])
        half = expected["grad"][..., rank * PADDED // 2:(rank + 1) * PADDED // 2]
        torch.testing.assert_close(got[rank]["grad"], half, atol=1e-5, rtol=1e-5)
    assert math.isfinite(float(expected["kl"].sum())) and float(expected["kl"].sum()) > 0
