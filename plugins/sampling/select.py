"""Best-of-N selection, as ms-swift's sampler does it, as pure functions of one prompt's candidates.

- a PRM's step scores become one score per candidate (`aggregate_steps`: min, last or prod);
- each scorer's scores are min-max normalised over *all* candidates of the prompt (`normalize`, ms-swift's
  rule), so the result never depends on how the candidates were spread over workers;
- the selection score is `prm + 10 * orm` (normalised; a missing scorer counts 1.0 for every candidate);
- a candidate passes when its raw ORM score is above `orm_threshold` and its aggregated PRM score above
  `prm_threshold` (strictly, as ms-swift);
- a prompt whose passing ORM count reaches `int(N * easy_query_threshold)` is dropped: the model solves it;
- the `n_best_to_keep` highest-scoring passing candidates are kept, each paired with the lowest-scoring
  candidate not kept as its rejected response.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

AGGREGATIONS = ("min", "last", "prod")
ORM_WEIGHT = 10.0  # ms-swift: score = prm + orm * 10


def aggregate_steps(steps: list[float], how: str = "min") -> float:
    """One score from a PRM's per-step scores; no steps scores 0."""
    if how not in AGGREGATIONS:
        raise ValueError(f"prm_aggregation '{how}' is unknown; use one of {', '.join(AGGREGATIONS)}")
    if not steps:
        return 0.0
    if how == "min":
        return float(min(steps))
    if how == "last":
        return float(steps[-1])
    return float(math.prod(steps))


def normalize(scores: list[float]) -> list[float]:
    """ms-swift's min-max normalisation over one prompt's candidates: equal scores become min(1, score)
    (0 for 0), others (s - min) / (max - min + 1e-5)."""
    low, high = min(scores), max(scores)
    if low == high:
        return [0.0 if low == 0 else min(1.0, low)] * len(scores)
    return [(s - low) / (high - low + 1e-5) for s in scores]


@dataclass(frozen=True)
class Selection:
    """What one prompt gives: its chosen candidates (indices, best first) and the rejected partner of each
    (None without scorers), the selection score of every candidate, and which passed the thresholds."""

    chosen: tuple[int, ...]
    rejected: int | None
    scores: tuple[float, ...]
    passed: tuple[bool, ...]
    easy: bool = False


def select(
    orm: list[float] | None,
    prm: list[float] | None,
    n_best_to_keep: int,
    orm_threshold: float = 0.0,
    prm_threshold: float = 0.0,
    easy_query_threshold: float | None = None,
) -> Selection:
    """Best-of-N for one prompt from its candidates' raw ORM scores and aggregated PRM scores (either may
    be None: no such scorer). Without any scorer every candidate is kept, in order, with no partner."""
    n = len(orm if orm is not None else prm if prm is not None else [])
    if orm is None and prm is None:
        raise ValueError("select needs ORM or PRM scores; without scorers every candidate is kept")
    passed = [
        (orm is None or orm[i] > orm_threshold) and (prm is None or prm[i] > prm_threshold) for i in range(n)
    ]
    orm_norm = normalize(orm) if orm is not None else [1.0] * n
    prm_norm = normalize(prm) if prm is not None else [1.0] * n
    scores = [p + ORM_WEIGHT * o for p, o in zip(prm_norm, orm_norm)]
    if easy_query_threshold is not None and orm is not None:
        solved = sum(1 for s in orm if s > orm_threshold)
        if solved >= max(1, int(n * easy_query_threshold)):
            return Selection((), None, tuple(scores), tuple(passed), easy=True)
    order = sorted(range(n), key=lambda i: (-scores[i], i))  # best first; ties: the earlier candidate
    chosen = [i for i in order[:n_best_to_keep] if passed[i]]
    rest = [i for i in order if i not in chosen]
    if not chosen or not rest:
        return Selection((), None, tuple(scores), tuple(passed))
    return Selection(tuple(chosen), rest[-1], tuple(scores), tuple(passed))
