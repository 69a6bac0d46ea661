"""`Trainer`: the loop every algorithm shares. An algorithm writes its step and its own state; the base
keeps the progress bar, metrics JSONL and lifecycle hooks, phase timing, and checkpoints that `--resume`
continues exactly (step, data position, engine state).

```python
class MyTrainer(Trainer):
    def train_step(self) -> dict[str, float]:          # one optimizer step
        with self.timer("train"):
            return {"loss": ...}
```
"""

from __future__ import annotations

import contextlib
import math
import numbers
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import log
from .checkpoint import (
    RunLock, RunRecord, check_output_dir, checkpoints, finished_run, load_state, partial_run, remove_previous_run,
    resolve_resume, save_checkpoint, save_final,
)
from .errors import ConfigError, RlcoreError, RoleRestarted
from .integrity import check_folder
from .log import BARE, logger, scrub_data
from .metrics import MetricsWriter
from .signals import StopOnSignal

if TYPE_CHECKING:
    from .manager import Plugins


class PhaseTimer:
    """Seconds per phase of the current step, reported as `time/<phase>`: `with timer("generate"): ...`.

    Phases nest without counting twice: while an inner phase runs (a resampling generation inside the
    reward phase), its time is booked to it alone and the outer phase's clock stops.
    """

    def __init__(self) -> None:
        self.times: dict[str, float] = defaultdict(float)
        self._open: list[list[Any]] = []  # [phase, started] of the phases running now, innermost last

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        now = time.perf_counter()
        if self._open:  # the outer phase's clock stops here
            outer = self._open[-1]
            self.times[f"time/{outer[0]}"] += now - outer[1]
        self._open.append([phase, now])
        try:
            yield
        finally:
            now = time.perf_counter()
            _, started = self._open.pop()
            self.times[f"time/{phase}"] += now - started
            if self._open:
                self._open[-1][1] = now

    def pop(self) -> dict[str, float]:
        out, self.times = dict(self.times), defaultdict(float)
        return out


class Trainer:
    """Holds the validated config and the loaded plugins; `fit()` runs the loop to `max_steps`.

    Override `train_step()` (one optimizer step, returning its metrics); where the algorithm has state
    of its own, `state_dict()` / `load_state_dict()` (JSON: data position, counters) and `save_model()` /
    `load_model()` (engine state into a checkpoint folder); `start()` is the context its roles run in
    and `on_start()` what happens once they do. The config keys read: `output_dir`, `max_steps`,
    `save_steps`, `save_total_limit`, `resume`, `logging_steps`, `on_nonfinite`, each optional but `max_steps`.
    A step whose `loss` or `grad_norm` is NaN or infinite stops the run before it is counted or saved; with
    `on_nonfinite: skip` it is skipped instead, where the engine says it skipped the update (`update_skipped`).
    Lifecycle hooks go through `self.hook`: `rlcore_train_start(trainer)`,
    `rlcore_step_end(trainer, step, metrics)`, `rlcore_train_end(trainer, metrics)`.
    """

    name = "train"  # the progress bar's label
    progress_keys: tuple[str, ...] = ("loss",)  # metrics shown on the progress bar
    plot_keys: tuple[str, ...] = ("loss", "grad_norm", "learning_rate")  # `rlcore plot`'s panels (those logged)
    resume_fixed: tuple[str, ...] = ()  # dotted keys a resumed run may not change (data position, shapes)

    def __init__(self, config: Any, plugins: Plugins, *, use_ray: bool = False):
        self.config = config
        self.plugins = plugins
        self.use_ray = use_ray
        self.output_dir = Path(getattr(config, "output_dir", "output"))
        check_output_dir(self.output_dir)
        RunLock(self.output_dir).refuse_if_held()  # before a subclass builds anything there (a demo model)
        self.resume_from = self.resume_point()  # refuses to overwrite a run
        self.timer = PhaseTimer()
        self.step = 0
        self._metrics: MetricsWriter | None = None
        self.finished: dict[str, Any] | None = None  # `--resume` of a finished run: its last metrics

    @property
    def hook(self) -> Any:
        return self.plugins.hook

    @property
    def metrics(self) -> MetricsWriter:
        if self._metrics is None:
            self._metrics = MetricsWriter(self.output_dir / "metrics.jsonl")
        return self._metrics

    @property
    def max_steps(self) -> int:
        return int(self.config.max_steps)

    @property
    def save_steps(self) -> int:
        """A checkpoint every this many steps (0: at the end only)."""
        return getattr(self.config, "save_steps", 0) or 0

    @property
    def overwrite(self) -> bool:
        """`overwrite_output_dir`: checkpoint folders rlcore did not write may be replaced."""
        return bool(getattr(self.config, "overwrite_output_dir", False))

    # -- what an algorithm writes ---------------------------------------------------------------------

    @classmethod
    def check(cls, config: Any, plugins: Plugins) -> None:
        """Every check a run makes before it allocates anything (the resource plan, names, data, model),
        without building the run; `rlcore config validate` calls it. Raises ConfigError listing all."""

    def train_step(self) -> dict[str, Any]:
        """One optimizer step; its metrics."""
        raise NotImplementedError(f"{type(self).__name__} must implement train_step() (or fit())")

    def steps_begun_ahead(self) -> list[dict[str, Any]]:
        """When a signal ends the loop: the metrics of steps the algorithm's engines had already begun past
        `self.step` (a trainer that runs its next step while the loop logs the last), each finished now. The loop
        counts and logs them before its checkpoint, so the checkpoint holds what the engines hold. None by default."""
        return []

    @contextlib.contextmanager
    def start(self) -> Iterator[None]:
        """The context the loop runs in (an algorithm starts its roles here)."""
        yield

    def on_start(self) -> None:
        """Once the roles run and a checkpoint is restored, before the first step."""

    def state_dict(self) -> dict[str, Any]:
        """The algorithm's own state for a checkpoint (JSON-serialisable)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back what `state_dict` returned."""

    def save_model(self, path: Path) -> None:
        """Write the engines' state (model, optimizer, ...) into the checkpoint folder `path`."""

    def load_model(self, path: Path) -> None:
        """Read what `save_model` wrote."""

    exports_model = False  # the run ends by writing output_dir/final (`export_model`)

    def export_model(self, path: Path) -> None:
        """Write the trained model in Hugging Face format (weights, config, tokenizer) into the folder `path`,
        once the run reached max_steps: it becomes `output_dir/final`. Only where `exports_model`."""

    def on_end(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """Once the loop reached `max_steps` (not after a signal): what `fit()` returns and
        `rlcore_train_end` gets; the last step's metrics unless the algorithm sums up otherwise."""
        return metrics

    def resume_point(self) -> Path | None:
        """The checkpoint `resume` names (None for a fresh run, which may not overwrite another's outputs, but
        starts afresh where a run stopped before its first checkpoint, saying so)."""
        resume = getattr(self.config, "resume", None) or "no"
        if partial_run(self.output_dir) and not getattr(self, "_said_afresh", False):
            self._said_afresh = True
            nothing = " (--resume: there is no checkpoint to resume)" if resume == "auto" else ""
            logger.warning(f"output_dir '{self.output_dir}' holds only what a run left that stopped before its first "
                           f"checkpoint{nothing}; starting a new run there (its metrics.jsonl is replaced)")
        return resolve_resume(self.output_dir, resume, self.overwrite, final=self.exports_model)

    # -- the loop -------------------------------------------------------------------------------------

    def fit(self) -> dict[str, Any]:
        """Run to `max_steps`: restore, step, log, checkpoint; return the last step's metrics.

        SIGINT (Ctrl-C) or SIGTERM (a scheduler's preemption) during a step lets the step finish, saves a
        checkpoint and exits (KeyboardInterrupt, or SystemExit 143), saying where it saved; a second one
        stops at once. `output_dir` is locked for the run's life.
        """
        with self._locked() as record, StopOnSignal() as stop:
            if self.finished is not None:
                return self.finished
            with self.start(), self._ending(record, stop):
                return self._loop(stop, record)

    def _loop(self, stop: StopOnSignal, record: RunRecord) -> dict[str, Any]:
        """`fit`'s loop, once output_dir is locked and the roles run."""
        save_steps = self.save_steps
        stop.arm()  # again: starting Ray sets a SIGTERM handler of its own (sys.exit, mid-step)
        self.restore()
        if getattr(self.config, "max_restarts", 0):
            self.start_state = self.state_dict()  # what a recovery without a checkpoint goes back to
        self.on_start()
        record.began = True
        self.hook.rlcore_train_start(trainer=self)
        last: dict[str, Any] = {}
        saved = self.step

        def held() -> str:  # what the output_dir holds if the run stops now
            if not saved:
                return "nothing was saved (run again, without --resume)"
            lost = "" if self.step == saved else f"; step {self.step} was not saved" if self.step == saved + 1 \
                else f"; steps {saved + 1}-{self.step} were not saved"
            return f"{self.holder(saved)} holds step {saved}{lost} (continue with --resume)"

        where = None  # the checkpoint written after the loop, if any
        with stop.failing(held):
            with self.progress() as bar:
                while self.step < self.max_steps and not stop.signal:
                    try:
                        last = self.train_step()
                    except RoleRestarted as lost:  # max_restarts: the train side was built again
                        saved = self.recover(lost)
                        bar.n = self.step
                        bar.refresh()
                        continue
                    self._check_finite(last, held)
                    self.step += 1
                    self.log(last, bar)
                    if save_steps and self.step % save_steps == 0:
                        self.save()
                        saved = self.step
                for last in self.steps_begun_ahead() if stop.signal else ():
                    self._check_finite(last, held)
                    self.step += 1
                    self.log(last, bar)
            if self.step > saved or (not save_steps and self.step and not stop.signal):
                where = self.save()
            if self.exports_model and not stop.signal and self.step >= self.max_steps:
                self.save_final()
        if stop.signal:
            if where is not None:
                stop.exit(f"after step {self.step}; saved {where} (continue with --resume)")
            elif self.step:
                stop.exit(f"after step {self.step}, which {self.holder(self.step)} holds (continue with --resume)")
            stop.exit("before step 1; nothing was trained or saved (run again, without --resume)")
        last = self.on_end(last)
        self.hook.rlcore_train_end(trainer=self, metrics=last)
        record.end()
        return last

    def holder(self, step: int) -> str:
        """What in output_dir holds `step` once saved, as a stop message names it: its checkpoint folder (a trainer
        whose `save` writes elsewhere, such as an output's state file, says that)."""
        return f"checkpoint-{step}"

    def recover(self, lost: RoleRestarted) -> int:
        """Go on, in this run, from its newest checkpoint (or from the start, before its first) once `lost.role`'s
        workers were restarted and built again (`max_restarts`): the engines' and the algorithm's state are loaded,
        the metrics of later steps dropped (they are trained again), and `on_recover` runs. Returns the step."""
        self.timer.pop()  # the lost step's phases
        found = checkpoints(self.output_dir)
        path = found[-1][1] if found else None
        if path is not None:
            state = load_state(path)
            self.load_model(path)
            self.load_state_dict(state)
            self.step, where = state["step"], path.name
        else:
            self.load_state_dict(self.start_state)
            self.step, where = 0, "the start (no checkpoint yet)"
        self.metrics.resume_at(self.step)
        self.on_recover(path)
        logger.warning(f"{lost}; the run goes on from {where}")
        return self.step

    def on_recover(self, path: Path | None) -> None:
        """After `recover` loaded the checkpoint `path` (None: the start) into rebuilt workers: what else the algorithm
        must do again (a RoleTrainer syncs the trained weights to the roles that generate)."""

    def run_note(self) -> dict[str, Any]:
        """What output_dir's rlcore_run.json says of the run besides its state: the algorithm, the plot's panels."""
        return {"algorithm": self.name, "plot_keys": list(self.plot_keys)}

    def save_final(self) -> Path:
        """`output_dir/final`: the trained model in Hugging Face format (see `export_model`), written atomically."""
        final = save_final(self.output_dir, self.step, self.export_model, overwrite=self.overwrite)
        logger.info(f"the trained model (step {self.step}) is in {final}, in Hugging Face format")
        return final

    def _check_finite(self, metrics: dict[str, Any], held: Callable[[], str]) -> None:
        """A step whose loss or gradient norm is not finite stops the run (nothing of it is counted or saved),
        or, with `on_nonfinite: skip` and an engine that skipped its update, goes on with a warning."""
        bad = {k: metrics[k] for k in NONFINITE_KEYS if isinstance(metrics.get(k), numbers.Real)
               and not math.isfinite(metrics[k])}
        if not bad:
            return
        what = ", ".join(f"{k} {v}" for k, v in bad.items())
        step = self.step + 1
        skip = getattr(self.config, "on_nonfinite", "stop") == "skip"
        if skip and metrics.get("update_skipped"):
            logger.warning(f"step {step}: {what}; the engine skipped its update (on_nonfinite: skip)")
            return
        why = " and the engine applied its update, so it cannot be skipped" if skip else ""
        offered = hasattr(self.config, "on_nonfinite") and not skip
        fix = " or set on_nonfinite=skip to skip such steps" if offered else ""
        raise RlcoreError(f"step {step}: {what} is not finite{why}; the run stopped before counting or saving it: "
                          f"{held()}. Lower learning_rate, check that step's data{fix}")

    @contextlib.contextmanager
    def _locked(self) -> Iterator[RunRecord]:
        """output_dir's lock for the run; once it is held, the check that refuses to overwrite a run again: a
        run may have finished there while this one was being built. Yields the run's record, whose end is written
        however the run ends (`_ending` writes it first, before the roles' teardown)."""
        with RunLock(self.output_dir), log.to_file(self.output_dir):
            self.resume_from = self.resume_point()
            if self.resume_from is None and self.overwrite:
                removed = remove_previous_run(self.output_dir)
                if removed:
                    logger.warning(f"overwrite_output_dir: this run replaces the earlier run in output_dir "
                                   f"'{self.output_dir}' (removed {', '.join(removed)}; its metrics.jsonl is replaced)")
            self.finished = self.finished_before()
            record = RunRecord(self.output_dir, self.run_note())
            if self.finished is None:  # a finished run's --resume trains nothing and leaves its record as it is
                record.running()
            with self._ending(record):
                yield record

    @contextlib.contextmanager
    def _ending(self, record: RunRecord, stop: StopOnSignal | None = None) -> Iterator[None]:
        """The record's end when the block raises: "stopped" by the signal, "failed" with why, or, for a run refused
        before it began, the record it found."""
        try:
            yield
        except BaseException as exc:
            record.end(exc, stop.signal if stop is not None else None)
            raise

    def finished_before(self) -> dict[str, Any] | None:
        """Where `resume` names the last checkpoint of a run that finished (at max_steps or past it): says so and
        returns that run's last logged metrics, so that `--resume` of a finished run does nothing and succeeds."""
        if self.resume_from is None or not finished_run(self.output_dir):
            return None
        newest = checkpoints(self.output_dir)
        try:
            step = load_state(self.resume_from)["step"]
        except RlcoreError:  # a damaged state: `restore` passes it over or says so
            return None
        if not newest or newest[-1][1] != self.resume_from or step < self.max_steps:
            return None
        final = f"; its model is in {self.output_dir / 'final'}" if self.exports_model else ""
        logger.info(f"the run in output_dir '{self.output_dir}' is finished: it trained {step} steps (max_steps="
                    f"{self.max_steps}){final}. Nothing to resume; raise max_steps to train further")
        rows = self.metrics.read()
        return rows[-1] if rows else {}

    def log(self, metrics: dict[str, Any], bar: Any = None) -> None:
        """Phase times and the step into `metrics`; append it to metrics.jsonl; call the step-end hook;
        move the bar; every `logging_steps` steps, print the bar's metrics on a line of their own."""
        metrics.update(self.timer.pop(), step=self.step)
        try:
            self.hook.rlcore_step_end(trainer=self, step=self.step, metrics=metrics)
        finally:  # after the hooks, with what they added (also when one of them raises)
            self.metrics.write(metrics)
        if bar is not None:
            self.show(bar, metrics)

    def show(self, bar: Any, metrics: dict[str, Any]) -> None:
        """Move the progress bar one step, showing `progress_keys`; every `logging_steps` steps, print them
        on a line of their own."""
        shown = {k: metrics[k] for k in self.progress_keys if isinstance(metrics.get(k), (int, float))}
        bar.update(1)
        bar.set_postfix({k: f"{v:.3g}" for k, v in shown.items()}, refresh=False)
        every = getattr(self.config, "logging_steps", 0) or 0
        if every and self.step % every == 0:
            line = f"{self.name} step {self.step}/{self.max_steps}: " + " ".join(f"{k}={v:.4g}" for k, v in shown.items())
            logger.info(line, extra=BARE)  # beside the bar (stderr, and run.log); stdout keeps the run's summary

    @contextlib.contextmanager
    def progress(self) -> Iterator[Any]:
        from tqdm.auto import tqdm

        with tqdm(total=self.max_steps, initial=self.step, desc=self.name, unit="step", dynamic_ncols=True) as bar, \
                log.bar_safe(bar):  # a hook's print lands on a line of its own
            yield bar

    # -- checkpoints ----------------------------------------------------------------------------------

    @property
    def config_as_given(self) -> Any:
        """The config as the user gave it (`model: tiny`, not the folder a run built it in), which a checkpoint
        keeps and a resume compares: a run folder moved elsewhere resumes."""
        return getattr(self, "given_config", None) or self.config

    def save(self) -> Path:
        """`checkpoint-{step}` in output_dir, written atomically: the engines' state, then the trainer state."""
        given = self.config_as_given
        config = scrub_data(given.model_dump(mode="json")) if hasattr(given, "model_dump") else None
        state = {"step": self.step, **self.state_dict(), "config": config}
        return save_checkpoint(self.output_dir, self.step, state, self.save_model,
                               keep=getattr(self.config, "save_total_limit", None), overwrite=self.overwrite)

    def _check_changes(self, path: Path, saved: Any) -> None:
        """Say which keys differ from the checkpoint's config; refuse those in `resume_fixed`."""
        given = self.config_as_given
        if not isinstance(saved, dict) or not hasattr(given, "model_dump"):
            return
        now = _flat(scrub_data(given.model_dump(mode="json")))  # a saved config holds no secret
        before = _flat(scrub_data(saved))
        how = ("resume", "overwrite_output_dir")  # how the run started, not what it trains
        changed = sorted(k for k in set(now) | set(before) if now.get(k) != before.get(k) and k not in how)
        if not changed:
            return
        fixed = [k for k in changed if any(k == f or k.startswith(f + ".") for f in self.resume_fixed)]
        if fixed:
            raise ConfigError(
                f"resume: {', '.join(f'{k} ({before.get(k)!r} -> {now.get(k)!r})' for k in fixed)} differ from "
                f"{path.name}'s config; they fix the data position or the shapes of the run. Set them back, or "
                f"start a new run in another output_dir",
                [(k, "differs from the checkpoint's config") for k in fixed],
            )
        logger.info(f"resume: changed since {path.name}: "
                    + ", ".join(f"{k} {before.get(k)!r} -> {now.get(k)!r}" for k in changed))

    def restore(self) -> None:
        """Continue from the checkpoint `resume` names, if any; metrics of later steps are dropped. With
        `resume: auto`, a damaged newest checkpoint (a torn file, a state that is not JSON) is passed over
        for the newest intact one, with a warning saying which."""
        if self.resume_from is None:
            self.metrics.resume_at(0)
            return
        candidates = [self.resume_from]
        if getattr(self.config, "resume", None) == "auto":
            candidates += [path for _, path in reversed(checkpoints(self.output_dir)) if path != self.resume_from]
        for i, path in enumerate(candidates):
            try:
                state = load_state(path)
                self._check_changes(path, state.get("config"))
                if state["step"] > self.max_steps:
                    raise ConfigError(
                        f"resume: {path} is at step {state['step']}, past max_steps={self.max_steps}; "
                        f"raise max_steps to train further"
                    )
                check_folder(path)  # every piece whole before any is loaded: a damaged one is refused in one line
                self.load_model(path)
                self.load_state_dict(state)
                break
            except ConfigError:  # the checkpoint is intact but does not fit this run: never passed over
                raise
            except Exception as exc:
                why = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)[:500]
                if i + 1 == len(candidates):
                    raise RlcoreError(f"cannot resume from {path}: {why}") from exc
                logger.warning(f"{path.name} is damaged ({why}); resuming from {candidates[i + 1].name}")
        self.resume_from = path
        self.step = state["step"]
        self.metrics.resume_at(self.step)


NONFINITE_KEYS = ("loss", "grad_norm")  # a step with one of these NaN or infinite did not train


def _flat(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'train': {'gpus': 2}} -> {'train.gpus': 2}."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
