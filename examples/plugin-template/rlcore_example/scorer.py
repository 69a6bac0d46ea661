"""A worker class of the plugin's own: the `scorer` role, whose calls use the plugin's dispatcher and collector.

Run it through `rlcore.RoleSession` (see tests/test_rlcore_example.py): without Ray the role is one
in-process worker; with Ray it is one actor per worker the resource plan gives it, and `score()` splits
its list with `reverse_slice` (worker 0 gets the last shard) and adds the partial scores with `sum`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlcore import function, worker, worker_rank


def square(value: float) -> float:
    """The scoring engine the tests give the role: a plain function, so it travels to Ray workers."""
    return value * value


@worker(group="scorer")
class Scorer:
    """Scores numbers with its engine; `RoleSetup(Scorer, engine, options)` builds one per worker."""

    def __init__(self, engine: Callable[[float], float], options: dict[str, Any]):
        self.engine = engine
        self.scale = float(options.get("scale", 1.0))
        self.device = options["device"]  # the session sets it from the role's placement

    @function(dispatch="reverse_slice", collect="sum")
    def score(self, values: list[float]) -> float:
        """The scaled sum of the engine's scores of this worker's shard of `values`."""
        return self.scale * sum(self.engine(v) for v in values)

    @function(dispatch="reverse_slice", collect="none")
    def shard(self, values: list[float]) -> tuple[int, list[float]]:
        """This worker's rank and the shard of `values` it got."""
        return worker_rank(), list(values)
