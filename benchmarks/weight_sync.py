"""Weight sync on the GPU: rlcore's transports against the raw transfer of the same bytes, in one run.

For a Qwen2-0.5B-, 1.5B- and 7B-shaped model (random bf16 weights with Hugging Face names, vocabulary 151,936):
- `cuda_ipc` (one GPU, two processes): rlcore's `CudaIpcSender` / `IpcReceiver`, the trainer packing bucket
  i+1 while the receiver loads bucket i, against a raw IPC copy (one flat buffer of the same bytes, mapped
  once, copied in one call). Also the previous behaviour: fresh buffers and a fresh mapping every sync.
- `nccl` (two GPUs): rlcore's `BroadcastGroup` (pipelined, kept buffers) against one raw NCCL broadcast of
  a flat buffer of the same bytes over the same process group.
- `vllm_load` (one GPU, 0.5b and 1.5b): a vLLM engine of the shape loading a whole model's buckets through
  its own `load_weights` against rlcore's `ReplayLoader` replaying them.
- `session_colocate` (one GPU) and `session_separate` (two): the whole path, `RoleSession.sync_weights` on
  Ray between an hf train engine and a vLLM rollout engine, Ray calls and the engines' export and load
  included; its transport row above is the comparison. `--device cpu` runs these two with hf engines on
  fake GPUs (object store / gloo), a check of the harness.

The receiver's "load" copies each received tensor into its own copy of the model, by name, in one batched
copy: what a vLLM engine's replayed load does (rlcore.plugins.vllm.weight_replay); vLLM's own Python loaders add to
it on the first sync of a layout only. A sync is timed on the sender from its start to the receiver's
"loaded" message (as `RoleSession.sync_weights` waits for both); the median of `--syncs` after one warm-up.

    python benchmarks/weight_sync.py                       # every shape, every transport the GPUs allow
    python benchmarks/weight_sync.py --shapes 0.5b --syncs 10
    python benchmarks/weight_sync.py --transports session_colocate,session_separate --shapes 0.5b
The table prints milliseconds, GB/s and rlcore / raw; `--json PATH` (default
benchmarks/results/weight_sync-<date>-<gpus>gpu.json) keeps it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

SHAPES = {  # hidden, layers, heads, kv heads, intermediate, tied embeddings (Qwen2's published configs)
    "tiny": (256, 2, 4, 2, 512, True),  # the GPU tests' model, for a quick run (and the session rows on the CPU)
    "0.5b": (896, 24, 14, 2, 4864, True),
    "1.5b": (1536, 28, 12, 2, 8960, True),
    "7b": (3584, 28, 28, 4, 18944, False),
}
VOCAB = 151_936
BUCKET_BYTES = 512 << 20
TARGETS = {("cuda_ipc", "0.5b"): "<= 8 ms", ("nccl", "0.5b"): "<= 10 ms", ("nccl", "7b"): ">= 150 GB/s"}


def model_shapes(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """Hugging Face names and shapes of a Qwen2 model of this size."""
    hidden, layers, heads, kv_heads, inter, tied = SHAPES[shape]
    head_dim = hidden // heads
    out = [("model.embed_tokens.weight", (VOCAB, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}"
        out += [(f"{p}.self_attn.q_proj.weight", (hidden, hidden)), (f"{p}.self_attn.q_proj.bias", (hidden,)),
                (f"{p}.self_attn.k_proj.weight", (kv_heads * head_dim, hidden)), (f"{p}.self_attn.k_proj.bias", (kv_heads * head_dim,)),
                (f"{p}.self_attn.v_proj.weight", (kv_heads * head_dim, hidden)), (f"{p}.self_attn.v_proj.bias", (kv_heads * head_dim,)),
                (f"{p}.self_attn.o_proj.weight", (hidden, hidden)),
                (f"{p}.mlp.gate_proj.weight", (inter, hidden)), (f"{p}.mlp.up_proj.weight", (inter, hidden)),
                (f"{p}.mlp.down_proj.weight", (hidden, inter)),
                (f"{p}.input_layernorm.weight", (hidden,)), (f"{p}.post_attention_layernorm.weight", (hidden,))]
    out.append(("model.norm.weight", (hidden,)))
    if not tied:
        out.append(("lm_head.weight", (VOCAB, hidden)))
    return out


def make_weights(shape: str, device: str, fill: bool) -> list[tuple[str, torch.Tensor]]:
    tensors = []
    for name, dims in model_shapes(shape):
        t = torch.empty(dims, dtype=torch.bfloat16, device=device)
        if fill:
            t.normal_()
        tensors.append((name, t))
    return tensors


def loader(shape: str, device: str):
    """The receiver's model and a load that copies a bucket into it by name, in one batched copy."""
    own = dict(make_weights(shape, device, fill=False))

    def load(bucket):
        torch._foreach_copy_([own[name] for name, _ in bucket], [t for _, t in bucket])

    return own, load


def nbytes(weights) -> int:
    return sum(t.numel() * t.element_size() for _, t in weights)


# -------------------------------------------------------------------------------------------------
# CUDA IPC: this process sends, a spawned one on the same GPU receives
# -------------------------------------------------------------------------------------------------


def ipc_receiver(conn, shape: str) -> None:
    from rlcore.runtime.weight_sync import IpcReceiver

    torch.cuda.set_device(0)
    own, load = loader(shape, "cuda:0")
    flat = torch.empty(nbytes(list(own.items())), dtype=torch.uint8, device="cuda:0")
    receiver, raw = IpcReceiver(), None
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        kind, payload = msg
        start = time.perf_counter()
        if kind == "bucket":
            bucket = receiver.receive(payload)
        elif kind == "fresh":  # the previous behaviour: map every bucket anew, drop it after the load
            bucket = IpcReceiver().receive(payload)
        elif kind == "raw":
            if raw is None:
                rebuild, args = payload
                raw = rebuild(*args)
        elif kind == "check":  # the loaded model equals what was sent (a checksum per tensor)
            conn.send([float(own[name].float().sum()) for name in payload])
            continue
        mapped = time.perf_counter()
        if kind == "raw":
            flat.copy_(raw)
        else:
            load(bucket)
            del bucket
        loaded = time.perf_counter()
        torch.cuda.current_stream().synchronize()
        conn.send(("ok", {"map": mapped - start, "load": loaded - mapped, "sync": time.perf_counter() - loaded}))


VARIANTS = {  # label: (receiver message, sender kept from sync to sync, pack the next bucket during the load)
    "rlcore": ("bucket", True, True),
    "rlcore, no overlap": ("bucket", True, False),
    "fresh (before)": ("fresh", False, True),
}


def bench_ipc(shape: str, syncs: int) -> dict:
    from torch.multiprocessing.reductions import reduce_tensor

    from rlcore.runtime.weight_sync import CudaIpcSender, iter_buckets

    torch.cuda.set_device(0)
    weights = make_weights(shape, "cuda:0", fill=True)
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=ipc_receiver, args=(there, shape), daemon=True)
    proc.start()
    assert here.recv() == "ready"
    phases: dict[str, float] = {}

    def timed(key: str, fn, *args):
        start = time.perf_counter()
        out = fn(*args)
        phases[key] = phases.get(key, 0.0) + time.perf_counter() - start
        return out

    def ack() -> None:
        status, theirs = timed("sender wait", here.recv)
        assert status == "ok"
        for key, seconds in theirs.items():
            phases[f"receiver {key}"] = phases.get(f"receiver {key}", 0.0) + seconds

    def sync(sender: CudaIpcSender, kind: str, overlap: bool) -> float:
        start = time.perf_counter()
        sender.start()
        buckets = iter_buckets(weights, BUCKET_BYTES)
        here.send((kind, timed("sender pack", sender.pack, next(buckets))))
        for bucket in buckets:
            if not overlap:
                ack()
            payload = timed("sender pack", sender.pack, bucket)  # the other buffer, while the receiver loads
            if overlap:
                ack()
            here.send((kind, payload))
        ack()
        return time.perf_counter() - start

    out: dict = {"bytes": nbytes(weights), "variants": {}, "phases": {}}
    for label, (kind, kept, overlap) in VARIANTS.items():
        times, sender = [], CudaIpcSender()
        for i in range(syncs + 1):
            if i == 1:
                phases.clear()  # the warm-up's phases are not counted
            if not kept:
                sender.close()
                sender = CudaIpcSender()
            times.append(sync(sender, kind, overlap))
        out["variants"][label] = times[1:]
        out["phases"][label] = {k: v / syncs for k, v in phases.items()}
        if label == "rlcore":
            here.send(("check", [name for name, _ in weights]))
            sums = here.recv()
            want = [float(t.float().sum()) for _, t in weights]
            assert all(abs(a - b) <= 1e-3 * max(1.0, abs(b)) for a, b in zip(sums, want)), "the receiver's model differs"
        sender.close()

    flat = torch.empty(nbytes(weights), dtype=torch.uint8, device="cuda:0")
    handle = reduce_tensor(flat)
    raw = []
    for _ in range(syncs + 1):
        start = time.perf_counter()
        here.send(("raw", handle))
        assert here.recv()[0] == "ok"
        raw.append(time.perf_counter() - start)
    here.send(None)
    proc.join(timeout=60)
    return {**out, "rlcore_s": out["variants"]["rlcore"], "raw_s": raw[1:]}


# -------------------------------------------------------------------------------------------------
# vLLM's load: its own Python loaders against rlcore's replay of them, in one process
# -------------------------------------------------------------------------------------------------


def bench_vllm_load(shape: str, syncs: int) -> dict:
    """A vLLM engine of this shape (dummy weights) loads a whole model's buckets: plain `load_weights` against
    a ReplayLoader (traced on the warm-up), both from the same flat CUDA buckets."""
    import tempfile

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    from rlcore.testing import build_tiny_model
    from rlcore.plugins.vllm.weight_replay import ReplayLoader
    from rlcore.runtime.weight_sync import flatten_bucket, iter_buckets, unflatten_bucket

    hidden, layers, heads, kv_heads, inter, tied = SHAPES[shape]
    if not tied:
        raise SystemExit("vllm rows build tied-embedding shapes only (0.5b, 1.5b)")
    model_dir = build_tiny_model(Path(tempfile.mkdtemp()) / shape, hidden_size=hidden, num_layers=layers, num_heads=heads,
                                 num_kv_heads=kv_heads, intermediate_size=inter, vocab_size=VOCAB, dtype="bfloat16")
    llm = LLM(model=str(model_dir), gpu_memory_utilization=0.3, max_model_len=512, enforce_eager=True, dtype="bfloat16",
              load_format="dummy")
    model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    weights = make_weights(shape, "cuda:0", fill=True)
    buckets = [unflatten_bucket(flatten_bucket(b)) for b in iter_buckets(weights, BUCKET_BYTES)]
    replay = ReplayLoader(lambda w: model.load_weights(weights=w), [*model.parameters(), *model.buffers()])

    def timed(load) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for bucket in buckets:
            load(bucket)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    plain = [timed(lambda w: model.load_weights(weights=w)) for _ in range(syncs + 1)][1:]
    replayed = [timed(replay) for _ in range(syncs + 1)][1:]  # the first traces
    assert replay.why_not == {} and replay.replayed == syncs * len(buckets), replay.stats()
    return {"bytes": nbytes(weights), "rlcore_s": replayed, "raw_s": plain, "stats": replay.stats()}


# -------------------------------------------------------------------------------------------------
# NCCL: this process is rank 0 on GPU 0, a spawned one rank 1 on GPU 1
# -------------------------------------------------------------------------------------------------


def nccl_receiver(port: int, shape: str, syncs: int, queue) -> None:
    from rlcore.runtime.weight_sync import BroadcastGroup

    torch.cuda.set_device(1)
    own, load = loader(shape, "cuda:1")
    group = BroadcastGroup("127.0.0.1", port, 1, 2, backend="nccl", device="cuda:1", timeout_s=300)
    for _ in range(syncs + 1):
        queue.put(("stats", group.receive_into(load)))
    queue.put(("check", [float(t.float().sum()) for t in own.values()]))
    flat = torch.empty(sum(t.numel() * t.element_size() for t in own.values()), dtype=torch.uint8, device="cuda:1")
    for _ in range(syncs + 1):
        group._broadcast(flat).wait()
        torch.cuda.current_stream().synchronize()
        queue.put(("raw", None))


def bench_nccl(shape: str, syncs: int) -> dict:
    from rlcore.runtime.rendezvous import find_free_port
    from rlcore.runtime.weight_sync import BroadcastGroup, iter_buckets

    torch.cuda.set_device(0)
    weights = make_weights(shape, "cuda:0", fill=True)
    port = find_free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=nccl_receiver, args=(port, shape, syncs, queue), daemon=True)
    proc.start()
    group = BroadcastGroup("127.0.0.1", port, 0, 2, backend="nccl", device="cuda:0", timeout_s=300)
    rlcore, sent, received = [], [], []
    for _ in range(syncs + 1):
        start = time.perf_counter()
        sent.append(group.send(iter_buckets(weights, BUCKET_BYTES)))
        kind, stats = queue.get(timeout=300)
        rlcore.append(time.perf_counter() - start)
        received.append(stats)
    kind, sums = queue.get(timeout=300)
    want = [float(t.float().sum()) for _, t in weights]
    assert kind == "check" and all(abs(a - b) <= 1e-3 * max(1.0, abs(b)) for a, b in zip(sums, want)), "the receiver's model differs"
    flat = torch.empty(nbytes(weights), dtype=torch.uint8, device="cuda:0")
    raw = []
    for _ in range(syncs + 1):
        start = time.perf_counter()
        group._broadcast(flat).wait()
        queue.get(timeout=300)
        raw.append(time.perf_counter() - start)
    proc.join(timeout=60)
    phases = {k: statistics.median(s[k] for s in sent[1:]) for k in sent[0] if k.endswith("_s")}
    phases.update({k: statistics.median(s[k] for s in received[1:]) for k in received[0]})
    return {"bytes": nbytes(weights), "rlcore_s": rlcore[1:], "raw_s": raw[1:], "phases": phases}


# -------------------------------------------------------------------------------------------------


# -------------------------------------------------------------------------------------------------
# the whole path: RoleSession.sync_weights between a train and a rollout role on Ray
# -------------------------------------------------------------------------------------------------


def bench_session(shape: str, syncs: int, layout: str, device: str) -> dict:
    """`RoleSession.sync_weights` end to end (Ray calls, the engines' export and load included): an hf train
    engine and a vLLM rollout engine (on the CPU: the hf rollout engine, fake GPUs placing the actors) of this
    shape, colocated (CUDA IPC; object store on the CPU) or separate (NCCL; gloo on the CPU)."""
    import tempfile

    from rlcore import RoleSession, RoleSetup, load_plugins
    from rlcore.runtime.cluster import init
    from rlcore.testing import build_tiny_model
    from rlcore.runtime.resources import plan_from_config
    from rlcore.runtime.roles import GenerateWorker, TrainWorker

    hidden, layers, heads, kv_heads, inter, tied = SHAPES[shape]
    if not tied:
        raise SystemExit("session rows build tied-embedding shapes only (tiny, 0.5b, 1.5b)")
    vocab = None if shape == "tiny" else VOCAB
    model_dir = str(build_tiny_model(Path(tempfile.mkdtemp()) / shape, hidden_size=hidden, num_layers=layers, num_heads=heads,
                                     num_kv_heads=kv_heads, intermediate_size=inter, vocab_size=vocab, dtype="bfloat16"))
    gpu = device == "cuda"
    if not gpu:
        init("local", num_cpus=4, num_gpus=2)  # fake GPUs place the actors; the engines compute on the CPU
    plugins = load_plugins()
    roles = {"train": {"gpus": 1}, "rollout": {"gpus": 1}}
    config = {**roles, "colocate_groups": [["train", "rollout"]]} if layout == "colocate" else roles
    plan = plan_from_config(config, roles=("train", "rollout"), plugins=plugins)
    dtype = "bfloat16" if gpu else "float32"
    train = {"model": model_dir, "dtype": dtype, "device": device}
    rollout = ({"model": model_dir, "dtype": dtype, "vllm_gpu_memory_utilization": 0.3, "vllm_enforce_eager": True,
                "vllm_max_model_len": 512, "vllm_enable_sleep_mode": False} if gpu else train)
    setups = {"train": RoleSetup(TrainWorker, "hf", train),
              "rollout": RoleSetup(GenerateWorker, "vllm" if gpu else "hf", rollout)}
    options = {} if gpu or layout == "colocate" else {"weight_sync_backend": "gloo"}
    session = RoleSession(plan, setups, use_ray=True, plugins=plugins, syncs=(("train", "rollout"),), **options)
    stats = []
    with session.start():
        for _ in range(syncs + 1):
            stats.append(session.sync_weights("train", "rollout", BUCKET_BYTES))
        diff = session.check_weight_sync("train", "rollout", list(range(3, 19)))  # the weights arrived
        transport = session.transports[("train", "rollout")]
    nbytes = stats[-1]["weight_sync/gb_per_s"] * stats[-1]["weight_sync/seconds"] * 1e9
    phases = {k: statistics.median(s[k] for s in stats[1:]) for k in stats[1] if k.endswith("_s") and k != "weight_sync/gb_per_s"}
    return {"bytes": nbytes, "rlcore_s": [s["weight_sync/seconds"] for s in stats[1:]], "session_transport": transport,
            "phases": phases, "check_max_diff": diff}


BASELINES = {"cuda_ipc": "raw IPC copy", "nccl": "raw broadcast", "vllm_load": "vLLM load_weights"}
BENCHES = {"cuda_ipc": bench_ipc, "nccl": bench_nccl, "vllm_load": bench_vllm_load}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="0.5b,1.5b,7b")
    parser.add_argument("--transports", default="cuda_ipc,nccl",
                        help="cuda_ipc, nccl, vllm_load (vLLM's loaders vs replay), session_colocate, session_separate "
                             "(RoleSession.sync_weights end to end)")
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: the session rows only, on fake GPUs with hf engines (a check of this script)")
    parser.add_argument("--json")
    args = parser.parse_args()
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    if args.device == "cuda" and gpus == 0:
        sys.exit("weight_sync.py needs a GPU (or --device cpu --transports session_colocate,session_separate)")
    rows, skipped = [], []
    for transport in args.transports.split(","):
        session = transport.startswith("session_")
        if args.device == "cpu" and not session:
            skipped.append(f"{transport}: needs a GPU")
            continue
        if transport in ("nccl", "session_separate") and args.device == "cuda" and gpus < 2:
            skipped.append(f"{transport}: needs 2 GPUs, this machine has {gpus}")
            continue
        for shape in args.shapes.split(","):
            if transport in ("vllm_load", "session_colocate", "session_separate") and not SHAPES[shape][5]:
                skipped.append(f"{transport} {shape}: the tiny-model builder makes tied-embedding shapes only")
                continue
            if session:
                result = bench_session(shape, args.syncs, transport.removeprefix("session_"), args.device)
            else:
                result = BENCHES[transport](shape, args.syncs)
            ms = statistics.median(result["rlcore_s"]) * 1e3
            row = {"transport": transport, "shape": shape, "gb": result["bytes"] / 1e9, "rlcore_ms": ms,
                   "rlcore_gb_s": result["bytes"] / ms / 1e6, "target": TARGETS.get((transport, shape), ""), **result}
            if not session:
                base_ms = statistics.median(result["raw_s"]) * 1e3
                row.update(baseline=BASELINES[transport], baseline_ms=base_ms, baseline_gb_s=result["bytes"] / base_ms / 1e6,
                           ratio=ms / base_ms)
            rows.append(row)
            print(f"{transport} {shape}: {ms:.2f} ms", file=sys.stderr, flush=True)
    where = f"{gpus} x {torch.cuda.get_device_name(0)}" if gpus else "CPU (fake GPUs)"
    print(f"\nweight sync, {where}, {BUCKET_BYTES >> 20} MB buckets, median of {args.syncs} syncs after a warm-up")
    print(f"{'transport':<16} {'shape':<5} {'GB':>6} {'rlcore ms':>10} {'GB/s':>7}  {'baseline':<17} {'ms':>8} {'GB/s':>7} "
          f"{'rlcore/base':>11}  target")
    for r in rows:
        if "baseline" in r:
            base = f"{r['baseline']:<17} {r['baseline_ms']:>8.2f} {r['baseline_gb_s']:>7.1f} {r['ratio']:>11.2f}"
        else:  # the whole path has no raw counterpart: its transport row is the comparison
            base = f"{'over ' + r['session_transport']:<17} {'-':>8} {'-':>7} {'-':>11}"
        print(f"{r['transport']:<16} {r['shape']:<5} {r['gb']:>6.2f} {r['rlcore_ms']:>10.2f} {r['rlcore_gb_s']:>7.1f}  {base}  {r['target']}")
    for r in rows:
        for label, times in r.get("variants", {}).items():
            per = r["phases"][label]
            print(f"cuda_ipc {r['shape']} {label:<19} {statistics.median(times) * 1e3:7.2f} ms; per sync: "
                  + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in per.items()))
        if r["transport"] == "nccl" or (r["transport"].startswith("session_") and r["phases"]):
            print(f"{r['transport']} {r['shape']} phases: "
                  + ", ".join(f"{k.split('/')[-1]} {v * 1e3:.2f} ms" for k, v in r["phases"].items()))
    for line in skipped:
        print(f"skipped: {line}")
    kind = f"{gpus}gpu" if gpus else "cpu"
    path = Path(args.json or Path(__file__).parent / "results" / f"weight_sync-{datetime.date.today()}-{kind}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"gpus": gpus, "device": torch.cuda.get_device_name(0) if gpus else "cpu",
                                "bucket_bytes": BUCKET_BYTES, "rows": rows, "skipped": skipped}, indent=1))
    print(f"json: {path}")


if __name__ == "__main__":
    os.environ.setdefault("NCCL_DEBUG", "WARN")
    main()
