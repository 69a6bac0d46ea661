"""A reward function with an option, in TRL's signature, so it works in TRL unchanged too."""

from __future__ import annotations

from typing import Any


def letter_ratio(prompts: list[Any], completions: list[Any], completion_ids: list[list[int]] | None = None, *,
                 letter: str = "e", **columns: Any) -> list[float | None]:
    """The fraction of each completion's characters that are `letter` (0 for an empty completion).

    `letter` is an option: `reward_kwargs={letter_ratio: {letter: a}}` sets it for a run.
    """
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]  # a string, or a conversation
    return [text.count(letter) / len(text) if text else 0.0 for text in texts]
