"""GRPO's experience and objective on a real tiny model, against TRL's definitions: the dapo normaliser over
a generation batch that feeds several optimizer steps, old log-probs recomputed when the policy moves between
those steps, the sampler importance-sampling correction, and a reward function failing on every completion."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from rlcore import RewardSpec, hookimpl, load_plugins
from rlcore.plugins.grpo.config import GRPOConfig
from rlcore.plugins.grpo.experience import ExperienceMaker
from rlcore.plugins.grpo.loss import policy_loss, sampler_importance_ratio
from rlcore.plugins.hf.rollout import HFRolloutEngine
from rlcore.plugins.hf.train import HFTrainEngine
from rlcore.plugins.rewards import RewardFailed
from rlcore.testing import resolve_tiny

# 2 declared train workers x 2 rows per micro-batch x 4 micro-steps per generation = 16 completions (4 prompts);
# 2 accumulation steps: the round feeds 2 optimizer steps of 8 rows
ROUND = {
    "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "steps_per_generation": 4,
    "num_generations": 4, "max_completion_length": 6, "train": {"cpus": 2},
}


@pytest.fixture(scope="module")
def engines(tiny_model):
    """A rollout engine and a fresh train engine per call (training changes the weights)."""
    rollout = HFRolloutEngine(str(tiny_model), seed=0)
    return rollout, lambda lr=1e-6: HFTrainEngine(str(tiny_model), learning_rate=lr, max_grad_norm=0.0)


def maker_for(tiny_model, tmp_path, plugins=None, **overrides):
    config = GRPOConfig(**{"model": str(tiny_model), "output_dir": str(tmp_path), **ROUND, **overrides})
    config = resolve_tiny(config)  # the default dataset, tiny:toy, as a run resolves it
    return ExperienceMaker(config, plugins or load_plugins(), dp_size=1)  # one process runs both workers' rows


def one_round(maker, rollout, train):
    rows, generations = maker.generate(rollout, step=0)
    scored = maker.score(rows, generations, regenerate=None)
    return scored, maker.logprobs(scored, train, None)


# ---------------------------------------------------------------------------------------------------------
# dapo: TRL divides by the generation batch's tokens / processes * accumulation / steps_per_generation
# ---------------------------------------------------------------------------------------------------------


def trl_micro_loss(micro, logprobs, config, round_tokens, num_processes):
    """TRL 1.16's own `GRPOTrainer._compute_loss` on one micro-batch, on a stand-in carrying what it reads."""
    from trl import GRPOTrainer

    accelerator = SimpleNamespace(
        num_processes=num_processes, sync_gradients=True, gather=lambda x: x, gather_for_metrics=lambda x: x,
        reduce=lambda x, reduction="sum": x,
    )
    stand_in = SimpleNamespace(
        loss_type=config.loss_type, importance_sampling_level=config.importance_sampling_level, beta=config.beta,
        epsilon_low=config.epsilon, epsilon_high=config.epsilon_high or config.epsilon,
        max_completion_length=config.max_completion_length, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        use_vllm=False, vllm_importance_sampling_correction=False, aux_loss_enabled=False,
        _entropy_bonus_enabled=False, current_gradient_accumulation_steps=config.gradient_accumulation_steps,
        model=SimpleNamespace(training=True), accelerator=accelerator,
        args=SimpleNamespace(delta=config.delta, use_bias_correction_kl=config.use_bias_correction_kl,
                             steps_per_generation=config.micro_steps_per_generation),
        _metrics={"train": defaultdict(list)},
        _get_per_token_logps_and_entropies=lambda *a, **k: (logprobs, torch.zeros_like(logprobs), None),
    )
    rows, cols = logprobs.shape
    inputs = {
        "prompt_ids": torch.zeros(rows, 1, dtype=torch.long), "prompt_mask": torch.ones(rows, 1, dtype=torch.long),
        "completion_ids": torch.zeros(rows, cols, dtype=torch.long), "completion_mask": micro["completion_mask"],
        "advantages": micro["advantages"], "old_per_token_logps": micro["old_logprobs"],
        "num_items_in_batch": torch.tensor(round_tokens),
    }
    return float(GRPOTrainer._compute_loss(stand_in, None, inputs))


def test_dapo_step_loss_is_trls_over_a_round_of_several_steps(engines, tiny_model, tmp_path):
    rollout, make_train = engines
    train = make_train()
    maker = maker_for(tiny_model, tmp_path, loss_type="dapo", vllm_importance_sampling_correction=False)
    _, batch = one_round(maker, rollout, train)
    steps = maker.mini_batches(batch, {})
    assert len(steps) == 2 and all(len(mini) == 8 for mini, _, _ in steps)
    cfg, workers = maker.config, maker.config.train_workers
    round_tokens = float(batch["completion_mask"].sum())
    mini, _, objective = steps[0]
    # TRL's per-process normaliser, times the workers this one process stands in for
    assert objective.num_items_in_batch == pytest.approx(
        round_tokens / workers * cfg.gradient_accumulation_steps / cfg.micro_steps_per_generation * workers
    )

    # the step's loss as TRL computes it: each worker sums its micro-batches' losses, DDP averages the workers
    logprobs = train.forward_logprobs(mini, cfg.temperature)
    micro_rows = [slice(i, i + cfg.per_device_train_batch_size) for i in range(0, len(mini), cfg.per_device_train_batch_size)]
    expected = sum(
        trl_micro_loss(mini.select(rows), logprobs[rows], cfg, round_tokens, workers) for rows in micro_rows
    ) / workers
    out = train.train_step(mini, objective, cfg.per_device_train_batch_size, cfg.temperature)
    assert out["loss"] == pytest.approx(expected, rel=1e-4, abs=1e-6)


# ---------------------------------------------------------------------------------------------------------
# old log-probs: recomputed when one generation feeds several optimizer steps
# ---------------------------------------------------------------------------------------------------------


def test_old_logprobs_are_the_generating_policy_s_when_steps_reuse_a_round(engines, tiny_model, tmp_path):
    rollout, make_train = engines
    train = make_train(lr=0.05)
    maker = maker_for(tiny_model, tmp_path, vllm_importance_sampling_correction=False)
    cfg = maker.config
    _, batch = one_round(maker, rollout, train)
    before = train.forward_logprobs(batch, cfg.temperature)  # the policy that generated the round
    (first, _, first_loss), (second, _, second_loss) = maker.mini_batches(batch, {})
    train.train_step(first, first_loss, cfg.per_device_train_batch_size, cfg.temperature)

    moved = train.forward_logprobs(second, cfg.temperature)
    mask, adv = second["completion_mask"], second["advantages"]
    norms = dict(num_items_in_batch=second_loss.num_items_in_batch, num_sequences_in_batch=second_loss.num_sequences_in_batch)
    off_policy, _ = policy_loss(moved, before[8:], adv, mask, **norms)
    on_policy, _ = policy_loss(moved, moved, adv, mask, **norms)
    assert abs(off_policy.item() - on_policy.item()) > 1e-3  # the first step moved the policy

    out = train.train_step(second, second_loss, cfg.per_device_train_batch_size, cfg.temperature)
    assert out["loss"] == pytest.approx(off_policy.item(), rel=1e-4, abs=1e-6)  # ratios against the generating policy


def test_old_logprobs_are_skipped_only_when_nothing_reuses_the_round(engines, tiny_model, tmp_path):
    rollout, make_train = engines
    train = make_train()
    on_policy = maker_for(tiny_model, tmp_path, steps_per_generation=2, vllm_importance_sampling_correction=False)
    assert "old_logprobs" not in one_round(on_policy, rollout, train)[1]
    iterations = maker_for(tiny_model, tmp_path, steps_per_generation=2, num_iterations=2,
                           vllm_importance_sampling_correction=False)
    assert "old_logprobs" in one_round(iterations, rollout, train)[1]


# ---------------------------------------------------------------------------------------------------------
# the sampler correction: on for any rollout engine, off under async_generate
# ---------------------------------------------------------------------------------------------------------

SAMPLER_METRICS = [
    "sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
    "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
]


def test_sampler_correction_of_a_round_that_feeds_several_steps_uses_one_old_forward(engines, tiny_model, tmp_path):
    rollout, make_train = engines
    train = make_train()
    maker = maker_for(tiny_model, tmp_path, vllm_importance_sampling_mode="token_truncate")  # 2 optimizer steps
    scored, batch = one_round(maker, rollout, train)
    torch.testing.assert_close(batch["old_logprobs"], train.forward_logprobs(batch, 1.0))
    ratio, metrics = sampler_importance_ratio(batch["old_logprobs"], batch["rollout_logprobs"], batch["completion_mask"],
                                              "token_truncate", None, 3.0)
    torch.testing.assert_close(batch["importance_sampling_ratio"], ratio)
    assert {k: scored.metrics[k] for k in SAMPLER_METRICS} == metrics
    assert metrics["sampling/sampling_logp_difference/max"] < 1e-3  # the HF sampler and trainer agree closely

    mini, _, objective = maker.mini_batches(batch, {})[0]
    assert objective.sampler_correction_mode is None  # the ratio travels with the batch
    logprobs = train.forward_logprobs(mini, 1.0)
    outputs = SimpleNamespace(logprobs=lambda: logprobs)
    whole, _ = objective(outputs, mini.update(importance_sampling_ratio=torch.ones_like(logprobs)))
    halved, _ = objective(outputs, mini.update(importance_sampling_ratio=torch.full_like(logprobs, 0.5)))
    assert halved.item() == pytest.approx(whole.item() / 2, rel=1e-5)


def test_sampler_correction_of_a_one_step_round_is_taken_in_the_step_as_a_separate_forward_gives_it(
        engines, tiny_model, tmp_path):
    import dataclasses

    from rlcore import Batch

    rollout, make_train = engines
    train = make_train()
    maker = maker_for(tiny_model, tmp_path, steps_per_generation=2, vllm_importance_sampling_mode="token_truncate")
    scored, batch = one_round(maker, rollout, train)
    assert "old_logprobs" not in batch and "importance_sampling_ratio" not in batch  # no separate forward
    assert not set(SAMPLER_METRICS) & set(scored.metrics)
    (mini, _, objective), = maker.mini_batches(batch, {})
    assert (objective.sampler_correction_mode, objective.sampler_clip_max) == ("token_truncate", 3.0)

    current = train.forward_logprobs(mini, 1.0)
    leaf = current.clone().requires_grad_()
    in_step, metrics = objective(SimpleNamespace(logprobs=lambda: leaf), mini)
    in_step.backward()
    # what the separate forward did: old = the same policy's log-probs, the ratio computed from them up front
    ratio, expected = sampler_importance_ratio(current, mini["rollout_logprobs"], mini["completion_mask"],
                                               "token_truncate", None, 3.0)
    other = current.clone().requires_grad_()
    separate, _ = dataclasses.replace(objective, sampler_correction_mode=None)(
        SimpleNamespace(logprobs=lambda: other), Batch({**mini, "old_logprobs": current, "importance_sampling_ratio": ratio}))
    separate.backward()
    assert in_step.item() == separate.item()
    torch.testing.assert_close(leaf.grad, other.grad, rtol=0, atol=0)
    assert {k: metrics[k] for k in SAMPLER_METRICS} == expected
    assert expected["sampling/importance_sampling_ratio/max"] != 1.0  # the ratio is not trivially 1


def test_no_sampler_correction_under_async_generate_or_when_off(engines, tiny_model, tmp_path):
    rollout, make_train = engines
    train = make_train()
    for overrides in ({"async_generate": True}, {"vllm_importance_sampling_correction": False}):
        scored, batch = one_round(maker_for(tiny_model, tmp_path, steps_per_generation=2, **overrides), rollout, train)
        assert "importance_sampling_ratio" not in batch and not set(SAMPLER_METRICS) & set(scored.metrics)
        assert ("old_logprobs" in batch) == bool(overrides.get("async_generate"))


# ---------------------------------------------------------------------------------------------------------
# rewards: failing on every completion stops the run; failing on some is counted (strict_rewards: fatal)
# ---------------------------------------------------------------------------------------------------------


class Graders:
    """A plugin with a reward that always raises and one that raises on completions containing `bad`."""

    def __init__(self) -> None:
        self.bad = ""

    def boom(self, prompts, completions, **kwargs):
        raise ValueError("the grader is down")

    def picky(self, prompts, completions, **kwargs):
        if any(c == self.bad for c in completions):
            raise ValueError(f"cannot grade {self.bad!r}")
        return [float(len(c)) for c in completions]

    @hookimpl
    def rlcore_rewards(self):
        yield RewardSpec("boom", fn=self.boom)
        yield RewardSpec("picky", fn=self.picky)


@pytest.fixture
def graders():
    plugins, graders = load_plugins(), Graders()
    plugins.register(graders, "graders")
    return plugins, graders


def test_a_reward_failing_on_every_completion_stops_the_run(engines, tiny_model, tmp_path, graders):
    rollout, _ = engines
    plugins, _ = graders
    maker = maker_for(tiny_model, tmp_path, plugins, reward_funcs=["toy", "boom"])
    rows, generations = maker.generate(rollout, step=0)
    with pytest.raises(RewardFailed, match=r"reward function 'boom' failed on all 16 completions of this step: "
                                           r"ValueError\('the grader is down'\)"):
        maker.score(rows, generations, regenerate=None)


def test_a_reward_failing_on_some_completions_is_counted_or_strict(engines, tiny_model, tmp_path, graders):
    rollout, _ = engines
    plugins, picky = graders
    maker = maker_for(tiny_model, tmp_path, plugins, reward_funcs=["toy", "picky"])
    rows, generations = maker.generate(rollout, step=0)
    picky.bad = generations[5].text
    failed = sum(g.text == picky.bad for g in generations)
    assert failed < len(generations)
    scored = maker.score(rows, generations, regenerate=None)
    assert scored.metrics["reward_errors"] == failed
    scored_ok = [len(g.text) for g in generations if g.text != picky.bad]
    assert scored.metrics["rewards/picky/mean"] == pytest.approx(sum(scored_ok) / len(scored_ok))

    strict = maker_for(tiny_model, tmp_path, plugins, reward_funcs=["toy", "picky"], strict_rewards=True)
    with pytest.raises(RewardFailed, match="reward function 'picky' failed: ValueError.*strict_rewards"):
        strict.score(rows, generations, regenerate=None)
