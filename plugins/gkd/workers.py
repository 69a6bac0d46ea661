"""GKD's two worker classes: the student's train workers with an optional colocated teacher, and the served
teacher's workers, whose top-k requests are split across the teacher's replicas."""

from __future__ import annotations

import functools
import time
from typing import Any

from rlcore import Batch, GenerateWorker, TeacherTrainWorker, TopK, function, worker, worker_rank
from rlcore.batch import host_column, host_of, pad_width
from rlcore.engines import Projection

from .objective import DistillObjective, GivenOutputs

HELDOUT_ROWS = 4  # rows per forward of the held-out measure: [rows, T, V] at most, never the whole batch


def teacher_answer(engine: Any, batch: Batch, k: int | None, temperature: float, *, projection: bool = True) -> Any:
    """A colocated teacher's side of the loss on `batch`, on its device: for the full vocabulary its last hidden
    states and LM head (a `Projection`, where the engine has `forward_projection` and `projection` is on), else
    its top-k (`TopK`) or full log-probs [B, T, V] at `temperature`."""
    tokens = Batch(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    host = host_of(batch)  # the micro-batch's CPU copy: the teacher's rows are found there, not on the GPU
    tokens.host = None if host is None else Batch(input_ids=host["input_ids"], attention_mask=host["attention_mask"])
    if k is None and projection and hasattr(engine, "forward_projection"):
        given = engine.forward_projection(tokens)
        if given is not None:
            return given
    return engine.forward_topk(tokens, k, temperature, on_device=True)  # used here: no round trip through CPU


TEACHER_GROUP = 4  # micro-batches a colocated teacher answers per forward
ROW = "_teacher_row"  # the column that tells a micro-batch's loss which rows of the step it holds


class TeacherAnswers:
    """A colocated teacher's side of a step's loss, answered `rows` rows at a time: fewer, larger forwards than one
    per micro-batch (each forward's Python and kernel launches, and an offloaded teacher's move in and out, are paid
    once per group), each micro-batch's loss then taking its own rows. A `Projection`'s hidden states or a `TopK`
    are [rows, T, H or k], small beside the logits; full log-probs (an offloaded teacher's full vocabulary) are
    [rows, T, V]: their groups are a micro-batch."""

    def __init__(self, forward: Any, batch: Batch, rows: int, device: Any):
        self.forward, self.batch, self.rows, self.device = forward, batch, rows, device
        self.span, self.answer = (0, 0), None

    def __call__(self, micro: Batch, k: int | None, temperature: float) -> Any:
        index = host_column(micro, ROW)  # on the CPU where the micro-batch came from there: no wait
        first, n = int(index[0]), len(index)
        if int(index[-1]) - first + 1 != n:  # not a run of rows (engines split into runs): this micro-batch alone
            return self.forward(micro, k, temperature)
        if not (self.span[0] <= first and first + n <= self.span[1]):
            self.span = (first, min(len(self.batch), first + max(n, self.rows)))
            rows = self.batch.select(slice(*self.span))
            tokens = Batch(input_ids=rows["input_ids"], attention_mask=rows["attention_mask"])
            self.answer = None  # the last group's answer goes before the next is made
            self.answer = self.forward(tokens.to(self.device), k, temperature)
        width, start = micro["input_ids"].shape[1], first - self.span[0]
        return _rows_of(self.answer, slice(start, start + n), width)


def _rows_of(answer: Any, rows: slice, width: int) -> Any:
    """Rows `rows`, columns `:width` of a teacher's answer ([B, T, ...]: Projection, TopK or log-probs)."""
    if isinstance(answer, Projection):
        return Projection(hidden=answer.hidden[rows, :width], weight=answer.weight, bias=answer.bias)
    if isinstance(answer, TopK):
        return TopK(ids=answer.ids[rows, :width], logprobs=answer.logprobs[rows, :width])
    return answer[rows, :width]


def concat_topk(results: list[TopK]) -> TopK:
    """The replicas' `TopK`s joined row-wise, each right-padded (zeros: no distribution) to the longest."""
    import torch

    width = max(r.ids.shape[1] for r in results)
    return TopK(ids=torch.cat([pad_width(r.ids, width) for r in results]),
                logprobs=torch.cat([pad_width(r.logprobs, width) for r in results]))


@worker(group="teacher")
class TeacherWorker(GenerateWorker):
    """A rollout engine serving a distillation teacher: prompt top-k log-probs of exact token sequences."""

    @function(dispatch="slice", collect=concat_topk)
    def topk(self, sequences: list[list[int]], k: int) -> TopK:
        return self.engine.prompt_topk_logprobs(sequences, k)


@worker(group="train")
class DistillWorker(TeacherTrainWorker):
    """The student's train engine and its optional colocated teacher (`TeacherTrainWorker`), with GKD's step."""

    def _teacher_forward(self, batch: Batch, k: int | None, temperature: float) -> Any:
        from torch.profiler import record_function

        start = time.perf_counter()
        # an offloaded teacher's head leaves the device again: no projection then
        with record_function("rlcore.teacher"), self._teacher_loaded():
            out = teacher_answer(self.teacher, batch, k, temperature, projection=not self.offload_teacher)
        self.teacher_seconds += time.perf_counter() - start
        return out

    @function(dispatch="dp", collect="mean")
    def distill_step(self, batch: Batch, objective: DistillObjective, micro_batch_size: int,
                     temperature: float) -> dict[str, float]:
        """One optimizer step on the GKD loss; a colocated teacher answers the micro-batches in this process,
        `TEACHER_GROUP` of them per forward (`TeacherAnswers`)."""
        import torch

        start, self.teacher_seconds = time.perf_counter(), 0.0
        teacher = None
        if self.teacher is not None:
            full_logprobs = self.offload_teacher and objective.topk is None  # [rows, T, V]: a micro-batch a group
            group = micro_batch_size * (1 if full_logprobs else TEACHER_GROUP)
            teacher = TeacherAnswers(self._teacher_forward, batch, group, getattr(self.teacher, "device", "cpu"))
            batch = Batch({**batch, ROW: torch.arange(len(batch))})
        loss_fn = functools.partial(objective, teacher=teacher)
        out = self.engine.train_step(batch, loss_fn, micro_batch_size, temperature)
        out["time/train_worker"] = time.perf_counter() - start
        if teacher is not None:  # the colocated teacher's forwards, inside the step
            out["time/teacher"] = self.teacher_seconds
        return out

    @function(collect="first")
    def heldout_jsd(self, batch: Batch, objective: DistillObjective) -> float | None:
        """The token mean of the JSD to the teacher on `batch` (held-out rows), without training: rank 0's
        (every rank takes part when the engine's passes are collectives, as `forward_topk`)."""
        import torch

        if not self._takes_part():
            return None
        teacher = self._teacher_forward if self.teacher is not None else None
        total, tokens = 0.0, 0.0
        for start in range(0, len(batch), HELDOUT_ROWS):
            rows = batch.select(slice(start, start + HELDOUT_ROWS))
            width = int(rows["attention_mask"].sum(dim=1).max())
            rows = Batch({k: v[:, :width] if hasattr(v, "dim") and v.dim() >= 2 else v for k, v in rows.items()})
            with torch.no_grad():
                full = self.engine.forward_topk(rows, None, objective.temperature)
                s, n = objective.divergence(GivenOutputs(full, rows["input_ids"]), rows, teacher)
            total, tokens = total + float(s), tokens + float(n)
        return total / max(tokens, 1.0) if worker_rank() == 0 else None
