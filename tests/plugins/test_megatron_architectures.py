"""Every architecture `mapping.ARCHITECTURES` declares beyond Qwen2 and Llama (`test_megatron_engine.py`) and Qwen3.5
(`test_megatron_linear_attention.py`), on the megatron engine on the CPU (one worker, float32): weights in and out
bitwise, an export transformers loads, log-probs and train steps equal transformers' and the hf engine's, GRPO; and
what it refuses, before any device. Every norm weight is drawn at random (a fresh model's are ones or zeros, which
would hide a norm read as x * w where it is x * (1 + w)), and rows run past Gemma 3's sliding window of 16."""

from __future__ import annotations

import json

import pytest
import torch

from rlcore import load_plugins
from rlcore.batch import Batch
from rlcore.testing import build_tiny_model

pytest.importorskip("megatron.core")

NEW = ("qwen2_untied", "mistral", "qwen3", "qwen3_moe", "gemma3")


def _with_random_norms(path, out):
    """`path`'s model with every norm weight drawn at random, saved to `out` (the tokenizer beside it)."""
    import shutil

    model = _hf_model(path)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.3 * torch.randn(param.shape, generator=g))
    model.save_pretrained(out)
    for file in path.iterdir():
        if file.name.startswith("tokenizer") or file.name == "generation_config.json":
            shutil.copy(file, out / file.name)
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("archs")
    return {arch: _with_random_norms(build_tiny_model(root / arch, arch=arch, num_layers=2, seed=3), root / f"{arch}-n")
            for arch in NEW}


def _changed(path, out, **keys):
    """A copy of the model at `path` in `out` whose config.json has `keys` changed."""
    import shutil

    shutil.copytree(path, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **keys}))
    return out


def _batch(seed: int = 0, rows: int = 4, width: int = 24) -> Batch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 260, (rows, width), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 19:] = 0
    mask[3, 5:] = 0
    completion = mask.clone()
    completion[:, :3] = 0
    tokens = torch.full((rows,), float(completion.sum()))
    return Batch({"input_ids": ids * mask, "attention_mask": mask, "completion_mask": completion, "batch_tokens": tokens})


def _hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("arch", NEW)
def test_weights_log_probs_and_export_equal_transformers(checkpoints, arch, tmp_path):
    from safetensors.torch import load_file

    from rlcore.export import write_hf_model
    from rlcore.plugins.hf.common import model_outputs
    from rlcore.plugins.megatron import make_forward_engine
    from rlcore.plugins.megatron.cpu_shim import cpu_current_device

    path = checkpoints[arch]
    engine = make_forward_engine(model=str(path))
    saved = load_file(str(path / "model.safetensors"))  # a MoE's experts one by one, as checkpoints and vLLM name them
    exported = dict(pair for bucket in engine.export_weights(bucket_bytes=64 << 10) for pair in bucket)
    assert exported.keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(exported[name], tensor), name

    batch = _batch()
    ids, mask = batch["input_ids"], batch["attention_mask"]
    T = ids.shape[1]
    hf = _hf_model(path)
    with torch.no_grad(), cpu_current_device():
        logits = engine.module(ids, torch.arange(T)[None].expand_as(ids), None)
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask).logits
        reference = model_outputs(hf, ids, mask, temperature=0.7)
    real = mask.bool()
    torch.testing.assert_close(logits[..., : expected.shape[-1]][real], expected[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(engine.forward_logprobs(batch, 0.7), reference.logprobs(), atol=1e-5, rtol=0)
    top, expected_top = engine.forward_topk(batch, 5, 0.7), reference.topk(5)
    assert torch.equal(top.ids, expected_top.ids)
    torch.testing.assert_close(top.logprobs, expected_top.logprobs, atol=1e-5, rtol=0)

    write_hf_model(str(tmp_path / "final"), engine.export_weights(), str(path), write=True)
    again = _hf_model(tmp_path / "final")
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids, attention_mask=mask).logits, expected)


def test_gemma_3s_sliding_window_and_local_rotary_base_count(checkpoints, tmp_path):
    """The Gemma 3 test above tells a sliding window from none and the local rotary base from the global one:
    transformers' log-probs move with either, on rows longer than the window."""
    from rlcore.plugins.hf.common import model_outputs

    batch = _batch(seed=4)
    config = json.loads((checkpoints["gemma3"] / "config.json").read_text())
    variants = {"as built": {}, "no window": {"sliding_window": 1024},
                "one base": {"rope_parameters": {kind: config["rope_parameters"]["full_attention"]
                                                 for kind in ("full_attention", "sliding_attention")}}}
    got = {}
    for name, change in variants.items():
        path = _changed(checkpoints["gemma3"], tmp_path / name.replace(" ", "-"), **change)
        with torch.no_grad():
            got[name] = model_outputs(_hf_model(path), batch["input_ids"], batch["attention_mask"], 1.0).logprobs()
    assert (got["as built"] - got["no window"]).abs().max() > 1e-3
    assert (got["as built"] - got["one base"]).abs().max() > 1e-3


@pytest.mark.parametrize("arch,window", [
    ("mistral", {"sliding_window": 8}),  # every layer (Mistral 7B v0.1's kind)
    ("qwen3", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),  # layers from 1 on
], ids=["mistral", "qwen3"])
def test_sliding_window_attention_equals_transformers(checkpoints, tmp_path, arch, window):
    from rlcore.plugins.hf.common import model_outputs
    from rlcore.plugins.megatron import make_forward_engine

    # layer_types null: transformers derives Qwen's from use_sliding_window and max_window_layers
    path = _changed(checkpoints[arch], tmp_path / "windowed", **window, layer_types=None)
    batch = _batch(seed=6)
    with torch.no_grad():
        expected = model_outputs(_hf_model(path), batch["input_ids"], batch["attention_mask"], 1.0).logprobs()
        plain = model_outputs(_hf_model(checkpoints[arch]), batch["input_ids"], batch["attention_mask"], 1.0).logprobs()
    assert (expected - plain).abs().max() > 1e-3  # the window shows on rows of 24
    engine = make_forward_engine(model=str(path))
    assert "sliding_attention" in engine.spec.layer_types and engine.spec.sliding_window == 8
    torch.testing.assert_close(engine.forward_logprobs(batch), expected, atol=1e-5, rtol=0)


LLAMA3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("arch,rope", [
    ("llama", LLAMA3), ("llama", {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}),
    ("gemma3", {"full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
], ids=["llama3", "linear", "gemma3-linear"])
def test_scaled_rotary_embeddings_equal_transformers(checkpoints, tmp_path, arch, rope):
    """Llama 3.1's llama3 scaling and linear scaling (Gemma 3 4B-27B's global layers): megatron-core's rotary
    embedding with rope_scaling or seq_len_interpolation_factor gives transformers' log-probs, on rows long enough
    for the scaling to show (300 positions)."""
    from rlcore.plugins.hf.common import model_outputs
    from rlcore.plugins.megatron import make_forward_engine

    base = checkpoints.get(arch) or build_tiny_model(tmp_path / arch, arch=arch, num_layers=2, seed=3)
    unscaled = json.loads((base / "config.json").read_text())["rope_parameters"]
    path = _changed(base, tmp_path / "scaled", rope_parameters=rope)
    batch = _batch(seed=5, width=300)
    with torch.no_grad():
        expected = model_outputs(_hf_model(path), batch["input_ids"], batch["attention_mask"], 1.0).logprobs()
        plain = model_outputs(_hf_model(_changed(base, tmp_path / "plain", rope_parameters={
            **unscaled, **({"full_attention": {"rope_type": "default", "rope_theta": rope["full_attention"]["rope_theta"]}}
                           if arch == "gemma3" else {"rope_type": "default", "rope_theta": rope["rope_theta"]})})),
            batch["input_ids"], batch["attention_mask"], 1.0).logprobs()
    assert (expected - plain).abs().max() > 1e-4  # the scaling shows
    torch.testing.assert_close(make_forward_engine(model=str(path)).forward_logprobs(batch), expected, atol=1e-5, rtol=0)


def test_normalised_top_k_routing_equals_transformers(checkpoints, tmp_path):
    """Qwen3-MoE with norm_topk_prob true (Qwen3-30B-A3B's; the default, false, is the test above): the top-k
    weights renormalised to sum to 1 (megatron's softmax after the top-k); the log-probs are transformers'."""
    from rlcore.plugins.hf.common import model_outputs
    from rlcore.plugins.megatron import make_forward_engine

    path = _changed(checkpoints["qwen3_moe"], tmp_path / "normalised", norm_topk_prob=True)
    batch = _batch(seed=2)
    engine = make_forward_engine(model=str(path))
    assert not engine.config.moe_router_pre_softmax
    with torch.no_grad():
        expected = model_outputs(_hf_model(path), batch["input_ids"], batch["attention_mask"], temperature=1.0).logprobs()
        unnormalised = model_outputs(_hf_model(checkpoints["qwen3_moe"]), batch["input_ids"], batch["attention_mask"],
                                     temperature=1.0).logprobs()
    assert (expected - unnormalised).abs().max() > 1e-3  # the two routings differ: the test tells them apart
    torch.testing.assert_close(engine.forward_logprobs(batch), expected, atol=1e-5, rtol=0)


MLP_CLASSES = {"gemma3": "SandwichMLP", "qwen3_moe": "MoELayer", "qwen3_5_moe": "MoELayer"}  # the others: SwiGLUMLP


@pytest.mark.parametrize("arch", ["qwen2", "llama", *NEW, "qwen3_5", "qwen3_5_moe"])
def test_the_built_model_is_what_the_mapping_names(checkpoints, arch, tmp_path):
    """Each architecture as transformers' default config builds it (sizes changed only, `rlcore.testing.ARCH_CONFIGS`):
    megatron-core builds the layers the engine's spec asks for (its MLP a ModuleSpec in 0.16, a builder in 0.19:
    `attention.set_mlp` places rlcore's class in either) and their parameters are the mapping's names, no more, no
    fewer. tests/gpu/test_megatron_archs_gpu.py runs the same on megatron-core 0.19."""
    from rlcore.plugins.megatron import make_forward_engine, mapping
    from rlcore.plugins.megatron.support import SafetensorsReader

    path = checkpoints.get(arch) or build_tiny_model(tmp_path / arch, arch=arch, num_layers=2, seed=3)
    engine = make_forward_engine(model=str(path))
    assert {type(layer.mlp).__name__ for layer in engine.module.decoder.layers} == {MLP_CLASSES.get(arch, "SwiGLUMLP")}
    built = {name for name in engine.module.state_dict() if not name.endswith("_extra_state")}
    with SafetensorsReader(path) as hf:
        assert built == set(mapping.hf_to_megatron(hf, engine.spec))


def test_set_mlp_places_a_class_in_either_form_of_the_layer_spec():
    """megatron-core 0.16's local spec holds the MLP as a ModuleSpec, 0.19's as `partial(MLP.as_mlp_submodule,
    submodules=...)` (a classmethod that 0.16's MLP lacks: `Builder19` stands for it here); either gets the class with
    its submodules kept, and any other form is refused rather than ignored (0.19 ignored `.module = cls` on a partial)."""
    import functools
    import types

    from megatron.core.transformer.mlp import MLP

    from rlcore import RlcoreError
    from rlcore.plugins.megatron.attention import layer_spec, set_mlp
    from rlcore.plugins.megatron.gemma import SandwichMLP

    layer = layer_spec().submodules  # the installed megatron-core's form
    set_mlp(layer, SandwichMLP)
    assert getattr(layer.mlp, "module", None) is SandwichMLP or layer.mlp.func.__self__ is SandwichMLP

    class Builder19(MLP):
        @classmethod
        def as_mlp_submodule(cls, submodules, **kwargs):
            return cls, submodules

    built = types.SimpleNamespace(mlp=functools.partial(Builder19.as_mlp_submodule, submodules="fc1, fc2"))
    set_mlp(built, type("Sandwich19", (Builder19,), {}))
    assert built.mlp.func.__self__.__name__ == "Sandwich19" and built.mlp.keywords == {"submodules": "fc1, fc2"}
    with pytest.raises(RlcoreError, match="neither a ModuleSpec of megatron's MLP"):
        set_mlp(types.SimpleNamespace(mlp=functools.partial(print)), SandwichMLP)


def _nll(outputs, micro):
    mask = micro["completion_mask"].float()
    return -(outputs.logprobs() * mask).sum() / micro["batch_tokens"][0], {"tokens": float(mask.sum())}


@pytest.mark.parametrize("arch", NEW)
def test_train_steps_equal_the_hf_engine(checkpoints, arch):
    """Same weights, batch and AdamW: per-step losses within 1e-5 and gradient norms within 1e-4 (float32 sums of the
    same terms in other kernel orders), and the trained weights export alike."""
    from rlcore.plugins.hf import make_train_engine as make_hf_engine
    from rlcore.plugins.megatron import make_train_engine

    batch = _batch(seed=1)
    engines = {"megatron": make_train_engine(model=str(checkpoints[arch]), learning_rate=1e-3, seed=0),
               "hf": make_hf_engine(model=str(checkpoints[arch]), learning_rate=1e-3, seed=0)}
    steps = {name: [e.train_step(batch, _nll, micro_batch_size=2) for _ in range(3)] for name, e in engines.items()}
    for mine, theirs in zip(steps["megatron"], steps["hf"], strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=1e-5)
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-4)
    assert steps["megatron"][-1]["loss"] < steps["megatron"][0]["loss"]
    torch.testing.assert_close(engines["megatron"].forward_logprobs(batch), engines["hf"].forward_logprobs(batch),
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["qwen2_untied", "mistral", "qwen3", "qwen3_moe", "gemma3"])
def test_grpo_on_the_megatron_engine_runs_like_the_hf_engine(checkpoints, arch, tmp_path):
    from rlcore.plugins.grpo.config import GRPOConfig
    from rlcore.plugins.grpo.trainer import GRPOTrainer

    rows = {}
    for engine in ("hf", "megatron"):
        config = GRPOConfig(
            model=str(checkpoints[arch]), output_dir=str(tmp_path / engine), learning_rate=1e-3, max_completion_length=6,
            per_device_train_batch_size=4, num_generations=4, max_steps=2, train={"engine": engine},
        )
        GRPOTrainer(config, load_plugins()).fit()
        rows[engine] = [json.loads(line) for line in (tmp_path / engine / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows["megatron"]] == [1, 2]
    for mine, theirs in zip(rows["megatron"], rows["hf"], strict=True):
        assert mine["reward"] == theirs["reward"]
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-4)
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=1e-5)
    assert (tmp_path / "megatron" / "final" / "model.safetensors").is_file()


# -- refused before any device: the engine's own check, as `rlcore config validate` runs it -----------------------


def test_the_engine_check_names_architecture_and_parallel_problems(checkpoints, tmp_path):
    engines = load_plugins().engines
    check = engines.get("megatron", kind="train").check
    phi = _changed(checkpoints["qwen3"], tmp_path / "phi", architectures=["Phi3ForCausalLM"], model_type="phi3")
    assert [m for _, m in check(model=str(phi))] == [
        "architecture Phi3ForCausalLM has no Hugging Face <-> megatron mapping; supported: Qwen2ForCausalLM, "
        "LlamaForCausalLM, MistralForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM, Qwen3_5ForCausalLM, "
        "Qwen3_5MoeForCausalLM, Gemma3ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration "
        "(use train.engine=hf for others)"]
    capped = _changed(checkpoints["gemma3"], tmp_path / "capped", final_logit_softcapping=30.0)
    assert [m for _, m in check(model=str(capped))] == [
        "Gemma3ForCausalLM: final_logit_softcapping is not mapped (it must be null)"]
    assert check(model=str(checkpoints["qwen3_moe"]), tensor_model_parallel_size=2, pipeline_model_parallel_size=2) == []
    problems = check(model=str(checkpoints["qwen3_moe"]), tensor_model_parallel_size=3, expert_model_parallel_size=3,
                     pipeline_model_parallel_size=4)
    assert [key for key, _ in problems] == ["expert_model_parallel_size"] + ["tensor_model_parallel_size"] * 3 + [
        "pipeline_model_parallel_size", "expert_model_parallel_size"]
    assert "expert_model_parallel_size=3 does not divide the model's 4 experts" in [m for _, m in problems]
    dense = check(model=str(checkpoints["qwen3"]), expert_model_parallel_size=2, device="cpu")
    assert [m for _, m in dense] == [
        "expert_model_parallel_size=2 must be 1: expert parallelism is not built yet (each rank holds every expert; "
        "tensor parallelism splits them)",
        "expert_model_parallel_size=2 needs a model with experts; Qwen3ForCausalLM has none"]
    forward = engines.get("megatron", kind="forward").check
    assert "megatron forward engine has no option 'learning_rate'" in forward(model=str(checkpoints["qwen3"]), learning_rate=1.0)[0][1]


def test_config_validate_reports_an_unmapped_architecture(checkpoints, tmp_path, capsys):
    from rlcore.cli import main

    config = tmp_path / "grpo.yaml"
    config.write_text("train:\n  engine: megatron\n")
    phi = _changed(checkpoints["qwen3"], tmp_path / "phi", architectures=["Phi3ForCausalLM"], model_type="phi3")
    assert main(["config", "validate", "--plugin", "grpo", "--config", str(config), f"model={phi}"]) == 2
    err = capsys.readouterr().err
    assert "model: architecture Phi3ForCausalLM has no Hugging Face <-> megatron mapping" in err
    assert "use train.engine=hf" in err
    assert main(["config", "validate", "--plugin", "grpo", "--config", str(config), f"model={checkpoints['qwen3_moe']}",
                 "train.engine_kwargs.expert_model_parallel_size=3"]) == 2
    assert "expert_model_parallel_size=3 does not divide the model's 4 experts" in capsys.readouterr().err
    assert main(["config", "validate", "--plugin", "grpo", "--config", str(config), f"model={checkpoints['qwen3_moe']}"]) == 0
