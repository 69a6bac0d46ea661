"""`RoleTrainer`: an algorithm as its roles, its step and its own state; the base does the rest.

```python
class MyTrainer(RoleTrainer):
    @classmethod
    def roles(cls, config):                          # the roles this run has
        return ["train", "rollout"]

    def setups(self):                                # how to build each one
        return {"train": RoleSetup(TrainWorker, "hf", train_options(self.config, model)),
                "rollout": RoleSetup(GenerateWorker, "hf", {"model": model})}

    def train_step(self):                            # one optimizer step, its metrics
        with self.timer("generate"), self.session.active("rollout"):
            ...
```
The base builds the resource plan once, with every other check the algorithm names (`problems`), and
reports all problems at once before anything is allocated (`rlcore config validate` runs the same checks);
it makes the `RoleSession` from the plan, prints the placement and starts the roles around the loop;
`rlcore.Trainer` runs the loop, the metrics, the hooks, signals, checkpoints and `--resume`.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

from .config import config_error, problems_of
from .extras import engine_name_problems
from .memory import RoleUse
from .model_checks import ModelUse, model_problems
from .runtime.devices import resolve_gpus
from .runtime.resources import ResourcePlan, plan_from_config
from .sections import engine_config_problems, generate_engine_problems, other_engine_key_problems, train_engine_problems
from .runtime.session import RoleSession, RoleSetup, announce
from .testing import is_tiny, resolve_tiny
from .trainer import Trainer


class RoleTrainer(Trainer):
    """An algorithm that runs roles. Write `roles()` (a classmethod of the config: which roles this run has),
    `setups()` (a `RoleSetup` per role), `train_step()`, and where needed `problems()` (the algorithm's own
    checks), `models()` (the models it loads, whose files the base checks against its keys), `prepare()` (what
    the setups need, built once the checks pass), `session_options()` (e.g. `syncs`), and its state (`state_dict`,
    `load_state_dict`; `checkpointed` names the role whose engine a checkpoint holds, or override `save_model` /
    `load_model`). `self.plan` and `self.session` are the run's. A config's `tiny` names (`model: tiny`,
    `dataset: tiny:toy`, see `rlcore.testing`) are built in output_dir once the checks pass, so that the
    algorithm reads them as any model or file.
    """

    checkpointed: str | None = None  # the role whose engine state a checkpoint holds (in its folder `model`)
    # A run checks `problems()` with the plan, before anything is built; False: a run checks the plan, and the
    # algorithm's own objects report a bad model or dataset as they are built (`config validate` checks all).
    check_on_run = True
    required: tuple[str, ...] = ()  # keys a run needs set (e.g. model, dataset): unset is a problem with the fix
    # session keys the algorithm fixes whatever the config says (e.g. sampling's `sleep_level: 0`: nothing trains
    # beside its vLLM); its session and its memory plan both read them
    session_fixed: ClassVar[dict[str, Any]] = {}

    def __init__(self, config: Any, plugins: Any, *, use_ray: bool = False):
        config = resolve_gpus(config, type(self).roles, use_ray=use_ray)  # the CLI's config is resolved already
        super().__init__(config, plugins, use_ray=use_ray)
        self.plan: ResourcePlan | None = self.checked(self.config, plugins, own=self.check_on_run, run=True)
        if self.plan is not None and not use_ray:
            gpus_here(self.config, self.plan)
        self.given_config = self.config
        self.config = resolve_tiny(self.config, self.output_dir)
        self.prepare()
        self.session: RoleSession | None = None
        self.checked_syncs = 0  # the syncs `sync_probe` has handed a probe to, of this run
        if self.plan is not None:
            recoverable = (self.checkpointed,) if self.checkpointed else ()  # its loss resumes the last checkpoint
            self.session = RoleSession.from_config(self.config, self.plan, self.setups(), use_ray=use_ray,
                                                   plugins=plugins, **{"recoverable": recoverable, **self.session_fixed,
                                                                       **self.session_options()})

    # -- what an algorithm writes ---------------------------------------------------------------------

    @classmethod
    def roles(cls, config: Any) -> list[str]:
        """The roles a run of `config` has (e.g. `reference` only when a KL term needs it)."""
        raise NotImplementedError(f"{cls.__name__} must implement roles(config)")

    @classmethod
    def problems(cls, config: Any, plugins: Any, run: bool = False) -> list[tuple[str, str]]:
        """The algorithm's own checks beside the resource plan's (names, data, tokenizer), as (key, message)
        pairs; builds nothing. `run`: a run checks (it may import a user's `module:function`); False for
        `rlcore config validate`, which runs no user code. `rlcore.problems_of` turns raising checks into pairs."""
        return []

    @classmethod
    def models(cls, config: Any) -> list[ModelUse]:
        """The models a run of `config` loads, with the lengths, prompts and vocabulary it asks of each
        (`rlcore.model_checks.ModelUse`): their files are checked against them in `rlcore config validate` and
        before a run allocates anything, whatever `check_on_run` says."""
        return []

    @classmethod
    def memory_use(cls, config: Any) -> dict[str, RoleUse]:
        """What a step asks of each role, for the memory plan (`rlcore plan`): the role's engine and options as
        `setups` builds them, its phase and its workload's sizes (`rlcore.memory.RoleUse`); none: nothing to plan."""
        return {}

    def prepare(self) -> None:
        """What the roles' setups need, once every check passed (data read, an output opened)."""

    def setups(self) -> dict[str, RoleSetup]:
        """How to build each of `roles(config)`: a worker class, an engine, its options."""
        raise NotImplementedError(f"{type(self).__name__} must implement setups()")

    def session_options(self) -> dict[str, Any]:
        """Further `RoleSession` options: `syncs` (the role pairs `sync_weights` moves weights between), ...; the
        config's own session keys are read already, and `session_fixed` overrides them."""
        return {}

    # -- what the base does ---------------------------------------------------------------------------

    @classmethod
    def check(cls, config: Any, plugins: Any) -> None:
        """Every check a run makes before it allocates anything; raises one ConfigError listing all."""
        cls.checked(config, plugins)

    @classmethod
    def checked(cls, config: Any, plugins: Any, own: bool = True, run: bool = False,
                models: bool = True) -> ResourcePlan | None:
        """The resource plan of `roles(config)` (None without roles), once the plan and (with `own`) the
        algorithm's `problems` (with `run`, see there) are clean, and (with `models`) the models' files. `tiny`
        names are checked as what they build, built in a temporary directory (a run builds its own in output_dir
        once every check passed)."""
        unset = [(key, "is unset; name one (a demo's preset, examples/demo/*.yaml, names `tiny`: the tiny random "
                       "model, and `tiny:toy`: a toy dataset; rlcore run with neither --config nor model runs it)")
                 for key in cls.required if getattr(config, key, None) in (None, "", [])]
        if unset:
            raise config_error(unset)
        if any(is_tiny(v) for v in _values(config)):
            with tempfile.TemporaryDirectory(prefix="rlcore-tiny-") as root:
                return cls._checked(resolve_tiny(config, root), plugins, own, run, models)
        return cls._checked(config, plugins, own, run, models)

    @classmethod
    def _checked(cls, config: Any, plugins: Any, own: bool, run: bool, models: bool = True) -> ResourcePlan | None:
        roles, plans = cls.roles(config), []

        def plan() -> None:
            plans.append(plan_from_config(config, roles=roles, policy=config.placement, plugins=plugins))

        problems = problems_of([("(resource plan)", plan)] if roles else [])
        problems += cls.problems(config, plugins, run=run) if own else []
        problems += engine_name_problems(config, plugins, roles)
        problems += train_engine_problems(config, plugins) if "train" in roles else []
        problems += other_engine_key_problems(config, roles) + engine_config_problems(config, plugins, roles)
        uses = cls.models(config) if models else []  # the models' own files: read, never loaded
        problems += model_problems(uses)
        problems += [problem for use in uses for role in use.roles if role in roles
                     for problem in generate_engine_problems(config, plugins, role, use.name)]
        if problems:
            raise config_error(problems)
        return plans[0] if plans else None

    @contextlib.contextmanager
    def start(self) -> Iterator[None]:
        """Print the placement, then run the roles for the loop's life."""
        if self.session is None:
            yield
            return
        announce(self.session.describe())
        with self.session.start():
            yield

    def sync_weights(self, src: str = "train", dst: str = "rollout", probe: list[int] | None = None) -> dict[str, float]:
        """`src`'s weights into `dst` (timed as the `sync` phase), in buckets of `weight_sync_bucket_mb`, or only its
        LoRA adapter where `dst`'s engine takes it alone (`EngineSpec.syncs_adapter`: vLLM's `vllm_enable_lora`; through
        output_dir/adapter_sync); with a `probe` sequence, `dst` must then score it as `src` does."""
        bucket_mb = getattr(self.config, "weight_sync_bucket_mb", 512)
        with self.timer("sync"):
            if self.syncs_adapter(dst):
                stats = self.session.sync_adapter(src, dst, str(self.output_dir / "adapter_sync"))
            else:
                stats = self.session.sync_weights(src, dst, bucket_mb << 20)
        if probe is not None:
            self.session.check_weight_sync(src, dst, probe)
        return stats

    CHECKED_SYNCS = 2  # check_weight_sync: the run's first sync, and the first after a step

    def sync_probe(self, sequence: Callable[[], list[int]]) -> list[int] | None:
        """The probe `sync_weights` checks a sync with (`sequence()`) for the run's first CHECKED_SYNCS syncs where the
        config's `check_weight_sync` is on, else None. The first sync carries the checkpoint's weights; the first
        after a step carries trained ones (a LoRA adapter starts at zero, so a merge or a tensor the sync leaves
        out shows only then)."""
        if not getattr(self.config, "check_weight_sync", False) or self.checked_syncs >= self.CHECKED_SYNCS:
            return None
        self.checked_syncs += 1
        return sequence()

    def syncs_adapter(self, role: str) -> bool:
        """Whether `role`'s engine takes the train engine's LoRA adapter alone at a sync (`EngineSpec.syncs_adapter`
        of its options)."""
        setup = self.session.setups.get(role) if self.session is not None else None
        if setup is None or not isinstance(setup.engine, str):
            return False
        for spec in self.plugins.engines:
            if spec.name == setup.engine and spec.syncs_adapter is not None:
                return bool(spec.syncs_adapter(**setup.options))
        return False

    def on_recover(self, path: Path | None) -> None:
        """The roles that take the trained weights (`syncs`) take the checkpoint's; not a step's time."""
        for src, dst in self.session.syncs:
            RoleTrainer.sync_weights(self, src, dst)
        self.timer.pop()

    def log(self, metrics: dict[str, Any], bar: Any = None) -> None:
        """The base's, with `restarts/<role>`: the role's workers Ray restarted so far in this run (max_restarts)."""
        if self.session is not None:
            metrics.update(self.session.restarts())
        super().log(metrics, bar)

    def save_model(self, path: Path) -> None:
        if self.checkpointed:
            self.session[self.checkpointed].save(str(path / "model"))

    def load_model(self, path: Path) -> None:
        if self.checkpointed:
            self.session[self.checkpointed].load(str(path / "model"))

    @property
    def exports_model(self) -> bool:  # type: ignore[override]
        return self.checkpointed is not None

    def export_model(self, path: Path) -> None:
        """The `checkpointed` role's model in Hugging Face format (LoRA merged into the base weights)."""
        self.session[self.checkpointed].save_hf(str(Path(path).resolve()))


def gpus_here(config: Any, plan: ResourcePlan) -> None:
    """A run without Ray places its GPU roles on this machine: where torch sees no CUDA device, a ConfigError naming
    the keys that gave each role GPUs, before anything is built (a role whose engine_kwargs name a device is left
    to its engine)."""
    try:
        import torch
    except ImportError:  # the engines say what they need
        return
    if torch.cuda.is_available():
        return
    problems = []
    for group in plan.groups:
        for role in group.roles if group.device == "GPU" else ():
            if (getattr(getattr(config, role, None), "engine_kwargs", None) or {}).get("device"):
                continue
            key = f"device_groups.{group.name}" if getattr(config, "device_groups", None) else f"{role}.gpus"
            problems.append((key, f"puts the {role} role on GPUs, and without --use-ray it runs in this process, which "
                                  f"sees no CUDA device; run it with --use-ray on a cluster with GPUs, or on the CPU "
                                  f"({role}.gpus=0, or a device group with device: CPU)"))
    if problems:
        raise config_error(problems)


def _values(config: Any) -> list[Any]:
    """The config's values, one section deep, lists flattened: where a `tiny` name may stand."""
    out: list[Any] = []
    for key in type(config).model_fields:
        value = getattr(config, key)
        values = [getattr(value, k) for k in type(value).model_fields] if hasattr(type(value), "model_fields") else [value]
        for v in values:
            out.extend(v if isinstance(v, list) else [v])
    return out
