"""LoRA on megatron-core's parallel linears (linear_qkv, linear_proj, linear_fc1, linear_fc2; the experts' too; the
output layer of an untied model, asked for as `lm_head` or `output_layer`, as peft's `all-linear` leaves it out) and
the gated delta-net's torch linears, correct under tensor parallelism, and its weights out in Hugging Face names:
merged into the base, or a PEFT adapter.

An adapter is a child module of the linear it adapts (`<linear>.adapter.lora_A`, `.lora_B`), its output added to the
linear's by a forward hook: the GPTModel keeps megatron's classes, forward and parameter names, so the Hugging Face
mapping, megatron's DDP and optimizers see the same model plus a few trainable tensors. Under tensor parallelism the
factors split as the base weight does (peft's `LoraParallelLinear` layout):

- ColumnParallelLinear (weight split by output rows): A [r, in] replicated, B [out/tp, r] split by rows; the grad of
  A's output is summed over the tensor group (megatron's copy-to-region), so A's grad is whole and equal on every rank.
- RowParallelLinear (weight split by input columns): A [r, in/tp] split by columns, its output summed over the group
  (reduce-from-region) before the replicated B [out, r].

A is drawn once on the CPU from the engine's seed for the whole (unsplit) layer and each rank keeps its part, so the
adapters start equal on every rank and for every tensor size; B starts at zero (the model starts as the base).

The output layer's B has a row per padded vocabulary row; no token reads the padding (its logits are masked, or cut
off by the chunked head), so those rows get no gradient, stay zero, and are dropped on export as the base weight's
are. Where the engine applies the output layer in chunks (`chunked_lm_head`), the hook stands aside (`deferred`) and
the chunked head adds the adapter's term itself (`rlcore.head.HeadAdapter`).

Why not peft's own megatron path (`LoraConfig(megatron_config=...)`, peft.tuners.lora.tp_layer), as of peft 0.21:
its dispatcher fails before building anything (`dispatch_megatron` reads `kwargs["fan_in_fan_out"]`, which
`LoraModel` no longer passes: KeyError); behind that, its forward takes the (output, bias) tuples that megatron's
parallel linears return for tensors (`lora_B(lora_A(x)) * scaling`), it sets `params_dtype=float32` on the TransformerConfig it is handed (the
engine's own), it initialises the replicated factor on each tensor rank independently (then B @ A is no longer one
matrix), and it renames every adapted weight to `...base_layer.weight`, which neither the Hugging Face mapping nor
megatron's checkpoints know. peft is used for what fits: `LoraConfig` writes `adapter_config.json`, and the adapter
is in peft's file format, which `PeftModel.from_pretrained` loads onto the Hugging Face model.
"""

from __future__ import annotations

import difflib
import functools
import json
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlcore import RlcoreError

if TYPE_CHECKING:
    import torch

# megatron-core's linears (local layer spec) and the Hugging Face projections each holds; the gated delta-net's
# torch linears (`linear_attention.py`, tensor size 1) are named as in transformers
MEGATRON_LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
TORCH_LINEARS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
HF_TO_MEGATRON = {
    "q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "qkv_proj": "linear_qkv",
    "o_proj": "linear_proj", "gate_proj": "linear_fc1", "up_proj": "linear_fc1", "gate_up_proj": "linear_fc1",
    "down_proj": "linear_fc2", "lm_head": "output_layer",
}
OUTPUT_LAYER = "output_layer"
ALL_LINEAR = "all-linear"
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
_CODE = float(2 ** 40)  # index codes: tensor id * _CODE + flat index, exact in float64 (below 2**53)


def _targets(targets: str | Iterable[str]) -> list[str]:
    return [targets] if isinstance(targets, str) else list(targets)


def target_problems(targets: str | Iterable[str]) -> list[tuple[str, str]]:
    """Names in `lora_target_modules` that name no megatron linear, each with the closest known name."""
    known = [ALL_LINEAR, *MEGATRON_LINEARS, OUTPUT_LAYER, *HF_TO_MEGATRON, *TORCH_LINEARS]
    if not isinstance(targets, (str, list, tuple)) or not _targets(targets):
        return [("lora_target_modules", f"lora_target_modules={targets!r} must be {ALL_LINEAR!r} or a non-empty list of names")]
    problems = []
    for name in _targets(targets):
        if name not in known:
            close = difflib.get_close_matches(str(name), known, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            problems.append(("lora_target_modules",
                             f"lora_target_modules: {name!r} is no linear the megatron engine adapts; known: "
                             f"{', '.join(known)}.{hint}"))
    return problems


def megatron_targets(targets: str | Iterable[str]) -> set[str]:
    """The megatron linears `targets` names: Hugging Face projections map to the fused linear that holds them
    (q_proj -> linear_qkv adapts q, k and v together: one A, one B over the fused output; lm_head -> output_layer).
    `all-linear` leaves the output layer out, as peft does."""
    names = _targets(targets)
    if ALL_LINEAR in names:
        return {*MEGATRON_LINEARS, *TORCH_LINEARS}
    return {HF_TO_MEGATRON.get(n, n) for n in names}


@functools.cache
def _adapter_class() -> type:
    """`LoraAdapter`, made on first use (so that the option checks above import no torch)."""
    import torch
    import torch.nn.functional as F

    class LoraAdapter(torch.nn.Module):
        """scale * B(A(dropout(x))) beside one of megatron's parallel linears or a torch linear (see the module
        docstring); a torch linear is whole on every rank, as a column-parallel one at tensor size 1."""

        def __init__(self, linear: Any, rank: int, alpha: float, dropout: float, a_full: torch.Tensor):
            from megatron.core.tensor_parallel import RowParallelLinear
            from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

            super().__init__()
            parallel = not isinstance(linear, torch.nn.Linear)
            self.column = not isinstance(linear, RowParallelLinear)
            self.group = linear.tp_group if parallel else None
            self.tp = torch.distributed.get_world_size(self.group) if parallel else 1
            self.tp_rank = torch.distributed.get_rank(self.group) if parallel else 0
            if self.tp > 1 and (linear.explicit_expert_comm or linear.sequence_parallel):
                raise RlcoreError(
                    "LoRA on an expert's linear at tensor_model_parallel_size > 1 (megatron splits experts over the expert "
                    "tensor group and reduces them in its token dispatcher) or with sequence parallelism is not built; "
                    "adapt the attention alone (lora_target_modules=[q_proj, k_proj, v_proj, o_proj]) or use tensor size 1")
            self.gather_output = parallel and self.column and linear.gather_output
            self.scaling = alpha / rank
            self.dropout = dropout
            self.deferred = False  # True while a chunked head applies this adapter itself (`_add_delta` stands aside)
            weight = linear.weight
            out_local = weight.shape[0]
            a = a_full if self.column else a_full.chunk(self.tp, dim=1)[self.tp_rank]
            self.lora_A = torch.nn.Parameter(a.to(weight.device, weight.dtype).contiguous())
            self.lora_B = torch.nn.Parameter(torch.zeros(out_local, rank, dtype=weight.dtype, device=weight.device))
            if parallel:  # the split factor is counted on every rank by megatron's grad norm
                split, dim = (self.lora_B, 0) if self.column else (self.lora_A, 1)
                set_tensor_model_parallel_attributes(split, True, dim, 1)
            for p in (self.lora_A, self.lora_B):  # an expert's adapter is reduced where the expert's weight is
                p.allreduce = getattr(weight, "allreduce", True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            from megatron.core import tensor_parallel as tpl

            if self.dropout and self.training:
                if self.column:  # the input is the same on every tensor rank: so is its mask (the default generator)
                    x = F.dropout(x, self.dropout)
                else:  # each rank holds other input columns: megatron's model-parallel generator
                    with tpl.get_cuda_rng_tracker().fork():
                        x = F.dropout(x, self.dropout)
            x = x.to(self.lora_A.dtype)
            if self.tp == 1:
                return F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scaling
            if self.column:
                u = tpl.copy_to_tensor_model_parallel_region(F.linear(x, self.lora_A), group=self.group)
                delta = F.linear(u, self.lora_B)
                if self.gather_output:
                    delta = tpl.gather_from_tensor_model_parallel_region(delta, group=self.group)
            else:
                u = tpl.reduce_from_tensor_model_parallel_region(F.linear(x, self.lora_A), group=self.group)
                delta = F.linear(u, self.lora_B)
            return delta * self.scaling

        def head(self, vocab: int) -> Any:
            """This adapter as the chunked head's `HeadAdapter` over the first `vocab` output rows (the vocabulary
            without megatron's padding), dropout only while training; tensor size 1."""
            from rlcore.head import HeadAdapter

            return HeadAdapter(self.lora_A, self.lora_B[:vocab], self.scaling, self.dropout if self.training else 0.0)

        def merged(self, weight: torch.Tensor) -> torch.Tensor:
            """This rank's shard of W + scale * B @ A, computed in float32 (or W's wider dtype) beside W, rounded once
            to W's dtype; W itself is not touched."""
            dtype = torch.promote_types(weight.dtype, torch.float32)
            delta = (self.lora_B.detach().to(dtype) @ self.lora_A.detach().to(dtype)) * self.scaling
            return (weight.detach().to(dtype) + delta).to(weight.dtype)

    return LoraAdapter


def _add_delta(linear: Any, args: tuple[Any, ...], output: Any) -> Any:
    if linear.adapter.deferred:
        return output
    if isinstance(output, tuple):  # megatron's linears return (output, bias)
        out, bias = output
        return out + linear.adapter(args[0]).to(out.dtype), bias
    return output + linear.adapter(args[0]).to(output.dtype)


def _output_requires_grad(module: Any, args: tuple[Any, ...], output: Any) -> Any:
    """The frozen embedding's output as needing grad while training: megatron's recomputation (an autograd Function)
    passes gradients back only where its inputs require them, and every adapter is behind it."""
    import torch

    if torch.is_grad_enabled() and not output.requires_grad:
        output.requires_grad_()
    return output


def add_adapters(model: torch.nn.Module, *, rank: int, alpha: float, dropout: float, targets: str | Iterable[str],
                 seed: int) -> dict[str, Any]:
    """Freeze every weight of `model`, put an adapter on each linear that `targets` names, and return them by the
    linear's name (megatron state-dict prefix, e.g. `decoder.layers.0.self_attention.linear_qkv`). The output layer
    must hold its own weight (an untied model: the engine's config check refuses a tied one)."""
    import torch
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    kinds = (ColumnParallelLinear, RowParallelLinear, torch.nn.Linear)

    wanted = megatron_targets(targets)
    model.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    adapters: dict[str, Any] = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] not in wanted or not isinstance(module, kinds):
            continue
        # peft's init: A ~ kaiming_uniform(a=sqrt(5)), i.e. U(-1/sqrt(in), 1/sqrt(in)); drawn whole, then split
        fan_in = module.in_features if isinstance(module, torch.nn.Linear) else module.input_size
        bound = 1 / math.sqrt(fan_in)
        a_full = torch.empty(rank, fan_in).uniform_(-bound, bound, generator=generator)
        module.adapter = _adapter_class()(module, rank, alpha, dropout, a_full)
        module.register_forward_hook(_add_delta)
        adapters[name] = module.adapter
    if not adapters:
        raise RlcoreError(f"lora_target_modules={_targets(targets)!r} matches no linear of the model "
                          f"(megatron names: {', '.join(MEGATRON_LINEARS + (OUTPUT_LAYER,) + TORCH_LINEARS)})")
    embedding = getattr(model, "embedding", None)  # the first pipeline stage's
    if embedding is not None:
        embedding.register_forward_hook(_output_requires_grad)
    grouped = [n for n, m in model.named_modules() if type(m).__name__ in ("GroupedMLP", "TEGroupedMLP")]
    if grouped and wanted & {"linear_fc1", "linear_fc2"}:
        raise RlcoreError(f"LoRA on grouped experts ({grouped[0]}) is not built; the local spec's SequentialMLP is")
    return adapters


def is_adapter_key(name: str) -> bool:
    """Whether a megatron state-dict key is an adapter's (not part of the base model)."""
    return ".adapter.lora_" in name


# --------------------------------------------------------------------------- Hugging Face names

def full_shape(name: str, local: torch.Size, tp: int, merge_tp: Callable) -> tuple[int, ...]:
    """The unsplit shape of megatron tensor `name` whose shard on each of `tp` ranks is `local`."""
    import torch

    return tuple(merge_tp(name, [torch.empty(local, device="meta") for _ in range(tp)]).shape)


def local_shard(full: torch.Tensor, name: str, local: torch.Size, tp: int, tp_rank: int, merge_tp: Callable) -> torch.Tensor:
    """Rank `tp_rank`'s shard of `full`, split as `merge_tp(name, ...)` joins shards (its exact inverse)."""
    import torch

    if tp == 1:
        return full.clone()
    numel = math.prod(local)
    codes = merge_tp(name, [(k * _CODE + torch.arange(numel, dtype=torch.float64)).reshape(local) for k in range(tp)])
    codes = codes.flatten()
    mine = torch.div(codes, _CODE, rounding_mode="floor") == tp_rank
    out = torch.empty(numel, dtype=full.dtype)
    out[(codes[mine] % _CODE).long()] = full.flatten()[mine]
    return out.reshape(local)


def hf_index(shapes: Mapping[str, tuple[int, ...]], adapted: list[str],
             to_hf: Callable[[dict[str, torch.Tensor]], Iterator[tuple[str, torch.Tensor]]]) -> dict[str, tuple[str, Any, Any]]:
    """Where each adapted Hugging Face module's weight lies in a megatron linear: {hf module: (megatron linear,
    rows, cols)}, with hf weight = megatron weight[rows][:, cols].

    Found by sending index codes through the mapping (`to_hf`: full megatron tensors by name -> Hugging Face pairs):
    one pass with each weight's row numbers, one with its column numbers (zero-stride tensors: no memory until the
    mapping copies). It holds for any mapping that only splits and reorders (q/k/v per query group, gate/up), and
    the LoRA factors follow it: B_hf = B[rows], A_hf = A[:, cols]."""
    import torch

    ids = {f"{name}.weight": i for i, name in enumerate(adapted)}

    def probe(axis: int) -> dict[str, torch.Tensor]:
        out = {}
        for key, shape in shapes.items():
            if key in ids:
                numbers = torch.arange(shape[axis], dtype=torch.float64) + ids[key] * _CODE
                out[key] = (numbers[:, None] if axis == 0 else numbers[None, :]).expand(shape)
            else:
                out[key] = torch.full((), -1.0, dtype=torch.float64).expand(shape)
        return out

    index = {}
    for (hf_name, rows), (_, cols) in zip(to_hf(probe(0)), to_hf(probe(1)), strict=True):
        if rows.numel() == 0 or rows.flatten()[0] < 0:
            continue
        if rows.dim() != 2 or not hf_name.endswith(".weight"):
            raise RlcoreError(f"the megatron -> Hugging Face mapping gives {hf_name} {tuple(rows.shape)} from an adapted "
                              "linear; a LoRA adapter in Hugging Face names needs a 2-d weight")
        number = int(rows[0, 0] // _CODE)
        same = torch.div(rows[:, 0], _CODE, rounding_mode="floor") == number
        if not (torch.equal(rows, rows[:, :1].expand_as(rows)) and torch.equal(cols, cols[:1].expand_as(cols))
                and bool(same.all()) and bool((torch.div(cols[0], _CODE, rounding_mode="floor") == number).all())):
            raise RlcoreError(f"{hf_name} is not rows and columns of one megatron linear; no LoRA adapter maps onto it")
        index[hf_name.removesuffix(".weight")] = (adapted[number], (rows[:, 0] % _CODE).long(), (cols[0] % _CODE).long())
    return index


def to_hf_adapter(factors: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
                  index: Mapping[str, tuple[str, Any, Any]]) -> dict[str, torch.Tensor]:
    """PEFT's adapter tensors (`base_model.model.<module>.lora_A.weight`, `.lora_B.weight`) from each megatron
    linear's whole (A, B)."""
    out = {}
    for module, (source, rows, cols) in index.items():
        a, b = factors[source]
        out[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a[:, cols].contiguous()
        out[f"{PEFT_PREFIX}{module}.lora_B.weight"] = b[rows].contiguous()
    return out


def from_hf_adapter(tensors: Mapping[str, torch.Tensor], index: Mapping[str, tuple[str, Any, Any]],
                    shapes: Mapping[str, tuple[int, int]], rank: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each megatron linear's whole (A, B) from PEFT adapter tensors: `to_hf_adapter` inverted, bit for bit. Rows of
    B that no Hugging Face module holds (the output layer's vocabulary padding, which trains none) are zero."""
    import torch

    factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    seen: dict[str, torch.Tensor] = {}  # the columns of A given so far
    for module, (source, rows, cols) in index.items():
        keys = [f"{PEFT_PREFIX}{module}.lora_{x}.weight" for x in "AB"]
        missing = [k for k in keys if k not in tensors]
        if missing:
            raise RlcoreError(f"the adapter has no {missing[0]}")
        a_hf, b_hf = (tensors[k] for k in keys)
        out_rows, width = shapes[source]
        if source not in factors:
            factors[source] = (torch.zeros(rank, width, dtype=a_hf.dtype), torch.zeros(out_rows, rank, dtype=b_hf.dtype))
            seen[source] = torch.zeros(width, dtype=torch.bool)
        (a, b), a_seen = factors[source], seen[source]
        if a_hf.shape != (rank, len(cols)) or b_hf.shape != (len(rows), rank):
            raise RlcoreError(f"the adapter's {module} factors are {tuple(a_hf.shape)} and {tuple(b_hf.shape)}; this "
                              f"engine's rank {rank} needs ({rank}, {len(cols)}) and ({len(rows)}, {rank})")
        overlap = a_seen[cols]
        if overlap.any() and not torch.equal(a[:, cols][:, overlap], a_hf[:, overlap]):
            raise RlcoreError(f"the adapter's {module}.lora_A differs from the other projections of {source}: the "
                              "megatron engine adapts a fused linear with one A")
        a[:, cols], b[rows] = a_hf, b_hf
        a_seen[cols] = True
    for source, a_seen in seen.items():
        if not a_seen.all():
            raise RlcoreError(f"the adapter leaves part of {source} without factors")
    return factors


def write_peft_adapter(path: Path, tensors: Mapping[str, torch.Tensor], *, rank: int, alpha: float, dropout: float,
                       base_model: str) -> None:
    """`adapter_config.json` (peft's LoraConfig) and `adapter_model.safetensors` in `path`."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    modules = sorted({key.removeprefix(PEFT_PREFIX).split(".lora_")[0].rsplit(".", 1)[-1] for key in tensors})
    path.mkdir(parents=True, exist_ok=True)
    LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=modules, task_type="CAUSAL_LM",
               base_model_name_or_path=base_model).save_pretrained(str(path))
    save_file({k: t.detach().cpu().contiguous() for k, t in tensors.items()}, str(path / ADAPTER_WEIGHTS),
              metadata={"format": "pt"})


def read_peft_adapter(path: Path, rank: int) -> dict[str, torch.Tensor]:
    """The adapter tensors `write_peft_adapter` wrote, after checking its rank."""
    from safetensors.torch import load_file

    config_file, weights = path / ADAPTER_CONFIG, path / ADAPTER_WEIGHTS
    if not config_file.is_file() or not weights.is_file():
        raise RlcoreError(f"'{path}' holds no PEFT adapter ({ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
    saved_rank = json.loads(config_file.read_text()).get("r")
    if saved_rank != rank:
        raise RlcoreError(f"the adapter in '{path}' has rank {saved_rank}; this engine's lora_rank is {rank}")
    return load_file(str(weights))
