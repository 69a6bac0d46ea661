"""`MegatronTrainEngine`: megatron-core's GPTModel (its local layer spec with torch SDPA as the core attention,
`attention.py`: no Transformer Engine, no Apex) built from a Hugging Face checkpoint of an architecture `mapping` declares, trained with tensor, pipeline and data parallelism.

The group's workers (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the worker runtime) form one
torch.distributed world; megatron's parallel state cuts it as rlcore's `Mesh` orders ranks (tensor
fastest, then pipeline, then data: order "tp-cp-ep-pp-dp"). On CUDA: megatron's DistributedDataParallel,
its distributed optimizer, bf16 through `Float16Module`, micro-batches through megatron's pipeline
schedule. Without CUDA (tests, CI): one worker, float32, and the named stand-ins of `cpu_shim`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
from collections.abc import Iterator
from typing import Any

from rlcore import RlcoreError
from rlcore.batch import Batch, token_columns, trim_padding
from rlcore.engines import (
    LossFn, NamedTensors, TopK, TrainEngine, check_temperature, check_train_step, common_problems, raise_problems,
    torch_device,
)
from rlcore.runtime import join_torch_world

from . import lora, mapping
from .state import EngineState
from .support import (
    DECAY_STYLES, HostOffload, MegatronOptions, SafetensorsReader, model_dir, model_problems, option_problems, torch_dtype,
)

LINEAR_KEYS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
               "linear_conv_kernel_dim")  # ModelSpec's and TransformerConfig's names


class MegatronTrainEngine(EngineState, TrainEngine):
    """A megatron-core GPTModel on one worker of a tensor x pipeline x data parallel group.

    Options are `MegatronOptions`: the hf engine's (`rlcore.TrainOptions`) plus `tensor_model_parallel_size`,
    `pipeline_model_parallel_size`, `make_vocab_size_divisible_by`, `use_distributed_optimizer` and `master_weights` (false: bf16 AdamW
    without fp32 master params, gradients or moments, the hf engine's numerics and memory) and `chunked_lm_head`
    (true: at tensor size 1 the output layer runs in chunks of positions on the last hidden states, as the hf
    engine's does; no [B, T, V] logits unless a loss asks for the full vocabulary).
    With `lora_rank` > 0 the base weights are frozen and LoRA adapters (`lora.py`: `lora_alpha`, `lora_dropout`,
    `lora_target_modules`) train on megatron's parallel linears (the output layer too where `lm_head` is named);
    `export_weights` merges them out of place, and `export_adapter` writes them as a PEFT adapter. Every problem
    with the options, the architecture and the parallel sizes is reported at once, before any weight is allocated.
    """

    def __init__(self, options: MegatronOptions | str | None = None, **keys: Any):
        o = MegatronOptions.of(options, **keys)
        model, dtype, device, seed, forward_only = o.model, o.dtype, o.device, o.seed, o.forward_only
        kind = "forward" if forward_only else "train"
        options = {**{f.name: getattr(o, f.name) for f in dataclasses.fields(o) if f.name != "optimizer"},
                   **dataclasses.asdict(o.optimizer)}
        tp, pp = o.tensor_model_parallel_size, o.pipeline_model_parallel_size
        problems = common_problems(model, dtype, device) + option_problems(options)
        spec = None
        if not any(key == "model" for key, _ in problems):
            spec, found = model_problems(options, int(os.environ.get("WORLD_SIZE", "1")))
            problems += found
        raise_problems(f"megatron {kind} engine", problems)

        import torch

        self.spec, self.model_name, self.forward_only = spec, str(model), forward_only
        self.device = torch_device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            torch.cuda.set_device(self.device)
        self.dtype = torch_dtype(dtype, self.model_name, self.cuda)
        self.logprob_micro_batch_size = o.logprob_micro_batch_size
        self.chunked_lm_head = bool(o.chunked_lm_head) and tp == 1  # the vocabulary whole on one rank
        self.global_step = 0
        self._host = HostOffload()
        torch.manual_seed(seed)
        self.rank, self.world_size = join_torch_world(self.device, o.dist_timeout_s, alone=True)
        self._init_parallel_state(tp, pp, o.expert_model_parallel_size, seed)
        self.padded_vocab = mapping.padded_vocab_size(spec.vocab_size, tp, o.make_vocab_size_divisible_by)
        self.config = self._transformer_config(o.gradient_checkpointing)
        # megatron puts its parallel layers on the GPU, torch's norms stay where torch.nn makes them (the CPU)
        self.module = self._build_model().to(self.device)
        self._load_hf(self.model_name)
        self.lora_rank, self.lora_alpha, self.lora_dropout = o.lora_rank, o.lora_alpha, o.lora_dropout
        self.adapters = lora.add_adapters(  # before the wrappers: Float16Module casts them, DDP and the optimizer see them
            self.module, rank=o.lora_rank, alpha=o.lora_alpha, dropout=o.lora_dropout, targets=o.lora_target_modules,
            seed=seed,
        ) if o.lora_rank else {}
        self._lora_index: dict[str, Any] | None = None
        self._wrap_and_optimize(options)

    # ------------------------------------------------------------------ construction

    def _init_parallel_state(self, tp: int, pp: int, ep: int, seed: int) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel

        if ps.model_parallel_is_initialized():
            have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                    ps.get_expert_model_parallel_world_size())
            if have != (tp, pp, ep):
                raise RlcoreError(
                    f"megatron's parallel state of this process is tensor x pipeline x expert = {have[0]} x {have[1]} x "
                    f"{have[2]} (another megatron engine built it); this engine asks {tp} x {pp} x {ep}: one layout per process"
                )
        else:
            ps.initialize_model_parallel(
                tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
                order="tp-cp-ep-pp-dp",
            )
        self.tp, self.pp, self.ep = tp, pp, ep
        self.ep_rank = ps.get_expert_model_parallel_rank()
        self.collective = tp * pp > 1  # every rank of the group takes part in each pass and export
        self.tp_rank, self.pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        self.tp_group = ps.get_tensor_model_parallel_group() if tp > 1 else None
        self.pp_group = ps.get_pipeline_model_parallel_group() if pp > 1 else None
        self.first_stage, self.last_stage = self.pp_rank == 0, self.pp_rank == pp - 1
        if self.cuda:
            tensor_parallel.model_parallel_cuda_manual_seed(seed)
        else:
            from .cpu_shim import use_cpu_rng_tracker

            use_cpu_rng_tracker()

    def _transformer_config(self, gradient_checkpointing: bool) -> Any:
        import torch
        from megatron.core.transformer.transformer_config import TransformerConfig

        s = self.spec
        recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        gelu_tanh = functools.partial(torch.nn.functional.gelu, approximate="tanh")  # transformers' gelu_pytorch_tanh
        activation = {"silu": torch.nn.functional.silu, "gelu_tanh": gelu_tanh}[s.activation]
        return TransformerConfig(
            num_layers=s.num_layers, hidden_size=s.hidden_size, num_attention_heads=s.num_heads,
            num_query_groups=s.num_kv_heads, kv_channels=s.head_dim, ffn_hidden_size=s.ffn_hidden_size,
            normalization="RMSNorm", layernorm_epsilon=s.norm_eps, gated_linear_unit=True,
            activation_func=activation, softmax_scale=s.softmax_scale, add_bias_linear=False, add_qkv_bias=s.qkv_bias,
            hidden_dropout=0.0, attention_dropout=0.0, attention_softmax_in_fp32=True,
            qk_layernorm=s.qk_norm, attention_output_gate=s.attention_output_gate, **self._moe_config(),
            **{k: getattr(s, k) for k in LINEAR_KEYS if getattr(s, k)},
            bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
            masked_softmax_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
            tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=self.pp, sequence_parallel=False,
            params_dtype=self.dtype, pipeline_dtype=self.dtype, bf16=self.dtype == torch.bfloat16,
            fp16=self.dtype == torch.float16, use_cpu_initialization=not self.cuda, perform_initialization=False,
            **(recompute if gradient_checkpointing else {}),
        )

    def _moe_config(self) -> dict[str, Any]:
        """megatron's MoE keys for routed experts as transformers routes them: softmax over the experts, the top k,
        renormalised to sum to 1 (`norm_topk_prob`: a softmax over the top-k logits, megatron's default order) or
        not (softmax first, `moe_router_pre_softmax`); no load-balancing loss (transformers adds none unless
        `output_router_logits`), no token dropping."""
        s = self.spec
        if not s.num_experts:
            return {}
        return dict(
            num_moe_experts=s.num_experts, moe_router_topk=s.moe_topk, moe_ffn_hidden_size=s.moe_ffn_hidden_size,
            moe_router_score_function="softmax", moe_router_pre_softmax=not s.norm_topk_prob,
            moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="allgather",
            moe_grouped_gemm=False, moe_router_dtype="fp32", expert_model_parallel_size=self.ep,
            moe_shared_expert_intermediate_size=s.shared_expert_ffn_hidden_size or None,
            moe_shared_expert_gate=bool(s.shared_expert_ffn_hidden_size),
        )

    def _build_model(self) -> Any:
        from megatron.core.models.gpt import GPTModel

        from .attention import SdpaAttention, layer_spec, sliding_windows

        theta = self.spec.rope_theta
        spec = layer_spec(qk_norm=self.spec.qk_norm, num_experts=self.spec.num_experts)
        # causal SDPA needs no mask; another core attention (megatron's local one) takes the [T, T] mask
        self.causal_mask = not issubclass(spec.submodules.self_attention.submodules.core_attention, SdpaAttention)
        kinds = [self.spec.layer_type(i) for i in range(self.spec.num_layers)]
        if "sliding_attention" in kinds:  # those layers see the last sliding_window positions
            spec.submodules.self_attention.submodules.core_attention = sliding_windows(
                tuple(self.spec.sliding_window if kind == "sliding_attention" else None for kind in kinds))
        if self.spec.sandwich_norms:  # Gemma 3: sandwich and (1 + w) norms, sliding layers with their own rotary base
            from .gemma import gemma_block_spec

            spec = gemma_block_spec(spec, len(mapping.layer_range(self.spec, self.pp_rank, self.pp)), kinds,
                                    self.spec.local_rope_theta)
        elif self.spec.zero_centered_norm:  # Qwen3.5: its norms, gated attention and linear attention, layer by layer
            from .linear_attention import hybrid_layer_specs

            layers = mapping.layer_range(self.spec, self.pp_rank, self.pp)
            spec = hybrid_layer_specs(spec, [self.spec.layer_type(i) for i in layers])
        model = GPTModel(
            self.config, spec, vocab_size=self.padded_vocab,
            max_sequence_length=self.spec.max_position_embeddings, pre_process=self.first_stage,
            post_process=self.last_stage, share_embeddings_and_output_weights=self.spec.tied,
            position_embedding_type="rope", rotary_percent=self.spec.rotary_percent,
            rotary_base=int(theta) if float(theta).is_integer() else theta,
            seq_len_interpolation_factor=self.spec.rope_factor if self.spec.rope_type == "linear" else None,
            rope_scaling=self.spec.rope_type == "llama3", rope_scaling_factor=self.spec.rope_factor,
        )
        if self.spec.scaled_embedding and self.first_stage:
            from .gemma import scale_embeddings

            scale_embeddings(model, self.spec.hidden_size)
        return model

    def _load_hf(self, model: str) -> None:
        """This rank's shard of the Hugging Face weights, into the (unwrapped) GPTModel."""
        with SafetensorsReader(model_dir(model)) as hf:
            self._load_megatron_state(mapping.hf_to_megatron(
                hf, self.spec, tp_rank=self.tp_rank, tp=self.tp, pp_rank=self.pp_rank, pp=self.pp,
                padded_vocab=self.padded_vocab, ep_rank=self.ep_rank, ep=self.ep,
            ))

    def _load_megatron_state(self, state: dict[str, Any]) -> None:
        result = self.module.load_state_dict(state, strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state") and not lora.is_adapter_key(k)]
        if missing or result.unexpected_keys:
            raise RlcoreError(
                f"the Hugging Face -> megatron mapping of {self.model_name} does not fit the model: missing "
                f"{missing[:5]}, unexpected {result.unexpected_keys[:5]}"
            )

    def _wrap_and_optimize(self, o: dict[str, Any]) -> None:
        """Float16Module for bf16/fp16; then, to train: megatron DDP (CUDA) and megatron-core's optimizer or torch's AdamW."""
        import torch
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        model = self.module
        if self.dtype != torch.float32:
            from megatron.core.transformer.module import Float16Module

            model = Float16Module(self.config, model)
        self.optimizer = self.scheduler = None
        if self.forward_only:
            self.model = model.requires_grad_(False).eval()
            return
        # megatron-core's optimizers on CUDA with master weights (mixed precision), else torch's AdamW on the params
        # themselves: on the CPU, and bf16 without master weights stepping on its bf16 main_grad (adamw.TorchAdamW)
        mixed = self.cuda and (o["master_weights"] or self.dtype == torch.float32)
        if self.cuda:
            from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

            ddp_config = DistributedDataParallelConfig(
                grad_reduce_in_fp32=mixed, overlap_grad_reduce=False, use_distributed_optimizer=o["use_distributed_optimizer"],
            )
            model = DistributedDataParallel(self.config, ddp_config, model)
            self.config.no_sync_func = model.no_sync
            self.config.finalize_model_grads_func = finalize_model_grads
        if mixed:
            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

            self.optimizer = get_megatron_optimizer(OptimizerConfig(
                optimizer="adam", lr=o["learning_rate"], min_lr=0.0, weight_decay=o["weight_decay"],
                adam_beta1=o["adam_beta1"], adam_beta2=o["adam_beta2"], adam_eps=o["adam_epsilon"],
                clip_grad=o["max_grad_norm"] or 0.0, bf16=self.config.bf16, fp16=self.config.fp16,
                params_dtype=self.dtype, use_distributed_optimizer=o["use_distributed_optimizer"],
            ), [model])
        else:
            from .adamw import TorchAdamW

            self.optimizer = TorchAdamW(
                list(model.parameters()), lr=o["learning_rate"], weight_decay=o["weight_decay"],
                betas=(o["adam_beta1"], o["adam_beta2"]), eps=o["adam_epsilon"], clip_grad=o["max_grad_norm"] or 0.0,
            )
        if self.cuda:
            self.config.grad_scale_func = self.optimizer.scale_loss
        self.model = model.eval()
        warmup = 0 if o["lr_scheduler_type"] == "constant" else o["warmup_steps"]
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0, max_lr=o["learning_rate"], min_lr=o["min_lr"], lr_warmup_steps=warmup,
            lr_decay_steps=max(o["max_steps"], warmup + 1), lr_decay_style=DECAY_STYLES[o["lr_scheduler_type"]],
            start_wd=o["weight_decay"], end_wd=o["weight_decay"], wd_incr_steps=max(o["max_steps"], 1),
            wd_incr_style="constant",
            override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=False,  # on load: this run's lr and schedule
        )

    # ------------------------------------------------------------------ passes

    def _schedule(self) -> Any:
        if self.cuda:
            from megatron.core.pipeline_parallel import get_forward_backward_func

            return get_forward_backward_func()
        from .cpu_shim import forward_backward_local

        return forward_backward_local

    def _run(self, micros: list[Batch], loss_func_of: Any, forward_only: bool) -> list[dict[str, Any]]:
        """The micro-batches through megatron's schedule; returns the last stage's loss-function dicts."""
        import torch

        def forward_step(data_iterator: Iterator[Batch], model: Any) -> tuple[Any, Any]:
            micro = next(data_iterator)
            ids = micro["input_ids"]
            T = ids.shape[1]
            positions = torch.arange(T, device=ids.device)[None].expand_as(ids)
            # rows are right-padded, so causal is the whole mask (`attention.py`); SDPA builds none
            mask = torch.ones(T, T, dtype=torch.bool, device=ids.device).triu(1)[None, None] if self.causal_mask else None
            with self._hidden_states_out():
                out = model(ids, positions, mask)
            return out, lambda logits: loss_func_of(logits, micro)

        width = micros[0]["input_ids"].shape[1]
        return self._schedule()(
            forward_step_func=forward_step, data_iterator=iter(micros), model=[self.model],
            num_microbatches=len(micros), seq_length=width, micro_batch_size=len(micros[0]),
            decoder_seq_length=width, forward_only=forward_only,
        )

    @contextlib.contextmanager
    def _hidden_states_out(self) -> Iterator[None]:
        """With `chunked_lm_head`, the last stage's forward returns the last hidden states [B, T, H] in place of
        logits: its output layer passes them through (for that forward only; its weight stays where the
        mapping and the optimizer have it, and `_outputs` applies it in chunks, with its LoRA adapter's term)."""
        layer = getattr(self.module, "output_layer", None) if self.chunked_lm_head and self.last_stage else None
        if layer is None:
            yield
            return
        adapter = getattr(layer, "adapter", None)
        layer.forward = lambda hidden_states, *args, **kwargs: (hidden_states, None)
        if adapter is not None:
            adapter.deferred = True
        try:
            yield
        finally:
            del layer.forward  # the class's forward again
            if adapter is not None:
                adapter.deferred = False

    def _output_head(self) -> Any:
        """The output layer's weight (the embedding's where they are tied) without the vocabulary padding, and its
        LoRA adapter (`rlcore.head.HeadAdapter`, None without one) over the same rows."""
        from types import SimpleNamespace

        module = self.module
        tied = getattr(module, "share_embeddings_and_output_weights", False)
        weight = module.shared_embedding_or_output_weight() if tied else module.output_layer.weight
        bias = getattr(module.output_layer, "bias", None)
        vocab = self.spec.vocab_size
        adapter = getattr(module.output_layer, "adapter", None)
        return SimpleNamespace(weight=weight[:vocab], bias=None if bias is None else bias[:vocab],
                               adapter=None if adapter is None else adapter.head(vocab))

    def _outputs(self, logits: Any, micro: Batch, temperature: float) -> Any:
        """`ModelOutputs` of a last stage's forward: of its hidden states through the output layer in chunks
        (`chunked_lm_head`), else of its vocab-parallel logits."""
        if self.chunked_lm_head:
            from rlcore.batch import host_column
            from rlcore.head import HeadModelOutputs

            head = self._output_head()
            # Float16Module hands the last stage's output back in float32: the head runs in the model's dtype
            hidden = logits.to(head.weight.dtype)
            return HeadModelOutputs(hidden, head, micro["input_ids"], micro["attention_mask"], temperature,
                                    host_mask=host_column(micro, "attention_mask"))
        from .vocab_parallel import VocabParallelOutputs

        return VocabParallelOutputs(logits, micro["input_ids"], micro["attention_mask"], self.spec.vocab_size,
                                    self.tp_group, temperature)

    def _forward_chunks(self, batch: Batch, temperature: float, takes: list[tuple[Any, tuple[int, ...], Any]],
                        on_device: bool = False) -> list[Any]:
        """For each `(take, trailing, dtype)`: `take(outputs)` of every chunk of `logprob_micro_batch_size` rows,
        as one tensor [B, T, *trailing] on CPU (or the engine's device); one forward pass per chunk, computed on
        the last stage and broadcast over the pipeline."""
        import torch

        check_temperature(temperature)
        self._ensure_loaded()
        input_ids, attention_mask = token_columns(batch)
        where = self.device if on_device else "cpu"
        outs = [torch.zeros(*input_ids.shape, *trailing, dtype=dtype, device=where) for _, trailing, dtype in takes]
        lengths = attention_mask.sum(dim=1)
        self.model.eval()

        def loss_func(logits: Any, micro: Batch) -> tuple[Any, dict[str, Any]]:
            outputs = self._outputs(logits, micro, temperature)
            return logits.new_zeros(()), {"values": [take(outputs) for take, _, _ in takes]}

        with torch.no_grad():
            for start in range(0, len(batch), self.logprob_micro_batch_size):
                rows = slice(start, start + self.logprob_micro_batch_size)
                width = max(int(lengths[rows].max()), 1)
                micro = Batch({"input_ids": input_ids[rows, :width], "attention_mask": attention_mask[rows, :width]})
                micro = micro.to(self.device)
                result = self._run([micro], loss_func, forward_only=True)
                for i, (_, trailing, dtype) in enumerate(takes):
                    value = result[0]["values"][i] if self.last_stage else torch.empty(
                        micro["input_ids"].shape + trailing, dtype=dtype, device=self.device)
                    if self.pp > 1:
                        from megatron.core import parallel_state as ps

                        torch.distributed.broadcast(value, ps.get_pipeline_model_parallel_last_rank(), group=self.pp_group)
                    outs[i][rows, :width] = value
        return outs

    def forward_logprobs(self, batch: Batch, temperature: float = 1.0) -> Any:
        """Per-token log-probs [B, T] (CPU, float32), vocab-parallel, aligned as `rlcore.engines` says."""
        import torch

        return self._forward_chunks(batch, temperature, [(lambda o: o.logprobs(), (), torch.float32)])[0]

    def forward_topk(self, batch: Batch, k: int | None, temperature: float = 1.0, *, on_device: bool = False) -> TopK | Any:
        """Top-k log-probs (a `TopK` [B, T, k]: a top-k per vocabulary shard, then over the shards' candidates)
        or, for k=None, full-vocabulary log-probs [B, T, V] (gathered), on CPU (with `on_device`, on the
        engine's device)."""
        import torch

        if k is not None and (not isinstance(k, int) or k < 1):
            raise RlcoreError(f"forward_topk: k={k!r} must be a positive int or None (full vocabulary)")
        if k is None:
            full = (lambda o: o.full_logprobs(), (self.spec.vocab_size,), torch.float32)
            return self._forward_chunks(batch, temperature, [full], on_device)[0]
        k = min(k, self.spec.vocab_size)
        ids, values = self._forward_chunks(batch, temperature, [
            (lambda o: o.topk(k).ids, (k,), torch.long), (lambda o: o.topk(k).logprobs, (k,), torch.float32),
        ], on_device)
        return TopK(ids=ids, logprobs=values)

    def train_step(self, batch: Batch, loss_fn: LossFn, micro_batch_size: int, temperature: float = 1.0) -> dict[str, float]:
        """One optimizer step over `batch` in micro-batches through megatron's schedule (see
        `TrainEngine.train_step`). With pipeline stages every micro-batch has the batch's width and the
        same number of rows (so `len(batch)` must be a multiple of the micro-batch count)."""
        import torch

        check_train_step("megatron", self.forward_only, micro_batch_size, temperature)
        token_columns(batch)
        if len(batch) == 0:
            raise RlcoreError(f"train_step: rank {self.rank} got an empty batch")
        num_micro = math.ceil(len(batch) / micro_batch_size)
        if self.pp > 1 and len(batch) % num_micro:
            raise RlcoreError(
                f"train_step: with pipeline_model_parallel_size={self.pp} every micro-batch needs the same rows; "
                f"{len(batch)} rows do not split into {num_micro} equal micro-batches of at most {micro_batch_size}"
            )
        self._ensure_loaded()
        batch = trim_padding(batch)
        micros = [(m if self.pp > 1 else trim_padding(m)).to(self.device) for m in batch.split(num_micro)]

        def loss_func(logits: Any, micro: Batch) -> tuple[Any, dict[str, Any]]:
            loss, metrics = loss_fn(self._outputs(logits, micro, temperature), micro)
            # megatron's schedule divides by the micro-batch count; the contract's loss is already a share
            # tensors: read once the step is done (a float here would wait for the GPU each micro-batch)
            kept = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}
            return loss * num_micro, {"loss": loss.detach(), **kept}

        self._zero_grad()
        self.model.train()
        try:
            stored = self._run(micros, loss_func, forward_only=False)
        finally:
            self.model.eval()
        lr = self.optimizer.param_groups[0]["lr"]
        _, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=1)
        self._zero_grad()
        self.global_step += 1
        sums: dict[str, float] = {}
        for metrics in stored:
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + float(value)
        out = {key: (value if key == "loss" else value / num_micro) for key, value in sums.items()}
        if self.pp > 1:  # the metrics live on the last stage
            from megatron.core import parallel_state as ps

            box = [out]
            torch.distributed.broadcast_object_list(box, ps.get_pipeline_model_parallel_last_rank(), group=self.pp_group)
            out = box[0]
        out.update(grad_norm=float(grad_norm if grad_norm is not None else 0.0), learning_rate=float(lr))
        return out

    def _zero_grad(self) -> None:
        if hasattr(self.model, "zero_grad_buffer"):
            self.model.zero_grad_buffer()
        self.optimizer.zero_grad(set_to_none=True)

    # ------------------------------------------------------------------ weights out

    def _stage_tensors(self) -> Iterator[tuple[str, Any]]:
        """This stage's megatron tensors, tensor shards gathered (a collective over the tensor group)."""
        import torch

        for name, tensor in self.module.state_dict(keep_vars=True).items():
            if name.endswith("_extra_state") or not torch.is_tensor(tensor) or lora.is_adapter_key(name):
                continue
            adapter = self.adapters.get(name.removesuffix(".weight"))  # W + scale * B @ A, out of place
            tensor = adapter.merged(tensor) if adapter is not None and name.endswith(".weight") else tensor.detach()
            if self.tp > 1 and not name.endswith("layernorm.weight"):
                parts = [torch.empty_like(tensor) for _ in range(self.tp)]
                torch.distributed.all_gather(parts, tensor.contiguous(), group=self.tp_group)
                tensor = mapping.merge_tp(name, parts)
            yield name, tensor

    def hf_tensors(self) -> Iterator[tuple[str, Any]]:
        """All weights in Hugging Face names, on every rank of the group (a collective: every rank calls it).

        Tensor shards are gathered over the tensor group; each pipeline stage's tensors are broadcast from
        the stage that owns them over the pipeline group, all before the first yield (so consumers on
        different ranks never interleave collectives). Every rank can then feed its own colocated rollout.
        """
        import torch

        self._ensure_loaded()
        with torch.no_grad():
            mine = list(mapping.megatron_to_hf(dict(self._stage_tensors()), self.spec, pp_rank=self.pp_rank, pp=self.pp))
            if self.pp == 1:
                yield from mine
                return
            ranks = torch.distributed.get_process_group_ranks(self.pp_group)
            everything: list[tuple[str, Any]] = []
            for stage in range(self.pp):
                box = [[(n, tuple(t.shape), str(t.dtype)) for n, t in mine] if stage == self.pp_rank else None]
                torch.distributed.broadcast_object_list(box, ranks[stage], group=self.pp_group)
                owned = dict(mine) if stage == self.pp_rank else {}
                for name, shape, dtype in box[0]:
                    tensor = owned[name].contiguous() if owned else torch.empty(
                        shape, dtype=getattr(torch, dtype.removeprefix("torch.")), device=self.device)
                    torch.distributed.broadcast(tensor, ranks[stage], group=self.pp_group)
                    everything.append((name, tensor))
            yield from everything

    def export_weights(self, bucket_bytes: int = 512 << 20) -> Iterator[NamedTensors]:
        """Weights in Hugging Face names in buckets, on every rank (every rank of the group must call it)."""
        from rlcore.runtime import iter_buckets

        if bucket_bytes < 1:
            raise RlcoreError(f"export_weights: bucket_bytes={bucket_bytes!r} must be positive")
        yield from iter_buckets(self.hf_tensors(), bucket_bytes)

    def state(self) -> dict[str, Any]:
        return {
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "num_parameters": sum(p.numel() for p in self.module.parameters()),
            "num_trainable_parameters": sum(p.numel() for p in self.module.parameters() if p.requires_grad),
            "lora": bool(self.adapters),
            "global_step": self.global_step,
            "rank": self.rank,
            "world_size": self.world_size,
            "tensor_model_parallel_size": self.tp,
            "pipeline_model_parallel_size": self.pp,
            "forward_only": self.forward_only,
        }
