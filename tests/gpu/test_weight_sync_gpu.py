"""Weight sync on GPUs: CUDA IPC between two Ray actors sharing one GPU, and an NCCL broadcast group
between two GPUs (the CPU paths are tested in tests/core/test_weight_sync.py)."""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from pathlib import Path

import pytest
import torch

from rlcore.runtime.rendezvous import find_free_port
from rlcore.runtime.weight_sync import BroadcastGroup, iter_buckets

TIMEOUT_S = 120
MiB = 1 << 20


def _weights(version: int, device: str) -> list[tuple[str, torch.Tensor]]:
    """Mixed dtypes; the embedding and up_proj (512 KB each) fill one MiB bucket, norm and step a second."""
    g = torch.Generator().manual_seed(version)
    weights = [
        ("model.embed_tokens.weight", torch.randn(1024, 256, generator=g).to(torch.bfloat16)),
        ("model.layers.0.mlp.up_proj.weight", torch.randn(512, 256, generator=g)),
        ("model.norm.weight", torch.randn(256, generator=g).to(torch.bfloat16)),
        ("step", torch.tensor(version)),
    ]
    return [(name, t.to(device)) for name, t in weights]


def test_cuda_ipc_between_two_ray_actors_sharing_one_gpu():
    ray = pytest.importorskip("ray", reason="Ray is not installed on this machine")
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote(num_gpus=0.5, num_cpus=1)
    class Sender:
        def __init__(self):
            from rlcore.runtime.weight_sync import CudaIpcSender

            self.weights = _weights(0, "cuda")
            self.sender = CudaIpcSender()

        def pack(self, bucket_bytes):
            return [self.sender.pack(bucket) for bucket in iter_buckets(self.weights, bucket_bytes)]

        def close(self):
            self.sender.close()

        def gpu_uuid(self):
            return str(torch.cuda.get_device_properties(0).uuid)

    @ray.remote(num_gpus=0.5, num_cpus=1)
    class Receiver:
        def receive(self, payloads):
            from rlcore.runtime.weight_sync import IpcReceiver

            receiver = IpcReceiver()
            out = [(name, t.cpu()) for payload in payloads for name, t in receiver.receive(payload)]
            torch.cuda.synchronize()
            return out

        def gpu_uuid(self):
            return str(torch.cuda.get_device_properties(0).uuid)

    if ray.is_initialized():
        ray.shutdown()
    # The actors call this module's _weights: let Ray's workers import it.
    path = os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
    ray.init(num_cpus=4, num_gpus=1, include_dashboard=False, _node_ip_address="127.0.0.1", runtime_env={"env_vars": {"PYTHONPATH": path}})
    try:
        pg = placement_group([{"GPU": 1, "CPU": 2}])
        ray.get(pg.ready(), timeout=TIMEOUT_S)
        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)
        sender = Sender.options(scheduling_strategy=strategy).remote()
        receiver = Receiver.options(scheduling_strategy=strategy).remote()
        assert ray.get(sender.gpu_uuid.remote(), timeout=TIMEOUT_S) == ray.get(receiver.gpu_uuid.remote(), timeout=TIMEOUT_S)

        payloads = ray.get(sender.pack.remote(MiB), timeout=TIMEOUT_S)
        assert len(payloads) == 2
        got = ray.get(receiver.receive.remote(payloads), timeout=TIMEOUT_S)
        ray.get(sender.close.remote(), timeout=TIMEOUT_S)
        want = _weights(0, "cpu")
        assert [name for name, _ in got] == [name for name, _ in want]
        for (name, g), (_, w) in zip(got, want):
            assert g.dtype == w.dtype and torch.equal(g, w), name
        remove_placement_group(pg)
    finally:
        ray.shutdown()


def _nccl_member(rank: int, port: int, results) -> None:
    try:
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
        group = BroadcastGroup("127.0.0.1", port, rank, 2, backend="nccl", device=device, timeout_s=TIMEOUT_S)
        big = [("big", torch.full((256 * MiB,), 0.5, dtype=torch.bfloat16, device=device))]  # 512 MB
        if rank == 0:
            for version in range(2):
                group.send(iter_buckets(_weights(version, device), MiB))
            group.send([big])  # warm-up of the 512 MB path
            stats = group.send([big])
            results.put(("ok", rank, stats))
            return
        for version in range(2):
            got = [(name, t.cpu()) for bucket in group.receive() for name, t in bucket]
            want = _weights(version, "cpu")
            assert [name for name, _ in got] == [name for name, _ in want]
            for (name, g), (_, w) in zip(got, want):
                assert g.dtype == w.dtype and torch.equal(g, w), f"sync {version}: {name}"
        for _ in range(2):
            received = [t for bucket in group.receive() for _, t in bucket]
            assert len(received) == 1 and received[0].shape == (256 * MiB,) and bool((received[0] == 0.5).all())
        results.put(("ok", rank, None))
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))


def test_nccl_broadcast_between_two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs for an NCCL broadcast; this machine has {torch.cuda.device_count()}")
    port = find_free_port()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_nccl_member, args=(rank, port, results), daemon=True) for rank in (0, 1)]
    for p in procs:
        p.start()
    try:
        outcomes = [results.get(timeout=TIMEOUT_S) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=TIMEOUT_S)
            if p.is_alive():
                p.kill()
    errors = [o for o in outcomes if o[0] != "ok"]
    assert not errors, errors
    stats = next(o[2] for o in outcomes if o[1] == 0)
    seconds = stats["weight_sync/seconds"]
    print(f"NCCL broadcast of one 512 MB bucket: {seconds * 1e3:.1f} ms ({stats['weight_sync/bytes'] / seconds / 1e9:.0f} GB/s)")
    assert stats["weight_sync/bytes"] == 512 * MiB
