"""The built-in rewards plugin: accuracy, format, cosine, repetition, soft_overlong and the toy task's reward.

All have TRL's signature `fn(prompts, completions, completion_ids, **columns)`, so a TRL reward function
works here unchanged and these work in TRL. `resolve_reward` finds one by name (or `module:function`) and
gives it the config's options (`reward_options`: a dataclass's fields, a function's keyword arguments);
`call_reward` calls it without letting one bad completion end a run (a function failing on all of them does:
`RewardFailed`); both live in core (`rlcore.rewards`) and are re-exported here. `OrmScorer`
(rlcore.plugins.rewards.orm) is what an `orm` role runs, registered as the engine `hf` of kind `reward`: a
sequence-classification reward model.
"""

from __future__ import annotations

import dataclasses

from rlcore import EngineSpec, RewardSpec, hookimpl
from rlcore.rewards import RewardFailed, call_reward, check_reward, resolve_reward, reward_options
from rlcore.testing import toy_reward

from .functions import CosineReward, RepetitionPenalty, SoftOverlong, accuracy_reward, completion_text, format_reward
from .orm import OrmScorer, reward_memory

__all__ = [
    "CosineReward",
    "RepetitionPenalty",
    "RewardFailed",
    "SoftOverlong",
    "accuracy_reward",
    "call_reward",
    "check_reward",
    "completion_text",
    "format_reward",
    "resolve_reward",
    "reward_options",
]


@hookimpl
def rlcore_rewards():
    yield RewardSpec("accuracy", fn=accuracy_reward, description="math_verify: completion's answer == `solution`")
    yield RewardSpec("format", fn=format_reward, description="<think>...</think><answer>...</answer>")
    yield RewardSpec("toy", fn=toy_reward, description="fraction of characters in `target` (the embedded task)")
    for name, fn, description in (
        ("cosine", CosineReward(), "correctness scaled by length (cosine schedule)"),
        ("repetition", RepetitionPenalty(), "n-gram repetition penalty"),
        ("soft_overlong", SoftOverlong(), "DAPO's soft overlong punishment"),
    ):
        yield RewardSpec(name, fn=fn, description=description, options=dataclasses.asdict(fn))


def make_orm_scorer(**options):
    """An `OrmScorer(model_path, device, dtype, batch_size)`; transformers is imported when it is built."""
    return OrmScorer(**options)


@hookimpl
def rlcore_engines():
    yield EngineSpec("hf", kind="reward", factory=make_orm_scorer, imports=("torch", "transformers"), memory=reward_memory,
                     description="a sequence-classification reward model (one label) scoring (prompt, completion) pairs")
