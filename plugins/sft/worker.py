"""`LMWorker`: one worker of the `default` role, a Hugging Face trainer that the driver moves one optimizer
step at a time.

The trainer's own loop (`Trainer.train()`: gradient accumulation, loss normalisation over the world, clipping,
schedulers, mixed precision, resume with data skipping) runs in a thread of the worker. A callback holds it at
each step boundary: after `on_train_begin`, and after each step's logs. There it waits for the driver's next
command: run one more step, save a checkpoint, finish, or stop. So rlcore's loop (progress, metrics JSONL and
hooks, signals, atomic checkpoints, --resume) and the trainer's loop both stay whole, at the cost of one call
per optimizer step. That call's round trip is hidden where the driver will ask for the next step anyway
(`run_ahead`): the command for it is queued as the step's logs leave, so the trainer never waits for the driver
except before a checkpoint, the last step, or a stop.
"""

from __future__ import annotations

import os
import queue
import threading
import traceback
from pathlib import Path
from typing import Any

from rlcore import RlcoreError, function, worker

CHECKPOINT = "model"  # the Hugging Face checkpoint inside rlcore's checkpoint-N folder


class _Stop(BaseException):
    """Unwinds the trainer's loop when the driver stops before max_steps (a signal, an error elsewhere)."""


def _gate_callback(runner: HFRunner) -> Any:
    from transformers import TrainerCallback

    class Gate(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            runner.pause(state.global_step, {})

        def on_log(self, args, state, control, logs=None, **kwargs):
            if state.global_step > runner.paused_at:  # the step's logs (the end-of-training summary comes later)
                runner.pause(state.global_step, dict(logs or {}))

    return Gate()


class HFRunner:
    """A Hugging Face trainer run step by step from another thread (see the module docstring)."""

    def __init__(self, trainer: Any):
        self.trainer = trainer
        self.trainer.add_callback(_gate_callback(self))
        self.commands: queue.Queue = queue.Queue()
        self.replies: queue.Queue = queue.Queue()
        self.paused_at = -1
        self.ahead = False  # a "step" command was sent past the last reply (see step)
        self.thread: threading.Thread | None = None
        self.done = False

    # -- in the training thread -----------------------------------------------------------------------

    def pause(self, step: int, logs: dict[str, Any]) -> None:
        self.paused_at = step
        self.replies.put(("paused", logs))
        while True:
            command, arg = self.commands.get()
            if command == "stop":
                raise _Stop
            if command in ("step", "finish"):
                return
            try:  # "save", "save_hf"
                (self._save_hf if command == "save_hf" else self._save)(arg)
                self.replies.put(("saved", None))
            except Exception as exc:
                self.replies.put(("error", (exc, traceback.format_exc())))

    def _save(self, path: str) -> None:
        """The trainer's own checkpoint (model, optimizer, scheduler, scaler, RNG of every rank, its state)
        as `path/model`; every rank takes part."""
        trainer, args = self.trainer, self.trainer.args
        previous = args.output_dir
        args.output_dir = path
        try:
            trainer._save_checkpoint(trainer.model_wrapped, trial=None)
        finally:
            args.output_dir = previous
        _barrier()
        if args.should_save:
            os.replace(Path(path) / f"checkpoint-{trainer.state.global_step}", Path(path) / CHECKPOINT)
        _barrier()

    def _save_hf(self, path: str) -> None:
        """The trained model and its tokenizer as a Hugging Face folder `path`; a LoRA adapter is merged into
        the base weights first (the run's last act: nothing trains after it). Every rank takes part."""
        trainer = self.trainer
        model = trainer.accelerator.unwrap_model(trainer.model)
        if hasattr(model, "merge_and_unload"):  # a peft model
            model = model.merge_and_unload()
        if trainer.args.should_save:
            model.save_pretrained(path)
            if trainer.processing_class is not None:
                trainer.processing_class.save_pretrained(path)
        _barrier()

    def _main(self, resume: str | None) -> None:
        try:
            import torch

            if torch.cuda.is_available() and self.trainer.args.device.type == "cuda":
                torch.cuda.set_device(self.trainer.args.device)  # the current device is per thread
            out = self.trainer.train(resume_from_checkpoint=resume)
            self.replies.put(("done", dict(out.metrics)))
        except _Stop:
            self.replies.put(("stopped", None))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, who raises it
            self.replies.put(("error", (exc, traceback.format_exc())))
        finally:
            self.done = True

    # -- in the worker's thread -----------------------------------------------------------------------

    def _reply(self, expected: str) -> Any:
        while True:
            try:
                kind, value = self.replies.get(timeout=1.0)
            except queue.Empty:
                if self.thread is not None and not self.thread.is_alive() and self.replies.empty():
                    raise RlcoreError("the trainer's thread ended without a reply") from None
                continue
            if kind == "error":
                exc, text = value
                raise RlcoreError(f"{type(exc).__name__}: {exc}\n{text}") from exc
            if kind != expected:
                raise RlcoreError(f"the trainer's thread answered '{kind}' where '{expected}' was expected")
            return value

    def begin(self, resume: str | None) -> int:
        """Start the trainer's loop (from a checkpoint, with `resume`); returns the step it starts at."""
        if self.thread is not None:
            raise RlcoreError("the trainer has begun already")
        self.thread = threading.Thread(target=self._main, args=(resume,), daemon=True, name="rlcore-hf-trainer")
        self.thread.start()
        self._reply("paused")
        return self.paused_at

    def step(self, ahead: bool = False) -> dict[str, Any]:
        """Run the next optimizer step; its logs. With `ahead`, the step after it starts at once, while the logs
        travel to the driver and it logs them (the driver passes it where it will ask for that step anyway: not
        before a save or the last step); the next `step()`, `ahead_logs()` or `close()` takes that step's reply."""
        if not self.ahead:
            self.commands.put(("step", None))
        self.ahead = False
        logs = self._reply("paused")
        if ahead:
            self.commands.put(("step", None))
            self.ahead = True
        return logs

    def ahead_logs(self) -> list[dict[str, Any]]:
        """The logs of the step begun ahead, once it has finished (none if no step runs ahead)."""
        if not self.ahead:
            return []
        self.ahead = False
        return [self._reply("paused")]

    def save(self, path: str) -> None:
        self._not_ahead("save")
        self.commands.put(("save", path))
        self._reply("saved")

    def save_hf(self, path: str) -> None:
        self._not_ahead("save_hf")
        self.commands.put(("save_hf", path))
        self._reply("saved")

    def _not_ahead(self, what: str) -> None:
        if self.ahead:  # the trainer would save a step the driver has not counted
            raise RlcoreError(f"{what}() while a step runs ahead: take its logs first (step() or ahead_logs())")

    def close(self) -> dict[str, Any] | None:
        """Let a finished loop end (its summary metrics), or unwind one stopped early (after the step begun ahead,
        if one was)."""
        if self.thread is None or self.done:
            return None
        self.ahead_logs()
        finished = self.paused_at >= self.trainer.state.max_steps
        self.commands.put(("finish" if finished else "stop", None))
        out = self._reply("done" if finished else "stopped")
        self.thread.join(timeout=60)
        return out


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


@worker(group="default")
class LMWorker:
    """A Hugging Face trainer per worker; the group is one data-parallel world. `build(**options)` makes the
    trainer (`build_sft`, `build_pt`)."""

    def __init__(self, build: Any, options: dict[str, Any]):
        self.setup(build, options)

    @function()
    def setup(self, build: Any, options: dict[str, Any]) -> None:
        self.runner = HFRunner(build(**options))

    @function(collect="first")
    def plan(self) -> dict[str, Any]:
        """The run's shape as the trainer sees it: its optimizer steps (from max_steps or the epochs over the
        data), the world, the global batch and the rows after tokenising (and packing)."""
        trainer = self.runner.trainer
        args = trainer.args
        steps = trainer.set_initial_training_values(args, trainer.get_train_dataloader())[-1]
        return {"max_steps": int(steps), "world_size": args.world_size, "train_rows": len(trainer.train_dataset),
                "global_batch": args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size}

    @function(collect="first")
    def begin(self, resume: str | None) -> int:
        return self.runner.begin(resume)

    @function(collect="first")
    def step(self, ahead: bool = False) -> dict[str, Any]:
        return self.runner.step(ahead)

    @function(collect="first")
    def ahead_logs(self) -> list[dict[str, Any]]:
        return self.runner.ahead_logs()

    @function(collect="first")
    def save(self, path: str) -> None:
        self.runner.save(path)

    @function(collect="first")
    def save_hf(self, path: str) -> None:
        self.runner.save_hf(path)

    @function(collect="first")
    def close(self) -> dict[str, Any] | None:
        return self.runner.close()

    @function()
    def where(self) -> dict[str, Any]:
        """This worker's place: its rank, world and node (the environment the placement gave it), the trainer's
        torch.distributed backend and device, whether it read the data files, and the files of its tokenised rows."""
        import socket

        import torch.distributed as dist

        keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
        backend = dist.get_backend() if dist.is_available() and dist.is_initialized() else None
        trainer = self.runner.trainer
        return {**{k.lower(): os.environ.get(k) for k in keys}, "pid": os.getpid(), "host": socket.gethostname(),
                "backend": backend, "device": str(trainer.args.device),
                "rows_read_here": getattr(trainer, "rlcore_rows_read_here", None),
                "token_cache": sorted(c["filename"] for c in trainer.train_dataset.cache_files)}
