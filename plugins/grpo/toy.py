"""The toy task moved to `rlcore.testing`, where every plugin and test can reach it; these names stay."""

from rlcore.testing import PROMPTS, RANDOM_POLICY_REWARD, TARGET, chance_reward, toy_dataset, toy_reward

__all__ = ["PROMPTS", "RANDOM_POLICY_REWARD", "TARGET", "chance_reward", "toy_dataset", "toy_reward"]
