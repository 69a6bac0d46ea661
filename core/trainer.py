"""`Trainer`: the base class of every algorithm's driver. Subclass it, override the step methods."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .manager import Plugins


class Trainer:
    """Holds the validated config and the loaded plugins; `fit()` runs the algorithm.

    Lifecycle hooks are called through `self.hook`: `rlcore_train_start(trainer)`,
    `rlcore_step_end(trainer, step, metrics)`, `rlcore_train_end(trainer, metrics)`.
    """

    def __init__(self, config: Any, plugins: Plugins, *, use_ray: bool = False):
        from .dispatch import use_plugins

        self.config = config
        self.plugins = plugins
        self.use_ray = use_ray
        use_plugins(plugins)  # workers resolve engines, dispatchers and collectors with these plugins

    @property
    def hook(self) -> Any:
        return self.plugins.hook

    def fit(self) -> dict[str, Any]:
        """Run to the end; return the summary metrics."""
        raise NotImplementedError(f"{type(self).__name__} must implement fit()")
