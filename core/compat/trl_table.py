"""What rlcore does with every field of TRL 1.16's GRPOConfig, GKDConfig (trl.experimental.gkd), SFTConfig and
transformers' TrainingArguments, as data: `rlcore.compat.trl_names` applies it, docs/migrating/trl.md lists it
and tests/core/test_trl_table.py walks the dataclasses' own fields against it, so a new TRL key fails a test.

Each field has one `Answer`:
- `rlcore`: an rlcore key of that name, or one the translation maps it onto (`why` says which);
- `noted`: asks for nothing rlcore must do (logging cosmetics, a speed switch): taken and listed once on stderr;
- `unless`: a feature rlcore does not build; at TRL's default (or an `accept`ed value) it asks for nothing and is
  listed with the noted keys, any other value is refused in one line with `why`.
For sft and pt, whose workers run TRL's SFTTrainer or transformers' Trainer, a field of that trainer's arguments
that the config does not have itself is passed to it (`trainer_kwargs`), unless its answer is `held` (rlcore's own
loop does that part: checkpoints, logging, hub pushes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Answer:
    """What rlcore does with one of TRL's keys (see the module docstring)."""

    what: str  # "rlcore", "noted" or "unless"
    why: str
    default: Any = None
    accept: tuple[Any, ...] = ()
    held: bool = False

    def asks_nothing(self, value: Any) -> bool:
        """The value leaves the feature off: TRL's default, an accepted value, or empty."""
        return value == self.default or value in self.accept or value in (None, [], {}, "")


def rlcore(where: str) -> Answer:
    return Answer("rlcore", where)


def noted(why: str, held: bool = True) -> Answer:
    return Answer("noted", why, held=held)


def unless(default: Any, why: str, *accept: Any, held: bool = False) -> Answer:
    return Answer("unless", why, default, accept, held)


HUB = ("rlcore pushes nothing to the Hugging Face Hub; upload the run's model afterwards (`hf upload REPO "
       "OUTPUT_DIR/checkpoint-N`)")
EVAL = ("rlcore runs no evaluation loop for this algorithm (gkd holds eval_size rows out and logs eval/jsd every "
        "eval_steps); drop it")
DDP = "rlcore sets up its workers' DDP itself (gloo on the CPU, NCCL on GPUs); drop it"
SHARDED = ("rlcore trains every worker with DDP (or the megatron engine's tensor and pipeline parallelism), not "
           "FSDP or DeepSpeed; set lora_rank, gradient_checkpointing or train.engine megatron if the model does not fit")
LOGGED = "rlcore logs every step to metrics.jsonl and prints one line every logging_steps"
DATA_ORDER = "rlcore reads the prompts in an order set by seed, reshuffled each epoch, and resumes it exactly"
COMPILE = "rlcore's engines do not torch.compile the model; drop it"
VLLM_SERVER = ("rlcore places vLLM as a role of the run (rollout:, colocated or separate), never as an external "
               "server; drop it")
NOT_LOGGED = "rlcore logs each step's metrics (metrics.jsonl), not the completions' text"

# transformers' TrainingArguments (every TRL config's base)
TRAINING_ARGUMENTS: dict[str, Answer] = {
    "output_dir": rlcore("output_dir (TRL's null: rlcore's default, output)"),
    "per_device_train_batch_size": rlcore("per_device_train_batch_size"),
    "num_train_epochs": rlcore("num_train_epochs (sft, pt); grpo and gkd: max_steps from the dataset's rows"),
    "max_steps": rlcore("max_steps (TRL's -1: train num_train_epochs)"),
    "learning_rate": rlcore("learning_rate"),
    "lr_scheduler_type": rlcore("lr_scheduler_type"),
    "lr_scheduler_kwargs": unless(None, "rlcore's schedules take warmup_steps and min_lr (the cosine's floor); give "
                                  "those keys"),
    "warmup_steps": rlcore("warmup_steps"),
    "optim": unless("adamw_torch_fused", "rlcore's train engines step torch's AdamW (adam_beta1, adam_beta2, "
                    "adam_epsilon, weight_decay); use adamw_torch, or drop it", "adamw_torch"),
    "optim_args": unless(None, "rlcore's optimizer is torch's AdamW; give its options as adam_beta1, adam_beta2, "
                         "adam_epsilon, weight_decay"),
    "weight_decay": rlcore("weight_decay"),
    "adam_beta1": rlcore("adam_beta1"),
    "adam_beta2": rlcore("adam_beta2"),
    "adam_epsilon": rlcore("adam_epsilon"),
    "optim_target_modules": unless(None, "it picks the modules of GaLore-like optimizers, which rlcore does not build"),
    "gradient_accumulation_steps": rlcore("gradient_accumulation_steps"),
    "average_tokens_across_devices": unless(True, "rlcore normalises the loss over the optimizer step's tokens on "
                                            "every worker (grpo: as loss_type says); drop it"),
    "max_grad_norm": rlcore("max_grad_norm"),
    "label_smoothing_factor": unless(0.0, "rlcore's losses have no label smoothing; drop it"),
    "bf16": rlcore("bf16 (sft, pt: mixed precision; grpo, gkd, sample: every role's dtype bfloat16)"),
    "fp16": rlcore("fp16 (as bf16, in float16)"),
    "bf16_full_eval": unless(False, EVAL),
    "fp16_full_eval": unless(False, EVAL),
    "tf32": unless(None, "rlcore leaves TF32 matmuls at PyTorch's default; drop it"),
    "activation_checkpointing": rlcore("gradient_checkpointing (transformers 5's name)"),
    "activation_checkpointing_kwargs": noted("rlcore's hf engine recomputes each layer without re-entrant autograd "
                                             "(use_reentrant: false); the gradients are the same", held=False),
    "gradient_checkpointing": rlcore("gradient_checkpointing (grpo, gkd: train.gradient_checkpointing)"),
    "gradient_checkpointing_kwargs": noted("rlcore's hf engine recomputes each layer without re-entrant autograd "
                                           "(use_reentrant: false); the gradients are the same", held=False),
    "torch_compile": unless(False, COMPILE),
    "torch_compile_backend": unless(None, COMPILE),
    "torch_compile_mode": unless(None, COMPILE),
    "use_liger_kernel": unless(False, "Liger kernels are not built in rlcore's engines; drop it"),
    "liger_kernel_config": unless(None, "Liger kernels are not built in rlcore's engines; drop it"),
    "use_cache": unless(False, "rlcore trains without the KV cache and generates with it, whatever this says; drop it"),
    "neftune_noise_alpha": unless(None, "NEFTune's embedding noise is not built in rlcore; drop it"),
    "torch_empty_cache_steps": noted("rlcore empties the CUDA cache where its roles hand memory over; memory only"),
    "auto_find_batch_size": unless(False, "rlcore plans memory before it starts (rlcore plan, --fit picks the batch); "
                                   "drop it"),
    "logging_strategy": unless("steps", LOGGED + "; use logging_steps", held=True),
    "logging_steps": rlcore("logging_steps"),
    "logging_first_step": noted("rlcore's metrics.jsonl has every step, the first too"),
    "log_on_each_node": noted("rlcore logs from the driver, once per run"),
    "logging_nan_inf_filter": noted("rlcore logs every step's values as they are; on_nonfinite says what a NaN step "
                                    "does"),
    "include_num_input_tokens_seen": noted("rlcore logs each step's token counts in metrics.jsonl"),
    "log_level": rlcore("log_level (TRL's passive: rlcore's default, info; critical: error)"),
    "log_level_replica": noted("rlcore logs from the driver; its workers' messages reach it"),
    "disable_tqdm": noted("rlcore draws its own progress bar, on a terminal only"),
    "report_to": rlcore("report_to (tensorboard, wandb with rlcore[tensorboard], rlcore[wandb]; none)"),
    "run_name": rlcore("run_name (the W&B run's name)"),
    "project": noted("the Trackio/W&B project name of TRL's loggers; rlcore's W&B logger reads wandb_project"),
    "trackio_space_id": unless(None, "Trackio is not one of rlcore's loggers (report_to: tensorboard, wandb)"),
    "trackio_bucket_id": unless(None, "Trackio is not one of rlcore's loggers (report_to: tensorboard, wandb)"),
    "trackio_static_space_id": unless(None, "Trackio is not one of rlcore's loggers (report_to: tensorboard, wandb)"),
    "eval_strategy": unless("no", EVAL),
    "eval_steps": rlcore("eval_steps (gkd)"),
    "eval_delay": unless(0, EVAL),
    "per_device_eval_batch_size": noted("no evaluation batches here (gkd scores its eval_size rows in one batch)"),
    "prediction_loss_only": noted("no predictions are kept: rlcore's evaluation logs losses only"),
    "eval_on_start": unless(False, EVAL),
    "eval_do_concat_batches": noted("no predictions are kept: rlcore's evaluation logs losses only"),
    "eval_use_gather_object": noted("no predictions are kept: rlcore's evaluation logs losses only"),
    "eval_accumulation_steps": noted("no predictions are kept: rlcore's evaluation logs losses only"),
    "include_for_metrics": unless([], EVAL),
    "batch_eval_metrics": unless(False, EVAL),
    "save_only_model": noted("rlcore's checkpoints keep the optimizer and RNG state, so --resume continues exactly; "
                             "save_total_limit bounds their disk"),
    "save_strategy": unless("steps", "rlcore writes a checkpoint every save_steps (0: at the end only); use "
                            "save_steps", held=True),
    "save_steps": rlcore("save_steps"),
    "save_on_each_node": noted("rlcore's driver writes each checkpoint once, into output_dir"),
    "save_total_limit": rlcore("save_total_limit"),
    "enable_jit_checkpoint": unless(False, "rlcore checkpoints on a signal itself (SIGINT, SIGTERM: after the step); "
                                    "drop it", held=True),
    "push_to_hub": unless(False, HUB, held=True),
    "hub_token": unless(None, HUB, held=True),
    "hub_private_repo": unless(None, HUB, held=True),
    "hub_model_id": unless(None, HUB, held=True),
    "hub_strategy": unless("every_save", HUB, held=True),
    "hub_always_push": unless(False, HUB, held=True),
    "hub_revision": unless(None, HUB, held=True),
    "load_best_model_at_end": unless(False, EVAL),
    "metric_for_best_model": unless(None, EVAL),
    "greater_is_better": unless(None, EVAL),
    "ignore_data_skip": unless(False, "--resume continues the data where the checkpoint left it, always; drop it",
                               held=True),
    "restore_callback_states_from_checkpoint": unless(False, "rlcore has no trainer callbacks to restore; drop it",
                                                      held=True),
    "full_determinism": unless(False, "rlcore seeds every role from seed, but does not switch PyTorch to its "
                               "deterministic kernels; drop it"),
    "seed": rlcore("seed"),
    "data_seed": unless(None, DATA_ORDER + "; drop it"),
    "use_cpu": unless(False, "the placement picks the device: gpus: 0 (or a device group with device: CPU) runs on "
                      "the CPU", held=True),
    "accelerator_config": unless(None, "rlcore does not run through Accelerate's launcher; drop it", held=True),
    "parallelism_config": unless(None, SHARDED, held=True),
    "dataloader_drop_last": noted(DATA_ORDER + ": every batch is full, running on across epoch ends", held=False),
    "dataloader_num_workers": rlcore("dataloader_num_workers (sft, pt; elsewhere the driver reads the prompts)"),
    "dataloader_pin_memory": noted("speed only", held=False),
    "dataloader_persistent_workers": noted("speed only", held=False),
    "dataloader_prefetch_factor": noted("speed only", held=False),
    "dataloader_multiprocessing_context": noted("speed only", held=False),
    "dataloader_in_order": noted(DATA_ORDER, held=False),
    "remove_unused_columns": noted("rlcore passes every column of a row to the reward functions and keeps what the "
                                   "trainer needs", held=False),
    "label_names": unless(None, "rlcore's losses read the completion tokens' labels themselves; drop it"),
    "train_sampling_strategy": unless("random", DATA_ORDER + "; drop it"),
    "length_column_name": noted("rlcore does not group rows by length", held=False),
    "ddp_find_unused_parameters": unless(None, DDP, held=True),
    "ddp_bucket_cap_mb": noted("speed only", held=False),
    "ddp_broadcast_buffers": unless(None, DDP, held=True),
    "ddp_static_graph": noted("speed only", held=False),
    "ddp_backend": unless(None, DDP, held=True),
    "ddp_timeout": noted("rlcore bounds a silent worker by worker_timeout_s (Ray)", held=False),
    "fsdp": unless(None, SHARDED, "", held=True),
    "fsdp_config": unless(None, SHARDED, held=True),
    "deepspeed": unless(None, SHARDED, held=True),
    "debug": unless("", "transformers' TPU debug metrics are not built in rlcore; drop it", held=True),
    "skip_memory_metrics": unless(True, "rlcore logs no memory metrics (`rlcore plan` shows the memory plan); drop it",
                                  held=False),
    "do_train": noted("transformers' example scripts' switch; rlcore run trains"),
    "do_eval": noted("transformers' example scripts' switch; " + EVAL),
    "do_predict": noted("transformers' example scripts' switch; rlcore predicts nothing"),
    "resume_from_checkpoint": unless(None, "use resume: auto (or a checkpoint's path), or --resume", held=True),
    "local_rank": noted("set by the launcher; rlcore sets LOCAL_RANK for each worker"),
}

GENERATION = "rlcore's rollout engines sample with temperature, top_p and top_k only; drop it"
ENTROPY = "entropy regularisation is not built in rlcore's GRPO loss; drop it"

# TRL's GRPOConfig beyond TrainingArguments
GRPO_CONFIG: dict[str, Answer] = {
    "model_init_kwargs": unless(None, "give the model's dtype as dtype (train.dtype, rollout.dtype); other "
                                "from_pretrained options are not read"),
    "trust_remote_code": rlcore("refused when true: rlcore never runs a model repository's own code"),
    "router_aux_loss_coef": unless(None, "rlcore adds no MoE router loss; drop it"),
    "disable_dropout": unless(False, "rlcore trains with the model's own dropout rates (its config.json); set them "
                              "to 0 there"),
    "cast_lm_head_to_fp32": unless(False, "rlcore runs the lm_head in the model's dtype and its log-softmax in "
                                   "float32; drop it"),
    "num_generations": rlcore("num_generations"),
    "num_generations_eval": unless(None, EVAL),
    "max_completion_length": rlcore("max_completion_length (sample: max_new_tokens)"),
    "ds3_gather_for_generation": noted("DeepSpeed ZeRO-3 only, which rlcore does not use"),
    "shuffle_dataset": unless(True, DATA_ORDER + "; drop it"),
    "pad_to_multiple_of": noted("padding only: rlcore's engines pad (or pack) as their kernels need"),
    "generation_batch_size": unless(None, "rlcore's generation batch is per_device_train_batch_size x train workers x "
                                    "steps_per_generation; set steps_per_generation"),
    "steps_per_generation": rlcore("steps_per_generation"),
    "temperature": rlcore("temperature"),
    "top_p": rlcore("top_p"),
    "top_k": rlcore("top_k"),
    "min_p": unless(None, GENERATION),
    "generation_kwargs": unless(None, GENERATION + " (or a vLLM option in rollout.vllm_engine_kwargs)"),
    "chat_template_kwargs": rlcore("chat_template_kwargs (enable_thinking is read; other template options too)"),
    "repetition_penalty": unless(1.0, GENERATION + "; the repetition reward penalises repeats"),
    "cache_implementation": noted("generation's KV cache layout: speed only"),
    "use_vllm": rlcore("rollout.engine (vllm or hf)"),
    "vllm_mode": unless("colocate", VLLM_SERVER + " (colocate_groups: [[train, rollout]] shares the GPUs)"),
    "vllm_model_impl": unless("vllm", "rlcore's vLLM rollout loads vLLM's own implementation; drop it"),
    "vllm_enable_sleep_mode": noted("rlcore sleeps a colocated vLLM at sleep_level while the train role steps"),
    "vllm_structured_outputs_regex": unless(None, "structured generation is not built in rlcore; drop it"),
    "vllm_server_base_url": unless(None, VLLM_SERVER),
    "vllm_server_host": unless("0.0.0.0", VLLM_SERVER),
    "vllm_server_port": unless(8000, VLLM_SERVER, [8000]),  # ms-swift's default is a list
    "vllm_server_timeout": unless(240.0, VLLM_SERVER),
    "vllm_group_port": unless(51216, "rlcore's weight sync picks its own port (weight_sync_backend); drop it"),
    "vllm_gpu_memory_utilization": rlcore("rollout.vllm_gpu_memory_utilization"),
    "vllm_max_model_length": rlcore("rollout.vllm_max_model_len"),
    "vllm_tensor_parallel_size": rlcore("rollout.vllm_tensor_parallel_size"),
    "beta": rlcore("beta"),
    "num_iterations": rlcore("num_iterations"),
    "epsilon": rlcore("epsilon"),
    "delta": rlcore("delta"),
    "epsilon_high": rlcore("epsilon_high"),
    "sapo_temperature_neg": unless(1.05, "TRL's SAPO loss is not built in rlcore (loss_type: grpo, bnpo, dr_grpo, "
                                   "dapo); drop it"),
    "sapo_temperature_pos": unless(1.0, "TRL's SAPO loss is not built in rlcore; drop it"),
    "vespo_k_pos": unless(2.0, "TRL's VESPO loss is not built in rlcore; drop it"),
    "vespo_lambda_pos": unless(3.0, "TRL's VESPO loss is not built in rlcore; drop it"),
    "vespo_k_neg": unless(3.0, "TRL's VESPO loss is not built in rlcore; drop it"),
    "vespo_lambda_neg": unless(2.0, "TRL's VESPO loss is not built in rlcore; drop it"),
    "importance_sampling_level": rlcore("importance_sampling_level"),
    "reward_weights": rlcore("reward_weights"),
    "multi_objective_aggregation": unless("sum_then_normalize", "rlcore sums the weighted rewards, then normalises "
                                          "(TRL's default); drop it"),
    "scale_rewards": rlcore("scale_rewards"),
    "loss_type": rlcore("loss_type (grpo, bnpo, dr_grpo, dapo)"),
    "mask_truncated_completions": rlcore("mask_truncated_completions"),
    "sync_ref_model": unless(False, "rlcore's reference model stays the starting policy (TR-DPO's sync is not "
                             "built); drop it"),
    "ref_model_mixup_alpha": noted("only with sync_ref_model, which is not built"),
    "ref_model_sync_steps": noted("only with sync_ref_model, which is not built"),
    "top_entropy_quantile": unless(1.0, ENTROPY),
    "entropy_coef": unless(0.0, ENTROPY),
    "use_adaptive_entropy": unless(False, ENTROPY),
    "entropy_coef_min": noted("only with use_adaptive_entropy, which is not built"),
    "entropy_coef_max": noted("only with use_adaptive_entropy, which is not built"),
    "entropy_coef_delta": noted("only with use_adaptive_entropy, which is not built"),
    "entropy_target": noted("only with use_adaptive_entropy, which is not built"),
    "max_tool_calling_iterations": rlcore("max_turns (tool rounds + 1)"),
    "vllm_importance_sampling_correction": rlcore("vllm_importance_sampling_correction"),
    "vllm_importance_sampling_mode": rlcore("vllm_importance_sampling_mode"),
    "vllm_importance_sampling_clip_max": rlcore("vllm_importance_sampling_clip_max"),
    "vllm_importance_sampling_clip_min": rlcore("vllm_importance_sampling_clip_min"),
    "vllm_importance_sampling_cap": rlcore("vllm_importance_sampling_clip_max (TRL's older name)"),
    "off_policy_mask_threshold": unless(None, "TRL's off-policy sequence mask is not built in rlcore (its "
                                        "vllm_importance_sampling_* keys correct the rollout's drift); drop it"),
    "use_bias_correction_kl": rlcore("use_bias_correction_kl"),
    "log_completions": noted(NOT_LOGGED),
    "log_multimodal": noted(NOT_LOGGED),
    "num_completions_to_print": noted(NOT_LOGGED),
    "log_unique_prompts": noted(NOT_LOGGED),
    "log_completions_hub_repo": unless(None, HUB),
    "use_transformers_continuous_batching": noted("the hf rollout engine's batching: speed only"),
    "transformers_continuous_batching_config": noted("the hf rollout engine's batching: speed only"),
    "use_transformers_paged": noted("the hf rollout engine's KV cache: speed only"),
}

# TRL's SFTConfig beyond TrainingArguments (passed to TRL's SFTTrainer for sft)
SFT_CONFIG: dict[str, Answer] = {
    "model_init_kwargs": unless(None, "give the model's dtype as dtype; other from_pretrained options are not read"),
    "trust_remote_code": rlcore("refused when true: rlcore never runs a model repository's own code"),
    "router_aux_loss_coef": unless(None, "rlcore adds no MoE router loss; drop it"),
    "chat_template_path": unless(None, "the tokenizer's own chat template is used (sft passes it to TRL)"),
    "dataset_text_field": unless("text", "rlcore reads a row's text from its text column (pt) or its messages / "
                                 "prompt and completion (sft)"),
    "dataset_kwargs": unless(None, "rlcore reads the dataset's rows as they are (sft passes it to TRL)"),
    "dataset_num_proc": noted("rlcore tokenises each node's rows once; speed only"),
    "eos_token": unless(None, "the tokenizer's own end-of-sequence token is used (sft passes it to TRL)"),
    "max_length": rlcore("max_length (sft, pt)"),
    "truncation_mode": unless("keep_start", "rows longer than max_length keep their start here (sft passes it to TRL)"),
    "shuffle_dataset": unless(False, DATA_ORDER + " (sft passes it to TRL)"),
    "packing": rlcore("packing (sft, pt)"),
    "packing_strategy": unless("bfd", "packing concatenates rows here (sft passes it to TRL)"),
    "padding_free": rlcore("padding_free (sft)"),
    "pad_to_multiple_of": noted("padding only: rlcore's engines pad (or pack) as their kernels need"),
    "eval_packing": unless(None, EVAL),
    "completion_only_loss": rlcore("completion_only_loss (sft)"),
    "assistant_only_loss": rlcore("assistant_only_loss (sft)"),
    "loss_type": unless("nll", "TRL's SFT losses other than nll are not built in gkd (sft passes it to TRL)"),
    "activation_offloading": unless(False, "activation offloading is not built in rlcore's engines (sft passes it "
                                    "to TRL); use gradient_checkpointing"),
    "pad_token": unless(None, "the tokenizer's pad token (else its end-of-sequence token) is used (sft passes it to "
                        "TRL)"),
}

# TRL's GKDConfig (trl.experimental.gkd) beyond SFTConfig
GKD_CONFIG: dict[str, Answer] = {
    "temperature": rlcore("temperature"),
    "lmbda": rlcore("lmbda"),
    "beta": rlcore("beta"),
    "max_new_tokens": rlcore("max_completion_length (gkd)"),
    "teacher_model_name_or_path": rlcore("teacher_model (gkd)"),
    "teacher_model_init_kwargs": unless(None, "give the teacher's dtype as teacher.dtype; other from_pretrained "
                                        "options are not read"),
    "disable_dropout": unless(True, "rlcore trains with the model's own dropout rates (its config.json); set them "
                              "to 0 there", False),
    "seq_kd": rlcore("seq_kd"),
}

TABLES = {"TrainingArguments": TRAINING_ARGUMENTS, "GRPOConfig": GRPO_CONFIG, "SFTConfig": SFT_CONFIG,
          "GKDConfig": GKD_CONFIG}
SECRET = ("hub_token",)  # never echoed


def answer(key: str) -> tuple[str, Answer] | None:
    """(the TRL config that defines `key`, what rlcore does with it), the most specific config first."""
    for owner in ("GKDConfig", "GRPOConfig", "SFTConfig", "TrainingArguments"):
        if key in TABLES[owner]:
            return owner, TABLES[owner][key]
    return None


def passed_to(kind: str) -> set[str]:
    """The keys rlcore passes to the trainer of an sft (TRL's SFTConfig) or pt (TrainingArguments) worker."""
    tables = [TRAINING_ARGUMENTS, SFT_CONFIG] if kind == "sft" else [TRAINING_ARGUMENTS]
    return {key for table in tables for key, a in table.items() if a.what != "rlcore" and not a.held}
