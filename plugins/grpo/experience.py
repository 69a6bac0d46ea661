"""Turning prompts into training batches: generate, score, compute advantages and log-probs, cut mini-batches."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from rlcore import Batch, RlcoreError, SamplingParams
from rlcore.batch import pad_tokens
from rlcore.data import PromptEncoder, PromptSampler, load_prompts
from rlcore.episodes import episode_metrics
from rlcore.rewards import call_reward, check_reward, resolve_reward

from .config import GRPOConfig


@dataclass(frozen=True)
class OldLogprobs:
    """Where a round's old log-probs come from, and where TRL's sampler correction takes its ratio: decided here,
    once per config, for the driver and the train step alike.

    - `source`: "rollout" with async_generate (generated one step ago: the sampler's own log-probs are the old
      policy's); "step" where a round feeds one optimizer step (`num_iterations` 1, no more micro-batches than one
      step accumulates): the old policy is the one trained, so the step's own forward gives them, detached, and
      no separate forward runs; else "forward": the generating policy's, computed once by a no-grad forward.
    - `correction`: None (off, or async_generate, where the ratio is 1), "step" (the step takes the ratio from its
      own log-probs, `PolicyObjective`) or "driver" (the ratio is computed with the separate forward)."""

    source: str
    correction: str | None

    @classmethod
    def of(cls, config: GRPOConfig) -> OldLogprobs:
        if config.async_generate:
            return cls("rollout", None)
        reused = config.num_iterations > 1 or config.micro_steps_per_generation > config.gradient_accumulation_steps
        if not config.vllm_importance_sampling_correction:
            return cls("forward" if reused else "step", None)
        return cls("forward", "driver") if reused else cls("step", "step")


@dataclass
class Scored:
    """A generation round after scoring: the completions, their prompts' token ids, and their advantages."""

    prompt_ids: list[list[int]]  # one per completion
    generations: list[Any]
    advantages: Any  # torch tensor [N]
    metrics: dict[str, float]


class ExperienceMaker:
    """Owns the tokenizer, the data order and the reward functions; builds each round's batches."""

    def __init__(self, config: GRPOConfig, plugins: Any, dp_size: int):
        self.config = config
        cfg = config
        self.dp_size = dp_size  # the running group's train workers: only the loss normalisers divide by it
        self.old_logprobs = OldLogprobs.of(cfg)
        # the batches are the global ones the config declares (validated there), also when one process trains
        self.generation_batch_size = cfg.per_device_train_batch_size * cfg.train_workers * cfg.micro_steps_per_generation
        self.step_rows = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * cfg.train_workers
        self.prompts_per_round = self.generation_batch_size // cfg.num_generations
        self.reward_names = list(cfg.reward_funcs)
        self.reward_fns = self.reward_functions(cfg, plugins)  # orm: bound once the roles run (bind_orm)
        self.reward_weights = cfg.reward_weights or [1.0] * len(self.reward_fns)
        self.prompts = PromptEncoder.of(cfg.model, cfg)
        self.sampler = PromptSampler(self.prompts.keep(self.prompt_rows(cfg)), self.prompts_per_round, seed=cfg.seed)
        self.tokenizer, self.stop_ids = self.prompts.tokenizer, self.prompts.stop_ids

    @classmethod
    def check(cls, config: GRPOConfig, plugins: Any) -> list[tuple[str, str]]:
        """What building one would find wrong, as (key, problem) pairs: unknown rewards or options, a
        dataset that does not load, a model whose tokenizer does not load. Builds no model."""
        problems: list[tuple[str, str]] = []
        for key, check in (
            ("reward_funcs", lambda: cls.check_rewards(config, plugins)),
            ("dataset", lambda: cls.prompt_rows(config)),
            ("model", lambda: PromptEncoder(config.model, config.use_chat_template)),
        ):
            try:
                check()
            except RlcoreError as exc:
                found = getattr(exc, "problems", None)
                problems.extend(found if found else [(key, str(exc))])
        return problems + config.multi_turn_problems(plugins)

    @classmethod
    def reward_functions(cls, config: GRPOConfig, plugins: Any) -> list[Any]:
        """The config's reward functions with their options (None for `orm`, the reward-model role)."""
        return [None if name == "orm" else resolve_reward(name, plugins, cls._reward_options(config, name))
                for name in config.reward_funcs]

    @classmethod
    def check_rewards(cls, config: GRPOConfig, plugins: Any) -> None:
        """The config's reward functions and their options, checked without running a user's file or module."""
        for name in config.reward_funcs:
            if name != "orm":
                check_reward(name, plugins, cls._reward_options(config, name))

    @staticmethod
    def prompt_rows(config: GRPOConfig) -> list[dict[str, Any]]:
        return load_prompts(config.dataset)

    def bind_orm(self, orm: Any) -> None:
        """Score `orm` in reward_funcs with the reward-model role's workers."""
        if orm is not None:
            index = self.reward_names.index("orm")
            self.reward_fns[index] = lambda prompts, completions, **columns: orm.score(prompts, completions)

    @staticmethod
    def _reward_options(config: GRPOConfig, name: str) -> dict[str, Any] | None:
        """The config's `reward_kwargs[name]`; soft_overlong also learns the run's max_completion_length."""
        options = dict(config.reward_kwargs.get(name, {}))
        if name == "soft_overlong":
            options.setdefault("max_completion_length", config.max_completion_length)
        return options or None

    # -- prompts --------------------------------------------------------------------------------

    def encode(self, prompt: Any) -> list[int]:
        return self.prompts.encode(prompt)

    def sampling_params(self, step: int) -> SamplingParams:
        cfg = self.config
        return SamplingParams(
            n=cfg.num_generations, max_tokens=cfg.max_completion_length, temperature=cfg.temperature,
            top_p=cfg.top_p, top_k=cfg.top_k, stop_token_ids=self.stop_ids, seed=cfg.seed * 100003 + step,
        )

    def generate(self, rollout: Any, step: int) -> tuple[list[dict], list[Any]]:
        """The next prompts' completions: rows and generations, prompt-major (num_generations each)."""
        return self.finish_generate(self.start_generate(rollout, step, blocking=True))

    def start_generate(self, rollout: Any, step: int, blocking: bool = False) -> tuple[list[dict], list[list[int]], Any]:
        """Take the next prompts and start generating; `finish_generate` waits for the completions."""
        rows = self.sampler.next_batch()
        if self.config.multi_turn:  # one episode per completion; the rollout workers build the prompts and environments
            call = rollout.generate_episodes if blocking else rollout.generate_episodes_async
            params = dataclasses.replace(self.sampling_params(step), n=1)
            episodes = [r for r in rows for _ in range(self.config.num_generations)]
            return rows, [], call(episodes, self.config.episode_setup(self.config.model, self.config.max_completion_length), params)
        prompt_ids = [self.encode(r["prompt"]) for r in rows]
        call = rollout.generate if blocking else rollout.generate_async
        return rows, prompt_ids, call(prompt_ids, self.sampling_params(step))

    def finish_generate(self, started: tuple[list[dict], list[list[int]], Any]) -> tuple[list[dict], list[Any]]:
        rows, prompt_ids, result = started
        generations = result if isinstance(result, list) else result.get()
        for g, p in zip(generations, [p for p in prompt_ids for _ in range(self.config.num_generations)]):  # `Generation.prompt_ids`; episodes carry theirs
            g.prompt_ids = p
        return rows, generations

    # -- rewards and advantages -----------------------------------------------------------------

    def score(self, rows: list[dict], generations: list[Any], regenerate: Any) -> Scored:
        """Rewards, advantages and round metrics; with dynamic_sample, groups whose rewards are all equal
        are replaced by fresh ones (at most max_resample_times more generations)."""
        import torch

        from .advantages import combine_rewards, compute_advantages, nanstd, zero_std_groups

        cfg, G = self.config, self.config.num_generations
        per_func, errors = self._rewards(rows, generations)
        metrics: dict[str, float] = {}
        if cfg.dynamic_sample:
            rows, generations, per_func, metrics = self._dynamic_sample(rows, generations, per_func, regenerate, errors)
        rewards = combine_rewards(per_func, self.reward_weights)
        advantages = compute_advantages(rewards, G, scale_rewards=cfg.scale_rewards, estimator=cfg.advantage_estimator)
        lengths = torch.tensor([len(g.token_ids) for g in generations], dtype=torch.float)
        truncated = torch.tensor([g.finish_reason == "length" for g in generations], dtype=torch.float)
        metrics.update(
            {
                "reward": float(torch.nanmean(rewards)),
                "reward_std": float(nanstd(rewards)),  # as TRL: over the round, not within groups
                "frac_reward_zero_std": float(zero_std_groups(rewards, G).float().mean()),
                "completions/mean_length": float(lengths.mean()),
                "completions/min_length": float(lengths.min()),
                "completions/max_length": float(lengths.max()),
                "completions/clipped_ratio": float(truncated.mean()),
                "reward_errors": float(sum(errors.values())),  # completions a reward function failed on
                "kl": float("nan"),  # written as null unless a reference model measures it (beta > 0)
                "off_policy_steps": float(cfg.async_generate),  # async: generated by the previous step's policy
            }
        )
        if cfg.multi_turn:
            metrics.update(episode_metrics(generations))
        for j, name in enumerate(self.reward_names):
            metrics[f"rewards/{name}/mean"] = float(torch.nanmean(per_func[:, j]))
            metrics[f"rewards/{name}/std"] = float(nanstd(per_func[:, j]))
        return Scored([g.prompt_ids for g in generations], generations, advantages, metrics)

    def _rewards(self, rows: list[dict], generations: list[Any]) -> tuple[Any, dict[str, int]]:
        """[N, F] rewards (NaN: None or failed) and, per function, the completions it failed on. A function
        failing on all of them (or on any, with strict_rewards) stops the run: `RewardFailed`."""
        import torch

        G = self.config.num_generations
        expanded = [r for r in rows for _ in range(G)]
        prompts = [r["prompt"] for r in expanded]
        completions = [  # an episode's: the whole conversation after the prompt, as TRL gives it with tools
            g.messages if hasattr(g, "messages") else [{"role": "assistant", "content": g.text}] if isinstance(p, list)
            else g.text
            for g, p in zip(generations, prompts)
        ]
        completion_ids = [g.token_ids for g in generations]
        columns = {k: [r.get(k) for r in expanded] for k in rows[0] if k not in ("prompt",)}
        if self.config.multi_turn:
            columns["environment_reward"] = [g.reward for g in generations]
        out = torch.full((len(generations), len(self.reward_fns)), float("nan"))
        errors: dict[str, int] = {}
        for j, (name, fn) in enumerate(zip(self.reward_names, self.reward_fns)):
            values, n_errors = call_reward(
                fn, name, prompts, completions, completion_ids, columns, strict=self.config.strict_rewards,
                timeout_s=self.config.reward_timeout_s,
            )
            errors[name] = n_errors
            out[:, j] = torch.tensor([float("nan") if v is None else float(v) for v in values])
        return out, errors

    def _dynamic_sample(self, rows, generations, per_func, regenerate, errors):
        """DAPO's dynamic sampling: keep groups whose rewards differ, generate more until the round is full."""
        import torch

        from .advantages import combine_rewards, zero_std_groups

        G, want = self.config.num_generations, len(rows)
        kept: list[tuple] = []  # (row, generations, rewards) per group with a learning signal
        flat: list[tuple] = []  # groups whose rewards are all equal: zero advantage

        def sort(rows, gens, pf) -> None:
            equal = set(zero_std_groups(combine_rewards(pf, self.reward_weights), G).nonzero().flatten().tolist())
            for i, row in enumerate(rows):
                group = (row, gens[i * G : (i + 1) * G], pf[i * G : (i + 1) * G])
                (flat if i in equal else kept).append(group)

        sort(rows, generations, per_func)
        resamples = 0
        while len(kept) < want and resamples < self.config.max_resample_times:
            resamples += 1
            new_rows, new_gens = regenerate()
            new_per_func, new_errors = self._rewards(new_rows, new_gens)
            for name, count in new_errors.items():
                errors[name] += count
            sort(new_rows, new_gens, new_per_func)
        filled = max(0, want - len(kept))  # out of retries: fill up with flat groups
        groups = (kept + flat[:filled])[:want]
        metrics = {"dynamic_sample/resamples": float(resamples), "dynamic_sample/filled": float(filled)}
        return (
            [g[0] for g in groups],
            [x for g in groups for x in g[1]],
            torch.cat([g[2] for g in groups]),
            metrics,
        )

    # -- log-probs and batches ------------------------------------------------------------------

    def build_batch(self, prompt_ids: list[list[int]], generations: list[Any]) -> Batch:
        """Prompt + completion, right-padded, with the completion mask (and truncated ones masked out
        when mask_truncated_completions)."""
        import torch

        seqs = [p + g.token_ids for p, g in zip(prompt_ids, generations)]
        input_ids, attention = pad_tokens(seqs, self.tokenizer.pad_token_id)
        completion = torch.zeros(input_ids.shape, dtype=torch.float)
        sampled = torch.zeros(input_ids.shape, dtype=torch.float)  # the rollout engine's log-probs
        for i, (p, s) in enumerate(zip(prompt_ids, seqs)):
            sampled[i, len(p) : len(s)] = torch.tensor(generations[i].logprobs, dtype=torch.float)
            truncated = generations[i].finish_reason == "length" and self.config.mask_truncated_completions
            if not truncated:  # an episode's tokens the model did not generate (tool results, hints) stay 0
                mask = getattr(generations[i], "loss_mask", None)
                completion[i, len(p) : len(s)] = 1 if mask is None else torch.tensor(mask, dtype=torch.float)
        return Batch(input_ids=input_ids, attention_mask=attention, completion_mask=completion, rollout_logprobs=sampled)

    def logprobs(self, scored: Scored, train: Any, reference: Any, teacher: Any = None) -> Batch:
        """The round's batch with advantages, and old/reference log-probs where the loss needs them; with the
        sampler correction, its ratio per token (and its metrics added to the round's). With a teacher
        (`teacher(batch, temperature)` -> its log-probs [B, T]), the advantages are per token (`teacher_advantages`)."""
        cfg, old = self.config, self.old_logprobs
        batch = self.build_batch(scored.prompt_ids, scored.generations)
        batch["advantages"] = scored.advantages
        if old.source == "rollout":
            batch["old_logprobs"] = batch["rollout_logprobs"]
        elif old.source == "forward":  # reused for several steps: the generating policy's, computed once
            batch["old_logprobs"] = train.forward_logprobs(batch, cfg.temperature)
        if old.correction == "driver":
            from .loss import sampler_importance_ratio  # with the loss module: torch

            mask = batch["completion_mask"]
            ratio, metrics = sampler_importance_ratio(
                batch["old_logprobs"], batch["rollout_logprobs"], mask, cfg.vllm_importance_sampling_mode,
                cfg.vllm_importance_sampling_clip_min, cfg.vllm_importance_sampling_clip_max,
            )
            batch["importance_sampling_ratio"] = ratio.expand(mask.shape).contiguous()
            scored.metrics.update({k: float(v) for k, v in metrics.items()})  # CPU tensors here: no wait
        if reference is not None:
            batch["ref_logprobs"] = reference.forward_logprobs(batch, cfg.temperature)
        if teacher is not None:
            from .advantages import teacher_advantages, teacher_kl

            # the old policy's log-probs of the sampled tokens; where the step's own forward gives them to the loss,
            # they are computed here for the advantage only, as ms-swift computes them for it
            policy = batch["old_logprobs"] if "old_logprobs" in batch else train.forward_logprobs(batch, cfg.temperature)
            teacher_logprobs = teacher(batch, cfg.temperature)
            mask = batch["completion_mask"]
            batch["advantages"] = teacher_advantages(scored.advantages, teacher_logprobs, policy, mask, cfg.teacher_kl_coef)
            scored.metrics["teacher_kl"] = float(teacher_kl(teacher_logprobs, policy, mask))
        return batch

    def mini_batches(self, batch: Batch, metrics: dict[str, float]) -> list[tuple[Batch, dict, Any]]:
        """The optimizer steps this round feeds: (mini-batch, round metrics, loss function) each."""
        from .objective import PolicyObjective

        cfg = self.config
        steps = batch.chunks(self.step_rows)
        round_tokens = float(batch["completion_mask"].sum())
        out = []
        for _ in range(cfg.num_iterations):
            for mini in steps:
                objective = PolicyObjective.for_step(cfg, mini, self.dp_size, round_tokens, len(steps),
                                                     correct_in_step=self.old_logprobs.correction == "step")
                out.append((mini, metrics, objective))
        return out

    def probe_sequence(self) -> list[int]:
        """A fixed sequence for the weight-sync check: the first prompt of the data (its last token repeated to
        the two tokens the check scores, where max_prompt_length cut it shorter)."""
        ids = list(self.encode(self.sampler.rows[0]["prompt"])) or [0]
        return ids + ids[-1:] * (2 - len(ids))
