"""A plugin for the learning check's control run (tests/gpu/test_megatron_archs_gpu.py): GRPO whose weight sync
does nothing after the first, so vLLM keeps generating from the checkpoint's weights. Loaded through
RLCORE_PLUGINS, its `grpo` replaces the installed one for that run."""

from __future__ import annotations

import dataclasses

from rlcore import hookimpl
from rlcore.plugins import grpo


class GRPOWithoutWeightSync(grpo.GRPOTrainer):
    def sync_weights(self) -> dict[str, float]:
        if not getattr(self, "synced_once", False):  # the run's first sync: vLLM already holds these weights
            self.synced_once = True
            return super().sync_weights()
        return {}


@hookimpl
def rlcore_algorithms():
    for spec in grpo.rlcore_algorithms():
        yield dataclasses.replace(spec, trainer=GRPOWithoutWeightSync)
