"""A dispatcher, a collector and a placement policy, with the signatures documented in rlcore.specs."""

from __future__ import annotations

from typing import Any

from rlcore import PlacementRequest, ResourceError


def reverse_slice(n: int, args: tuple, kwargs: dict, mesh: Any = None) -> list[tuple[tuple, dict] | None]:
    """Cut list/tuple arguments into `n` contiguous near-equal shards; worker 0 gets the last shard.

    Other arguments go to every worker whole. A worker whose shards are all empty gets None.
    """
    if n < 1:
        raise ValueError(f"reverse_slice: a group needs at least one worker, got n={n}")

    def shard(value: Any, i: int) -> Any:
        if not isinstance(value, (list, tuple)):
            return value
        size, extra = divmod(len(value), n)
        start = i * size + min(i, extra)
        return value[start : start + size + (i < extra)]

    lengths = [len(v) for v in (*args, *kwargs.values()) if isinstance(v, (list, tuple))]
    calls: list[tuple[tuple, dict] | None] = []
    for worker in range(n):
        i = n - 1 - worker
        call_args = tuple(shard(a, i) for a in args)
        call_kwargs = {k: shard(v, i) for k, v in kwargs.items()}
        sliced = [v for v in (*call_args, *call_kwargs.values()) if isinstance(v, (list, tuple))]
        calls.append(None if lengths and not any(sliced) else (call_args, call_kwargs))
    return calls


def sum_results(results: list[Any]) -> Any:
    """The sum of the workers' results (element-wise for tuples of numbers); workers that returned None skipped."""
    present = [r for r in results if r is not None]
    if present and isinstance(present[0], tuple):
        return tuple(sum(parts) for parts in zip(*present))
    return sum(present)


def reverse_placement(request: PlacementRequest) -> dict[str, list[int]]:
    """Give each role its GPUs from the last global rank down; colocated roles share theirs."""
    total = request.nnodes * request.nproc_per_node
    group_of = {role: group for group in request.colocate_groups for role in group}
    placed: dict[str, list[int]] = {}
    next_free = total - 1
    for role, gpus in request.roles.items():
        group = group_of.get(role, (role,))
        partner = next((r for r in group if r in placed), None)
        if partner is not None:
            if gpus != len(placed[partner]):
                raise ResourceError(
                    f"placement 'reverse': colocated roles '{partner}' and '{role}' ask for "
                    f"{len(placed[partner])} and {gpus} GPUs; colocated roles must ask for the same number"
                )
            placed[role] = list(placed[partner])
            continue
        if gpus > next_free + 1:
            raise ResourceError(
                f"placement 'reverse': role '{role}' asks for {gpus} GPUs but only {next_free + 1} of {total} "
                f"are left ({request.nnodes} node(s) x {request.nproc_per_node}); lower {role}.gpus or add nodes"
            )
        placed[role] = list(range(next_free, next_free - gpus, -1))
        next_free -= gpus
    return placed
