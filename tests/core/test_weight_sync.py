"""Weight sync on the CPU: bucketing, flat buffers, a real gloo broadcast between two processes, and the check
after a sync between real hf engines."""

from __future__ import annotations

import json
import multiprocessing as mp
import traceback

import pytest
import torch

from rlcore import ConfigError, RlcoreError
from rlcore.runtime.rendezvous import find_free_port
from rlcore.runtime.weight_sync import (
    ALIGN,
    BroadcastGroup,
    FlatBucket,
    flatten_bucket,
    iter_buckets,
    unflatten_bucket,
)

TIMEOUT_S = 60


def _weights(version: int) -> list[tuple[str, torch.Tensor]]:
    """A small model's worth of mixed-dtype tensors, different for each version."""
    g = torch.Generator().manual_seed(version)
    return [
        ("model.embed_tokens.weight", torch.randn(64, 16, generator=g).to(torch.bfloat16)),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(16, 16, generator=g)),
        ("model.layers.0.self_attn.q_proj.bias", torch.randn(16, generator=g)),
        ("model.norm.weight", torch.randn(16, generator=g).to(torch.bfloat16)),
        ("model.rotary.step", torch.tensor(version, dtype=torch.int64)),
        ("lm_head.weight", torch.randn(64, 16, generator=g).to(torch.float16)),
    ]


def test_iter_buckets_respects_the_limit_and_keeps_order():
    tensors = [(f"w{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate([10, 10, 30, 5, 5, 5])]
    buckets = list(iter_buckets(tensors, bucket_bytes=80))  # 20 float32 per bucket
    assert [[name for name, _ in b] for b in buckets] == [["w0", "w1"], ["w2"], ["w3", "w4", "w5"]]
    assert [name for b in buckets for name, _ in b] == [name for name, _ in tensors]


def test_iter_buckets_rejects_a_non_positive_size():
    with pytest.raises(ConfigError, match="bucket_bytes must be positive, got 0"):
        list(iter_buckets([("w", torch.zeros(1))], bucket_bytes=0))


def test_flatten_makes_one_aligned_buffer_and_round_trips():
    tensors = _weights(1)
    bucket = flatten_bucket(tensors)
    assert bucket.buffer.dtype == torch.uint8 and bucket.buffer.dim() == 1 and bucket.buffer.is_contiguous()
    assert [m.offset % ALIGN for m in bucket.metas] == [0] * len(tensors)
    assert bucket.size == sum(-(-t.numel() * t.element_size() // ALIGN) * ALIGN for _, t in tensors)
    out = unflatten_bucket(bucket)
    assert [name for name, _ in out] == [name for name, _ in tensors]
    got = dict(out)
    for name, tensor in tensors:
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape
        assert torch.equal(got[name], tensor), name
        assert got[name].untyped_storage().data_ptr() == bucket.buffer.untyped_storage().data_ptr()  # views, not copies


def test_a_slot_is_reused_while_large_enough_and_replaced_by_a_larger_one():
    from rlcore.runtime.weight_sync import SlotPacker

    packer = SlotPacker()
    slot = packer.slot(0, 1 << 16)
    assert slot.dtype == torch.uint8 and slot.numel() == 1 << 16 and packer.versions[0] == 1
    assert packer.slot(2, 100) is slot  # bucket 2 shares slot 0, which holds it
    assert packer.slot(1, 100) is not slot  # slot 1 is another buffer
    grown = packer.slot(0, (1 << 16) + 1)
    assert grown is not slot and grown.numel() == (1 << 16) + 1 and packer.versions[0] == 2


def test_flatten_copies_strided_views():
    base = torch.randn(8, 6)
    bucket = flatten_bucket([("t", base.t()), ("narrow", base[:, 2:4])])
    got = dict(unflatten_bucket(bucket))
    assert torch.equal(got["t"], base.t()) and torch.equal(got["narrow"], base[:, 2:4])


def test_metadata_json_round_trip_allocates_a_matching_buffer():
    bucket = flatten_bucket(_weights(2))
    text = bucket.to_json(last=True)
    assert json.loads(text)["tensors"][3] == ["model.norm.weight", [16], "bfloat16", 64 * 16 * 2 + 16 * 16 * 4 + ALIGN]  # the 64-byte bias takes ALIGN
    assert json.loads(text)["last"] is True
    empty = FlatBucket.from_json(text)
    assert empty.metas == bucket.metas and empty.size == bucket.size
    assert empty.buffer.dtype == torch.uint8 and empty.buffer.numel() == bucket.size
    assert FlatBucket.from_json(text, device=None).buffer is None


def _receiver(port: int, syncs: int, results) -> None:
    """Rank 1: receive `syncs` syncs, compare each with what rank 0 sends, then time out on one more."""
    try:
        group = BroadcastGroup("127.0.0.1", port, rank=1, world_size=2, backend="gloo", timeout_s=10)
        for version in range(syncs):
            got = [(name, t.clone()) for bucket in group.receive() for name, t in bucket]
            want = _weights(version)
            assert [name for name, _ in got] == [name for name, _ in want], [name for name, _ in got]
            for (name, g), (_, w) in zip(got, want):
                assert g.dtype == w.dtype and torch.equal(g, w), f"sync {version}: {name} differs"
        try:
            next(group.receive())
            results.put("no timeout")
        except RlcoreError as e:
            results.put(f"ok: {e}")
    except BaseException:
        results.put(traceback.format_exc())


def test_gloo_broadcast_between_two_processes():
    """Rank 0 (this process) sends three versions of the weights in several buckets, through the kept buffers;
    rank 1 checks them."""
    port = find_free_port()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(port, 3, results), daemon=True)
    proc.start()
    try:
        group = BroadcastGroup("127.0.0.1", port, rank=0, world_size=2, backend="gloo", timeout_s=TIMEOUT_S)
        # sync 1 is one bucket larger than any slot so far (the slot grows); sync 2 goes back to 3 buckets
        for version, bucket_bytes, buckets in [(0, 2048, 3), (1, 1 << 20, 1), (2, 2048, 3)]:
            stats = group.send(iter_buckets(_weights(version), bucket_bytes=bucket_bytes))
            assert stats["weight_sync/buckets"] == buckets
            assert stats["weight_sync/bytes"] == sum(t.numel() * t.element_size() for _, t in _weights(version))
        outcome = results.get(timeout=TIMEOUT_S)
        assert outcome.startswith("ok: weight sync: rank 1 waited 10s for bucket 0 of sync 3"), outcome
    finally:
        proc.join(timeout=TIMEOUT_S)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0


def test_broadcast_group_rejects_bad_arguments_before_connecting():
    with pytest.raises(ConfigError, match="backend must be 'nccl' or 'gloo', got 'mpi'"):
        BroadcastGroup("127.0.0.1", 1, rank=0, world_size=2, backend="mpi")
    with pytest.raises(ConfigError, match="rank 2 of world_size 2"):
        BroadcastGroup("127.0.0.1", 1, rank=2, world_size=2, backend="gloo")


def test_an_engine_without_a_broadcast_receiver_says_so():
    """The engine contract does not know the transports: an engine that cannot join a group refuses clearly."""
    from rlcore import RolloutEngine

    class ApiEngine(RolloutEngine):
        generate = prompt_topk_logprobs = update_weights = sleep = wake_up = lambda self, *a, **k: None

    engine = ApiEngine()
    assert engine.weight_receivers() == 1
    with pytest.raises(RlcoreError, match="ApiEngine cannot receive weights over a broadcast group; colocate"):
        engine.join_weight_group("127.0.0.1", 1, 1, 2, "gloo")
    with pytest.raises(RlcoreError, match="ApiEngine cannot receive weights"):
        engine.receive_weights()


def test_check_weight_sync_compares_the_shared_top_k_layout(tmp_path):
    from rlcore.testing import build_tiny_model
    from rlcore.plugins.hf.rollout import HFRolloutEngine
    from rlcore.plugins.hf.train import HFTrainEngine
    from rlcore.runtime.weight_sync import check_weight_sync

    model = build_tiny_model(tmp_path / "tiny")
    train, rollout = HFTrainEngine(model), HFRolloutEngine(model)
    sequence = [5, 6, 7, 8, 9, 10]
    assert check_weight_sync(train, rollout, sequence) < 1e-4
    with torch.no_grad():
        rollout.model.get_parameter("model.norm.weight").mul_(5.0)
    with pytest.raises(RlcoreError, match="weight sync check failed"):
        check_weight_sync(train, rollout, sequence)


def test_slot_packer_keeps_layouts_per_bucket_and_follows_a_grown_slot():
    from rlcore.runtime.weight_sync import SlotPacker

    packer = SlotPacker()
    small = [("a", torch.arange(4.0)), ("b", torch.arange(2, dtype=torch.int64))]
    large = [("c", torch.arange(1000.0))]
    first, text = packer.pack(0, small)
    slot0 = first.buffer
    again, _ = packer.pack(0, [(n, t + 1) for n, t in small])  # same layout: same buffer, new values
    assert again.buffer is slot0 and torch.equal(dict(unflatten_bucket(again))["a"], torch.arange(4.0) + 1)
    grown, _ = packer.pack(2, large)  # bucket 2 shares slot 0 and needs more room
    assert grown.buffer is not slot0 and packer.versions[0] == 2
    back, text_back = packer.pack(0, small)  # bucket 0's kept views pointed at the old buffer: made again
    assert back.buffer is grown.buffer and text_back == text
    assert torch.equal(dict(unflatten_bucket(back))["a"], torch.arange(4.0))
    assert torch.equal(dict(unflatten_bucket(back))["b"], torch.arange(2, dtype=torch.int64))


def test_view_cache_makes_views_once_and_forgets_a_replaced_buffer():
    from rlcore.runtime.weight_sync import ViewCache

    bucket = flatten_bucket(_weights(1))
    text = bucket.to_json()
    cache = ViewCache()
    first = cache.views(("s0", 0), bucket.buffer, text)
    again = cache.views(("s0", 0), bucket.buffer, text)
    assert all(a is b for (_, a), (_, b) in zip(first, again))  # the same view objects
    assert torch.equal(dict(first)["lm_head.weight"], dict(_weights(1))["lm_head.weight"])
    other = cache.views(("s1", 0), bucket.buffer, text)
    cache.forget("s0")
    assert cache.views(("s0", 0), bucket.buffer, text)[0][1] is not first[0][1]  # made again
    assert cache.views(("s1", 0), bucket.buffer, text)[0][1] is other[0][1]  # another slot's are kept
