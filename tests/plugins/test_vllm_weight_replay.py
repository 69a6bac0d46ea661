"""ReplayLoader against a module laid out and loaded the way vLLM lays out and loads a Qwen2 model: fused
qkv_proj and gate_up_proj, a padded vocabulary, tensor-parallel shards, a tied lm_head that is skipped.

Every test scribbles over the parameters before each call, so a replay that misses a write shows, and
checks both the counters (the replay path was taken, or not) and the values against a fresh module
loaded plainly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rlcore.plugins.vllm.weight_replay import ReplayLoader, layout

HIDDEN, KV, INTER, VOCAB, PADDED_VOCAB, LAYERS = 16, 8, 24, 50, 64, 2
# (vLLM's fused parameter, the Hugging Face name it takes, the shard)
STACKED = [
    ("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1),
]


class VllmLike(nn.Module):
    """A Qwen2-shaped model as vLLM holds it on one tensor-parallel rank, with vLLM's `load_weights`."""

    def __init__(self, rank: int = 0, tp: int = 1, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.rank, self.tp = rank, tp

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.randn(*shape).to(dtype), requires_grad=False)

        shapes = {"embed_tokens.weight": (PADDED_VOCAB // tp, HIDDEN), "norm.weight": (HIDDEN,)}
        for i in range(LAYERS):
            p = f"layers.{i}."
            shapes[p + "self_attn.qkv_proj.weight"] = ((HIDDEN + 2 * KV) // tp, HIDDEN)
            shapes[p + "self_attn.qkv_proj.bias"] = ((HIDDEN + 2 * KV) // tp,)
            shapes[p + "self_attn.o_proj.weight"] = (HIDDEN, HIDDEN // tp)
            shapes[p + "mlp.gate_up_proj.weight"] = (2 * INTER // tp, HIDDEN)
            shapes[p + "mlp.down_proj.weight"] = (HIDDEN, INTER // tp)
            shapes[p + "input_layernorm.weight"] = (HIDDEN,)
        self.params = {name: param(*shape) for name, shape in shapes.items()}  # by vLLM's names
        for name, p in self.params.items():
            self.register_parameter(name.replace(".", "_"), p)
        # a buffer the loader never writes
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, HIDDEN, 2) / HIDDEN))

    def load_weights(self, weights) -> None:
        for name, w in weights:
            if name == "lm_head.weight":  # tied to the embedding
                continue
            name = name.removeprefix("model.")
            for fused, part, shard in STACKED:
                if part in name:
                    self._load_fused(self.params[name.replace(part, fused)], w, shard)
                    break
            else:
                param = self.params[name]
                if name == "embed_tokens.weight":
                    self._load_vocab(param, w)
                elif name.endswith(("o_proj.weight", "down_proj.weight")):
                    self._load_row_parallel(param, w)
                else:  # vLLM's default_weight_loader
                    param.data.copy_(w)

    def _load_fused(self, param: nn.Parameter, w: torch.Tensor, shard) -> None:
        q, kv, inter = HIDDEN // self.tp, KV // self.tp, INTER // self.tp
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv), 0: (0, inter), 1: (inter, inter)}[shard]
        param.data.narrow(0, offset, size).copy_(w.narrow(0, self.rank * size, size))

    def _load_row_parallel(self, param: nn.Parameter, w: torch.Tensor) -> None:
        size = param.shape[1]
        param.data.copy_(w.narrow(1, self.rank * size, size))  # a strided view of the incoming tensor

    def _load_vocab(self, param: nn.Parameter, w: torch.Tensor) -> None:
        rows = param.shape[0]
        start = self.rank * rows
        w = w.narrow(0, start, max(0, min(rows, w.shape[0] - start)))
        param[: w.shape[0]].data.copy_(w)
        param[w.shape[0] :].data.fill_(0)


def targets(model: nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]


def hf_weights(seed: int, dtype: torch.dtype = torch.bfloat16) -> list[tuple[str, torch.Tensor]]:
    """A full model's Hugging Face-named weights, different for each seed."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        for proj, rows in (("q_proj", HIDDEN), ("k_proj", KV), ("v_proj", KV)):
            shapes[p + f"self_attn.{proj}.weight"] = (rows, HIDDEN)
            shapes[p + f"self_attn.{proj}.bias"] = (rows,)
        shapes[p + "self_attn.o_proj.weight"] = (HIDDEN, HIDDEN)
        shapes[p + "mlp.gate_proj.weight"] = (INTER, HIDDEN)
        shapes[p + "mlp.up_proj.weight"] = (INTER, HIDDEN)
        shapes[p + "mlp.down_proj.weight"] = (HIDDEN, INTER)
        shapes[p + "input_layernorm.weight"] = (HIDDEN,)
    shapes["model.norm.weight"] = (HIDDEN,)
    shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    return [(name, torch.randn(*shape, generator=g).to(dtype)) for name, shape in shapes.items()]


def packed(weights: list[tuple[str, torch.Tensor]], lead: int = 0, device: str = "cpu") -> list[tuple[str, torch.Tensor]]:
    """The weights as views of one flat uint8 buffer at 16-byte aligned offsets, starting `lead` bytes in."""
    offsets, end = [], lead
    for _, t in weights:
        offsets.append(end)
        end += -(-t.numel() * t.element_size() // 16) * 16
    buffer = torch.zeros(end, dtype=torch.uint8, device=device)
    views = []
    for (name, t), offset in zip(weights, offsets):
        view = buffer[offset : offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        view.copy_(t)
        views.append((name, view))
    return views


def scribble(model: nn.Module) -> None:
    """Overwrite every parameter in place, so that only what a load writes is right afterwards."""
    for p in model.parameters():
        p.data.normal_()


def assert_same(model: nn.Module, reference: nn.Module) -> None:
    for (name, got), (_, want) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(got, want), name


def plainly_loaded(weights, **kwargs) -> VllmLike:
    reference = VllmLike(**kwargs)
    reference.load_weights(weights)
    return reference


@pytest.mark.parametrize("rank, tp", [(0, 1), (0, 2), (1, 2)])
@pytest.mark.parametrize("as_views", [True, False], ids=["flat-buffer", "separate"])
def test_replayed_loads_match_a_plain_load_bitwise(rank, tp, as_views):
    model = VllmLike(rank, tp)
    loader = ReplayLoader(model.load_weights, targets(model))
    for call, seed in enumerate([1, 2, 3]):
        weights = hf_weights(seed)
        scribble(model)
        loader(packed(weights, lead=64 * call) if as_views else weights)  # each call a new buffer, other offsets
        assert_same(model, plainly_loaded(weights, rank=rank, tp=tp))
    assert loader.stats() == {"traced": 1, "replayed": 2, "fallback": 0, "layouts": 1, "not_replayable": 0}


def test_a_flat_buffer_traced_replays_separate_tensors_of_the_same_layout():
    model = VllmLike()
    loader = ReplayLoader(model.load_weights, targets(model))
    loader(packed(hf_weights(1)))
    weights = hf_weights(2)
    scribble(model)
    loader(weights)
    assert (loader.traced, loader.replayed) == (1, 1)
    assert_same(model, plainly_loaded(weights))


def test_float32_incoming_into_bfloat16_parameters():
    model = VllmLike(dtype=torch.bfloat16)
    loader = ReplayLoader(model.load_weights, targets(model))
    loader(packed(hf_weights(1, torch.float32)))
    weights = hf_weights(2, torch.float32)
    scribble(model)
    loader(packed(weights))
    assert (loader.traced, loader.replayed) == (1, 1)
    assert model.params["norm.weight"].dtype == torch.bfloat16
    assert_same(model, plainly_loaded(weights))


def load_cast(model: VllmLike):
    """Casts each tensor to the parameter's dtype first: a new tensor, not a view of the incoming one."""

    def load(weights):
        model.load_weights([(name, w.to(torch.bfloat16)) for name, w in weights])

    return load


def load_cat(model: VllmLike):
    """Concatenates q, k and v before one copy into qkv_proj."""

    def load(weights):
        weights = dict(weights)
        for name in list(weights):
            if ".q_proj." in name:
                parts = [weights.pop(name.replace("q_proj", proj)) for proj in ("q_proj", "k_proj", "v_proj")]
                model.params[name.removeprefix("model.").replace("q_proj", "qkv_proj")].data.copy_(torch.cat(parts))
        rest = [(name, w) for name, w in weights.items() if ".k_proj." not in name and ".v_proj." not in name]
        model.load_weights(rest)

    return load


def load_setitem(model: VllmLike):
    """Writes the norms with `param[...] = w` instead of copy_."""

    def load(weights):
        for name, w in weights:
            if name.endswith("norm.weight"):
                model.params[name.removeprefix("model.")][...] = w
            else:
                model.load_weights([(name, w)])

    return load


def load_data_assign(model: VllmLike):
    """Replaces the norms' data instead of copying into it."""

    def load(weights):
        for name, w in weights:
            if name.endswith("norm.weight"):
                param = model.params[name.removeprefix("model.")]
                param.data = w.to(param.dtype, copy=True)
            else:
                model.load_weights([(name, w)])

    return load


def load_item(model: VllmLike):
    """Reads a value of the incoming tensor (as vLLM's default_weight_loader fills one-element parameters)."""

    def load(weights):
        for name, w in weights:
            if name == "model.norm.weight":
                model.params["norm.weight"].data.fill_(w[0].item())
                model.params["norm.weight"].data[1:].copy_(w[1:])
            else:
                model.load_weights([(name, w)])

    return load


@pytest.mark.parametrize(
    "make_load, reason",
    [
        (load_cast, "not a view of an incoming tensor"),
        (load_cat, "not a view of an incoming tensor"),
        (load_setitem, "Tensor.__setitem__ wrote a target"),
        (load_data_assign, "Tensor.data = wrote a target"),
        (load_item, "read the values"),
    ],
)
def test_a_loader_that_writes_other_than_by_copy_from_the_incoming_tensors_falls_back(make_load, reason):
    model = VllmLike()
    loader = ReplayLoader(make_load(model), targets(model), replay=True)
    for seed in (1, 2, 3):
        weights = hf_weights(seed, torch.float32)
        scribble(model)
        loader(packed(weights))
        assert_same(model, plainly_loaded(weights))
    assert (loader.traced, loader.replayed, loader.fallback) == (1, 0, 2)
    (why,) = loader.why_not.values()
    assert reason in why and "from 'model.embed_tokens.weight'" in why


def test_a_copy_into_a_tensor_that_is_not_a_target_falls_back():
    model = VllmLike()
    loader = ReplayLoader(model.load_weights, [model.params["norm.weight"]])
    loader(hf_weights(1))
    weights = hf_weights(2)
    loader(weights)
    assert (loader.traced, loader.replayed, loader.fallback) == (1, 0, 1)
    assert "not a target" in next(iter(loader.why_not.values()))
    assert_same(model, plainly_loaded(weights))


def test_replay_false_always_calls_the_loader():
    model = VllmLike()
    calls = []
    loader = ReplayLoader(lambda weights: calls.append(model.load_weights(weights)), targets(model), replay=False)
    for seed in (1, 2, 3):
        weights = hf_weights(seed)
        scribble(model)
        loader(weights)
        assert_same(model, plainly_loaded(weights))
    assert len(calls) == 3
    assert loader.stats() == {"traced": 0, "replayed": 0, "fallback": 3, "layouts": 0, "not_replayable": 0}


def test_each_bucket_layout_is_traced_once_and_replayed_after():
    model = VllmLike()
    loader = ReplayLoader(model.load_weights, targets(model))
    for seed in (1, 2, 3):
        weights = hf_weights(seed)
        scribble(model)
        loader(packed(weights[:8]))  # the embedding and most of layer 0
        loader(packed(weights[8:]))  # the rest, and the tied lm_head, which the loader skips
        assert_same(model, plainly_loaded(weights))
    assert loader.stats() == {"traced": 2, "replayed": 4, "fallback": 0, "layouts": 2, "not_replayable": 0}

    loader(packed(hf_weights(4, torch.float32)[:8]))  # same names, another dtype: another layout
    assert (loader.traced, loader.stats()["layouts"]) == (3, 3)


def test_layout_is_what_a_replay_depends_on():
    weights = hf_weights(1)
    assert layout(weights) == layout(packed(hf_weights(2), lead=48))
    assert layout(weights) != layout([(name, w.t()) if w.dim() == 2 else (name, w) for name, w in weights])
    assert layout(weights) != layout(list(reversed(weights)))


def test_clear_forgets_the_traces_and_takes_new_targets():
    model = VllmLike()
    loader = ReplayLoader(model.load_weights, targets(model))
    loader(hf_weights(1))
    for p in model.parameters():  # the engine re-allocates its parameters
        p.data = p.data.clone()
    loader.clear(targets(model))
    weights = hf_weights(2)
    loader(weights)
    loader(weights)
    assert (loader.traced, loader.replayed) == (2, 1)
    assert_same(model, plainly_loaded(weights))
