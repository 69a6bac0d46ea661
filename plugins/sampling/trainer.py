"""The sample and distill driver: prompts -> candidates -> orm/prm scores -> best-of-N -> resumable JSONL.

```
for batch in rows[next_row:] (batch_size prompts):
    texts  = sampler.generate(prompt ids, seeds)      # or the API teacher; N per prompt, rows split whole
    orm    = orm.score(prompts, texts, rows)          # reward function or reward model, on the orm workers
    prm    = aggregate(prm.score(prompts, texts))     # step scores -> min | last | prod
    lines  = best_of_n(every candidate of a prompt)   # here, on the driver: never per worker
    output.commit(lines, next_row)                    # fsync, then the state file: resumable at any moment
```
One batch is one step of `rlcore.RoleTrainer`'s loop (metrics JSONL, hooks, signals, run lock), but there are
no checkpoints: each step commits its batch, the position of a run is the output's state file, and
`--resume` continues after its last complete batch.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlcore import (
    ConfigError, ModelUse, NotRegistered, RlcoreError, RoleSetup, RoleTrainer, SamplingParams, did_you_mean,
    problems_of, worker_plugins,
)
from rlcore.data import PromptEncoder, has_conversations, load_rows, prompt_view
from rlcore.memory import RoleUse
from rlcore.rewards import check_reward, resolve_reward
from rlcore.runtime import logger, scrub_data
from rlcore.sections import rollout_options

from .config import SampleConfig
from .output import ResumableJsonl
from .scoring import FunctionScorer, ScoreRows, check_scores, is_reward_function, scorer
from .select import aggregate_steps, select
from .sources import ApiTeacher, SampleWorker


def row_id(row: dict[str, Any]) -> str:
    """ms-swift's stable id of a row: the md5 of its JSON with sorted keys."""
    return hashlib.md5(json.dumps(row, sort_keys=True, default=str).encode("utf-8")).hexdigest()


def shard(rows: list[Any], i: int, n: int) -> tuple[int, list[Any]]:
    """Shard i of n: contiguous, the first `len % n` shards one row longer; (its first index, its rows)."""
    size, extra = divmod(len(rows), n)
    start = i * size + min(i, extra)
    return start, rows[start : start + size + (1 if i < extra else 0)]


class SampleTrainer(RoleTrainer):
    """Runs sampling locally (every role in this process) or on Ray, roles placed by the resource plan; one
    step is one batch of prompts, committed to the output before the next."""

    config: SampleConfig
    name = "sample"
    plot_keys = ("pass_rate", "kept", "prompts_per_s", "candidates/mean_chars", "orm/mean")
    resume_fixed = (  # what the output's rows depend on: a resumed run may not change them
        "model", "dataset", "data_range", "system", "use_chat_template", "max_prompt_length", "num_return_sequences",
        "max_new_tokens", "temperature", "top_p", "top_k", "seed", "seed_per_prompt", "batch_size", "orm_model",
        "orm_kwargs", "prm_model", "prm_step_separator", "prm_step_token", "prm_aggregation", "orm_threshold",
        "prm_threshold", "easy_query_threshold", "n_best_to_keep", "output_file", "output_format", "api_base",
    )
    session_fixed = {"sleep_level": 0}  # vLLM never sleeps: nothing trains beside it
    save_steps = 1  # every batch is committed by its step: the run's position is the output's state file
    required = ("model",)

    # -- what runs where -----------------------------------------------------------------------------

    @classmethod
    def roles(cls, cfg: SampleConfig) -> list[str]:
        return (["sampler"] if cfg.uses_local_sampler else []) + (["prm"] if cfg.prm_model else []) + (
            ["orm"] if cfg.orm_model else [])

    @classmethod
    def problems(cls, cfg: SampleConfig, plugins: Any, run: bool = False) -> list[tuple[str, str]]:
        """The engines, the orm reward function and its options, the dataset and the model's tokenizer."""
        checks = [("dataset", lambda: cls.load_rows(cfg))]
        if cfg.uses_local_sampler:
            checks.append(("model", lambda: PromptEncoder(cfg.model, cfg.use_chat_template)))
        return cls.name_problems(cfg, plugins, run_code=run) + problems_of(checks)

    @classmethod
    def models(cls, cfg: SampleConfig) -> list[ModelUse]:
        """The sampler's model holds a prompt and its candidate (its engine checks its own context key); the reward
        models' files."""
        uses = []
        if cfg.uses_local_sampler:
            lengths = [(("max_prompt_length", "max_new_tokens"), (cfg.max_prompt_length, cfg.max_new_tokens))]
            uses.append(ModelUse("model", cfg.model, tuple(lengths), roles=("sampler",),
                                 conversations=lambda: "dataset" if has_conversations(cfg.dataset) else None))
        return uses + [ModelUse(key, getattr(cfg, key)) for key in ("orm_model", "prm_model") if getattr(cfg, key)]

    @classmethod
    def memory_use(cls, cfg: SampleConfig) -> dict[str, RoleUse]:
        """The sampler generates a batch's candidates (split over its GPUs; with `seed_per_prompt` one prompt's at a
        time); then the reward models score them, `batch_size` candidates per forward, one after the other (the plan
        adds both working sets: an upper bound); a reward function takes nothing on the GPU. vLLM stays awake
        (`sleep_level` 0): nothing trains here."""
        roles, length = cls.roles(cfg), cfg.max_prompt_length + cfg.max_new_tokens
        uses = {}
        if "sampler" in roles:  # seed_per_prompt: one engine call per prompt, its N candidates at once
            gpus = max(cfg.sampler.gpu_count or 1, 1)
            batch = cfg.num_return_sequences * (1 if cfg.seed_per_prompt else -(-cfg.batch_size // gpus))
            uses["sampler"] = RoleUse(cfg.sampler.engine, "rollout", rollout_options(cfg.sampler, cfg.model, cfg.seed),
                                      "generation", cfg.model, seq_len=length, sequences=batch)
        for kind in (k for k in ("prm", "orm") if k in roles):
            model, section = getattr(cfg, f"{kind}_model"), getattr(cfg, kind)
            options = {"model_path": model, "dtype": section.dtype, "batch_size": section.batch_size, **section.engine_kwargs}
            if kind == "orm" and is_reward_function(model, worker_plugins()):
                uses[kind] = RoleUse(FunctionScorer, "reward", options, "scoring", None)
            else:
                uses[kind] = RoleUse(section.engine, "reward", options, "scoring", model, seq_len=length)
        return uses

    @staticmethod
    def name_problems(cfg: SampleConfig, plugins: Any, run_code: bool = True) -> list[tuple[str, str]]:
        """The names a run resolves, checked without building anything: the engines, and orm_model as a reward
        function (with orm_kwargs) or a model (a directory, or a hub id `org/name`). Without `run_code` (config
        validate), a `file.py:function` orm_model is parsed, not imported."""
        problems: list[tuple[str, str]] = []
        engines = [("sampler.engine", cfg.sampler.engine, "rollout")] if cfg.uses_local_sampler else []
        engines += [(f"{k}.engine", getattr(cfg, k).engine, "reward") for k in ("orm", "prm")
                    if getattr(cfg, f"{k}_model") and getattr(cfg, k).engine != "hf"]
        for key, name, kind in engines:
            try:
                plugins.engines.get(name, kind=kind)
            except NotRegistered as exc:  # it lists the known ones
                problems.append((key, str(exc)))
        if cfg.orm_model and is_reward_function(cfg.orm_model, plugins):
            try:
                (resolve_reward if run_code else check_reward)(cfg.orm_model, plugins, cfg.orm_kwargs or None)
            except RlcoreError as exc:  # GRPO's key for these options is reward_kwargs.NAME; here it is orm_kwargs
                grpo_key = f"reward_kwargs.{cfg.orm_model}"
                problems.extend((k.replace(grpo_key, "orm_kwargs"), m.replace(grpo_key, "orm_kwargs"))
                                for k, m in getattr(exc, "problems", None) or [("orm_model", str(exc))])
        elif cfg.orm_model and "/" not in cfg.orm_model and not Path(cfg.orm_model).expanduser().is_dir():
            known = plugins.rewards.names()
            problems.append(("orm_model", f"'{cfg.orm_model}' is neither a registered reward function ({', '.join(known)})"
                             f" nor a model directory or hub id.{did_you_mean(cfg.orm_model, known)}"))
        if cfg.orm_kwargs and cfg.orm_model and not is_reward_function(cfg.orm_model, plugins):
            problems.append(("orm_kwargs", "are options of a reward function; orm_model is a reward model (use orm.engine_kwargs)"))
        return problems

    @staticmethod
    def load_rows(cfg: SampleConfig) -> tuple[int, list[dict[str, Any]]]:
        """(index of the first row in the dataset, the rows of this run's data_range shard)."""
        rows = load_rows(cfg.dataset)
        prompt_view(rows, cfg.dataset)  # every row has a prompt: all problems of the file at once
        return shard(rows, *cfg.data_range) if cfg.data_range else (0, rows)

    def prepare(self) -> None:
        """The rows, the prompt encoder or the API teacher."""
        cfg = self.config
        self.output = ResumableJsonl(self.output_dir, cfg.output_file)
        self.first_row, self.rows = self.load_rows(cfg)
        self.ids = [row_id(r) for r in self.rows]
        self.model_path = cfg.model
        self.encoder = None
        if cfg.uses_local_sampler:
            self.encoder = PromptEncoder(self.model_path, cfg.use_chat_template, cfg.max_prompt_length)
        self.teacher = None if cfg.uses_local_sampler else ApiTeacher(
            cfg.api_base, cfg.model, cfg.api_key and cfg.api_key.get_secret_value(), cfg.max_concurrency,
            cfg.max_retries, cfg.retry_backoff_s, cfg.request_timeout_s)
        self.written = 0
        self.done_before = False  # --resume of an output that was already complete

    def setups(self) -> dict[str, RoleSetup]:
        cfg, roles = self.config, self.roles(self.config)
        setups = {}
        if "sampler" in roles:
            sampler = rollout_options(cfg.sampler, self.model_path, cfg.seed)
            if "vllm_request_seeds" in sampler and "vllm_request_seeds" not in cfg.sampler.model_fields_set:
                sampler["vllm_request_seeds"] = cfg.seed_per_prompt  # else vLLM ignores a request's seed
            setups["sampler"] = RoleSetup(SampleWorker, cfg.sampler.engine, sampler)
        for kind in ("prm", "orm"):
            if kind in roles:
                section = getattr(cfg, kind)
                options = dict(kind=kind, model=getattr(cfg, f"{kind}_model"), engine=section.engine, dtype=section.dtype,
                               batch_size=section.batch_size, strict=cfg.strict_rewards,
                               reward_timeout_s=cfg.reward_timeout_s)
                if kind == "orm":
                    options["options"] = cfg.orm_kwargs
                else:
                    options["options"] = {"step_separator": cfg.prm_step_separator, "step_token": cfg.prm_step_token}
                setups[kind] = RoleSetup(ScoreRows, scorer, {**options, **section.engine_kwargs})
        return setups

    # -- the loop: one batch a step, its position the output's state file ----------------------------

    @property
    def max_steps(self) -> int:
        return -(-len(self.rows) // self.config.batch_size)

    def resume_point(self) -> None:
        """No checkpoints: `restore` continues the output's state file."""
        return None

    def restore(self) -> None:
        """Continue after the last complete batch (`--resume`), or start a fresh output that overwrites none."""
        cfg = self.config
        if cfg.resume == "auto":
            state = self.output.resume()
            self._check_changes(self.output.state_path, _secrets_hidden(state.get("config"), cfg))
            self.done_before = bool(state.get("done"))
            if self.done_before:
                logger.info(f"{self.output.final} is already complete; nothing to resume")
        else:
            if self.overwrite:
                self.output.remove_own()
            self.output.refuse_existing()
            metrics = self.output_dir / "metrics.jsonl"
            if metrics.is_file() and metrics.stat().st_size and not self.overwrite:
                raise ConfigError(f"output_dir '{self.output_dir}' holds the metrics.jsonl of another run; choose "
                                  "another output_dir, or continue that run with --resume")
            given = scrub_data(self.config_as_given.model_dump(mode="json"))  # `tiny`, not the folder it was built in
            self.output.start({"config": given, "rows": len(self.rows), "written": 0})
            state = self.output.state
        self.step, self.written = state["batches"], state["written"]
        if self.done_before:
            self.step = max(self.step, self.max_steps)
        self.metrics.resume_at(self.step)

    def train_step(self) -> dict[str, Any]:
        """Sample, score and select one batch of prompts, then commit its lines."""
        began, start = time.perf_counter(), self.output.state["next_row"]
        lines, metrics = self.sample_batch(start, self.rows[start : start + self.config.batch_size])
        self.written += len(lines)
        self.output.state["written"] = self.written
        with self.timer("write"):
            self.output.commit(lines, start + metrics["prompts"])
        metrics["prompts_per_s"] = metrics["prompts"] / (time.perf_counter() - began)
        return metrics

    def save(self) -> Path:
        """Each step committed its batch; the state file says where the run is."""
        return self.output.state_path

    def holder(self, step: int) -> str:
        """No checkpoint-N: the output so far and its state file hold every committed batch."""
        return f"{self.output.partial.name} with {self.output.state_path.name}"

    def on_end(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """Publish the output under its final name; return a summary."""
        if not self.done_before:
            path = self.output.finish()
            logger.info(f"wrote {self.written} rows to {path}")
        return self.summary(self.output.state)

    @contextlib.contextmanager
    def progress(self) -> Iterator[Any]:
        from tqdm.auto import tqdm

        with tqdm(total=len(self.rows), initial=self.output.state.get("next_row", 0), desc=self.name, unit="prompt",
                  dynamic_ncols=True) as bar:
            yield bar

    def show(self, bar: Any, metrics: dict[str, Any]) -> None:
        bar.update(metrics["prompts"])
        bar.set_postfix({"pass_rate": f"{metrics['pass_rate']:.3g}", "kept": self.written}, refresh=False)

    def summary(self, state: dict[str, Any]) -> dict[str, Any]:
        return {"output": str(self.output.final), "prompts": state["next_row"], "rows": state["written"],
                "batches": state["batches"]}

    # -- one batch -----------------------------------------------------------------------------------

    def prompt_of(self, row: dict[str, Any]) -> Any:
        """The row's prompt: its conversation without a final assistant message (or its text), with `system`."""
        prompt = prompt_view([row])[0]["prompt"]
        system = self.config.system
        if system is None:
            return prompt
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        return [{"role": "system", "content": system}] + [m for m in messages if m["role"] != "system"]

    def seeds(self, start: int, count: int) -> list[int]:
        """A seed per row, from the run's seed, the row's place in the dataset and its id."""
        base = self.first_row + start
        return [int(hashlib.md5(f"{self.config.seed}:{base + i}:{self.ids[start + i]}".encode()).hexdigest()[:8], 16)
                for i in range(count)]

    def candidates(self, start: int, prompts: list[Any]) -> tuple[list[str], list[list[int]] | None]:
        """`num_return_sequences` texts per prompt, prompt-major, and their token ids (None from an API)."""
        cfg = self.config
        params = SamplingParams(n=cfg.num_return_sequences, max_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                                top_p=cfg.top_p, top_k=cfg.top_k, seed=cfg.seed + start,
                                logprobs=False)  # best-of-N reads texts and scores: the sampler skips log-probs
        seeds = self.seeds(start, len(prompts))
        if self.teacher is not None:
            conversations = [p if isinstance(p, list) else [{"role": "user", "content": p}] for p in prompts]
            return self.teacher.generate(conversations, seeds, params), None
        params.stop_token_ids = list(self.encoder.stop_ids)
        ids = [self.encoder.encode(p) for p in prompts]
        out = self.session["sampler"].generate(ids, seeds if cfg.seed_per_prompt else None, params)
        return [text for text, _ in out], [list(token_ids) for _, token_ids in out]

    def sample_batch(self, start: int, rows: list[dict[str, Any]]) -> tuple[list[str], dict[str, Any]]:
        """The output lines of `rows` (starting at row `start` of the shard) and the batch's metrics."""
        cfg, N = self.config, self.config.num_return_sequences
        prompts = [self.prompt_of(r) for r in rows]
        with self.timer("generate"):
            texts, token_ids = self.candidates(start, prompts)
        if len(texts) != len(rows) * N:
            raise ConfigError(f"the sampler returned {len(texts)} candidates for {len(rows)} prompts x {N}")
        orm = prm = None
        if cfg.scored:
            expanded = [p for p in prompts for _ in range(N)]
            completions = [[{"role": "assistant", "content": t}] if isinstance(p, list) else t
                           for p, t in zip(expanded, texts)]
            with self.timer("score"):
                every_row = [r for r in rows for _ in range(N)]
                if cfg.orm_model:
                    orm = self.session["orm"].score(expanded, completions, every_row, token_ids)
                    check_scores("orm", orm, len(texts))
                if cfg.prm_model:
                    steps = self.session["prm"].score(expanded, completions, every_row)
                    check_scores("prm", steps, len(texts))
                    prm = [aggregate_steps(s, cfg.prm_aggregation) for s in steps]
        lines, passed, easy = [], 0, 0
        for i, row in enumerate(rows):
            own = texts[i * N : (i + 1) * N]
            if not cfg.scored:
                lines += [self.line(row, prompts[i], start + i, text) for text in own]
                continue
            chosen = select(
                None if orm is None else orm[i * N : (i + 1) * N], None if prm is None else prm[i * N : (i + 1) * N],
                cfg.n_best_to_keep, cfg.orm_threshold, cfg.prm_threshold, cfg.easy_query_threshold,
            )
            passed += sum(chosen.passed)
            easy += chosen.easy
            for c in chosen.chosen:
                lines.append(self.line(row, prompts[i], start + i, own[c], own[chosen.rejected],
                                       chosen.scores[c], chosen.scores[chosen.rejected]))
        metrics = {
            "prompts": len(rows), "candidates": len(texts), "kept": len(lines),
            "pass_rate": passed / len(texts) if cfg.scored else 1.0, "easy_dropped": easy,
            "candidates/mean_chars": sum(len(t) for t in texts) / len(texts),
        }
        if orm is not None:
            metrics["orm/mean"] = sum(orm) / len(orm)
        if prm is not None:
            metrics["prm/mean"] = sum(prm) / len(prm)
        if self.teacher is not None:
            metrics["teacher/retries"] = self.teacher.retries
        return lines, metrics

    def line(self, row: dict[str, Any], prompt: Any, index: int, chosen: str, rejected: str | None = None,
             chosen_reward: float | None = None, rejected_reward: float | None = None) -> str:
        """One output row as JSON: ms-swift's layout, or a DPO pair."""
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        if self.config.output_format == "dpo":
            out: dict[str, Any] = {
                "prompt": messages, "chosen": [{"role": "assistant", "content": chosen}],
                "rejected": [{"role": "assistant", "content": rejected}],
                "chosen_reward": chosen_reward, "rejected_reward": rejected_reward,
            }
        else:
            out = {**row, "messages": messages + [{"role": "assistant", "content": chosen}]}
            if rejected is not None:
                out["rejected_response"] = rejected
            out["id"] = self.ids[index]
        return json.dumps(out, ensure_ascii=False, default=str)


def _secrets_hidden(saved: Any, config: Any) -> Any:
    """A saved config with its secrets (`api_key`) as a dump shows them now: a state file written before they
    were hidden holds them in clear, and a changed one must not be printed."""
    if not isinstance(saved, dict):
        return saved
    from typing import get_args

    from pydantic import SecretStr

    secret = [k for k, f in type(config).model_fields.items() if SecretStr in (f.annotation, *get_args(f.annotation))]
    return {**saved, **{k: str(SecretStr("hidden")) for k in secret if saved.get(k) is not None}}
