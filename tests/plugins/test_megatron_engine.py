"""The megatron engine on the CPU (one worker, tensor and pipeline size 1, float32) against transformers and
the hf engine: weights in and out, logits, log-probs, train steps, GRPO, checkpoints, and its errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoConfig

from rlcore import ConfigError, RlcoreError, load_plugins
from rlcore.batch import Batch
from rlcore.testing import build_tiny_model
from rlcore.plugins.hf import make_train_engine as make_hf_engine
from rlcore.plugins.megatron import make_forward_engine, make_train_engine

pytest.importorskip("megatron.core")  # the test extra installs it; a bare checkout reports the skip


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.getbasetemp() / "tiny-llama", arch="llama", num_layers=2, seed=1)


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def tiny(request, tiny_model, tiny_llama):
    return str(tiny_model if request.param == "qwen2" else tiny_llama)


def _batch(seed: int = 0, rows: int = 4, width: int = 10) -> Batch:
    """Right-padded rows with a prompt of 3 tokens; `batch_tokens` is the batch's completion-token count."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 260, (rows, width), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0  # right padding
    mask[3, 5:] = 0
    completion = mask.clone()
    completion[:, :3] = 0
    tokens = torch.full((rows,), float(completion.sum()))
    return Batch({"input_ids": ids * mask, "attention_mask": mask, "completion_mask": completion, "batch_tokens": tokens})


def _hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_hugging_face_to_megatron_to_hugging_face_is_bitwise(tiny):
    engine = make_forward_engine(model=tiny)
    exported = [pair for bucket in engine.export_weights(bucket_bytes=64 << 10) for pair in bucket]
    reference = dict(_hf_model(tiny).named_parameters())
    assert [name for name, _ in exported] == list(reference)  # named_parameters order; tied: no lm_head
    for name, tensor in exported:
        assert tensor.dtype == torch.float32 and torch.equal(tensor, reference[name]), name


def test_logits_and_log_probs_equal_transformers(tiny):
    from megatron.core.models.gpt import GPTModel

    from rlcore.plugins.hf.common import model_outputs
    from rlcore.plugins.megatron.cpu_shim import cpu_current_device

    engine = make_forward_engine(model=tiny)
    batch = _batch()
    ids, mask = batch["input_ids"], batch["attention_mask"]
    T = ids.shape[1]
    assert isinstance(engine.module, GPTModel)
    with torch.no_grad(), cpu_current_device():
        logits = engine.module(ids, torch.arange(T)[None].expand_as(ids), torch.ones(T, T, dtype=torch.bool).triu(1)[None, None])
    hf = _hf_model(tiny)
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask).logits
        reference = model_outputs(hf, ids, mask, temperature=0.7)
    assert logits.shape[-1] == engine.padded_vocab > expected.shape[-1]
    real = mask.bool()  # right padding: every real position sees the same prefix in both models
    torch.testing.assert_close(logits[..., : expected.shape[-1]][real], expected[real], atol=1e-4, rtol=0)
    torch.testing.assert_close(engine.forward_logprobs(batch, 0.7), reference.logprobs(), atol=1e-4, rtol=0)
    full = engine.forward_topk(batch, None, 0.7)
    torch.testing.assert_close(full, reference.full_logprobs(), atol=1e-4, rtol=0)
    top = engine.forward_topk(batch, 5, 0.7)
    expected_top = reference.topk(5)
    assert torch.equal(top.ids, expected_top.ids)
    torch.testing.assert_close(top.logprobs, expected_top.logprobs, atol=1e-4, rtol=0)


def test_the_chunked_output_layer_gives_the_vocab_parallel_values_and_steps(tiny):
    """`chunked_lm_head` (the default at tensor size 1) applies the output layer to the last hidden states in
    chunks: the same log-probs, top-k, full log-softmax and train steps as the vocab-parallel ops over the logits,
    and the loss never sees a logits tensor."""
    from rlcore.head import HeadModelOutputs
    from rlcore.plugins.megatron.vocab_parallel import VocabParallelOutputs

    engines = {chunked: make_train_engine(model=tiny, learning_rate=1e-3, seed=0, chunked_lm_head=chunked)
               for chunked in (True, False)}
    batch = _batch()
    got = {chunked: (e.forward_logprobs(batch, 0.7), e.forward_topk(batch, 5, 0.7), e.forward_topk(batch, None))
           for chunked, e in engines.items()}
    torch.testing.assert_close(got[True][0], got[False][0], atol=1e-5, rtol=0)
    assert torch.equal(got[True][1].ids, got[False][1].ids)
    torch.testing.assert_close(got[True][1].logprobs, got[False][1].logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(got[True][2], got[False][2], atol=1e-5, rtol=0)
    seen: dict[bool, set[type]] = {True: set(), False: set()}

    def nll_of(chunked):
        def nll(outputs, micro):
            seen[chunked].add(type(outputs))
            return _nll(outputs, micro)
        return nll

    steps = {chunked: [e.train_step(batch, nll_of(chunked), micro_batch_size=2) for _ in range(3)]
             for chunked, e in engines.items()}
    assert seen == {True: {HeadModelOutputs}, False: {VocabParallelOutputs}}
    for a, b in zip(steps[True], steps[False]):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5) and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    assert steps[True][-1]["loss"] < steps[True][0]["loss"]
    # the output layer's own forward is back after each pass: the module gives logits again
    module = engines[True].module
    assert "forward" not in vars(module.output_layer)


def test_the_swiglu_mlp_gives_megatrons_values_and_keeps_less_for_backward(tiny_model, monkeypatch):
    """`SwiGLUMLP` (the engine's MLP) against megatron's own: the same losses and gradient norms step by step, while
    the MLPs keep 2F fewer numbers per token and layer for backward (no silu(gate), no copy of `up`)."""
    from rlcore.plugins.megatron import attention

    spec = attention.layer_spec
    engines = {}
    for swiglu in (True, False):
        monkeypatch.setattr(attention, "layer_spec", lambda swiglu=swiglu, **keys: spec(swiglu, **keys))
        engines[swiglu] = make_train_engine(model=tiny_model, learning_rate=1e-3, seed=0)
    assert {type(layer.mlp).__name__ for layer in engines[True].module.decoder.layers} == {"SwiGLUMLP"}
    assert {type(layer.mlp).__name__ for layer in engines[False].module.decoder.layers} == {"MLP"}
    batch = _batch()
    kept: dict[bool, int] = {}
    for swiglu, engine in engines.items():
        storages: dict[int, int] = {}
        inside = [False]
        hooks = [h for layer in engine.module.decoder.layers for h in (
            layer.mlp.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True)),
            layer.mlp.register_forward_hook(lambda *_: inside.__setitem__(0, False)))]

        def pack(t):
            if inside[0] and not isinstance(t, torch.nn.Parameter):
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            engine.forward_logprobs(batch)  # inference: nothing kept
            first = engine.train_step(batch, _nll, micro_batch_size=4)
        for h in hooks:
            h.remove()
        kept[swiglu] = sum(storages.values())
        steps = [first, *(engine.train_step(batch, _nll, micro_batch_size=4) for _ in range(2))]
        engines[swiglu] = [(s["loss"], s["grad_norm"]) for s in steps]
    assert engines[True] == engines[False]
    tokens, layers = batch["input_ids"].numel(), 2  # every position of the right-padded rows runs the layers
    ffn = AutoConfig.from_pretrained(tiny_model).intermediate_size
    assert kept[False] - kept[True] == tokens * layers * 2 * ffn * 4  # float32


def _nll(outputs, micro):
    """Mean negative log-likelihood of the completion tokens: a loss both engines must lower alike."""
    mask = micro["completion_mask"].float()
    loss = -(outputs.logprobs() * mask).sum() / micro["batch_tokens"][0]  # this micro-batch's share
    return loss, {"tokens": float(mask.sum())}


def _steps(engine, batch, n=4):
    return [engine.train_step(batch, _nll, micro_batch_size=2) for _ in range(n)]


def test_train_steps_lower_the_loss_like_the_hf_engine(tiny_model):
    """Same weights, batch and AdamW settings: the per-step losses agree within 1e-4 (both are float32 sums of
    the same terms in different kernel orders, ~1e-6 apart at step 1; Adam's normalised updates keep the
    drift at that scale over four steps) and fall."""
    options = dict(model=str(tiny_model), learning_rate=1e-2, max_grad_norm=1.0, lr_scheduler_type="cosine",
                   warmup_steps=1, max_steps=4, seed=0)
    batch = _batch()
    megatron = _steps(make_train_engine(**options), batch)
    hf = _steps(make_hf_engine(**options), batch)
    losses = [m["loss"] for m in megatron]
    assert losses == sorted(losses, reverse=True) and losses[-1] < losses[0] - 0.05
    for mine, theirs in zip(megatron, hf):
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=1e-4)
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-3)
        assert mine["learning_rate"] == pytest.approx(theirs["learning_rate"], abs=1e-12)  # megatron's scheduler, HF's schedule
        assert mine["tokens"] == theirs["tokens"]


def test_save_then_load_continues_the_same_run(tiny_model, tmp_path):
    options = dict(model=str(tiny_model), learning_rate=1e-2, lr_scheduler_type="linear", max_steps=4, seed=0)
    batch = _batch(seed=1)
    first = make_train_engine(**options)
    first.train_step(batch, _nll, micro_batch_size=4)
    first.save(str(tmp_path / "ckpt"))
    first_weights = {n: t.clone() for bucket in first.export_weights() for n, t in bucket}  # views of live params
    expected = first.train_step(batch, _nll, micro_batch_size=4)
    meta = json.loads((tmp_path / "ckpt" / "megatron_meta.json").read_text())
    assert meta["global_step"] == 1 and (tmp_path / "ckpt" / "optimizer" / "rank_00000.pt").is_file()
    saved = dict(_hf_model(tmp_path / "ckpt" / "model").named_parameters())  # transformers loads the weights
    assert saved.keys() == first_weights.keys() and all(torch.equal(saved[n], t) for n, t in first_weights.items())
    resumed = make_train_engine(**options)
    resumed.load(str(tmp_path / "ckpt"))
    assert resumed.global_step == 1
    got = resumed.train_step(batch, _nll, micro_batch_size=4)
    assert got["loss"] == pytest.approx(expected["loss"], abs=1e-6)
    assert got["learning_rate"] == expected["learning_rate"] and got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
    with pytest.raises(RlcoreError, match="is not a checkpoint of the megatron train engine"):
        resumed.load(str(tmp_path))


def test_forward_engine_refuses_training_and_offload_drops_grads(tiny_model):
    engine = make_forward_engine(model=str(tiny_model))
    with pytest.raises(RlcoreError, match="forward-only megatron engine"):
        engine.train_step(_batch(), _nll, 2)
    trained = make_train_engine(model=str(tiny_model))
    param = next(trained.module.parameters())
    param.grad = torch.ones_like(param)
    trained.offload()
    assert param.grad is None
    trained.reload()
    assert trained.state()["tensor_model_parallel_size"] == 1


def test_grpo_on_the_megatron_engine_runs_like_the_hf_engine(tiny_model, tmp_path):
    """Three GRPO steps, same seed: the rollouts (rewards) are the same, so the weights after each sync were;
    grad norms agree to 1e-4 relative and the losses (on-policy GRPO: about 0) to 1e-5. A run cut after two
    steps and resumed gives the uninterrupted run's third step."""
    from rlcore.plugins.grpo.config import GRPOConfig
    from rlcore.plugins.grpo.trainer import GRPOTrainer

    def run(name, engine, **overrides):
        config = GRPOConfig(**{
            "model": str(tiny_model), "output_dir": str(tmp_path / name), "learning_rate": 1e-3, "max_completion_length": 8,
            "per_device_train_batch_size": 8, "gradient_accumulation_steps": 2, "num_generations": 4, "max_steps": 3,
            "train": {"engine": engine}, "save_steps": 3, **overrides,
        })
        GRPOTrainer(config, load_plugins()).fit()
        return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    rows = {engine: run(engine, engine) for engine in ("hf", "megatron")}
    assert [r["step"] for r in rows["megatron"]] == [1, 2, 3]
    for mine, theirs in zip(rows["megatron"], rows["hf"], strict=True):
        assert mine["reward"] == theirs["reward"]
        assert mine["completions/mean_length"] == theirs["completions/mean_length"]
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-4)
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=1e-5)
    # --resume: two steps, then a resumed run to three continues exactly where the uninterrupted run went
    run("cut", "megatron", max_steps=2, save_steps=1)
    resumed = run("cut", "megatron", save_steps=1, resume="auto")
    assert resumed[-1]["step"] == 3
    for key in ("reward", "grad_norm", "loss"):
        assert resumed[-1][key] == rows["megatron"][-1][key], key


# -- errors, before anything is allocated -------------------------------------------------------------------


def test_an_architecture_without_mapping_is_a_config_error(tiny_model, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(tiny_model, other)
    config = json.loads((other / "config.json").read_text())
    config["architectures"] = ["Phi3ForCausalLM"]
    config["model_type"] = "phi3"
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="Phi3ForCausalLM has no Hugging Face <-> megatron mapping; supported: "
                                          "Qwen2ForCausalLM, LlamaForCausalLM, MistralForCausalLM, Qwen3ForCausalLM, "
                                          "Qwen3MoeForCausalLM"):
        make_train_engine(model=str(other))


def test_parallel_sizes_that_do_not_fit_are_reported_together(tiny_model):
    with pytest.raises(ConfigError) as caught:
        make_train_engine(model=str(tiny_model), tensor_model_parallel_size=3, pipeline_model_parallel_size=3,
                          lora_rank=8, lora_target_modules=["qproj"], lr_scheduler_type="cosine", master_weights=False)
    message = str(caught.value)
    for part in (
        "tensor_model_parallel_size=3 does not divide the model's 4 attention heads",
        "pipeline_model_parallel_size=3 does not divide the model's 2 layers",
        "tensor_model_parallel_size=3 must be 1 on the CPU",
        "lora_target_modules: 'qproj' is no linear the megatron engine adapts",  # LoRA itself is offered
        "max_steps=0 must be > 0 for lr_scheduler_type='cosine'",
        "master_weights=False needs use_distributed_optimizer=false too",
    ):
        assert part in message, part
    with pytest.raises(ConfigError, match="megatron train engine has no option 'tensor_parallel_size'. Did you mean 'tensor_model_parallel_size'"):
        make_train_engine(model=str(tiny_model), tensor_parallel_size=2)


@pytest.mark.parametrize("topk", [None, 8], ids=["full-vocabulary", "top-8"])
def test_gkd_on_the_megatron_engine_runs_like_the_hf_engine(tiny_model, tmp_path, topk):
    """GKD with a colocated megatron teacher over the full vocabulary (the student's `full_logprobs`) or its
    top-k (vocab-parallel `topk`), on- and off-policy steps: per-step losses, JSD and grad norms of the megatron
    student equal the hf student's (same tolerance argument as the train-step test)."""
    from rlcore import load_config
    from rlcore.plugins.gkd.config import GKDConfig
    from rlcore.plugins.gkd.trainer import GKDTrainer

    teacher = build_tiny_model(tmp_path / "teacher", hidden_size=96, intermediate_size=192, seed=5)
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say {i}:", "completion": f"number {i}"}) + "\n" for i in range(24)))
    rows = {}
    for engine in ("hf", "megatron"):
        config = load_config(GKDConfig, None, [
            f"model={tiny_model}", f"teacher_model={teacher}", f"dataset={data}", f"output_dir={tmp_path / engine}",
            f"train.engine={engine}", "lmbda=0.5", "sft_alpha=0.5", "max_steps=3", "max_completion_length=6",
            "per_device_train_batch_size=4", "eval_size=4", "eval_steps=3", "learning_rate=1e-3",
            *([f"gkd_logits_topk={topk}"] if topk else []),
        ])
        GKDTrainer(config, load_plugins()).fit()
        rows[engine] = [json.loads(line) for line in (tmp_path / engine / "metrics.jsonl").read_text().splitlines()]
    assert {r["on_policy"] for r in rows["megatron"]} == {0.0, 1.0}
    for mine, theirs in zip(rows["megatron"], rows["hf"], strict=True):
        assert mine["on_policy"] == theirs["on_policy"]
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=1e-4)
        assert mine["jsd"] == pytest.approx(theirs["jsd"], abs=1e-4)
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-3)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\(\)` before")
def test_cosine_to_min_lr_is_the_same_schedule_on_both_engines(tiny_model):
    """`min_lr` (Megatron's and ms-swift's floor): linear warm-up, then a cosine from learning_rate down to min_lr at
    max_steps, as megatron's OptimizerParamScheduler and transformers' cosine_with_min_lr compute it."""
    import math

    options = dict(model=str(tiny_model), learning_rate=1e-2, min_lr=1e-3, lr_scheduler_type="cosine", warmup_steps=2,
                   max_steps=6, seed=0)
    megatron, hf = make_train_engine(**options), make_hf_engine(**options)
    expected, got = [], {"megatron": [], "hf": []}
    for step in range(7):
        decay = 0.5 * (1 + math.cos(math.pi * (step - 2) / 4))
        expected.append(1e-2 * step / 2 if step < 2 else 1e-3 + (1e-2 - 1e-3) * decay)
        got["megatron"].append(megatron.optimizer.param_groups[0]["lr"])
        got["hf"].append(hf.scheduler.get_last_lr()[0])
        megatron.scheduler.step(increment=1)
        hf.scheduler.step()
    assert got["megatron"] == pytest.approx(expected, abs=1e-12) and got["hf"] == pytest.approx(expected, abs=1e-12)
    assert expected[-1] == pytest.approx(1e-3)
    with pytest.raises(ConfigError, match="min_lr=0.001 is the floor of the cosine schedule"):
        make_train_engine(**{**options, "lr_scheduler_type": "linear"})
