"""`VLLMRolloutEngine`: rlcore's rollout (and teacher) engine over vLLM's offline `LLM`.

By default vLLM's engine core runs in the worker's own process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so
new weights are loaded in place through the model's `load_weights` without a copy through another
process. With `vllm_in_process=False` (and always with tensor parallelism) the engine core has processes
of its own, which overlap scheduling and output processing with the GPU; weights then reach each vLLM
worker through `collective_rpc` as a CUDA IPC handle of a flat bucket (each worker maps it, on its own GPU
or a peer's, and copies), and a broadcast group from the trainer is joined by the workers themselves. Log-probs
of sampled tokens come from vLLM's `logprobs_mode="processed_logprobs"`: the distribution the sampler drew
from, after temperature (and top-k/top-p), which is what importance sampling against the trainer needs.
Options are spelled as ms-swift spells them (`vllm_gpu_memory_utilization`, ...).

New weights go through vLLM's own `load_weights` once per bucket layout, traced; the later buckets of that
layout replay the traced copies as one batched copy (`weight_replay.py`), skipping vLLM's per-tensor
Python loaders (`vllm_weight_replay=False` keeps the loaders for every bucket).

Two choices keep generation near raw vLLM's speed (`benchmarks/vllm_generate.py` measures each):
- completions are decoded to text after generation, each in one tokenizer call, not token by token
  inside vLLM's engine loop;
- requests are not seeded one by one: vLLM's sampler draws seeded rows one kernel at a time, every token.
  The engine is seeded once at creation (`seed`); `vllm_request_seeds=True` passes `SamplingParams.seed`
  on to every request, for samples that do not depend on what else is in the batch.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from rlcore import ConfigError, Generation, RlcoreError, RolloutEngine, SamplingParams, TopK
from rlcore.engines import CheckpointLayout, checkpoint_layout, resolve_dtype

if TYPE_CHECKING:
    import torch

SLEEP_TAGS = ("weights", "kv_cache")
DEFAULT_MAX_LOGPROBS = 20  # vLLM's default cap on logprobs / prompt_logprobs per position

# Engine arguments that this engine sets itself from its own options; passing them in
# vllm_engine_kwargs would be ambiguous, so the error names the option to use instead.
_OWN_ENGINE_ARGS = {
    "model": "model",
    "tensor_parallel_size": "vllm_tensor_parallel_size",
    "gpu_memory_utilization": "vllm_gpu_memory_utilization",
    "max_model_len": "vllm_max_model_len",
    "enforce_eager": "vllm_enforce_eager",
    "enable_sleep_mode": "vllm_enable_sleep_mode",
    "dtype": "dtype",
    "seed": "seed",
    "logprobs_mode": "(none: this engine needs 'processed_logprobs')",
    "enable_lora": "vllm_enable_lora",
    "max_lora_rank": "vllm_max_lora_rank",
    "max_loras": "(none: the engine serves one adapter, the trained one)",
}
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's MaxLoRARanks


def _validate(
    model: str,
    tensor_parallel_size: int,
    gpu_memory_utilization: float,
    max_model_len: int | None,
    engine_kwargs: dict[str, Any],
    device: str = "cuda",
    max_lora_rank: int | None = None,
) -> None:
    problems: list[tuple[str, str]] = []
    if not str(device).startswith("cuda"):  # the session passes the role's device from the resource plan
        problems.append(("device", f"the vllm engine runs on GPUs, but this role is placed on '{device}'; give the "
                         "role GPUs (e.g. rollout.gpus: 1, or a GPU device group) or use engine hf"))
    if not isinstance(model, str) or not model:
        problems.append(("model", f"a model directory or hub name is required, got {model!r}"))
    if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
        problems.append(("vllm_tensor_parallel_size", f"must be an integer >= 1, got {tensor_parallel_size!r}"))
    if not isinstance(gpu_memory_utilization, (int, float)) or not 0 < gpu_memory_utilization <= 1:
        problems.append(("vllm_gpu_memory_utilization", f"must be in (0, 1], got {gpu_memory_utilization!r}"))
    if max_model_len is not None and (not isinstance(max_model_len, int) or max_model_len < 1):
        problems.append(("vllm_max_model_len", f"must be a positive integer or None, got {max_model_len!r}"))
    if max_lora_rank is not None and max_lora_rank not in LORA_RANKS:
        problems.append(("vllm_max_lora_rank", f"must be one of vLLM's ranks {', '.join(map(str, LORA_RANKS))}, got {max_lora_rank!r}"))
    if not isinstance(engine_kwargs, dict):
        problems.append(("vllm_engine_kwargs", f"must be a mapping of vLLM engine arguments, got {type(engine_kwargs).__name__}"))
    else:
        for key in sorted(set(engine_kwargs) & set(_OWN_ENGINE_ARGS)):
            problems.append((f"vllm_engine_kwargs.{key}", f"is set by this engine; use {_OWN_ENGINE_ARGS[key]} instead"))
    if problems:
        lines = "\n".join(f"  {key}: {msg}" for key, msg in problems)
        raise ConfigError(f"invalid vllm engine options ({len(problems)}):\n{lines}", problems)


def check_options(model: str = "", vllm_tensor_parallel_size: int = 1, vllm_engine_kwargs: Any = None,
                  vllm_enable_lora: bool = False, vllm_max_lora_rank: int = 16, vllm_max_model_len: Any = None,
                  **_: Any) -> list[tuple[str, str]]:
    """`EngineSpec.check`: a LoRA rank vLLM takes, a context the model holds, then `_model_problems`."""
    lora = []
    if vllm_enable_lora and vllm_max_lora_rank not in LORA_RANKS:
        lora.append(("vllm_max_lora_rank", f"({vllm_max_lora_rank}) is no rank vLLM takes; use one of "
                                           f"{', '.join(map(str, LORA_RANKS))}"))
    if vllm_enable_lora and model and _conditional(model):
        lora.append(("vllm_enable_lora", f"'{model}' is a conditional-generation checkpoint, whose adapter rlcore "
                                         "writes in its causal LM's module names, which vLLM does not map into it; "
                                         "set vllm_enable_lora: false (the sync then sends the merged weights)"))
    return lora + _context_problems(model, vllm_max_model_len) + _model_problems(model, vllm_tensor_parallel_size,
                                                                                vllm_engine_kwargs)


def _conditional(model: str) -> bool:
    try:
        return checkpoint_layout(model) is not None
    except ConfigError:  # no language model in it: the train engine's check names that
        return False


def _context_problems(model: str, max_model_len: Any) -> list[tuple[str, str]]:
    """`vllm_max_model_len` against the positions the model takes (config.json, with rope scaling), which vLLM
    refuses to exceed."""
    from rlcore.engines import read_model

    files = read_model(model) if model and isinstance(max_model_len, int) and not isinstance(max_model_len, bool) else None
    context = files.context() if files is not None else None
    if context is None or max_model_len <= context[0]:
        return []
    limit, how = context
    return [("vllm_max_model_len", f"{max_model_len} tokens is longer than the context of model '{model}': {limit} positions "
             f"({how}, config.json); set it to at most {limit}, or use a model with a longer context")]


def _model_problems(model: str, vllm_tensor_parallel_size: int, vllm_engine_kwargs: Any) -> list[tuple[str, str]]:
    """The model's architecture against the installed vLLM's (where vLLM is installed), and the tensor size against
    its heads, read from its config.json (vLLM splits the attention heads evenly over the ranks, and the KV heads
    too, or replicates them where there are fewer)."""
    from rlcore.engines import read_model

    files = read_model(model) if model else None
    impl = (vllm_engine_kwargs or {}).get("model_impl", "auto") if isinstance(vllm_engine_kwargs, dict) else "auto"
    if files is not None and impl != "transformers":
        unsupported = unsupported_architecture(files.config.get("architectures"))
        if unsupported:
            return [("model", f"'{model}' is a {unsupported}, which vLLM {_vllm_version()} does not serve "
                              f"(config.json architectures); use the rollout engine hf, or try vLLM's Transformers "
                              f"backend with vllm_engine_kwargs.model_impl=transformers")]
    size = vllm_tensor_parallel_size
    if files is None or not isinstance(size, int) or size <= 1:
        return []
    heads, kv = files.value("num_attention_heads"), files.value("num_key_value_heads")
    if not isinstance(heads, int):
        return []
    kv = kv if isinstance(kv, int) else heads
    divisors = ", ".join(str(n) for n in range(1, heads + 1) if heads % n == 0 and (kv % n == 0 or n % kv == 0))
    fix = f"use a size that splits them evenly ({divisors})"
    if heads % size:
        return [("vllm_tensor_parallel_size", f"{size} does not divide the {heads} attention heads of '{model}' "
                 f"(num_attention_heads, config.json); {fix}")]
    if kv % size and size % kv:
        return [("vllm_tensor_parallel_size", f"{size} neither divides nor is a multiple of the {kv} KV heads of "
                 f"'{model}' (num_key_value_heads, config.json); {fix}")]
    return []


def unsupported_architecture(architectures: Any) -> str | None:
    """The first of a config's `architectures` that the installed vLLM's registry lacks, where it lacks all of
    them (vLLM serves a model by any one it knows); None where vLLM is not installed here or knows one. The
    text-only Qwen3.5 (`Qwen3_5ForCausalLM`) is such a case for vLLM 0.26, which serves Qwen3.5 only as the
    published `Qwen3_5ForConditionalGeneration`."""
    if not isinstance(architectures, list) or not architectures:
        return None
    try:
        from vllm.model_executor.models import ModelRegistry
    except Exception:  # no vLLM here (a CPU machine validating for a GPU one): the engine reports it when built
        return None
    supported = set(ModelRegistry.get_supported_archs())
    return None if any(a in supported for a in architectures) else str(architectures[0])


def _vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vllm")
    except PackageNotFoundError:
        return "(not installed)"


def _loader(holder: Any, model: Any, replay: bool = True, layout: CheckpointLayout | None = None) -> Any:
    """`holder`'s weight loader for `model`, made once: vLLM's `load_weights`, traced on a bucket layout's first
    load and replayed as one batched copy after (rlcore.plugins.vllm.weight_replay; `vllm_weight_replay=False`: never).
    With the `layout` of a conditional-generation checkpoint the train engines' causal-LM names (`model.layers.0.x`)
    become the checkpoint's (`model.language_model.layers.0.x`), which vLLM's model maps as it maps the checkpoint."""
    loader = getattr(holder, "rlcore_loader", None)
    if loader is None:
        from .weight_replay import ReplayLoader

        def load(weights: Any) -> Any:
            if layout is not None:
                weights = [(layout.to_checkpoint(name), tensor) for name, tensor in weights]
            return model.load_weights(weights=weights)

        loader = ReplayLoader(load, [*model.parameters(), *model.buffers()], replay=replay)
        holder.rlcore_loader = loader
    return loader


def _load_weights_on_worker(worker: Any, named_tensors: list[tuple[str, torch.Tensor]], replay: bool = True,
                            layout: CheckpointLayout | None = None) -> None:
    """Run inside each vLLM worker (via collective_rpc) when workers live in their own processes."""
    _loader(worker, worker.model_runner.model, replay, layout)(named_tensors)


def _join_group_on_worker(worker: Any, host: str, port: int, rank: int, world_size: int, backend: str) -> None:
    """Inside each vLLM worker: join the trainer's broadcast group as rank + this worker's TP rank."""
    from rlcore.runtime import BroadcastGroup

    worker.rlcore_weight_group = BroadcastGroup(host, port, rank + worker.rank, world_size, backend)


def _gpu_on_worker(worker: Any) -> tuple[int, str]:
    """Inside each vLLM worker: its rank and the UUID of its GPU."""
    from rlcore.runtime import gpu_uuid

    return worker.rank, gpu_uuid()


def _load_ipc_on_worker(worker: Any, payloads: dict[int, dict[str, Any]], replay: bool = True,
                        layout: CheckpointLayout | None = None) -> None:
    """Inside each vLLM worker: load the bucket whose CUDA IPC handle is this worker's (by rank): packed on
    its own GPU by a trainer rank there, or on a peer GPU by a trainer in the engine's process."""
    from rlcore.runtime import IpcReceiver

    if getattr(worker, "rlcore_ipc", None) is None:
        worker.rlcore_ipc = IpcReceiver()  # keeps the sender's buffers mapped from sync to sync
    worker.rlcore_ipc.load(payloads[worker.rank], _loader(worker, worker.model_runner.model, replay, layout))


def _receive_on_worker(worker: Any, replay: bool = True, layout: CheckpointLayout | None = None) -> None:
    """Inside each vLLM worker: load every bucket of one sync straight from the broadcast group."""
    worker.rlcore_weight_group.receive_into(_loader(worker, worker.model_runner.model, replay, layout))


def _sampled_logprobs(logprobs: Any, token_ids: list[int]) -> list[float]:
    """Each sampled token's log-prob from vLLM's FlatLogprobs (asked for with flat_logprobs=True): with
    logprobs=0 a position holds its sampled token only, at its start index."""
    ids, values, starts = logprobs.token_ids, logprobs.logprobs, logprobs.start_indices
    if len(starts) != len(token_ids) or any(ids[s] != t for s, t in zip(starts, token_ids)):
        raise RlcoreError("vllm engine: the sampled tokens' log-probs do not line up with the tokens")
    return [float(values[s]) for s in starts]


class VLLMRolloutEngine(RolloutEngine):
    """vLLM's offline `LLM` behind rlcore's RolloutEngine interface: generation, teacher top-k, sleep, weights."""

    def __init__(
        self,
        model: str,
        vllm_tensor_parallel_size: int = 1,
        vllm_gpu_memory_utilization: float = 0.9,
        vllm_max_model_len: int | None = None,
        vllm_enforce_eager: bool = False,
        vllm_enable_sleep_mode: bool = True,
        vllm_in_process: bool = True,
        vllm_request_seeds: bool = False,
        vllm_weight_replay: bool = True,
        vllm_enable_lora: bool = False,
        vllm_max_lora_rank: int = 16,
        vllm_engine_kwargs: dict[str, Any] | None = None,
        dtype: str = "auto",
        seed: int = 0,
        device: str = "cuda",
    ):
        engine_kwargs = {} if vllm_engine_kwargs is None else vllm_engine_kwargs
        _validate(model, vllm_tensor_parallel_size, vllm_gpu_memory_utilization, vllm_max_model_len, engine_kwargs, device,
                  vllm_max_lora_rank if vllm_enable_lora else None)
        engine_kwargs = dict(engine_kwargs)
        # In process: weights load in place and sleep/wake act on this process's GPU.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if vllm_in_process else "1"
        self.in_process = vllm_in_process and vllm_tensor_parallel_size == 1
        self.tensor_parallel_size = vllm_tensor_parallel_size
        if not self.in_process:  # workers in their own processes receive rlcore's functions by pickle
            os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        try:
            import vllm
        except ImportError as e:
            raise ConfigError(f"the vllm engine needs vLLM: pip install 'rlcore[vllm]' ({e})") from e

        self._vllm = vllm
        self.sleep_mode = vllm_enable_sleep_mode
        self.max_logprobs = int(engine_kwargs.get("max_logprobs", DEFAULT_MAX_LOGPROBS))
        self.request_seeds = vllm_request_seeds
        self.weight_replay = vllm_weight_replay
        self._detokenize = not engine_kwargs.get("skip_tokenizer_init", False)
        self._asleep: set[str] = set()
        self._receiver_ranks: list[int] | None = None  # vLLM workers' ranks, in weight_receiver_gpus order
        self._ipc_sender: Any = None  # out of process: packs CUDA tensors handed to update_weights
        self.enable_lora = vllm_enable_lora
        self._lora_request: Any = None  # the adapter every request is served with (vllm_enable_lora), a new id per sync
        if vllm_enable_lora:  # one adapter at a time: the train engine's latest
            engine_kwargs.update(enable_lora=True, max_lora_rank=vllm_max_lora_rank, max_loras=1)
        # a conditional-generation checkpoint (Qwen3.5 as published): rollouts are text, so vLLM builds its language
        # model alone (no vision tower, no image processor) and the weight sync maps the train engines' names into it
        self.layout = checkpoint_layout(model)
        if self.layout is not None:
            engine_kwargs.setdefault("language_model_only", True)
        try:
            self.llm = vllm.LLM(
                model=model,
                tensor_parallel_size=vllm_tensor_parallel_size,
                gpu_memory_utilization=vllm_gpu_memory_utilization,
                max_model_len=vllm_max_model_len,
                enforce_eager=vllm_enforce_eager,
                enable_sleep_mode=vllm_enable_sleep_mode,
                dtype=resolve_dtype(dtype, model, cuda=True),  # never an upcast the user did not ask for
                seed=seed,
                logprobs_mode="processed_logprobs",
                **engine_kwargs,
            )
        except Exception as error:
            from vllm.model_executor.models.registry import ModelRegistry

            from .checks import inspection_cause, registry_modules

            cause = inspection_cause(error, registry_modules(ModelRegistry))
            if cause:
                raise RlcoreError(f"vllm engine: vLLM cannot load {model}: {cause}") from error
            raise
        if self.layout is None:  # a hub id whose files vLLM has only now downloaded
            self.layout = checkpoint_layout(model)

    # ---- generation --------------------------------------------------------

    def _require_awake(self, what: str, tags: Iterable[str] = SLEEP_TAGS) -> None:
        asleep = sorted(self._asleep & set(tags))
        if asleep:
            raise RlcoreError(f"vllm engine: cannot {what} while {', '.join(asleep)} sleep; call wake_up() first")

    def _sampling(self, params: SamplingParams) -> Any:
        if params.n < 1 or params.max_tokens < 1:
            raise ConfigError(f"sampling needs n >= 1 and max_tokens >= 1, got n={params.n}, max_tokens={params.max_tokens}")
        return self._vllm.SamplingParams(
            n=params.n,
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            stop_token_ids=list(params.stop_token_ids) or None,
            seed=params.seed if self.request_seeds else None,
            logprobs=0 if params.logprobs else None,  # the sampled token's own log-prob only, where asked for
            detokenize=False,  # decoded below, once per completion
            flat_logprobs=True,  # plain lists instead of a dict and a Logprob object per token
        )

    def _decode(self, generations: list[Generation]) -> None:
        if self._detokenize and generations:
            tokenizer = self.llm.get_tokenizer()  # vLLM's TokenizerLike promises decode; HF's have batch_decode
            ids = [generation.token_ids for generation in generations]
            if hasattr(tokenizer, "batch_decode"):  # a fast tokenizer decodes the batch in parallel, same texts
                texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
            else:
                texts = [tokenizer.decode(token_ids, skip_special_tokens=True) for token_ids in ids]
            for generation, text in zip(generations, texts, strict=True):
                generation.text = text

    @staticmethod
    def _generation(index: int, completion: Any, params: SamplingParams) -> Generation:
        token_ids = list(completion.token_ids)
        logprobs = _sampled_logprobs(completion.logprobs, token_ids) if params.logprobs else []
        return Generation(index, token_ids, logprobs, str(completion.finish_reason))

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """`params.n` completions per prompt, prompt-major, each token with the sampler's log-prob."""
        self._require_awake("generate")
        sampling = self._sampling(params)
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sampling, use_tqdm=False,
                                    **self._lora())
        result = [self._generation(index, completion, params)
                  for index, output in enumerate(outputs) for completion in output.outputs]
        self._decode(result)
        return result

    def run_episodes(self, episodes: list[Any], params: SamplingParams) -> None:
        """Multi-turn episodes on vLLM's engine loop: every episode's first turn is submitted at once, and an
        episode's next turn as soon as its previous one ends (its environment answers in between), so a slow
        episode never holds the others back."""
        self._require_awake("generate")
        engine, waiting, turns = self.llm.llm_engine, {}, 0

        def submit(episode: Any) -> None:
            nonlocal turns
            seed = None if params.seed is None else params.seed + 7919 * episode.turns + episode.index
            turn = dataclasses.replace(params, n=1, max_tokens=episode.budget(), seed=seed)
            request = f"rlcore-episode-{turns}"
            turns += 1
            engine.add_request(request, {"prompt_token_ids": episode.next_prompt()}, self._sampling(turn), **self._lora())
            waiting[request] = (episode, turn)

        for episode in episodes:
            if not episode.done:
                submit(episode)
        while waiting:
            for output in engine.step():
                if not output.finished:
                    continue
                episode, turn = waiting.pop(output.request_id)
                generation = self._generation(episode.index, output.outputs[0], turn)
                self._decode([generation])
                episode.advance(generation)
                if not episode.done:
                    submit(episode)

    def prompt_topk_logprobs(self, sequences: list[list[int]], k: int) -> TopK:
        """The k most likely tokens at every position of `sequences`, at temperature 1: a `TopK` [B, T, k] on
        CPU, right-padded to the longest sequence (row t: token t given tokens :t; row 0 and padding 0)."""
        import torch

        self._require_awake("score prompts")
        if not 1 <= k <= self.max_logprobs:
            raise ConfigError(
                f"prompt top-k: k={k} is outside 1..{self.max_logprobs}; raise vLLM's cap with "
                f"vllm_engine_kwargs={{'max_logprobs': {k}}}"
            )
        short = [i for i, s in enumerate(sequences) if len(s) < 2]
        if short:
            raise ConfigError(f"prompt top-k needs sequences of at least 2 tokens; sequences {short} are shorter")
        sampling = self._vllm.SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=k, detokenize=False)
        outputs = self.llm.generate([{"prompt_token_ids": list(s)} for s in sequences], sampling, use_tqdm=False,
                                    **self._lora())
        width = max(len(s) for s in sequences)
        ids = torch.zeros(len(sequences), width, k, dtype=torch.long)
        values = torch.zeros(len(sequences), width, k, dtype=torch.float32)
        for index, output in enumerate(outputs):
            # position 0 has no prefix (vLLM gives None); row t is token t given tokens :t
            for row, position in enumerate(output.prompt_logprobs[1:], start=1):
                # vLLM adds the prompt token's own log-prob to the top-k when it is not among them.
                best = sorted(position.items(), key=lambda item: item[1].logprob, reverse=True)[:k]
                ids[index, row] = torch.tensor([token for token, _ in best])
                values[index, row] = torch.tensor([lp.logprob for _, lp in best])
        return TopK(ids=ids, logprobs=values)

    # ---- weights ---------------------------------------------------------

    def _lora(self) -> dict[str, Any]:
        """`generate`'s LoRA argument: the latest synced adapter's request, where there is one."""
        return {"lora_request": self._lora_request} if self._lora_request is not None else {}

    def load_adapter(self, path: str) -> None:
        """Serve the PEFT adapter in folder `path` (Hugging Face module names) on the base weights from now on: a
        LoRARequest with a fresh id, loaded now (vLLM reads the folder), the one before removed. `path` must be
        visible here: the train rank that wrote it shares this node or its filesystem."""
        self._require_awake("load an adapter", tags=("weights",))
        if not self.enable_lora:
            raise ConfigError("vllm engine: an adapter-only sync needs vllm_enable_lora=True when the engine is created")
        if not os.path.isfile(os.path.join(path, "adapter_config.json")):
            import socket

            raise RlcoreError(f"vllm engine: no PEFT adapter at '{path}' on {socket.gethostname()}; vllm_enable_lora hands "
                              "the adapter over through output_dir, which must be a filesystem the train and rollout "
                              "nodes share (or drop vllm_enable_lora: merged weights are sent instead)")
        from vllm.lora.request import LoRARequest

        previous = self._lora_request
        lora_id = 1 if previous is None else previous.lora_int_id + 1
        request = LoRARequest(lora_name=f"rlcore-{lora_id}", lora_int_id=lora_id, lora_path=os.path.abspath(path))
        if not self.llm.llm_engine.add_lora(request):
            raise RlcoreError(f"vllm engine: vLLM did not load the adapter at '{path}' (LoRA id {lora_id})")
        self._lora_request = request
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
        self.llm.reset_prefix_cache()

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load one bucket of Hugging Face-named tensors into the model (vLLM maps and fuses the names)."""
        self._require_awake("load weights", tags=("weights",))
        if self.in_process:  # one worker, in this process: hand the tensors over as they are
            model = self.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
            _loader(self, model, self.weight_replay, self.layout)(named_tensors)
            return
        items = list(named_tensors)
        if items and all(tensor.is_cuda for _, tensor in items):  # one CUDA IPC handle that every worker maps
            from rlcore.runtime import CudaIpcSender

            if self._ipc_sender is None:
                self._ipc_sender = CudaIpcSender()
            payload = self._ipc_sender.pack(items)
            if self._receiver_ranks is None:
                self.weight_receiver_gpus()
            self.llm.collective_rpc(_load_ipc_on_worker, args=(dict.fromkeys(self._receiver_ranks, payload), self.weight_replay,
                                                                self.layout))
        else:
            cpu = [(name, tensor.detach().cpu()) for name, tensor in items]
            self.llm.collective_rpc(_load_weights_on_worker, args=(cpu, self.weight_replay, self.layout))

    def weight_receiver_gpus(self) -> list[str]:
        """This process's GPU in process; else each vLLM worker's GPU, in worker rank order."""
        if self.in_process:
            return super().weight_receiver_gpus()
        ranks = sorted(self.llm.collective_rpc(_gpu_on_worker))
        self._receiver_ranks = [rank for rank, _ in ranks]
        return [uuid for _, uuid in ranks]

    def load_ipc_bucket(self, payloads: list[dict[str, Any]]) -> None:
        """In process as any engine; else each vLLM worker maps the handle packed on its own GPU (payloads in
        the order of `weight_receiver_gpus`), so no weight leaves the GPU."""
        self._require_awake("load weights", tags=("weights",))
        if self.in_process:
            super().load_ipc_bucket(payloads)
            return
        if self._receiver_ranks is None:
            self.weight_receiver_gpus()
        if len(payloads) != len(self._receiver_ranks):
            raise RlcoreError(f"vllm engine: {len(payloads)} IPC payloads for {len(self._receiver_ranks)} workers")
        self.llm.collective_rpc(_load_ipc_on_worker, args=(dict(zip(self._receiver_ranks, payloads)), self.weight_replay,
                                                                   self.layout))

    def weight_receivers(self) -> int:
        """In process the engine receives broadcasts itself; otherwise each vLLM worker does."""
        return 1 if self.in_process else self.tensor_parallel_size

    def join_weight_group(self, host: str, port: int, rank: int, world_size: int, backend: str) -> None:
        """Join train rank 0's broadcast group: this process in process, else each vLLM worker as rank + its TP rank."""
        if self.in_process:
            from rlcore.runtime import BroadcastGroup

            self._weight_group = BroadcastGroup(host, port, rank, world_size, backend)
        else:
            self.llm.collective_rpc(_join_group_on_worker, args=(host, port, rank, world_size, backend))

    def receive_weights(self) -> dict[str, float] | None:
        """Load one sync's buckets from the broadcast group, then drop the prefix cache; in process, the
        receiving and loading seconds."""
        self._require_awake("receive weights", tags=("weights",))
        stats = None
        if self.in_process:
            stats = self._weight_group.receive_into(self.update_weights)
        else:
            self.llm.collective_rpc(_receive_on_worker, args=(self.weight_replay, self.layout))
        self.finish_weight_update()
        return stats

    def finish_weight_update(self) -> None:
        """Drop cached prefixes: their KV entries were computed with the old weights. The next sync's buckets
        go into the IPC buffers from the first again (their kept layouts and views)."""
        if self._ipc_sender is not None:
            self._ipc_sender.start()
        self.llm.reset_prefix_cache()

    # ---- memory ------------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        """Level 1 offloads weights to CPU memory and drops the KV cache; level 2 drops both."""
        if not self.sleep_mode:
            raise ConfigError("vllm engine: sleep needs vllm_enable_sleep_mode=True when the engine is created")
        if level not in (1, 2):
            raise ConfigError(f"vllm engine: sleep level must be 1 or 2, got {level}")
        self.llm.sleep(level=level)
        self._asleep = set(SLEEP_TAGS)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take back the memory of `tags` ("weights", "kv_cache"); None wakes everything."""
        if tags is not None:
            unknown = sorted(set(tags) - set(SLEEP_TAGS))
            if unknown:
                raise ConfigError(f"vllm engine: unknown wake_up tags {unknown}; known: {', '.join(SLEEP_TAGS)}")
        if not self._asleep:
            return
        self.llm.wake_up(tags=list(tags) if tags is not None else None)
        self._asleep -= set(tags if tags is not None else SLEEP_TAGS)
