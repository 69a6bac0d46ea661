"""What a megatron train engine holds beyond its step, and how it leaves and comes back: its LoRA adapter in PEFT's
names (`export_adapter`, loaded back bit for bit), its GPU memory (`offload` to pinned host memory, `reload`), its
checkpoints (`save`, `load`: Hugging Face weights or the adapter, the scheduler, each rank's optimizer shard).

`EngineState` is a part of `MegatronTrainEngine` (engine.py), kept apart to keep each file to one job: it reads the
engine's model, optimizer, adapters and parallel sizes, and its `_load_hf`.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlcore import RlcoreError
from rlcore.engines import checkpoint_layout
from rlcore.runtime import replace_dir

from . import lora, mapping
from .support import copy_model_files, model_dir, move_optimizer, shared_tmp, storages_of

META_FILE = "megatron_meta.json"


class EngineState:
    """The adapter, memory and checkpoint half of `MegatronTrainEngine`."""

    # ------------------------------------------------------------------ LoRA

    def _lora_shapes(self) -> dict[str, tuple[int, ...]]:
        """The whole (tensor-merged) shape of each of this stage's megatron tensors, adapters left out."""
        import torch

        return {name: lora.full_shape(name, t.shape, self.tp, mapping.merge_tp)
                for name, t in self.module.state_dict(keep_vars=True).items()
                if torch.is_tensor(t) and not name.endswith("_extra_state") and not lora.is_adapter_key(name)}

    def _hf_lora_index(self) -> dict[str, Any]:
        """Each adapted Hugging Face module of this stage and the rows and columns of the megatron linear it is."""
        if self._lora_index is None:
            self._lora_index = lora.hf_index(self._lora_shapes(), list(self.adapters), lambda full: mapping.megatron_to_hf(
                full, self.spec, pp_rank=self.pp_rank, pp=self.pp))
        return self._lora_index

    def _lora_factors(self) -> dict[str, tuple[Any, Any]]:
        """Each adapted linear's whole (A, B) on this stage, on the CPU: the split factor gathered over its tensor
        group and joined as its base weight is (a collective)."""
        import torch

        factors = {}
        for name, adapter in self.adapters.items():
            a, b = adapter.lora_A.detach(), adapter.lora_B.detach()
            if adapter.tp > 1:
                split = b if adapter.column else a
                parts = [torch.empty_like(split) for _ in range(adapter.tp)]
                torch.distributed.all_gather(parts, split.contiguous(), group=adapter.group)
                whole = mapping.merge_tp(f"{name}.weight", parts)
                a, b = (a, whole) if adapter.column else (whole, b)
            factors[name] = (a.cpu(), b.cpu())
        return factors

    def adapter_tensors(self) -> dict[str, Any]:
        """The LoRA adapter in PEFT's names (`base_model.model.<Hugging Face module>.lora_A.weight`, ...), CPU
        tensors of the whole model on every rank (a collective over the tensor and pipeline groups). A fused
        megatron linear gives each projection it holds the same A and its rows of B (q/k/v, gate/up)."""
        import torch

        if not self.adapters:
            raise RlcoreError("this megatron engine trains no LoRA adapter (lora_rank=0)")
        self._ensure_loaded()
        with torch.no_grad():
            mine = lora.to_hf_adapter(self._lora_factors(), self._hf_lora_index())
        if self.pp == 1:
            return mine
        stages: list[Any] = [None] * self.pp
        torch.distributed.all_gather_object(stages, mine, group=self.pp_group)
        return {key: tensor for stage in stages for key, tensor in stage.items()}

    def export_adapter(self, path: str) -> None:
        """The LoRA adapter as a PEFT folder (`adapter_config.json`, `adapter_model.safetensors`) that
        `peft.PeftModel.from_pretrained` loads onto the Hugging Face base model; every rank calls it, rank 0 writes."""
        tensors = self.adapter_tensors()
        if self.rank == 0:
            lora.write_peft_adapter(Path(path), tensors, rank=self.lora_rank, alpha=self.lora_alpha,
                                    dropout=self.lora_dropout, base_model=self.model_name)

    def _load_adapter(self, path: Path) -> None:
        """The adapter `export_adapter` wrote, into this rank's factors (split as at training), bit for bit."""
        import torch

        shapes = self._lora_shapes()
        factors = lora.from_hf_adapter(lora.read_peft_adapter(path, self.lora_rank), self._hf_lora_index(),
                                       {name: shapes[f"{name}.weight"] for name in self.adapters}, self.lora_rank)
        with torch.no_grad():
            for name, adapter in self.adapters.items():
                a, b = factors[name]
                split = (adapter.lora_B, b) if adapter.column else (adapter.lora_A, a)
                shard = lora.local_shard(split[1], f"{name}.weight", split[0].shape, adapter.tp, adapter.tp_rank,
                                         mapping.merge_tp)
                a, b = (a, shard) if adapter.column else (shard, b)
                adapter.lora_A.copy_(a)
                adapter.lora_B.copy_(b)

    # ------------------------------------------------------------------ memory

    def _ddp_buffers(self) -> list[Any]:
        return [*getattr(self.model, "buffers", []), *getattr(self.model, "expert_parallel_buffers", [])] \
            if hasattr(self.model, "zero_grad_buffer") else []

    def _inner_optimizers(self) -> list[Any]:
        if self.optimizer is None:
            return []
        return [o.optimizer for o in getattr(self.optimizer, "chained_optimizers", [self.optimizer])]

    def _optimizer_tensors(self) -> list[Any]:
        """The inner optimizers' params (megatron's fp32 main params) and state tensors (Adam moments)."""
        tensors: list[Any] = []
        for inner in self._inner_optimizers():
            tensors += [p for group in inner.param_groups for p in group["params"]]
            tensors += [v for state in inner.state.values() for v in state.values() if hasattr(v, "untyped_storage")]
        return tensors

    def gpu_bytes(self) -> int:
        """Bytes of GPU memory under the engine's own tensors (params, DDP buffers, optimizer state), each
        storage once; what `offload()` frees."""
        tensors = [*self.module.parameters(), *self.module.buffers(), *self._optimizer_tensors()]
        tensors += [t for b in self._ddp_buffers() for t in (b.param_data, b.grad_data) if t is not None]
        return sum(s.nbytes() for s in storages_of(tensors, "cuda").values())

    def offload(self, params: bool = True, grads: bool = True, optimizer: bool = True) -> None:
        """Params (megatron's contiguous DDP buffers, or each parameter of a forward-only model) and optimizer
        state (fp32 main params, Adam moments) to pinned host memory, grads dropped: the GPU memory the engine
        holds falls to what nothing else can free (see `HostOffload`). On a CPU engine only the grads are zeroed.

        Grads go first and the optimizer before the params: an fp32 param is its own main param (a view into
        the param buffer), and what a storage of the params holds moves with the params, once."""
        import torch

        if grads and self.optimizer is not None and "grads" not in self._host:
            self._zero_grad()  # not once the grad buffers are away: zeroing them then writes to freed memory
        if not self.cuda:
            return
        buffers = self._ddp_buffers()
        # with the distributed optimizer the params are views into DDP's param buffers (one storage each)
        model_tensors = [*self.module.parameters(), *self.module.buffers()]  # DDP's `buffers` is a list
        if grads:
            self._host.offload("grads", [b.grad_data for b in buffers], keep=False)
        if optimizer and self.optimizer is not None:
            self._host.offload("optimizer", self._optimizer_tensors(), skip=model_tensors)
        if params:
            self._host.offload("params", model_tensors)
        torch.cuda.empty_cache()

    def reload(self, params: bool = True, grads: bool = True, optimizer: bool = True) -> None:
        """Bring offloaded state back to the GPU, bitwise (grads as zeros)."""
        for what, wanted in (("params", params), ("grads", grads), ("optimizer", optimizer)):
            if wanted:
                self._host.reload(what)

    def _ensure_loaded(self) -> None:
        if "params" in self._host:
            raise RlcoreError("the megatron engine's params are offloaded; call reload(params=True) first")
        if "grads" in self._host and not self.forward_only:
            self.reload(params=False, grads=True, optimizer=False)

    # ------------------------------------------------------------------ checkpoints

    def _layout(self) -> dict[str, int]:
        return {"tensor_model_parallel_size": self.tp, "pipeline_model_parallel_size": self.pp, "world_size": self.world_size}

    def save(self, path: str) -> None:
        """`path/model/model.safetensors` (Hugging Face names: loadable by transformers; with LoRA the PEFT adapter
        instead, `export_adapter`'s files, the base being the engine's model), the scheduler and step in
        `path/megatron_meta.json`-side state, and each rank's optimizer shard (fp32 main params and Adam
        moments) in `path/optimizer/rank_NNNNN.pt`; written into a temporary directory, then renamed in place."""
        if self.forward_only:
            raise RlcoreError(f"save: a forward-only megatron engine holds the fixed model {self.model_name}; nothing to save")
        with self._all_loaded():
            self._save(Path(path))

    @contextlib.contextmanager
    def _all_loaded(self) -> Iterator[None]:
        """Everything on the GPU for the block (a checkpoint reads and writes every tensor; an offloaded one has
        no memory under it), then offloaded again as it was."""
        away = {what: what in self._host for what in ("params", "grads", "optimizer")}
        self.reload()
        try:
            yield
        finally:
            if any(away.values()):
                self.offload(**away)

    def _save(self, path: Path) -> None:
        import torch
        from safetensors.torch import save_file

        tmp = shared_tmp(path, self.rank, self.world_size)
        if self.adapters:  # every rank takes part
            adapter = self.adapter_tensors()
        else:
            weights = {name: t.detach().cpu().contiguous() for name, t in self.hf_tensors()}
        if self.rank == 0:
            (tmp / "model").mkdir(parents=True, exist_ok=True)
            if self.adapters:
                lora.write_peft_adapter(tmp / "model", adapter, rank=self.lora_rank, alpha=self.lora_alpha,
                                        dropout=self.lora_dropout, base_model=self.model_name)
            else:
                layout = checkpoint_layout(model_dir(self.model_name))
                if layout is not None:  # a conditional-generation checkpoint: its names, its vision tower beside
                    weights = dict(layout.with_carried(weights.items()))
                save_file(weights, str(tmp / "model" / "model.safetensors"), metadata={"format": "pt"})
                copy_model_files(model_dir(self.model_name), tmp / "model")
            meta = {**self._layout(), "global_step": self.global_step, "scheduler": self.scheduler.state_dict()}
            (tmp / META_FILE).write_text(json.dumps(meta))
        (tmp / "optimizer").mkdir(parents=True, exist_ok=True)
        torch.save(self._optimizer_state(), tmp / "optimizer" / f"rank_{self.rank:05d}.pt")
        if self.world_size > 1:
            torch.distributed.barrier()
        if self.rank == 0:
            replace_dir(tmp, path)
        if self.world_size > 1:
            torch.distributed.barrier()

    def load(self, path: str) -> None:
        """Restore what `save` wrote, with the same tensor, pipeline and data sizes."""
        if self.forward_only:
            raise RlcoreError("load: a forward-only megatron engine has no training state to load")
        path = Path(path)
        meta_file, shard = path / META_FILE, path / "optimizer" / f"rank_{self.rank:05d}.pt"
        weights = path / "model" / (lora.ADAPTER_WEIGHTS if self.adapters else "model.safetensors")
        if not meta_file.is_file() or not shard.is_file() or not weights.is_file():
            raise RlcoreError(f"'{path}' is not a checkpoint of the megatron train engine (no {META_FILE}, model/ or {shard.name})")
        meta = json.loads(meta_file.read_text())
        saved = {k: meta.get(k) for k in self._layout()}
        if saved != self._layout():
            raise RlcoreError(f"checkpoint '{path}' was written with {saved}; this engine runs {self._layout()}: resume with the same sizes")
        with self._all_loaded():
            self._load(path, meta, shard)

    def _load(self, path: Path, meta: dict[str, Any], shard: Path) -> None:
        import torch

        self._host.host.clear()  # the optimizer state is new tensors now: their host copies are made anew
        if self.adapters:  # the base is the engine's model, frozen
            self._load_adapter(path / "model")
        else:
            self._load_hf(str(path / "model"))
        try:  # tensors, numbers and strings only: a checkpoint is data, never code
            state = torch.load(shard, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise RlcoreError(f"{shard} cannot be read as an optimizer shard: {exc}") from exc
        for inner, main, inner_state in zip(self._inner_optimizers(), state["main"], state["inner"], strict=True):
            for p, saved_p in zip((p for g in inner.param_groups for p in g["params"]), main, strict=True):
                p.data.copy_(saved_p)
            inner.load_state_dict(inner_state)
            move_optimizer(inner, self.device)
        self.scheduler.load_state_dict(meta["scheduler"])
        self.global_step = int(meta["global_step"])

    def _optimizer_state(self) -> dict[str, Any]:
        inners = self._inner_optimizers()
        return {
            "inner": [o.state_dict() for o in inners],
            "main": [[p.detach().cpu() for g in o.param_groups for p in g["params"]] for o in inners],
        }
