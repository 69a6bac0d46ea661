"""GKD's data: conversations (prompt + the dataset's completion), their token ids, the held-out rows."""

from __future__ import annotations

from typing import Any

from rlcore import Batch, ConfigError
from rlcore.batch import pad_tokens
from rlcore.data import PromptEncoder, PromptSampler, conversation_view, load_rows

from .config import GKDConfig

class DistillData:
    """The rows (training and held-out), their encoding with the student's tokenizer, and batches."""

    def __init__(self, config: GKDConfig, batch_rows: int, model_path: str):
        cfg = self.config = config
        rows = self.rows_of(cfg)
        if cfg.eval_size and cfg.eval_size >= len(rows):
            raise ConfigError(f"eval_size={cfg.eval_size} holds out every row of the dataset ({len(rows)} rows); "
                              "lower it", [("eval_size", f"must be below the dataset's {len(rows)} rows")])
        cut = len(rows) - cfg.eval_size
        self.train_rows, self.heldout_rows = rows[:cut], rows[cut:]
        self.prompts = PromptEncoder.of(model_path, cfg)
        self.tokenizer, self.stop_ids = self.prompts.tokenizer, self.prompts.stop_ids
        self.sampler = PromptSampler(self.prompts.keep(self.train_rows), batch_rows, seed=cfg.seed)

    @staticmethod
    def rows_of(config: GKDConfig) -> list[dict[str, Any]]:
        """Each row's `prompt` (messages without the last assistant turn) and `completion` (that turn's text)."""
        rows = conversation_view(load_rows(config.dataset), config.dataset)
        out = []
        for row in rows:
            content = row["messages"][-1]["content"]
            if not isinstance(content, str):
                content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
            out.append({**row, "prompt": row["messages"][:-1], "completion": content})
        return out

    def encode(self, rows: list[dict[str, Any]]) -> tuple[list[list[int]], list[list[int]]]:
        """(prompt ids, completion ids) per row; a completion ends with the end-of-turn token, cut to
        max_completion_length."""
        eos = self.tokenizer.eos_token_id
        prompts = [self.prompts.encode(r["prompt"]) for r in rows]
        completions = []
        for r in rows:
            ids = list(self.tokenizer(r["completion"], add_special_tokens=False)["input_ids"]) + [eos]
            completions.append(ids[: self.config.max_completion_length])
        return prompts, completions

    def batch(self, prompts: list[list[int]], completions: list[list[int]], masks: list[list[int]] | None = None) -> Batch:
        """Prompt + completion, right-padded, with the completion mask (an episode's `masks`: 1 on the tokens the
        student generated, 0 on the environment's)."""
        import torch

        sequences = [p + c for p, c in zip(prompts, completions)]
        input_ids, attention = pad_tokens(sequences, self.tokenizer.pad_token_id)
        mask = torch.zeros(input_ids.shape, dtype=torch.float)
        for i, (p, s) in enumerate(zip(prompts, sequences)):
            mask[i, len(p) : len(s)] = 1 if masks is None else torch.tensor(masks[i], dtype=torch.float)
        return Batch(input_ids=input_ids, attention_mask=attention, completion_mask=mask)

    def heldout_batch(self) -> Batch | None:
        if not self.heldout_rows:
            return None
        return self.batch(*self.encode(self.heldout_rows))

    def probe_sequence(self) -> list[int]:
        """A fixed sequence for the weight-sync check: the first training row, prompt and completion."""
        prompts, completions = self.encode(self.train_rows[:1])
        return prompts[0] + completions[0]
