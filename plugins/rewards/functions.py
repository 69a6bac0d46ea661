"""The built-in reward functions, all with TRL's signature: `fn(prompts, completions, completion_ids, **columns)`.

`completions` are strings, or conversational lists of messages (the last message's `content` is judged, which
for TRL's one-message completions is `completion[0]["content"]`). Each returns one float, or None for
"cannot judge" (left out of the advantage, as in TRL), per completion. Parameterised rewards are frozen
dataclasses, picklable for Ray, whose fields are the options `reward_kwargs` may set.
"""

from __future__ import annotations

import logging
import math
import re
import threading
from dataclasses import dataclass
from typing import Any

from rlcore import ConfigError, RlcoreError
from rlcore.data import completion_text

FORMAT_PATTERN = re.compile(r"^<think>.*?</think>\s*<answer>.*?</answer>$", re.DOTALL)


def _column(columns: dict[str, Any], name: str, reward: str, n: int) -> list[Any]:
    values = columns.get(name)
    if values is None:
        raise ConfigError(f"reward '{reward}' needs a '{name}' column in the dataset; the rows have none")
    if len(values) != n:
        raise RlcoreError(f"reward '{reward}': column '{name}' has {len(values)} values for {n} completions")
    return list(values)


def _verify_answers(texts: list[str], solutions: list[Any]) -> list[float | None]:
    """math_verify as TRL's accuracy_reward uses it: 1.0 / 0.0, None when the reference does not parse."""
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig, parse, verify

    main = threading.current_thread() is threading.main_thread()  # math_verify times out with signal.alarm
    parse_timeout, verify_timeout = (10, 5) if main else (None, None)
    extraction = [
        LatexExtractionConfig(
            normalization_config=NormalizationConfig(units=True), boxed_match_priority=0, try_extract_without_anchor=False
        )
    ]
    if not main:
        logging.getLogger("math_verify").setLevel(logging.ERROR)
    rewards: list[float | None] = []
    for text, solution in zip(texts, solutions):
        gold = parse(str(solution), parsing_timeout=parse_timeout)
        if not gold:
            rewards.append(None)
            continue
        answer = parse(text, extraction_config=extraction, extraction_mode="first_match", parsing_timeout=parse_timeout)
        rewards.append(float(verify(gold, answer, timeout_seconds=verify_timeout)))
    return rewards


def accuracy_reward(prompts: list[Any], completions: list[Any], completion_ids: list[list[int]] | None = None,
                    **columns: Any) -> list[float | None]:
    """1.0 when the completion's answer equals the `solution` column (math_verify), else 0.0; None when the
    solution itself cannot be parsed."""
    solutions = _column(columns, "solution", "accuracy", len(completions))
    return _verify_answers([completion_text(c) for c in completions], solutions)


def format_reward(prompts: list[Any], completions: list[Any], completion_ids: list[list[int]] | None = None,
                  **columns: Any) -> list[float | None]:
    """1.0 for `<think>...</think> <answer>...</answer>` and nothing else around them, else 0.0."""
    return [1.0 if FORMAT_PATTERN.match(completion_text(c)) else 0.0 for c in completions]


@dataclass(frozen=True)
class CosineReward:
    """Correctness scaled by length on a cosine schedule (open-r1, ms-swift; "Demystifying Long CoT", App. C.1).

    A correct answer earns from `max_value_correct` (empty) down to `min_value_correct` (at `max_len` tokens);
    a wrong one from `min_value_wrong` (empty) up to `max_value_wrong`, so long wrong attempts are punished
    less. Length is the number of completion tokens, capped at `max_len`; None where accuracy is None.
    """

    max_len: int = 1000
    min_value_wrong: float = -1.0
    max_value_wrong: float = -0.5
    min_value_correct: float = 0.5
    max_value_correct: float = 1.0

    def __post_init__(self) -> None:
        if self.max_len < 1:
            raise ConfigError(f"reward 'cosine': max_len must be >= 1, got {self.max_len}")

    def __call__(self, prompts: list[Any], completions: list[Any], completion_ids: list[list[int]] | None = None,
                 **columns: Any) -> list[float | None]:
        if completion_ids is None:
            raise RlcoreError("reward 'cosine' needs completion_ids (it scales by the completion's token count)")
        correct = accuracy_reward(prompts, completions, completion_ids, **columns)
        rewards: list[float | None] = []
        for ok, ids in zip(correct, completion_ids):
            if ok is None:
                rewards.append(None)
                continue
            cosine = math.cos(min(len(ids) / self.max_len, 1.0) * math.pi)
            low, high = (self.min_value_correct, self.max_value_correct) if ok else (self.max_value_wrong, self.min_value_wrong)
            rewards.append(low + 0.5 * (high - low) * (1.0 + cosine))
        return rewards


@dataclass(frozen=True)
class RepetitionPenalty:
    """open-r1's n-gram repetition penalty: (1 - unique / total word n-grams) * max_penalty, in [max_penalty, 0]."""

    ngram_size: int = 3
    max_penalty: float = -1.0

    def __post_init__(self) -> None:
        if self.max_penalty > 0:
            raise ConfigError(f"reward 'repetition': max_penalty must be <= 0 (a penalty), got {self.max_penalty}")
        if self.ngram_size < 1:
            raise ConfigError(f"reward 'repetition': ngram_size must be >= 1, got {self.ngram_size}")

    def __call__(self, prompts: list[Any], completions: list[Any], completion_ids: list[list[int]] | None = None,
                 **columns: Any) -> list[float | None]:
        rewards: list[float | None] = []
        for completion in completions:
            words = completion_text(completion).lower().split()
            if len(words) < self.ngram_size:
                rewards.append(0.0)
                continue
            ngrams = list(zip(*[words[i:] for i in range(self.ngram_size)]))
            rewards.append((1 - len(set(ngrams)) / len(ngrams)) * self.max_penalty)
        return rewards


@dataclass(frozen=True)
class SoftOverlong:
    """DAPO's soft overlong punishment (Eq. 13): 0 up to max_completion_length - soft_cache_length tokens,
    then linearly down to -1 at max_completion_length, and -1 beyond."""

    max_completion_length: int = 256
    soft_cache_length: int = 64

    def __post_init__(self) -> None:
        if not 0 <= self.soft_cache_length <= self.max_completion_length:
            raise ConfigError(
                f"reward 'soft_overlong': soft_cache_length ({self.soft_cache_length}) must be between 0 and "
                f"max_completion_length ({self.max_completion_length})"
            )

    def __call__(self, prompts: list[Any], completions: list[Any], completion_ids: list[list[int]] | None = None,
                 **columns: Any) -> list[float | None]:
        if completion_ids is None:
            raise RlcoreError("reward 'soft_overlong' needs completion_ids (it punishes by token count)")
        start = self.max_completion_length - self.soft_cache_length
        rewards: list[float | None] = []
        for ids in completion_ids:
            n = len(ids)
            if n <= start:
                rewards.append(0.0)
            elif n <= self.max_completion_length:
                rewards.append((start - n) / self.soft_cache_length)
            else:
                rewards.append(-1.0)
        return rewards
