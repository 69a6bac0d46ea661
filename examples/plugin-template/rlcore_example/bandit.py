"""Two roles on `rlcore`'s public names: rollout draws arms from a softmax, train takes REINFORCE steps on its logits."""

import math
import random

from pydantic import Field

from rlcore import AlgorithmSpec, CheckpointKeys, RoleConfig, RoleSetup, RoleTrainer, RunConfig, function, hookimpl, worker


def softmax(logits: list[float]) -> list[float]:
    weights = [math.exp(v - max(logits)) for v in logits]
    return [w / sum(weights) for w in weights]


@worker(group="rollout")
class Sampler:
    def __init__(self, engine: object, options: dict):
        self.arms = range(options["arms"])

    @function(dispatch="slice", collect="flatten")  # the seeds are cut into shards; the policy (a tuple) goes whole
    def sample(self, seeds: list[int], logits: tuple[float, ...]) -> list[int]:  # one arm per seed of the shard
        return [random.Random(seed).choices(self.arms, softmax(list(logits)))[0] for seed in seeds]


@worker(group="train")
class Learner:
    def __init__(self, engine: object, options: dict):
        self.lr = options["lr"]

    @function(dispatch="first")  # rank 0 alone; its result
    def step(self, logits: list[float], arms: list[int], rewards: list[float]) -> list[float]:
        probs, baseline = softmax(logits), sum(rewards) / len(rewards)  # REINFORCE, the mean reward as baseline
        return [v + self.lr * sum((r - baseline) * ((a == arm) - probs[a]) for arm, r in zip(arms, rewards)) / len(arms)
                for a, v in enumerate(logits)]


class BanditConfig(RunConfig, CheckpointKeys):
    """Learn which of `arms` arms pays (arm `best_arm`), with a rollout and a train role."""

    max_steps: int = Field(30, ge=1, le=1_000_000, description="policy-gradient steps")
    arms: int = Field(4, ge=2, le=1 << 16, description="arms of the bandit")
    best_arm: int = Field(3, ge=0, le=1 << 16, description="the arm that pays 1 (the others pay 0)")
    samples: int = Field(32, ge=1, le=1 << 20, description="arms drawn per step, split over the rollout workers")
    lr: float = Field(2.0, gt=0, le=1000, description="learning rate of the logits")
    train: RoleConfig = Field(default_factory=RoleConfig, description="the learner's workers")
    rollout: RoleConfig = Field(default_factory=RoleConfig, description="the samplers' workers")


class BanditTrainer(RoleTrainer):
    name, progress_keys = "bandit", ("reward", "p_best")

    @classmethod
    def roles(cls, config: BanditConfig) -> list[str]:
        return ["train", "rollout"]

    def setups(self) -> dict[str, RoleSetup]:
        options, self.logits = {"arms": self.config.arms, "lr": self.config.lr}, [0.0] * self.config.arms
        return {"train": RoleSetup(Learner, "python", options), "rollout": RoleSetup(Sampler, "python", options)}

    def train_step(self) -> dict:
        cfg, session, first = self.config, self.session, self.config.seed * 100003 + self.step * self.config.samples
        with self.timer("generate"):
            arms = session["rollout"].sample(list(range(first, first + cfg.samples)), tuple(self.logits))
        rewards = [float(arm == cfg.best_arm) for arm in arms]
        with self.timer("train"):
            self.logits = session["train"].step(self.logits, arms, rewards)
        return {"reward": sum(rewards) / len(rewards), "p_best": softmax(self.logits)[cfg.best_arm]}

    def state_dict(self) -> dict:
        return {"logits": self.logits}

    def load_state_dict(self, state: dict) -> None:
        self.logits = state["logits"]


@hookimpl
def rlcore_algorithms():  # a plugin of its own (entry point `bandit`): `rlcore run --plugin bandit`
    yield AlgorithmSpec("bandit", config=BanditConfig, trainer=BanditTrainer, description="a rollout and a train role")
