"""`HFTrainEngine`: a transformers causal LM with AdamW on one worker; a group's workers form one DDP world.

Build one with `HFTrainEngine(model="path/or/hub-id", optimizer=OptimizerOptions(learning_rate=1e-5), ...)` or `HFTrainEngine(TrainOptions(...))`
(flat optimizer keys, `learning_rate=1e-5`, work too) or through the registry
(`plugins.engines.get("hf", kind="train").factory(**options)`). When the worker runtime sets WORLD_SIZE > 1
(with RANK, MASTER_ADDR, MASTER_PORT), the engine joins that torch.distributed world (gloo on the CPU, NCCL
on CUDA) and wraps the model in DistributedDataParallel; gradients are then averaged over the workers.
With `forward_only=True` (the registry's kind "forward": a reference or teacher model) it holds the model
alone: no optimizer, no scheduler, no torch.distributed world, and `train_step` refuses.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlcore import RlcoreError
from rlcore.batch import Batch, host_column, pad_width, token_columns, trim_padding
from rlcore.engines import (
    LossFn, NamedTensors, Projection, TopK, TrainEngine, TrainOptions, check_temperature, check_train_step,
    checkpoint_layout, common_problems, names_lm_head, raise_problems, tied_head_problems, torch_device,
)
from rlcore.runtime import join_torch_world, replace_dir

from .attention import log_once, packing_choice, register_varlen, varlen_kernel
from .common import compile_layers, conditional_problems, load_causal_lm, model_outputs, packs_sequences
from .lora import lora_merged_tensors

log = logging.getLogger(__name__)

STATE_FILE = "engine_state.pt"
COMPILE_MODES = (None, "default", "max-autotune-no-cudagraphs")
# torch.compile modes that replay CUDA graphs: a replay reuses its output buffers, and a train step holds a layer's
# outputs past the next replay (saved activations across micro-batches, a colocated teacher's answer): GKD on the
# H200 stopped with "accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run"
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
# None: transformers' default (sdpa where torch has it). Packed rows get a block-causal mask under sdpa and eager, a
# document BlockMask under flex_attention (blocks of other sequences skipped), varlen kernels under flash attention.
ATTN_IMPLEMENTATIONS = (None, "sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")


@dataclass(frozen=True)
class HFOptions(TrainOptions):
    """The train engines' options plus the hf engine's own: `chunked_lm_head`, `padding_free` with
    `max_tokens_per_micro_batch`, `liger_kernel` and `torch_compile` with its backend and mode, named as
    transformers' TrainingArguments (and TRL's, verl's) name them (see `HFTrainEngine`)."""

    chunked_lm_head: bool = True
    padding_free: bool | None = None
    max_tokens_per_micro_batch: int | None = None
    attn_implementation: str | None = None
    liger_kernel: bool = False
    torch_compile: bool = False
    torch_compile_backend: str = "inductor"
    torch_compile_mode: str | None = None

    def problems(self) -> list[tuple[str, str]]:
        problems = super().problems() + conditional_problems(self.model)
        problems += tied_head_problems(self.model, self.lora_rank > 0 and names_lm_head(self.lora_target_modules))
        budget = self.max_tokens_per_micro_batch
        if self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            problems.append(("attn_implementation", f"attn_implementation={self.attn_implementation!r} is not one "
                             "of transformers' attention implementations: " + ", ".join(ATTN_IMPLEMENTATIONS[1:])))
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            problems.append(("max_tokens_per_micro_batch", f"max_tokens_per_micro_batch={budget!r} must be a "
                             "positive int (tokens of one micro-batch), or unset"))
        elif budget is not None and self.padding_free is not True:
            problems.append(("max_tokens_per_micro_batch", "max_tokens_per_micro_batch forms packed (padding-free) "
                             "micro-batches; set padding_free: true, or unset max_tokens_per_micro_batch"))
        if self.padding_free not in (None, True, False):
            problems.append(("padding_free", f"padding_free={self.padding_free!r} must be true, false or unset "
                             "(unset: pack only with a variable-length attention kernel)"))
        if self.torch_compile:
            import torch

            if self.torch_compile_backend not in torch._dynamo.list_backends(exclude_tags=()):
                problems.append(("torch_compile_backend", f"torch_compile_backend={self.torch_compile_backend!r} is "
                                 f"not a torch.compile backend; one of {', '.join(torch._dynamo.list_backends())}"))
            if self.torch_compile_mode in CUDA_GRAPH_MODES:
                problems.append(("torch_compile_mode", f"torch_compile_mode={self.torch_compile_mode!r} replays CUDA "
                                 "graphs, whose outputs a later replay overwrites while the train step still holds "
                                 "them; use max-autotune-no-cudagraphs or default"))
            elif self.torch_compile_mode not in COMPILE_MODES:
                problems.append(("torch_compile_mode", f"torch_compile_mode={self.torch_compile_mode!r} is not a "
                                 "torch.compile mode; one of " + ", ".join(str(m) for m in COMPILE_MODES)))
        if self.liger_kernel and str(self.device).startswith("cuda"):
            import importlib.util

            if importlib.util.find_spec("liger_kernel") is None:
                problems.append(("liger_kernel", "liger_kernel=True needs the liger-kernel package on the GPU's "
                                 "machine: pip install liger-kernel, or set liger_kernel: false"))
        return problems


class HFTrainEngine(TrainEngine):
    """A Hugging Face causal LM trained with AdamW (optionally LoRA through peft), DDP across a group.

    Options are `HFOptions` (`rlcore.TrainOptions` and `chunked_lm_head`, named as TRL and ms-swift name them),
    one object or keywords. `max_steps` (the run's optimizer steps) is needed
    by the cosine and linear schedules; `max_grad_norm=0` turns clipping off; `lora_rank=0` trains every weight;
    `logprob_micro_batch_size` bounds the rows of one forward-only pass (so [B, T, V] logits never exist
    for the whole batch at once). `chunked_lm_head` (on by default) has the model return its last hidden
    states and applies the LM head in chunks of positions (`rlcore.head`; TRL's chunked log-prob
    kernel where TRL is installed), so no [B, T, V] logits exist for log-probs, top-k or a distillation loss;
    models whose logits are more than a plain head (soft-capping, a logit scale) keep the logits path.
    Packing (`padding_free`) runs rows that hold padding as one packed row of their real tokens with per-sequence
    position ids (`PackedRows`; the attention keeps each sequence to itself), and a train step forms its
    micro-batches by tokens (`token_micro_batches`): rows are added to a micro-batch while its real tokens stay
    within `max_tokens_per_micro_batch` (unset: `micro_batch_size` x the batch's longest row, the padded split's
    size), as verl's `use_dynamic_bsz` with `ppo_max_token_len_per_gpu` does. Unset, the engine packs only with a
    variable-length attention kernel on the device and pads elsewhere (`attention.packing_choice`; under sdpa a
    packed row's mask is dense, slower than padding); `true` packs anyway, `false` pads. `attn_implementation`
    (transformers' name; unset: its default, sdpa) picks the attention kernel.
    `forward_only=True` builds the model without optimizer (see the module docstring). `liger_kernel` (off by
    default) swaps the model's RMSNorm, SwiGLU MLP and rotary embedding for liger-kernel's fused Triton kernels
    (`liger_kernel.transformers._apply_liger_kernel_to_instance`, as transformers' Trainer does for
    `use_liger_kernel`; its loss kernels are left off, the chunked head computes the loss); on a device other
    than CUDA the model keeps its torch modules, with a log line. `torch_compile` (off by default) compiles each
    decoder layer in place with `torch_compile_backend` and `torch_compile_mode` (`compile_layers`): fewer
    kernel launches and no per-op Python where a step is launch-bound; the first steps pay the compile.
    """

    def __init__(self, options: TrainOptions | str | None = None, **keys: Any):
        o = HFOptions.of(options, **keys)
        kind = "forward" if o.forward_only else "train"
        raise_problems(f"hf {kind} engine", common_problems(o.model, o.dtype, o.device) + o.problems())
        import torch

        model, dtype, opt = o.model, o.dtype, o.optimizer
        self.model_name = str(model)
        self.device = torch_device(o.device)
        if self.device.type == "cuda":  # for NCCL, and for tensors made for "cuda" elsewhere in this process
            torch.cuda.set_device(self.device)
        self.max_grad_norm = opt.max_grad_norm
        self.logprob_micro_batch_size = o.logprob_micro_batch_size
        self.chunked_lm_head = bool(o.chunked_lm_head)
        self.padding_free = o.padding_free  # the request; `_choose_packing` sets the choice
        self.varlen = False  # packed rows run with a variable-length kernel (cu_seq_lens passed to the model)
        self.max_tokens_per_micro_batch = o.max_tokens_per_micro_batch
        self.lora = o.lora_rank > 0
        self.forward_only = o.forward_only
        self.global_step = 0
        self._offloaded: set[str] = set()
        torch.manual_seed(o.seed)
        if o.forward_only:  # no gradients to average: no torch.distributed world to join
            self.rank, self.world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
            self.model = load_causal_lm(model, dtype, self.device, o.liger_kernel,
                                        o.attn_implementation).requires_grad_(False)
            self._choose_packing(o.attn_implementation)
            if o.torch_compile:
                compile_layers(self.model, o.torch_compile_backend, o.torch_compile_mode)
            self.trainable, self.ddp, self.optimizer, self.scheduler = [], None, None, None
            return
        self.rank, self.world_size = join_torch_world(self.device, o.dist_timeout_s)

        self.model = load_causal_lm(model, dtype, self.device, o.liger_kernel, o.attn_implementation)
        # a *ForConditionalGeneration checkpoint: the language model trains, the rest (a vision tower) stays as it is
        self.layout = checkpoint_layout(model)
        if self.layout is not None:
            for name, param in self.model.named_parameters():
                param.requires_grad_(param.requires_grad and self.layout.is_language_model(self.layout.to_checkpoint(name)))
        self._choose_packing(o.attn_implementation)
        if o.gradient_checkpointing:
            self.model.config.use_cache = False
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.lora:
            from peft import LoraConfig, get_peft_model

            # the model itself, where its config could not be read before the build (a hub id not yet downloaded)
            tied = self.model.get_output_embeddings().weight is self.model.get_input_embeddings().weight
            raise_problems("hf train engine", tied_head_problems(model, names_lm_head(o.lora_target_modules), tied))

            config = LoraConfig(
                r=o.lora_rank, lora_alpha=o.lora_alpha, lora_dropout=o.lora_dropout,
                target_modules=o.lora_target_modules, task_type="CAUSAL_LM",
            )
            self.model = get_peft_model(self.model, config)
        self.model.eval()
        if o.torch_compile:  # after peft (its adapters are compiled in), before DDP
            compile_layers(self.model, o.torch_compile_backend, o.torch_compile_mode)
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.ddp = None
        if self.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel

            device_ids = [self.device.index] if self.device.type == "cuda" else None
            self.ddp = DistributedDataParallel(self.model, device_ids=device_ids)
        self.optimizer = torch.optim.AdamW(
            self.trainable, lr=opt.learning_rate, betas=(opt.adam_beta1, opt.adam_beta2), eps=opt.adam_epsilon,
            weight_decay=opt.weight_decay,
        )
        from transformers import get_scheduler

        floor = opt.min_lr and opt.lr_scheduler_type == "cosine"  # Megatron's cosine to min_lr is transformers' this
        self.scheduler = get_scheduler(
            "cosine_with_min_lr" if floor else opt.lr_scheduler_type, self.optimizer, num_warmup_steps=opt.warmup_steps,
            num_training_steps=opt.max_steps or None, scheduler_specific_kwargs={"min_lr": opt.min_lr} if floor else None,
        )

    # ------------------------------------------------------------------ forward-only passes

    def forward_logprobs(self, batch: Batch, temperature: float = 1.0) -> Any:
        """Per-token log-probs [B, T] (CPU, float32), column t = log p(input_ids[t] | input_ids[:t])."""
        import torch

        check_temperature(temperature)
        self._ensure_loaded()
        input_ids, attention_mask = token_columns(batch)
        host_mask = host_column(batch, "attention_mask")
        out = torch.zeros(input_ids.shape, dtype=torch.float32)
        with torch.inference_mode():
            for rows, width in self._chunks(host_mask):
                ids, mask = input_ids[rows, :width].to(self.device), attention_mask[rows, :width].to(self.device)
                outputs = self._outputs(self.model, ids, mask, temperature, host_mask=host_mask[rows, :width])
                out[rows, :width] = outputs.logprobs().cpu()
        return out

    def forward_topk(self, batch: Batch, k: int | None, temperature: float = 1.0, *, on_device: bool = False) -> TopK | Any:
        """Top-k log-probs (a `TopK`, [B, T, k]) or full log-probs [B, T, V] when k is None, on CPU (with
        `on_device`, on the engine's device).

        Row t is the distribution of token t given tokens :t, aligned like `forward_logprobs`; row 0 and
        padded rows are 0. The values are those a train step's `ModelOutputs` gives at the same ids.
        """
        import torch

        check_temperature(temperature)
        if k is not None and (not isinstance(k, int) or k < 1):
            raise RlcoreError(f"forward_topk: k={k!r} must be a positive int or None (full vocabulary)")
        self._ensure_loaded()
        input_ids, attention_mask = token_columns(batch)
        host_mask = host_column(batch, "attention_mask")  # the widths and rows: on the CPU where it can
        (B, T), V = input_ids.shape, self._vocab_size()
        width_k = V if k is None else min(k, V)
        where = self.device if on_device else "cpu"
        values = torch.zeros(B, T, width_k, dtype=torch.float32, device=where)
        ids = None if k is None else torch.zeros(B, T, width_k, dtype=torch.long, device=where)  # no [B, T, V] of ids
        with torch.inference_mode():
            for rows, width in self._chunks(host_mask):
                outputs = self._outputs(
                    self.model, input_ids[rows, :width].to(self.device), attention_mask[rows, :width].to(self.device),
                    temperature, host_mask=host_mask[rows, :width],
                )
                if ids is None:
                    values[rows, :width] = outputs.full_logprobs()
                else:
                    top = outputs.topk(width_k)
                    values[rows, :width], ids[rows, :width] = top.logprobs, top.ids
        return values if ids is None else TopK(ids=ids, logprobs=values)

    def forward_projection(self, batch: Batch) -> Projection | None:
        """The last hidden states of `batch` (one forward, no gradient) and the LM head, on the engine's device,
        for a loss that projects them in chunks (a colocated distillation teacher); None where the engine keeps
        the logits path (`chunked_lm_head=False`, or a model whose logits are more than its head)."""
        import torch

        self._ensure_loaded()
        input_ids, attention_mask = token_columns(batch)
        host_mask = host_column(batch, "attention_mask")  # on the CPU where it can
        width = max(int(host_mask.sum(dim=1).max()), 1)
        with torch.no_grad():  # not inference_mode: a loss's backward saves these states
            outputs = self._outputs(self.model, input_ids[:, :width].to(self.device),
                                    attention_mask[:, :width].to(self.device), 1.0, host_mask=host_mask[:, :width])
            projection = outputs.projection()
        if projection is None:
            return None
        hidden = pad_width(projection.hidden, input_ids.shape[1])
        return Projection(hidden=hidden, weight=projection.weight, bias=projection.bias)

    def _choose_packing(self, attn_implementation: str | None) -> None:
        """Pack or pad (`attention.packing_choice`), logged once: unset `padding_free` packs only with a
        variable-length kernel on this device, and never a model whose layers carry a state along a row; packing
        with torch's varlen_attn or flash-attn switches the model's attention to that kernel."""
        kernel, why = varlen_kernel(self.model, self.device, attn_implementation)
        choice = packing_choice(self.padding_free, kernel, why, carries_state=not packs_sequences(self.model))
        self.padding_free, self.varlen = choice.pack, choice.attn is not None
        if choice.attn is not None and choice.attn != self.model.config._attn_implementation:
            register_varlen()
            self.model.set_attn_implementation(choice.attn)
        log_once(choice)

    def _outputs(self, module: Any, input_ids: Any, attention_mask: Any, temperature: float,
                 host_mask: Any = None) -> Any:
        return model_outputs(module, input_ids, attention_mask, temperature, chunked=self.chunked_lm_head,
                             host_mask=host_mask, packed=self.padding_free, varlen=self.varlen)

    def _chunks(self, attention_mask: Any) -> Iterator[tuple[slice, int]]:
        """Row slices of at most `logprob_micro_batch_size`, each with its longest row's width."""
        lengths = attention_mask.sum(dim=1)
        for start in range(0, attention_mask.shape[0], self.logprob_micro_batch_size):
            rows = slice(start, start + self.logprob_micro_batch_size)
            yield rows, max(int(lengths[rows].max()), 1)

    def _vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    # ------------------------------------------------------------------ training

    def train_step(self, batch: Batch, loss_fn: LossFn, micro_batch_size: int, temperature: float = 1.0) -> dict[str, float]:
        """One AdamW step over `batch` in micro-batches (see `TrainEngine.train_step` for the loss contract).

        `loss_fn(outputs, micro)` sees each micro-batch with its per-token columns ([B, T] and [B, T, k] alike)
        trimmed to the micro-batch's longest row (right padding only), and `HFModelOutputs` of the forward
        pass at `temperature`, as GRPO's importance ratio needs. The micro-batches are runs of consecutive rows:
        `micro_batch_size` rows each, or with `padding_free` as many rows as `max_tokens_per_micro_batch` holds
        (the loss's normalisers are the step's, so the step is the same however its rows are split). Gradients
        whose norm is NaN or infinite are dropped: weights, optimizer and schedule stay as they were, and the
        metrics say `update_skipped`.
        """
        import torch

        from torch.profiler import record_function

        check_train_step("hf", self.forward_only, micro_batch_size, temperature)
        token_columns(batch)
        lengths = host_column(batch, "attention_mask").sum(dim=1).tolist()
        spans: list[int] = []
        if self.padding_free:
            budget = self.max_tokens_per_micro_batch or micro_batch_size * max(max(lengths, default=1), 1)
            spans = token_micro_batches(lengths, budget)
        num_micro = len(spans) if self.padding_free else math.ceil(len(batch) / micro_batch_size)
        if self.ddp is not None:  # every rank must run the same number of backward passes
            count = torch.tensor([num_micro], device=self.device)
            torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
            num_micro = int(count.item())
        if len(batch) < num_micro or len(batch) == 0:
            raise RlcoreError(
                f"train_step: rank {self.rank} got {len(batch)} rows but its group runs {num_micro} "
                f"micro-batches; give every worker at least that many rows"
            )
        if self.padding_free:
            spans = split_to(spans, lengths, num_micro)
        else:
            spans = [len(part) for part in batch.split(num_micro)]
        self._ensure_loaded()
        module = self.ddp or self.model
        module.train()
        sums: dict[str, Any] = defaultdict(float)
        total_loss: Any = 0.0
        starts = [sum(spans[:i]) for i in range(num_micro)]
        for i, (start, rows) in enumerate(zip(starts, spans)):
            micro = batch.select(slice(start, start + rows))
            micro = trim_padding(micro).to(self.device)
            sync = self.ddp is None or i == num_micro - 1
            with nullcontext() if sync else self.ddp.no_sync():
                with record_function("rlcore.forward"):  # the phases' names in a torch profile
                    outputs = self._outputs(module, micro["input_ids"], micro["attention_mask"], temperature,
                                            host_mask=host_column(micro, "attention_mask"))
                with record_function("rlcore.loss"):
                    loss, metrics = loss_fn(outputs, micro)
                with record_function("rlcore.backward"):
                    loss.backward()
            total_loss = total_loss + loss.detach()  # tensors: read once the step is done, not per micro-batch
            for key, value in metrics.items():
                sums[key] = sums[key] + (value.detach() if isinstance(value, torch.Tensor) else value)
        module.eval()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.trainable, self.max_grad_norm or math.inf))
        lr = self.scheduler.get_last_lr()[0]
        skipped = not math.isfinite(grad_norm)  # NaN or infinite gradients would make every weight NaN
        if not skipped:
            with record_function("rlcore.optimizer"):
                self.optimizer.step()
            self.scheduler.step()
            self.global_step += 1
        self.optimizer.zero_grad(set_to_none=True)
        out = {"loss": float(total_loss)}
        out.update({key: float(value) / num_micro for key, value in sums.items()})
        out.update(grad_norm=grad_norm, learning_rate=float(lr))
        if skipped:
            out["update_skipped"] = 1.0
        return out

    # ------------------------------------------------------------------ weights and state

    def export_weights(self, bucket_bytes: int = 512 << 20) -> Iterator[NamedTensors]:
        """Weights in Hugging Face names (LoRA merged into the base weights), detached, on the model's device."""
        import torch

        from rlcore.runtime import iter_buckets

        if bucket_bytes < 1:
            raise RlcoreError(f"export_weights: bucket_bytes={bucket_bytes!r} must be positive")
        self._ensure_loaded()
        with torch.no_grad():
            named = lora_merged_tensors(self.model) if self.lora else (
                (name, p.detach()) for name, p in self.model.named_parameters()
            )
            yield from iter_buckets(named, bucket_bytes)

    def export_adapter(self, path: str) -> None:
        """The LoRA adapter as a PEFT folder (`adapter_config.json`, `adapter_model.safetensors`: peft's
        `save_pretrained`) that `peft.PeftModel.from_pretrained` and vLLM's LoRA load onto the base; rank 0 writes."""
        if not self.lora:
            raise RlcoreError("export_adapter: this hf engine trains every weight (lora_rank 0); it has no adapter")
        self._ensure_loaded()
        if self.rank == 0:
            self.model.save_pretrained(path)

    def offload(self, params: bool = True, grads: bool = True, optimizer: bool = True) -> None:
        """Move params and optimizer state to CPU memory and drop grads; params/optimizer are no-ops on a CPU model."""
        import torch

        if grads and self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cpu":
            return
        if params:
            _move_module(self.model, torch.device("cpu"))
            self._offloaded.add("params")
        if optimizer and self.optimizer is not None:
            _move_optimizer(self.optimizer, torch.device("cpu"))
            self._offloaded.add("optimizer")
        torch.cuda.empty_cache()

    def reload(self, params: bool = True, grads: bool = True, optimizer: bool = True) -> None:
        """Bring offloaded params and optimizer state back to the engine's device (grads are rebuilt by backward)."""
        if params and "params" in self._offloaded:
            _move_module(self.model, self.device)
            self._offloaded.discard("params")
        if optimizer and "optimizer" in self._offloaded:
            _move_optimizer(self.optimizer, self.device)
            self._offloaded.discard("optimizer")

    def _refuse_if_forward_only(self, what: str) -> None:
        if self.forward_only:
            raise RlcoreError(
                f"{what}: a forward-only hf engine holds the fixed model it was built from ({self.model_name}); "
                "it has no training state to save or load"
            )

    def _ensure_loaded(self) -> None:
        if "params" in self._offloaded:
            raise RlcoreError("the train engine's params are offloaded; call reload(params=True) first")

    def save(self, path: str) -> None:
        """Write `path/model` (save_pretrained: full weights, or the LoRA adapter) and `path/engine_state.pt`
        (optimizer, scheduler, step) into a temporary directory, then rename it into place. Rank 0 writes."""
        import torch

        self._refuse_if_forward_only("save")
        path = Path(path)
        if self.rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
            try:
                if self.layout is not None and not self.lora:  # the checkpoint's names, its vision tower beside
                    self.layout.write(tmp / "model", (pair for bucket in self.export_weights() for pair in bucket))
                else:
                    self.model.save_pretrained(tmp / "model")
                torch.save(
                    {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                     "global_step": self.global_step},
                    tmp / STATE_FILE,
                )
                replace_dir(tmp, path)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        if self.world_size > 1:
            torch.distributed.barrier()

    def load(self, path: str) -> None:
        """Restore what `save` wrote: weights in place, then optimizer, scheduler and step."""
        import torch
        from safetensors.torch import load_file

        self._refuse_if_forward_only("load")
        path = Path(path)
        files = sorted((path / "model").glob("*.safetensors"))
        if not files or not (path / STATE_FILE).is_file():
            raise RlcoreError(f"'{path}' is not a checkpoint of the hf train engine (no model/*.safetensors or {STATE_FILE})")
        weights: dict[str, Any] = {}
        for file in files:
            weights.update(load_file(file))
        if self.lora:
            from peft import set_peft_model_state_dict

            result = set_peft_model_state_dict(self.model, weights)
            missing = []
        else:
            if self.layout is not None:
                weights = self.layout.language_model(weights, set(self.model.state_dict()))
            result = self.model.load_state_dict(weights, strict=False)
            missing = _untied_missing(self.model, weights, result.missing_keys)
        if result.unexpected_keys or missing:
            raise RlcoreError(
                f"checkpoint '{path}' does not fit the model: unexpected {result.unexpected_keys[:5]}, "
                f"missing {missing[:5]}"
            )
        try:  # tensors, numbers and strings only: a checkpoint is data, never code
            state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise RlcoreError(f"{path / STATE_FILE} cannot be read as an engine state: {exc}") from exc
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.global_step = int(state["global_step"])
        self._keep_own_hyperparameters()

    def _keep_own_hyperparameters(self) -> None:
        """After a checkpoint's optimizer and schedule are loaded: the moments and the schedule's position are
        the checkpoint's, the learning rate, betas, eps and weight decay this engine's (a resumed run's config,
        which the resume message reports as changed), at the schedule's current factor."""
        own = self.optimizer.defaults
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs):
            group["lr"] = group["lr"] * own["lr"] / base if base else own["lr"]
            group["initial_lr"] = own["lr"]
            group.update({key: own[key] for key in ("betas", "eps", "weight_decay")})
        self.scheduler.base_lrs = [own["lr"]] * len(self.optimizer.param_groups)
        self.scheduler._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def state(self) -> dict[str, Any]:
        return {
            "device": str(self.device),
            "dtype": str(next(self.model.parameters()).dtype).removeprefix("torch."),
            "num_parameters": sum(p.numel() for p in self.model.parameters()),
            "num_trainable_parameters": sum(p.numel() for p in self.trainable),
            "global_step": self.global_step,
            "rank": self.rank,
            "world_size": self.world_size,
            "lora": self.lora,
            "forward_only": self.forward_only,
        }


def token_micro_batches(lengths: list[int], budget: int) -> list[int]:
    """The row counts of consecutive micro-batches over rows of `lengths` tokens: each takes rows while their
    tokens stay within `budget` (a row longer than the budget is a micro-batch of its own)."""
    spans: list[int] = []
    rows = tokens = 0
    for length in lengths:
        if rows and tokens + length > budget:
            spans.append(rows)
            rows = tokens = 0
        rows, tokens = rows + 1, tokens + length
    return spans + [rows] if rows else spans


def split_to(spans: list[int], lengths: list[int], count: int) -> list[int]:
    """`spans` split further until there are `count` (the group's most, so every DDP rank runs as many backward
    passes): the micro-batch of most tokens is halved by rows each time. `count` <= the rows."""
    spans = list(spans)
    while len(spans) < count:
        starts = [sum(spans[:i]) for i in range(len(spans))]
        tokens = [sum(lengths[s:s + n]) if n > 1 else -1 for s, n in zip(starts, spans)]
        i = max(range(len(spans)), key=tokens.__getitem__)
        spans[i:i + 1] = [spans[i] - spans[i] // 2, spans[i] // 2]
    return spans


def _move_module(module: Any, device: Any) -> None:
    """Move params and buffers in place (`.data`), so optimizer and DDP keep their references."""
    for tensor in [*module.parameters(), *module.buffers()]:
        tensor.data = tensor.data.to(device, non_blocking=True)


def _move_optimizer(optimizer: Any, device: Any) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            if hasattr(value, "to") and key != "step":
                state[key] = value.to(device, non_blocking=True)


def _untied_missing(model: Any, loaded: dict[str, Any], missing: list[str]) -> list[str]:
    """Missing keys that are not tied to a loaded weight (a tied lm_head is saved once)."""
    state = model.state_dict()
    loaded_ptrs = {state[k].data_ptr() for k in loaded if k in state}
    return [k for k in missing if state[k].data_ptr() not in loaded_ptrs]

