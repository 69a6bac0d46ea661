"""The ranges of numeric config keys: every int and float key declares both ends (`Field(..., ge=1, le=MAX_TOKENS)`),
so `config validate` refuses at once what a run would refuse or choke on later: a timeout Ray cannot hold, a seed
numpy refuses, a batch or a length that allocates gigabytes. The limits sit far beyond any real run and well inside
what the libraries take; a test walks every algorithm's config model and fails on a numeric key without both ends.
"""

from __future__ import annotations

MAX_WORKERS = 1 << 16  # GPUs, workers, nodes or parallel sizes one key may ask: beyond any cluster, plannable at once
MAX_TIMEOUT_S = 10_000_000.0  # seconds (116 days): Ray, threading and asyncio take it; 1e300 overflows them
MAX_SEED = 2**32 - 1  # numpy's and torch's generators take seeds from 0 to 2**32 - 1 alike
MAX_STEPS = 1_000_000_000  # steps, epochs, retries, intervals and rows counted by a run
MAX_BATCH = 1 << 20  # sequences in a batch, a group or a request pool
MAX_TOKENS = 1 << 22  # tokens of a prompt, a completion or a context; top-k over a vocabulary
MAX_MICRO_TOKENS = 1 << 30  # tokens of a packed micro-batch
MAX_RATE = 10.0  # learning rates, weight decay, clipping ranges: beyond it nothing trains
MAX_COEF = 1e6  # loss coefficients, clipping values, temperatures, gradient norms
MAX_GIB = 1 << 20  # GiB of one GPU's memory, MiB of a weight-sync bucket
MAX_SCORE = 1e15  # a reward or score threshold: rewards themselves are bounded so (rlcore.rewards.REWARD_LIMIT)

__all__ = [
    "MAX_BATCH", "MAX_COEF", "MAX_GIB", "MAX_MICRO_TOKENS", "MAX_RATE", "MAX_SCORE", "MAX_SEED", "MAX_STEPS",
    "MAX_TIMEOUT_S", "MAX_TOKENS", "MAX_WORKERS",
]
