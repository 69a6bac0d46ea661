"""`OrmScorer`: an outcome reward model (AutoModelForSequenceClassification, num_labels=1) scoring completions.

What an `orm` role runs. Texts are built as TRL's GRPOTrainer builds them for a reward model: prompt plus
completion, through the tokenizer's chat template when both are conversations, right-padded, no special
tokens added. The score is the model's single logit at the last real token.
"""

from __future__ import annotations

from typing import Any

from rlcore import ConfigError
from rlcore.engines import resolve_dtype, torch_device
from rlcore.memory import CUDA_CONTEXT, EngineMemory, Fix, MemoryQuery, dtype_bytes

from .functions import completion_text


class OrmScorer:
    """Loads a reward model once; `score(prompts, completions)` (or calling it as a reward function) scores pairs."""

    def __init__(self, model_path: str, device: str = "cpu", dtype: str = "auto", batch_size: int = 16):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        try:
            torch_dtype = getattr(torch, resolve_dtype(dtype, model_path, str(device).startswith("cuda")))
        except AttributeError:
            raise ConfigError(f"orm dtype '{dtype}' is not a torch dtype; use float32, bfloat16 or float16") from None
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model_path)
            self.model = AutoModelForSequenceClassification.from_pretrained(model_path, dtype=torch_dtype)
        except OSError as exc:
            raise ConfigError(f"orm model '{model_path}' cannot be loaded: {exc}") from exc
        if self.model.config.num_labels != 1:
            raise ConfigError(
                f"orm model '{model_path}' has num_labels={self.model.config.num_labels}; a reward model has one"
            )
        if self.tokenizer.pad_token is None:
            if self.tokenizer.eos_token is None:
                raise ConfigError(f"orm model '{model_path}': its tokenizer has neither a pad nor an eos token")
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id

        self.device, self.batch_size = torch_device(device), batch_size  # 'cuda' gets this worker's GPU index
        self.model.to(self.device).eval()

    def _text(self, prompt: Any, completion: Any) -> str:
        if isinstance(prompt, list) and isinstance(completion, list) and self.tokenizer.chat_template:
            return self.tokenizer.apply_chat_template(prompt + completion, tokenize=False)
        prompt_text = prompt if isinstance(prompt, str) else "".join(str(m.get("content") or "") for m in prompt)
        return prompt_text + completion_text(completion)

    def score(self, prompts: list[Any], completions: list[Any]) -> list[float]:
        """One score per (prompt, completion) pair."""
        import torch

        texts = [self._text(p, c) for p, c in zip(prompts, completions, strict=True)]
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            inputs = self.tokenizer(
                texts[start : start + self.batch_size], return_tensors="pt", padding=True,
                padding_side="right", add_special_tokens=False,
            ).to(self.device)
            with torch.inference_mode():
                scores.extend(self.model(**inputs).logits[:, 0].float().tolist())
        return scores

    def __call__(self, prompts: list[Any], completions: list[Any], completion_ids: list[list[int]] | None = None,
                 **columns: Any) -> list[float | None]:
        return list(self.score(prompts, completions))


def reward_memory(q: MemoryQuery) -> EngineMemory:
    """A reward model's bytes on its GPU (`EngineSpec.memory`), sequence or token classification alike: the
    decoder's weights without the LM head, a score head of at most hidden x hidden, and while it scores one layer's
    working set over `batch_size` candidates at the longest (`seq_len`) in inference mode, nothing kept for backward.
    It keeps its weights between batches."""
    s = q.model
    d = dtype_bytes(q.options.get("dtype"))
    weights = (s.params - (0 if s.tied else s.vocab * s.hidden) + s.hidden * s.hidden) * d
    batch = int(q.options.get("batch_size", 16))
    tokens = batch * q.use.seq_len
    active = {"cuda context": CUDA_CONTEXT, "weights": weights,
              "activations": tokens * (s.activation_bytes_per_token(d) // s.layers + s.hidden * d)}
    batch, fixes = batch // 2, []
    while batch >= 1:  # each halving, largest first: fewer candidates per forward, more forwards
        fixes.append(Fix({"batch_size": batch}, 1, "fewer candidates per reward-model forward"))
        batch //= 2
    return EngineMemory(active, {"cuda context": CUDA_CONTEXT, "weights": weights}, fixes=tuple(fixes))
