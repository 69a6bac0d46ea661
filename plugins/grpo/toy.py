"""The embedded default task: "write vowels". What `rlcore run --plugin grpo` trains when no dataset is given.

Prompts ask for a word ("Write a word:", "Say something:", ...); the reward (`toy`, registered by the rewards
plugin) is the fraction of the completion's characters that are in the row's `target` column ("aeiou").

Why this task: a tiny random-weight byte-level model (every byte a token, ~260 ids) starts near uniform,
so a completion's reward is small but rarely zero over ~16-24 tokens, groups of 8 almost always differ
(nonzero std, so GRPO gets a signal every step), and the policy only has to shift probability mass onto
5 of ~260 tokens, which it can do in a few dozen steps without understanding the prompt.

Chance level: a uniform policy over the 256 byte tokens emits a target byte with probability 5/256, so its
expected reward is about 5/256 = 0.0195 (`RANDOM_POLICY_REWARD`). The tiny model's tokenizer
(rlcore.plugins.hf.tiny: 267 ids, with merges such as "in", "he", "er" that carry vowels, and invalid UTF-8
runs decoding to replacement characters) raises that to about 0.044; `chance_reward(tokenizer)` measures it
for any tokenizer. A policy scoring several times that has visibly learned: a plain GRPO loop (8 prompts x 8
generations, 20 tokens, AdamW lr 1e-3, 2 CPU threads) went from 0.045 to 0.26 in 40 steps (80 s).
An empty completion scores 0, so stopping at once is not a way out.
"""

from __future__ import annotations

import random
from typing import Any

from rlcore.plugins.rewards.functions import completion_text

TARGET = "aeiou"
RANDOM_POLICY_REWARD = len(TARGET) / 256
PROMPTS = (
    "Write a word:",
    "Say something:",
    "Type a word:",
    "Write something:",
    "Give me a word:",
    "Say a word:",
    "Write:",
    "Word:",
)


def toy_dataset(n: int = 256, seed: int = 0) -> list[dict[str, Any]]:
    """`n` rows `{"prompt": ..., "target": "aeiou"}`, prompts drawn from PROMPTS with a seeded generator."""
    rng = random.Random(seed)
    return [{"prompt": rng.choice(PROMPTS), "target": TARGET} for _ in range(n)]


def chance_reward(tokenizer: Any, completion_length: int = 20, samples: int = 2000, seed: int = 0) -> float:
    """The toy reward a uniform random policy over `tokenizer`'s ids earns in expectation (a seeded estimate).

    Each sample is `completion_length` uniform ids, cut at the first eos as generation would cut it.
    """
    rng = random.Random(seed)
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    texts = []
    for _ in range(samples):
        ids = [rng.randrange(vocab) for _ in range(completion_length)]
        ids = ids[: ids.index(eos)] if eos in ids else ids
        texts.append(tokenizer.decode(ids, skip_special_tokens=True))
    rewards = toy_reward([""] * samples, texts)
    return sum(r for r in rewards if r is not None) / samples


def toy_reward(prompts: list[Any], completions: list[Any], completion_ids: list[list[int]] | None = None,
               **columns: Any) -> list[float | None]:
    """Fraction of the completion's characters found in its row's `target` (default "aeiou"); 0 when empty."""
    targets = columns.get("target") or [TARGET] * len(completions)
    rewards: list[float | None] = []
    for completion, target in zip(completions, targets):
        text = completion_text(completion)
        rewards.append(sum(ch in target for ch in text) / len(text) if text else 0.0)
    return rewards
