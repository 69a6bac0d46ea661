"""A hint environment for the embedded toy task (answer with the letters of `target`, "aeiou"), written as a user
writes one: no rlcore change, named in the config as `examples/multi_turn/vowel_hint.py:VowelHint`.

An answer whose toy reward is below `threshold` gets a hint as the next user message and the model tries again;
each turn's reward is the environment's reward part (summed over the episode by the `environment` reward).
"""

from rlcore import Environment, Step
from rlcore.testing import toy_reward


class VowelHint(Environment):
    def __init__(self, threshold: float = 0.5):
        self.threshold = threshold

    def reset(self, row):
        self.target = row.get("target", "aeiou")

    def step(self, turn):
        score = toy_reward([""], [turn.text], target=[self.target])[0]
        if score >= self.threshold:
            return Step(done=True, reward=score)
        return Step(messages=[{"role": "user", "content": f"Only {self.target}."}], reward=score)
