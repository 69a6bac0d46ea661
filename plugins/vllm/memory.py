"""The vllm engine's memory terms (`EngineSpec.memory`).

vLLM takes `vllm_gpu_memory_utilization` of the GPU's total memory on each of its GPUs, whatever the batch: its
weights (split over `vllm_tensor_parallel_size`), and the rest for the KV cache, activations and CUDA graphs. Asleep
(a colocated role working, `sleep_level` 1 or 2) it frees both on the GPU (level 1 keeps the weights in CPU memory,
level 2 drops them); `sleep_level: 0` keeps its whole share. A weight sync wakes its weights only.
"""

from __future__ import annotations

from rlcore.memory import CUDA_CONTEXT, EngineMemory, Fix, MemoryQuery, dtype_bytes


def max_num_seqs(options: dict, gpu_bytes: int) -> int:
    """The sequences vLLM runs at once: `vllm_engine_kwargs.max_num_seqs`, else its default for the LLM class (1024
    on a GPU of 70 GiB or more, as an H100 or H200; 256 below; an 80 GB A100 gets 256 from vLLM, so the larger
    figure here only keeps a higher floor under the shares proposed)."""
    given = (options.get("vllm_engine_kwargs") or {}).get("max_num_seqs")
    return int(given) if given else (1024 if gpu_bytes >= 70 * (1 << 30) else 256)


def vllm_memory(q: MemoryQuery) -> EngineMemory:
    o, s = q.options, q.model
    tp = int(o.get("vllm_tensor_parallel_size", 1) or 1)
    share = float(o.get("vllm_gpu_memory_utilization", 0.9))
    weights = s.params * dtype_bytes(o.get("dtype")) // tp
    reserved = int(share * q.gpu_bytes)
    active = {"vllm weights": weights, "vllm kv cache + activations": max(reserved - weights, 0)}
    asleep = q.colocated and q.sleep_level > 0
    resident = {"vllm (asleep)": CUDA_CONTEXT} if asleep else dict(active)
    sync = {"vllm weights": weights, "vllm (asleep)": CUDA_CONTEXT} if asleep else dict(active)
    # the lowest share that still holds the weights and a KV cache of the longest sequences in flight
    # (`sequences` per GPU: the engine holds its tp GPUs' sequences, its KV cache split over them), at most
    # vLLM's max_num_seqs of them running at once
    running = min(max(q.use.sequences, 1), max_num_seqs(o, q.gpu_bytes))
    kv = running * q.use.seq_len * s.kv_bytes_per_token(dtype_bytes(o.get("dtype")))
    floor = (weights + kv + CUDA_CONTEXT) / q.gpu_bytes
    fixes, step = [], round(share - 0.05, 2)
    while step >= max(floor, 0.05):  # each lower share, highest first: the first that fits keeps the most KV cache
        fixes.append(Fix({"vllm_gpu_memory_utilization": step}, 2, "a smaller share of the GPU for vLLM"))
        step = round(step - 0.05, 2)
    return EngineMemory(active, resident, sync, tuple(fixes))
