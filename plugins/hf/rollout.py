"""`HFRolloutEngine`: completions from a transformers causal LM with a hand-written batched sampling loop.

The loop prefills each distinct prompt once (left-padded), repeats the KV cache `n` times, samples every
row in one forward per token and drops finished rows from the cache as they stop (on one CPU thread, with
a 4-layer tiny model, about 1.2-1.3x `model.generate`'s candidates/s: benchmarks/sample_cpu.py). The log-prob of each sampled token is taken from the distribution the
sampler drew from: after temperature, top-k and top-p.

Build one with `HFRolloutEngine(model="path/or/hub-id")` or through the registry
(`plugins.engines.get("hf", kind="rollout").factory(**options)`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from rlcore import RlcoreError, did_you_mean
from rlcore.batch import pad_tokens
from rlcore.engines import (
    Generation, RolloutEngine, SamplingParams, TopK, common_problems, raise_problems, torch_device,
)

from .common import load_causal_lm, model_outputs

TAGS = ("weights", "kv_cache")
TOPK_ROWS = 16  # sequences per forward pass in prompt_topk_logprobs


class HFRolloutEngine(RolloutEngine):
    """Samples with a KV cache; `update_weights` copies into the live parameters; `sleep`/`wake_up` as vLLM's."""

    def __init__(self, model: str, dtype: str = "auto", device: str = "cpu", seed: int = 42):
        problems = common_problems(model, dtype, device)
        if not isinstance(seed, int):
            problems.append(("seed", f"seed={seed!r} must be an int"))
        raise_problems("hf rollout engine", problems)
        import torch
        from transformers import AutoTokenizer

        self.device = torch_device(device)
        self.model = load_causal_lm(model, dtype, self.device)
        self.tokenizer = AutoTokenizer.from_pretrained(str(model))
        eos = self.model.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if self.tokenizer.eos_token_id is not None:
            eos.append(self.tokenizer.eos_token_id)
        self.eos_token_ids = sorted(set(eos))
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = pad if pad is not None else (self.eos_token_ids or [0])[0]
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]
        self.generator = torch.Generator(self.device).manual_seed(seed)
        self._targets = dict(self.model.named_parameters(remove_duplicate=False))
        self._targets.update(self.model.named_buffers(remove_duplicate=False))
        self._params = list(self.model.parameters())
        self._shapes = [p.shape for p in self._params]
        self._sleep_level = 0
        self._unloaded: set[int] = set()  # ids of params dropped by sleep(2) and not yet updated
        self._pieces: dict[int, set[tuple[int, str]]] = {}  # the expert slices of a fused parameter updated so far
        # transformers 5.24 renamed forward's `past_key_values` (and the output's) to `cache`; 5.40 drops the old name
        import inspect

        self._cache_key = "cache" if "cache" in inspect.signature(type(self.model).forward).parameters else "past_key_values"

    # ------------------------------------------------------------------ generation

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """`params.n` completions per prompt, prompt-major, with the sampler's per-token log-probs."""
        import torch

        _check_sampling(prompts, params, self.vocab_size)
        self._check_ready()
        if not prompts:
            return []
        generator = self.generator
        if params.seed is not None:
            generator = torch.Generator(self.device).manual_seed(params.seed)
        stop = torch.tensor(sorted(set(self.eos_token_ids) | set(params.stop_token_ids)), device=self.device)
        rows, steps = len(prompts) * params.n, params.max_tokens
        tokens = torch.full((rows, steps), self.pad_token_id, dtype=torch.long, device=self.device)
        logprobs = torch.zeros(rows, steps, dtype=torch.float32, device=self.device)
        lengths = torch.full((rows,), steps, dtype=torch.long)
        stopped = torch.zeros(rows, dtype=torch.bool)

        with torch.inference_mode():
            input_ids, mask = self._left_pad(prompts)
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True)
            cache, logits = out[self._cache_key], out.logits[:, -1]
            next_pos = positions[:, -1] + 1
            if params.n > 1:
                # reorder_cache, not batch_repeat_interleave/batch_select_indices: every cache layer has it,
                # linear attention's (Qwen3.5's conv and recurrent states) too
                cache.reorder_cache(torch.arange(len(prompts), device=self.device).repeat_interleave(params.n))
                logits, mask, next_pos = (t.repeat_interleave(params.n, dim=0) for t in (logits, mask, next_pos))
            active = torch.arange(rows, device=self.device)
            for step in range(steps):
                token, token_logprob = _sample(logits, params, generator)
                tokens[active, step], logprobs[active, step] = token, token_logprob
                done = torch.isin(token, stop)
                if done.any():
                    finished = active[done].cpu()
                    lengths[finished], stopped[finished] = step + 1, True
                    keep = ~done
                    if not keep.any():
                        break
                    active, token, mask, next_pos = active[keep], token[keep], mask[keep], next_pos[keep]
                    cache.reorder_cache(keep.nonzero().squeeze(1))
                if step == steps - 1:
                    break
                mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
                out = self.model(
                    input_ids=token[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                    use_cache=True, **{self._cache_key: cache},
                )
                logits, next_pos = out.logits[:, -1], next_pos + 1

        token_lists = [row[:n].tolist() for row, n in zip(tokens.cpu(), lengths.tolist())]
        logprob_lists = [row[:n].tolist() for row, n in zip(logprobs.cpu(), lengths.tolist())]
        texts = self.tokenizer.batch_decode(token_lists, skip_special_tokens=True)
        return [
            Generation(
                prompt_index=i // params.n, token_ids=token_lists[i], logprobs=logprob_lists[i],
                finish_reason="stop" if stopped[i] else "length", text=texts[i],
            )
            for i in range(rows)
        ]

    def _left_pad(self, prompts: list[list[int]]) -> tuple[Any, Any]:
        input_ids, mask = pad_tokens(prompts, self.pad_token_id, left=True)
        return input_ids.to(self.device), mask.to(self.device)

    def prompt_topk_logprobs(self, sequences: list[list[int]], k: int) -> TopK:
        """The top-k log-probs at every position of `sequences`, at temperature 1: a `TopK` [B, T, k] on CPU
        (row t: the distribution of token t given tokens :t; row 0 and padding 0)."""
        import torch

        if not isinstance(k, int) or k < 1:
            raise RlcoreError(f"prompt_topk_logprobs: k={k!r} must be a positive int")
        _check_token_lists(sequences, self.vocab_size, "sequences")
        self._check_ready()
        k = min(k, self.vocab_size)
        input_ids, mask = pad_tokens(sequences, self.pad_token_id)
        ids = torch.zeros(*input_ids.shape, k, dtype=torch.long)
        values = torch.zeros(*input_ids.shape, k, dtype=torch.float32)
        with torch.no_grad():  # not inference_mode: a distillation loss may save these for backward
            for start in range(0, len(sequences), TOPK_ROWS):
                rows = slice(start, start + TOPK_ROWS)
                width = int(mask[rows].sum(dim=1).max())
                top = model_outputs(
                    self.model, input_ids[rows, :width].to(self.device), mask[rows, :width].to(self.device)
                ).topk(k)
                ids[rows, :width], values[rows, :width] = top.ids.cpu(), top.logprobs.cpu()
        return TopK(ids=ids, logprobs=values)

    # ------------------------------------------------------------------ weights and memory

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Copy tensors (Hugging Face names) into the live parameters, in place; any subset of names."""
        import torch

        if self._sleep_level:
            raise RlcoreError("update_weights on a sleeping rollout engine; call wake_up(tags=['weights']) first")
        with torch.no_grad():
            for name, tensor in named_tensors:
                target, whole, piece = self._target_of(name)
                if tuple(target.shape) != tuple(tensor.shape):
                    raise RlcoreError(
                        f"update_weights: '{name}' has shape {tuple(tensor.shape)}; the model's is {tuple(target.shape)}"
                    )
                target.copy_(tensor)
                if piece is None:
                    self._unloaded.discard(id(whole))
                else:  # one expert's slice of a fused parameter: loaded once every slice has come
                    pieces = self._pieces.setdefault(id(whole), set())
                    pieces.add(piece)
                    if len(pieces) == whole.shape[0] * (2 if piece[1] != "down_proj" else 1):
                        self._unloaded.discard(id(whole))
                        pieces.clear()

    def _target_of(self, name: str) -> tuple[Any, Any, tuple[int, str] | None]:
        """The tensor `name` is copied into, the parameter it belongs to, and (expert, projection) where it is
        one expert's slice of transformers' fused experts: checkpoints and the megatron engine name experts one
        by one (`mlp.experts.3.gate_proj.weight`), transformers 5 keeps them as `mlp.experts.gate_up_proj`
        [experts, 2 * width, hidden] (gate rows, then up rows) and `mlp.experts.down_proj` [experts, hidden, width]."""
        target = self._targets.get(name)
        if target is not None:
            return target, target, None
        match = _EXPERT.match(name)
        fused = match and self._targets.get(f"{match['prefix']}.{'down_proj' if match['proj'] == 'down_proj' else 'gate_up_proj'}")
        if fused is None or fused.dim() != 3 or int(match["expert"]) >= fused.shape[0]:
            raise RlcoreError(f"update_weights: the model has no weight '{name}'.{did_you_mean(name, self._targets)}")
        expert, proj = int(match["expert"]), match["proj"]
        width = fused.shape[1] // 2
        view = {"gate_proj": lambda: fused[expert, :width], "up_proj": lambda: fused[expert, width:],
                "down_proj": lambda: fused[expert]}[proj]()
        return view, fused, (expert, proj)

    def join_weight_group(self, host: str, port: int, rank: int, world_size: int, backend: str) -> None:
        """Join train rank 0's broadcast group as `rank` (NCCL buffers arrive on this engine's GPU)."""
        from rlcore.runtime import BroadcastGroup

        device = self.device if backend == "nccl" else None
        self._weight_group = BroadcastGroup(host, port, rank, world_size, backend, device=device)

    def receive_weights(self) -> dict[str, float]:
        """Load one sync's buckets from the broadcast group, then finish the update; the receiving and
        loading seconds."""
        if getattr(self, "_weight_group", None) is None:
            raise RlcoreError("receive_weights before join_weight_group: the engine is in no broadcast group")
        stats = self._weight_group.receive_into(self.update_weights)
        self.finish_weight_update()
        return stats

    def sleep(self, level: int = 1) -> None:
        """Level 1: weights to CPU memory (a no-op on a CPU engine); level 2: weights dropped (the next
        wake_up allocates them empty, and update_weights must fill them before generating). The KV cache
        lives only inside a `generate` call, so there is none to drop between calls."""
        import torch

        if level not in (1, 2):
            raise RlcoreError(f"sleep: level={level!r} must be 1 (offload weights) or 2 (drop weights)")
        if self._sleep_level:
            return
        for p in self._params:
            if level == 2:
                p.data = torch.empty(0, dtype=p.dtype, device=self.device)
            elif self.device.type != "cpu":
                p.data = p.data.to("cpu")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self._sleep_level = level

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take memory back: "weights" restores (level 1) or reallocates (level 2) them; "kv_cache" needs nothing."""
        import torch

        tags = list(TAGS) if tags is None else list(tags)
        unknown = [t for t in tags if t not in TAGS]
        if unknown:
            raise RlcoreError(f"wake_up: unknown tags {unknown}; known: {', '.join(TAGS)}")
        if "weights" not in tags or not self._sleep_level:
            return
        self._pieces.clear()
        for p, shape in zip(self._params, self._shapes):
            if self._sleep_level == 2:
                p.data = torch.empty(shape, dtype=p.dtype, device=self.device)
                self._unloaded.add(id(p))
            elif self.device.type != "cpu":
                p.data = p.data.to(self.device)
        self._sleep_level = 0

    def _check_ready(self) -> None:
        if self._sleep_level:
            raise RlcoreError("the rollout engine is asleep; call wake_up() before generating")
        if self._unloaded:
            raise RlcoreError(
                f"{len(self._unloaded)} weights were dropped by sleep(level=2) and not reloaded; "
                "call update_weights with every weight after wake_up"
            )


_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def _sample(logits: Any, params: SamplingParams, generator: Any) -> tuple[Any, Any]:
    """Draw one token per row; return it and its log-prob under the processed distribution."""
    import torch

    logits = logits.float()
    if params.temperature == 0:
        logprobs = torch.log_softmax(logits, dim=-1)
        token = logprobs.argmax(dim=-1)
        return token, logprobs.gather(1, token[:, None]).squeeze(1)
    if params.temperature != 1.0:
        logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs > params.top_p  # keeps the smallest prefix reaching top_p
        logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    logprobs = torch.log_softmax(logits, dim=-1)
    # Exponential race (Gumbel-max): argmax p / q with q ~ Exp(1) draws from p, in one pass.
    race = logprobs.exp() / torch.empty_like(logprobs).exponential_(generator=generator)
    token = race.argmax(dim=-1)
    return token, logprobs.gather(1, token[:, None]).squeeze(1)


def _check_token_lists(lists: Any, vocab_size: int, what: str) -> None:
    if not isinstance(lists, (list, tuple)):
        raise RlcoreError(f"{what} must be a list of token-id lists, got {type(lists).__name__}")
    for i, ids in enumerate(lists):
        if not isinstance(ids, (list, tuple)) or not ids:
            raise RlcoreError(f"{what}[{i}] must be a non-empty list of token ids, got {ids!r:.80}")
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise RlcoreError(f"{what}[{i}] holds a token id outside [0, {vocab_size}) (the model's vocabulary)")


def _check_sampling(prompts: Any, params: SamplingParams, vocab_size: int) -> None:
    problems = []
    if not isinstance(params.n, int) or params.n < 1:
        problems.append(f"n={params.n!r} must be a positive int")
    if not isinstance(params.max_tokens, int) or params.max_tokens < 1:
        problems.append(f"max_tokens={params.max_tokens!r} must be a positive int")
    if not params.temperature >= 0:
        problems.append(f"temperature={params.temperature!r} must be >= 0 (0: greedy)")
    if not 0 < params.top_p <= 1:
        problems.append(f"top_p={params.top_p!r} must be in (0, 1]")
    if not isinstance(params.top_k, int):
        problems.append(f"top_k={params.top_k!r} must be an int (0 or -1: off)")
    if any(not 0 <= t < vocab_size for t in params.stop_token_ids):
        problems.append(f"stop_token_ids={params.stop_token_ids!r} must lie in [0, {vocab_size})")
    if problems:
        raise RlcoreError("SamplingParams: " + "; ".join(problems))
    _check_token_lists(prompts, vocab_size, "prompts")
