"""The hf engines' memory terms (`EngineSpec.memory`), from the options and the model's config.json.

Train: the peak of a step is the worse of two moments, and the plan lists the parts of that one.
- Backward (the head's backward, or the first layer it reaches): the weights, AdamW's state from the last step, what
  the forward kept for backward (`activations`), and the working set of that backward. Gradients are not there yet:
  the engine drops them after every step (`zero_grad(set_to_none=True)`), and a layer's arrive as its saved tensors go.
- Optimizer step: weights, gradients, both moments, and the temporary `torch._foreach_sqrt` makes of the second
  moment (torch's default AdamW on CUDA is the foreach one): one more copy of the trainable state. A use whose
  option `optim` is `adamw_torch_fused` (transformers' Trainer's default from torch 2.8) makes none.
`activations` is a count, per token, of the tensors autograd saves in a transformers decoder layer (Qwen2, Llama:
pre-norm RMSNorm, SDPA attention, SwiGLU), each storage once; tests/plugins/test_hf_memory.py counts them with
`torch.autograd.graph.saved_tensors_hooks` over a real tiny model, in float32 and bfloat16, full and LoRA, with and
without checkpointing, and compares. What it found: each RMSNorm keeps its input upcast to float32, the normalized
states and its output (4h + 2hd bytes); attention keeps the rotated q and k, v and its output (2q + 2kv, the output's
transpose is a view of it) and a float32 logsumexp per head; the MLP keeps gate, its SiLU, up and their product (4I).
Under LoRA (peft, adapters in float32) the frozen linears keep nothing, each adapter keeps its input cast to float32
(one copy per adapter in half precision; q/k/v and gate/up share theirs in float32), the norms keep only the float32
input (their weights are frozen), the first layer's input norm nothing (the frozen embedding needs no gradient), and
the MLP's product only as down's adapter copy. Gradient checkpointing keeps each layer's input and recomputes one
layer at a time. The working sets are read from the code that runs: TRL's `ChunkedLogProbFunction` (the chunked head
on a GPU where TRL is installed) holds a [4096, 32768] tile and float32 gradients of the hidden rows and of the head
(then their cast); rlcore's torch chunks hold per 1024 rows a float32 copy of the logits and logsumexp's backward's
three temporaries (16 bytes a logit); without the chunked head the [B, T, V] logits stay while `HFModelOutputs`'s
row-by-row normaliser saves a float32 copy of each row (a use with `model_loss`, SFT's Trainer, has transformers'
cross-entropy instead: 8 bytes a logit beyond them). A layer's backward holds two [T, I] gradients of the MLP
beside what it saved (under LoRA the float32 gradient of down's adapter input), and a tied head's gradient waits for
the embedding's. torch's cuBLAS takes a 32 MiB workspace from the caching allocator for each thread that runs matmuls
(the forward's and autograd's backward thread); the allocator's rounding is left to the context's slack.
The working sets were checked against the CPU's resident peak of a step (docs/memory.md says how and where they
fell short); the GPU check (tests/gpu/test_memory_gpu.py) compares the sum with torch's peak on an H200.

While a colocated role works the engine keeps its weights and optimizer state unless the session offloads them
(`offload_model`, `offload_optimizer`); gradients are always dropped. Rollout: the weights and a KV cache for every
sequence in flight.
"""

from __future__ import annotations

from rlcore.engines import installed_version
from rlcore.memory import (
    CHUNK_ROWS, CUDA_CONTEXT, EngineMemory, MemoryQuery, ModelShape, dtype_bytes, forward_terms, teacher_terms,
    train_fixes,
)

CUBLAS_WORKSPACE = 4096 * 8 * 1024  # torch's default on sm90 (CUBLAS_WORKSPACE_CONFIG :4096:8), per matmul thread
TRL_TOKEN_CHUNK, TRL_VOCAB_CHUNK = 4096, 32768  # the tile of TRL's chunked log-prob kernel (rlcore.head's too)


def layer_saved(s: ModelShape, d: int, lora: int = 0, dropout_mask: int = 0, first: bool = False) -> int:
    """Bytes one decoder layer's forward keeps for backward per token (see the module docstring): full training, or
    LoRA of rank `lora` on every linear. `dropout_mask`: bytes of peft's dropout mask per input element (0: no
    dropout; 1 on CUDA, whose fused dropout keeps a bool mask; 4 on the CPU, the float32 adapter input's dtype);
    `first`: the first layer, whose input needs no gradient under LoRA."""
    h, q, kv, inter = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim, _mlp_width(s)
    attention = (2 * q + 2 * kv) * d + 4 * s.heads  # rotated q, k; v; the output; float32 logsumexp per head
    norm = 4 * h + 4  # the input upcast to float32 (the input itself in float32) and its float32 rsqrt
    if not lora:
        return 2 * (norm + 2 * h * d) + attention + 4 * inter * d
    each = 5 * h + q + inter  # the inputs of q, k, v, o, gate, up, down's adapters
    if dropout_mask:  # each adapter keeps its own dropped-out float32 input, and the mask where the input needs a grad
        adapters = each * (4 + dropout_mask) - (3 * h * dropout_mask if first else 0)
    else:  # a float32 copy each in half precision; in float32 q/k/v and gate/up share one, o's is attention's output
        adapters = each * 4 if d < 4 else (2 * h + inter) * 4
    adapters += 7 * lora * 4  # lora_B's [T, r] inputs
    return adapters + (1 if first else 2) * norm + attention + 3 * inter * d


def saved_per_token(s: ModelShape, d: int, lora: int = 0, dropout_mask: int = 0, checkpointing: bool = False) -> int:
    """Bytes the whole forward keeps for backward per token: every layer's (with checkpointing: every layer's input),
    the final norm's (its float32 input; its normalized states unless the head is frozen) and the head's input rows."""
    if checkpointing:
        layers = s.layers * s.hidden * d
    elif lora:
        layers = (layer_saved(s, d, lora, dropout_mask, first=True)
                  + (s.layers - 1) * layer_saved(s, d, lora, dropout_mask))
    else:
        layers = s.layers * layer_saved(s, d)
    final_norm = 4 * s.hidden + 4 + (0 if lora else s.hidden * d)
    return layers + final_norm + s.hidden * d


def head_working_set(s: ModelShape, d: int, rows: int, micro_batch: int, chunked: bool, trl: bool,
                     trainable: bool, model_loss: bool = False) -> int:
    """Bytes the loss's head holds in its backward beyond what the forward saved: TRL's tile and float32
    gradients, rlcore's torch chunks, or the whole [B, T, V] logits (see the module docstring); `model_loss`:
    transformers' own cross-entropy over the logits (SFT's Trainer), 8 bytes a logit beyond them."""
    head_grad = s.vocab * s.hidden * (4 + d) if trainable else 0  # float32, then its cast to the weight's dtype
    if model_loss:  # its float32 log-softmax and gradient: 8.0 bytes a logit measured on the CPU
        return rows * s.vocab * (d + 8)
    if not chunked:  # the logits; each row's float32 copy; one row's logsumexp backward or the logits' gradient
        rows_in = max(micro_batch, 1)
        per_logit = max(d + 4 + 12 / rows_in, 2 * d + 4 + 8 / rows_in)
        return int(rows * s.vocab * per_logit)
    if trl:
        tile = min(rows, TRL_TOKEN_CHUNK) * min(s.vocab, TRL_VOCAB_CHUNK) * d
        return tile + rows * s.hidden * (4 + d) + head_grad
    return min(rows, CHUNK_ROWS) * s.vocab * 16 + rows * s.hidden * 4 + (s.vocab * s.hidden * d if trainable else 0)


def trl_head() -> bool:
    """Whether the chunked head runs TRL's kernel on the GPU: TRL >= 1.16 installed (read without importing it)."""
    return (installed_version("trl") or (0, 0)) >= (1, 16)


def train_memory(q: MemoryQuery) -> EngineMemory:
    """The train engine's bytes on one GPU at the step's peak (the worse of backward and the optimizer step), while
    a colocated role works, and while weights are synced."""
    s, o = q.model, q.options
    d = dtype_bytes(o.get("dtype"))
    rank = int(o.get("lora_rank") or 0)
    checkpointing = bool(o.get("gradient_checkpointing"))
    mask = 1 if float(o.get("lora_dropout") or 0) > 0 else 0  # CUDA's fused dropout: a bool mask
    trainable = s.lora_params(rank, o.get("lora_target_modules", "all-linear")) if rank else s.params
    state_bytes = 4 if rank else d  # peft keeps the adapters in float32; AdamW's state is in the params' dtype
    tokens = q.use.micro_batch * q.use.seq_len
    weights = s.params * d + (trainable * 4 if rank else 0)
    common = {"cuda context": CUDA_CONTEXT, "cublas workspaces": 2 * CUBLAS_WORKSPACE, "weights": weights}
    optimizer = trainable * 2 * state_bytes
    if q.workers > 1:  # DDP's gradient buckets, allocated beside the gradients when it wraps the model
        common["ddp buckets"] = trainable * state_bytes
    teacher_active, teacher_resident = teacher_terms(q)
    head = head_working_set(s, d, tokens, q.use.micro_batch, bool(o.get("chunked_lm_head", True)), trl_head(),
                            trainable=not rank, model_loss=bool(o.get("model_loss")))
    tied_grad = s.vocab * s.hidden * d if s.tied and not rank else 0  # waits for the embedding's gradient
    layer = tokens * (2 * _mlp_width(s) * d if not rank else max(2 * d, 4) * _mlp_width(s)) + tied_grad
    if checkpointing:  # the first layer backward reaches is recomputed: its saved tensors come back
        layer += tokens * layer_saved(s, d, rank, mask)
    backward = {**common, "optimizer state": optimizer,
                "activations": tokens * saved_per_token(s, d, rank, mask, checkpointing),
                **({"logits": head} if head >= layer else {"layer backward": layer}), **teacher_active}
    # transformers' Trainer (SFT's workers) defaults to the fused AdamW from torch 2.8: no temporary of the state
    temporary = 0 if o.get("optim") == "adamw_torch_fused" else trainable * state_bytes
    step = {**common, "gradients": trainable * state_bytes, "optimizer state": optimizer,
            **({"optimizer step": temporary} if temporary else {}),
            **{k: v for k, v in teacher_active.items() if k == "teacher weights"}}
    active = backward if sum(backward.values()) >= sum(step.values()) else step
    resident = {"cuda context": CUDA_CONTEXT, **teacher_resident}
    if not q.offload_model:
        resident["weights"] = weights
    if not q.offload_optimizer:
        resident["optimizer state"] = optimizer
    sync = {"cuda context": CUDA_CONTEXT, "weights": weights, "optimizer state": optimizer,
            "sync buckets": 2 * q.bucket_bytes, **teacher_resident}
    return EngineMemory(active, resident, sync, train_fixes(q))


def _mlp_width(s: ModelShape) -> int:
    """The MLP's width a token goes through: I, or a MoE's experts per token and its shared expert."""
    if s.experts:
        return s.experts_per_token * s.expert_intermediate + s.shared_intermediate
    return s.intermediate


def forward_memory(q: MemoryQuery) -> EngineMemory:
    """A forward-only model (a reference): see `rlcore.memory.forward_terms`."""
    return forward_terms(q, chunk_rows=CHUNK_ROWS)


def rollout_memory(q: MemoryQuery) -> EngineMemory:
    """transformers' sampling loop: the weights, a KV cache for every sequence in flight at its longest, and the
    last position's logits in float32; asleep it keeps nothing but its context."""
    s = q.model
    d = dtype_bytes(q.options.get("dtype"))
    weights = s.params * d
    sequences = max(q.use.sequences, 1)
    active = {"cuda context": CUDA_CONTEXT, "weights": weights,
              "kv cache": sequences * q.use.seq_len * s.kv_bytes_per_token(d), "logits": sequences * s.vocab * 4}
    asleep = q.colocated and q.sleep_level > 0
    resident = {"cuda context": CUDA_CONTEXT} if asleep else dict(active)
    return EngineMemory(active, resident, {"cuda context": CUDA_CONTEXT, "weights": weights})
