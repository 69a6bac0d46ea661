"""LoRA on the megatron engine on the CPU (one worker, float32): adapters start as the base model, train alone,
export merged (out of place) and as a PEFT adapter that peft loads onto the transformers model, checkpoint and
resume exactly, and run GRPO through the trainer."""

from __future__ import annotations

import json

import pytest
import torch

from rlcore import ConfigError, RlcoreError, load_plugins
from rlcore.batch import Batch
from rlcore.testing import build_tiny_model
from rlcore.plugins.megatron import make_train_engine

pytest.importorskip("megatron.core")
peft = pytest.importorskip("peft")

LORA = dict(lora_rank=4, lora_alpha=8)
ALL = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.getbasetemp() / "tiny-llama-lora", arch="llama", num_layers=2, seed=1)


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def tiny(request, tiny_model, tiny_llama):
    return str(tiny_model if request.param == "qwen2" else tiny_llama)


def _batch(seed: int = 0, rows: int = 4, width: int = 10) -> Batch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 260, (rows, width), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    mask[3, 5:] = 0
    completion = mask.clone()
    completion[:, :3] = 0
    tokens = torch.full((rows,), float(completion.sum()))
    return Batch({"input_ids": ids * mask, "attention_mask": mask, "completion_mask": completion, "batch_tokens": tokens})


def _nll(outputs, micro):
    mask = micro["completion_mask"].float()
    return -(outputs.logprobs() * mask).sum() / micro["batch_tokens"][0], {}


def _hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _base(engine) -> dict[str, torch.Tensor]:
    """The megatron base weights (adapters left out), copied."""
    return {n: t.clone() for n, t in engine.module.state_dict().items()
            if torch.is_tensor(t) and ".adapter." not in n and not n.endswith("_extra_state")}


def _adapters(engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.module.named_parameters() if ".adapter." in n}


def _exported(engine) -> dict[str, torch.Tensor]:
    return {n: t.clone() for bucket in engine.export_weights() for n, t in bucket}


def test_with_b_at_zero_the_log_probs_are_the_base_models(tiny):
    base, tuned = make_train_engine(model=tiny), make_train_engine(model=tiny, **LORA)
    batch = _batch()
    assert torch.equal(tuned.forward_logprobs(batch), base.forward_logprobs(batch))
    trainable = [p for p in tuned.module.parameters() if p.requires_grad]
    assert {n for n, p in tuned.module.named_parameters() if p.requires_grad} == set(_adapters(tuned))
    assert sorted({name.rsplit(".", 1)[-1] for name in tuned.adapters}) == ["linear_fc1", "linear_fc2", "linear_proj", "linear_qkv"]
    assert len(tuned.adapters) == 4 * 2  # four linears in each of two layers
    held = [p for group in tuned.optimizer.param_groups for p in group["params"]]
    assert {id(p) for p in held} == {id(p) for p in trainable}  # the optimizer holds the adapters only
    assert tuned.state()["num_trainable_parameters"] == sum(p.numel() for p in trainable) < base.state()["num_parameters"] / 10
    assert all(not a.lora_B.any() for a in tuned.adapters.values())


def test_lora_steps_lower_the_loss_change_only_the_adapters_and_export_leaves_the_base_bitwise(tiny_model):
    engine = make_train_engine(model=str(tiny_model), learning_rate=1e-2, seed=0, **LORA)
    base, adapters = _base(engine), _adapters(engine)
    batch = _batch()
    losses = [engine.train_step(batch, _nll, micro_batch_size=2)["loss"] for _ in range(4)]
    assert losses == sorted(losses, reverse=True) and losses[-1] < losses[0] - 0.05, losses
    after = _base(engine)
    assert after.keys() == base.keys() and all(torch.equal(after[n], t) for n, t in base.items())
    trained = _adapters(engine)
    assert all(not torch.equal(trained[n], t) for n, t in adapters.items())  # every A and B moved
    exported = _exported(engine)
    again = _exported(engine)
    assert all(torch.equal(t, base[n]) for n, t in _base(engine).items())  # merged out of place: no drift
    assert all(torch.equal(again[n], t) for n, t in exported.items())
    # layer 0's merged q, k and v are the base plus scale * B @ A, cut into rows: the deltas' squares sum alike
    adapter = engine.adapters["decoder.layers.0.self_attention.linear_qkv"]
    delta = (adapter.lora_B @ adapter.lora_A).detach() * 2.0  # alpha 8 / rank 4
    hf = _hf_model(tiny_model)
    split = [exported[n] - hf.get_parameter(n).detach() for n in (f"model.layers.0.self_attn.{x}_proj.weight" for x in "qkv")]
    assert all(d.abs().max() > 0 for d in split)
    assert sum(float(d.square().sum()) for d in split) == pytest.approx(float(delta.square().sum()), rel=1e-4)


@pytest.mark.parametrize("targets,modules", [
    ("all-linear", ALL),
    (["q_proj", "v_proj", "down_proj"], {"q_proj", "k_proj", "v_proj", "down_proj"}),  # q/v: the fused linear_qkv
    (["linear_proj", "linear_fc1"], {"o_proj", "gate_proj", "up_proj"}),
], ids=["all-linear", "hf-names", "megatron-names"])
def test_the_merged_export_and_the_adapter_equal_peft_on_transformers(tiny, tmp_path, targets, modules):
    from peft import PeftModel

    engine = make_train_engine(model=tiny, learning_rate=1e-2, seed=0, lora_target_modules=targets, **LORA)
    batch = _batch(seed=2)
    for _ in range(2):
        engine.train_step(batch, _nll, micro_batch_size=2)
    merged = _exported(engine)
    engine.export_adapter(str(tmp_path / "adapter"))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert set(config["target_modules"]) == modules and config["r"] == 4 and config["lora_alpha"] == 8
    reference = PeftModel.from_pretrained(_hf_model(tiny), str(tmp_path / "adapter")).eval()
    adapted = {n.removeprefix("base_model.model.") for n, m in reference.named_modules() if hasattr(m, "lora_A")}
    assert {n.rsplit(".", 1)[-1] for n in adapted if n.startswith("model.layers.")} == modules
    loaded = [p for n, p in reference.named_parameters() if "lora_B" in n]
    assert len(loaded) == 2 * len(modules) and all(p.abs().max() > 0 for p in loaded)  # the trained B, not peft's zeros
    plain = _hf_model(tiny)
    result = plain.load_state_dict(merged, strict=False)  # the merged export as a transformers model
    assert not result.unexpected_keys and all(k == "lm_head.weight" for k in result.missing_keys)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        theirs = reference(input_ids=ids, attention_mask=mask).logits
        mine = plain(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)
    # the megatron engine's own forward (adapters unmerged) against peft's, as the base model's test compares them
    from rlcore.plugins.hf.common import model_outputs

    with torch.no_grad():
        expected = model_outputs(reference, ids, mask, temperature=1.0).logprobs()
    torch.testing.assert_close(engine.forward_logprobs(batch), expected, atol=1e-4, rtol=0)
    peft_merged = dict(reference.merge_and_unload().named_parameters())
    assert peft_merged.keys() == merged.keys()
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, peft_merged[name], atol=1e-6, rtol=0, msg=name)


def test_lora_save_then_load_continues_the_same_run(tiny_model, tmp_path):
    from peft import PeftModel

    options = dict(model=str(tiny_model), learning_rate=1e-2, lr_scheduler_type="linear", max_steps=4, seed=0, **LORA)
    batch = _batch(seed=1)
    first = make_train_engine(**options)
    first.train_step(batch, _nll, micro_batch_size=4)
    first.save(str(tmp_path / "ckpt"))
    saved_adapters, merged = _adapters(first), _exported(first)
    expected = first.train_step(batch, _nll, micro_batch_size=4)
    model = tmp_path / "ckpt" / "model"
    assert sorted(p.name for p in model.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    state = torch.load(tmp_path / "ckpt" / "optimizer" / "rank_00000.pt", weights_only=True)
    moments = [v for s in state["inner"][0]["state"].values() for k, v in s.items() if k == "exp_avg"]
    assert len(moments) == len(saved_adapters) and sum(m.numel() for m in moments) == sum(
        t.numel() for t in saved_adapters.values())  # the optimizer state is the adapters'
    peft_merged = dict(PeftModel.from_pretrained(_hf_model(tiny_model), str(model)).merge_and_unload().named_parameters())
    assert all(torch.allclose(peft_merged[n], t, atol=1e-6, rtol=0) for n, t in merged.items())
    resumed = make_train_engine(**options)
    resumed.load(str(tmp_path / "ckpt"))
    assert resumed.global_step == 1
    loaded = _adapters(resumed)
    assert all(torch.equal(loaded[n], t) for n, t in saved_adapters.items())  # bit for bit
    got = resumed.train_step(batch, _nll, micro_batch_size=4)
    assert got["loss"] == expected["loss"] and got["grad_norm"] == expected["grad_norm"]
    assert got["learning_rate"] == expected["learning_rate"]
    assert all(torch.equal(t, _adapters(first)[n]) for n, t in _adapters(resumed).items())
    with pytest.raises(RlcoreError, match="is not a checkpoint of the megatron train engine"):
        make_train_engine(model=str(tiny_model)).load(str(tmp_path / "ckpt"))  # full weights, not an adapter
    with pytest.raises(RlcoreError, match="has rank 4; this engine's lora_rank is 8"):
        make_train_engine(**{**options, "lora_rank": 8}).load(str(tmp_path / "ckpt"))


def test_lora_target_names_are_checked_before_anything_is_built(tiny_model):
    with pytest.raises(ConfigError) as caught:
        make_train_engine(model=str(tiny_model), lora_rank=4, lora_target_modules=["qproj", "linear_fc1", "embed_tokens"])
    message = str(caught.value)
    assert "'qproj' is no linear the megatron engine adapts" in message and "Did you mean 'q_proj'?" in message
    assert "'embed_tokens' is no linear" in message and "'linear_fc1'" not in message.split("known:")[0]
    with pytest.raises(ConfigError, match="must be 'all-linear' or a non-empty list"):
        make_train_engine(model=str(tiny_model), lora_rank=4, lora_target_modules=[])
    with pytest.raises(RlcoreError, match="this megatron engine trains no LoRA adapter"):
        make_train_engine(model=str(tiny_model)).export_adapter("unused")


def test_lora_on_a_tied_output_layer_is_refused_before_the_run(tiny_model, untied):
    """lm_head (or output_layer) among the targets of a tied model: one problem in the engine's check, as the hf
    engine words it, and the build refuses before any weight; all-linear and an untied model are fine."""
    from test_hf_train import TIED_HEAD

    check = load_plugins().engines.get("megatron", kind="train").check
    expected = [("lora_target_modules", TIED_HEAD.format(tiny_model))]
    for targets in (["q_proj", "lm_head"], ["output_layer"]):
        assert check(model=str(tiny_model), lora_rank=4, lora_target_modules=targets) == expected, targets
    assert check(model=str(tiny_model), lora_rank=4) == []
    assert check(model=untied, lora_rank=4, lora_target_modules=["lm_head"]) == []
    with pytest.raises(ConfigError) as caught:
        make_train_engine(model=str(tiny_model), lora_rank=4, lora_target_modules=["lm_head"])
    assert str(caught.value) == "megatron train engine: " + TIED_HEAD.format(tiny_model)


def test_grpo_with_lora_on_the_megatron_engine(tiny_model, tmp_path):
    """Two GRPO steps with train.engine=megatron and train.lora_rank=8 through the trainer: the steps run, final/
    holds the merged model and, in final/adapter, the PEFT adapter that gives the same weights on the base; a run
    cut after one step and resumed gives the uninterrupted run's second step."""
    from peft import PeftModel

    from rlcore.plugins.grpo.config import GRPOConfig
    from rlcore.plugins.grpo.trainer import GRPOTrainer

    def run(name, **overrides):
        config = GRPOConfig(**{
            "model": str(tiny_model), "output_dir": str(tmp_path / name), "learning_rate": 1e-2,
            "max_completion_length": 8, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 2,
            "num_generations": 4, "max_steps": 2, "train": {"engine": "megatron", "lora_rank": 8}, "save_steps": 2,
            **overrides,
        })
        GRPOTrainer(config, load_plugins()).fit()
        return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    rows = run("run")
    assert [r["step"] for r in rows] == [1, 2] and all(r["grad_norm"] > 0 for r in rows)
    final = tmp_path / "run" / "final"
    merged = dict(_hf_model(final).named_parameters())
    assert json.loads((final / "adapter" / "adapter_config.json").read_text())["r"] == 8
    reference = dict(PeftModel.from_pretrained(_hf_model(tiny_model), str(final / "adapter")).merge_and_unload().named_parameters())
    assert merged.keys() == reference.keys()
    assert all(torch.allclose(merged[n], reference[n], atol=1e-6, rtol=0) for n in merged)
    base = dict(_hf_model(tiny_model).named_parameters())
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"])
    run("cut", max_steps=1, save_steps=1)
    resumed = run("cut", save_steps=1, resume="auto")
    assert resumed[-1]["step"] == 2
    for key in ("reward", "grad_norm", "loss"):
        assert resumed[-1][key] == rows[-1][key], key


# -- the output layer (lm_head) of an untied model ------------------------------------------------------------


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.getbasetemp() / "tiny-untied-lora", arch="qwen2_untied", num_layers=2,
                                seed=1))


def _grads(engine, batch) -> dict[str, torch.Tensor]:
    """The adapters' gradients of one NLL pass over `batch` through the engine's schedule (no optimizer step)."""
    engine._zero_grad()
    engine.model.train()
    engine._run([batch], lambda logits, micro: (_nll(engine._outputs(logits, micro, 1.0), micro)[0], {}),
                forward_only=False)
    engine.model.eval()
    return {n: p.grad.clone() for n, p in engine.module.named_parameters() if ".adapter." in n}


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked-head", "module-forward"])
def test_the_output_layer_adapter_gives_peft_values_and_gradients(untied, tmp_path, chunked):
    """lm_head among the targets adapts megatron's output layer (its B over the padded vocabulary, the padding rows
    untrained): after two steps, on the chunked head (the adapter's term added per chunk) and through the module's
    forward (the hook), the log-probs, top-k, full log-softmax and the factors' gradients equal peft's with the
    exported adapter on transformers' model, the merged export (padding dropped) equals peft's merge, and a checkpoint
    loads back bit for bit."""
    from peft import PeftModel

    from rlcore.plugins.hf.common import model_outputs

    engine = make_train_engine(model=untied, learning_rate=1e-2, seed=0, chunked_lm_head=chunked,
                               lora_target_modules=["q_proj", "lm_head"], **LORA)
    batch = _batch(seed=2)
    for _ in range(2):
        engine.train_step(batch, _nll, micro_batch_size=2)
    vocab = engine.spec.vocab_size
    head = engine.adapters["output_layer"]
    assert head.lora_B.shape[0] == engine.padded_vocab > vocab
    assert head.lora_B[:vocab].abs().max() > 0 and not head.lora_B[vocab:].any()
    engine.export_adapter(str(tmp_path / "adapter"))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert set(config["target_modules"]) == {"lm_head", "q_proj", "k_proj", "v_proj"}
    reference = PeftModel.from_pretrained(_hf_model(untied), str(tmp_path / "adapter"), is_trainable=True)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        expected = model_outputs(reference, ids, mask, temperature=0.7)
        torch.testing.assert_close(engine.forward_logprobs(batch, 0.7), expected.logprobs(), atol=1e-5, rtol=0)
        torch.testing.assert_close(engine.forward_topk(batch, None, 0.7), expected.full_logprobs(), atol=1e-5, rtol=0)
        top, expected_top = engine.forward_topk(batch, 5, 0.7), expected.topk(5)
    assert torch.equal(top.ids, expected_top.ids)
    torch.testing.assert_close(top.logprobs, expected_top.logprobs, atol=1e-5, rtol=0)
    mine = _grads(engine, batch)
    _nll(model_outputs(reference.train(), ids, mask), batch)[0].backward()
    theirs = {n: p.grad for n, p in reference.named_parameters() if "lm_head.lora_" in n}
    a, b = mine["output_layer.adapter.lora_A"], mine["output_layer.adapter.lora_B"]
    assert a.abs().max() > 0 and not b[vocab:].any()
    torch.testing.assert_close(a, theirs["base_model.model.lm_head.lora_A.default.weight"], atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(b[:vocab], theirs["base_model.model.lm_head.lora_B.default.weight"], atol=1e-6, rtol=1e-4)
    merged = _exported(engine)
    assert merged["lm_head.weight"].shape[0] == vocab
    peft_merged = dict(reference.merge_and_unload().named_parameters())
    assert peft_merged.keys() == merged.keys()
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, peft_merged[name], atol=1e-6, rtol=0, msg=name)
    engine.save(str(tmp_path / "ckpt"))  # the checkpoint's adapter has lm_head's V rows; the padding comes back zero
    resumed = make_train_engine(model=untied, learning_rate=1e-2, seed=1, chunked_lm_head=chunked,
                                lora_target_modules=["q_proj", "lm_head"], **LORA)
    resumed.load(str(tmp_path / "ckpt"))
    loaded, trained = _adapters(resumed), _adapters(engine)
    assert loaded.keys() == trained.keys() and all(torch.equal(loaded[n], t) for n, t in trained.items())


def test_grpo_with_lm_head_lora_on_the_megatron_engine_runs_like_the_hf_engine(untied, tmp_path, monkeypatch):
    """Three GRPO steps with LoRA on o_proj, down_proj and lm_head of the untied model, same seed, on the megatron
    engine and on the hf engine (peft), both starting from the same adapter (megatron's initial A, exported in peft's
    names and loaded into the hf engine's peft model; peft draws its own otherwise): the rewards of every step are
    the same, so each step's synced weights (the merged output layer among them) were; grad norms agree to 1e-4."""
    from peft import set_peft_model_state_dict

    from rlcore.plugins.grpo.config import GRPOConfig
    from rlcore.plugins.grpo.trainer import GRPOTrainer
    from rlcore.plugins.hf.train import HFTrainEngine
    from rlcore.plugins.megatron.engine import MegatronTrainEngine

    initial: dict[str, torch.Tensor] = {}
    megatron_init, hf_init = MegatronTrainEngine.__init__, HFTrainEngine.__init__

    def megatron_start(self, *args, **keys):
        megatron_init(self, *args, **keys)
        initial.update(self.adapter_tensors())

    def hf_start(self, *args, **keys):
        hf_init(self, *args, **keys)
        result = set_peft_model_state_dict(self.model, initial)
        assert not result.unexpected_keys

    monkeypatch.setattr(MegatronTrainEngine, "__init__", megatron_start)
    monkeypatch.setattr(HFTrainEngine, "__init__", hf_start)

    def run(engine):
        config = GRPOConfig(**{
            "model": untied, "output_dir": str(tmp_path / engine), "learning_rate": 1e-2, "max_completion_length": 8,
            "per_device_train_batch_size": 8, "gradient_accumulation_steps": 2, "num_generations": 4, "max_steps": 3,
            "save_steps": 0, "train": {"engine": engine, "lora_rank": 8, "lora_alpha": 16,
                                       "lora_target_modules": ["o_proj", "down_proj", "lm_head"]},
        })
        GRPOTrainer(config, load_plugins()).fit()
        return [json.loads(line) for line in (tmp_path / engine / "metrics.jsonl").read_text().splitlines()]

    rows = {engine: run(engine) for engine in ("megatron", "hf")}
    assert "base_model.model.lm_head.lora_A.weight" in initial
    assert [r["step"] for r in rows["megatron"]] == [1, 2, 3]
    for mine, theirs in zip(rows["megatron"], rows["hf"], strict=True):
        assert mine["reward"] == theirs["reward"]
        assert mine["completions/mean_length"] == theirs["completions/mean_length"]
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-4)
    assert len({r["reward"] for r in rows["megatron"]}) > 1  # the rollouts moved: the synced adapters did


# -- tensor parallelism on the CPU: two processes over gloo ---------------------------------------------------

TP_WORKER = r'''
import sys

import torch

torch.distributed.init_process_group("gloo")
rank, tp = torch.distributed.get_rank(), torch.distributed.get_world_size()
from megatron.core import parallel_state as ps
ps.initialize_model_parallel(tensor_model_parallel_size=tp)
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.transformer_config import TransformerConfig
from rlcore.plugins.megatron import lora
from rlcore.plugins.megatron.cpu_shim import cpu_current_device, use_cpu_rng_tracker
from rlcore.plugins.megatron.mapping import merge_tp
use_cpu_rng_tracker()
torch.set_default_dtype(torch.float64)  # float64: the parallel and whole sums agree to 1e-10, not float32 rounding
H, F, V, r, s = 16, 24, 10, 4, 2.0
g = torch.Generator().manual_seed(0)
W1, W2, W3 = torch.randn(F, H, generator=g), torch.randn(H, F, generator=g), torch.randn(V, H, generator=g)
A1, B1, A2, B2, A3, B3 = (torch.randn(*shape, generator=g) for shape in ((r, H), (F, r), (r, F), (H, r), (r, H), (V, r)))
x, out_grad = torch.randn(3, 5, H, generator=g), torch.randn(3, 5, V, generator=g)
cfg = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=2, use_cpu_initialization=True,
                        perform_initialization=False, tensor_model_parallel_size=tp, gradient_accumulation_fusion=False,
                        params_dtype=torch.float64)
model = torch.nn.Module()
model.linear_qkv = ColumnParallelLinear(H, F, config=cfg, init_method=torch.nn.init.zeros_, bias=False, gather_output=False)
model.linear_proj = RowParallelLinear(F, H, config=cfg, init_method=torch.nn.init.zeros_, bias=False, input_is_parallel=True, skip_bias_add=True)
model.output_layer = ColumnParallelLinear(H, V, config=cfg, init_method=torch.nn.init.zeros_, bias=False, gather_output=False)
adapters = lora.add_adapters(model, rank=r, alpha=s * r, dropout=0.0, targets=["q_proj", "o_proj", "lm_head"], seed=0)
assert set(adapters) == {"linear_qkv", "linear_proj", "output_layer"}
shard = lambda full, name, local: lora.local_shard(full, name, local, tp, rank, merge_tp)
with torch.no_grad():
    model.linear_qkv.weight.copy_(shard(W1, "linear_qkv.weight", model.linear_qkv.weight.shape))
    model.linear_proj.weight.copy_(shard(W2, "linear_proj.weight", model.linear_proj.weight.shape))
    model.output_layer.weight.copy_(shard(W3, "output_layer.weight", model.output_layer.weight.shape))
    q, p, o = adapters["linear_qkv"], adapters["linear_proj"], adapters["output_layer"]
    q.lora_A.copy_(A1); q.lora_B.copy_(shard(B1, "linear_qkv.weight", q.lora_B.shape))
    p.lora_A.copy_(shard(A2, "linear_proj.weight", p.lora_A.shape)); p.lora_B.copy_(B2)
    o.lora_A.copy_(A3); o.lora_B.copy_(shard(B3, "output_layer.weight", o.lora_B.shape))
# the reference: the whole layers, no parallelism
ref = [t.clone().requires_grad_() for t in (A1, B1, A2, B2, A3, B3, x)]
a1, b1, a2, b2, a3, b3, xr = ref
y_ref = (xr @ (W1 + s * b1 @ a1).T) @ (W2 + s * b2 @ a2).T
z_ref = y_ref @ (W3 + s * b3 @ a3).T
(z_ref * out_grad).sum().backward()
xt = x.clone().requires_grad_()
columns = slice(rank * V // tp, (rank + 1) * V // tp)  # this rank's vocabulary columns of the output layer
with cpu_current_device():
    y = model.linear_proj(model.linear_qkv(xt)[0])[0]
    z = model.output_layer(y)[0]
    (z * out_grad[..., columns]).sum().backward()
def close(a, b):
    return torch.allclose(a, b, atol=1e-10, rtol=1e-10)
checks = {
    "output": close(y, y_ref) and close(z, z_ref[..., columns]),
    "input grad": close(xt.grad, xr.grad),
    "qkv A grad (replicated)": close(q.lora_A.grad, a1.grad),
    "qkv B grad (row shard)": close(q.lora_B.grad, shard(b1.grad, "linear_qkv.weight", q.lora_B.shape)),
    "proj A grad (column shard)": close(p.lora_A.grad, shard(a2.grad, "linear_proj.weight", p.lora_A.shape)),
    "proj B grad (replicated)": close(p.lora_B.grad, b2.grad),
    "output layer A grad (replicated)": close(o.lora_A.grad, a3.grad),
    "output layer B grad (row shard)": close(o.lora_B.grad, shard(b3.grad, "output_layer.weight", o.lora_B.shape)),
    "merged output layer shard": close(o.merged(model.output_layer.weight), shard(W3 + s * B3 @ A3, "output_layer.weight", model.output_layer.weight.shape)),
    "merged qkv shard": close(q.merged(model.linear_qkv.weight), shard(W1 + s * B1 @ A1, "linear_qkv.weight", model.linear_qkv.weight.shape)),
    "merged proj shard": close(p.merged(model.linear_proj.weight), shard(W2 + s * B2 @ A2, "linear_proj.weight", model.linear_proj.weight.shape)),
    "base frozen": not any(m.weight.requires_grad or m.weight.grad is not None for m in (model.linear_qkv, model.linear_proj, model.output_layer)),
    "split attributes": q.lora_B.tensor_model_parallel and p.lora_A.tensor_model_parallel and not getattr(q.lora_A, "tensor_model_parallel", False),
}
# gate/up: a linear_fc1 shard per rank is [gate part; up part]; local_shard inverts merge_tp bit for bit
full = torch.randn(2 * F, r, generator=g)
parts = [lora.local_shard(full, "linear_fc1.weight", (2 * F // tp, r), tp, k, merge_tp) for k in range(tp)]
checks["fc1 shard round trip"] = torch.equal(merge_tp("linear_fc1.weight", parts), full)
checks["fc1 shard is gate and up"] = torch.equal(parts[rank], torch.cat([full[:F].chunk(tp)[rank], full[F:].chunk(tp)[rank]]))
failed = [k for k, ok in checks.items() if not ok]
print(f"rank {rank}: {'ok' if not failed else 'FAILED ' + ', '.join(failed)}")
sys.exit(1 if failed else 0)
'''


def test_adapters_split_over_two_tensor_ranks_give_the_whole_layers_values_and_gradients(tmp_path):
    """megatron's ColumnParallelLinear (as linear_qkv), RowParallelLinear (as linear_proj) and ColumnParallelLinear (as
    the output layer, lm_head) at tensor size 2, in two processes over gloo, against the same layers whole in plain
    torch (float64): outputs, the input's gradient, each factor's gradient (A of the column layers and B of the row
    layer whole and equal on both ranks, the others this rank's shard), the merged shards; and `local_shard`
    inverting `merge_tp` for gate/up."""
    import os
    import socket
    import subprocess
    import sys

    worker = tmp_path / "worker.py"
    worker.write_text(TP_WORKER)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, str(worker)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                       MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES=""))
             for rank in range(2)]
    outputs = [proc.communicate(timeout=600)[0] for proc in procs]
    for rank, (proc, out) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0 and f"rank {rank}: ok" in out, out[-3000:]


# -- the other architectures: Qwen3 (q/k norm), Qwen3-MoE (the experts' linears), Qwen3.5 (the gated delta-net's) --

ATTENTION = {f"self_attn.{x}_proj" for x in "qkvo"}
MLP = {f"mlp.{x}_proj" for x in ("gate", "up", "down")}


EXPERTS = {f"mlp.experts.{e}.{x}_proj" for e in range(4) for x in ("gate", "up", "down")}
DELTA_NET = {f"linear_attn.{x}" for x in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")}


@pytest.mark.parametrize("arch,modules,in_peft", [
    ("qwen3", ATTENTION | MLP, True),
    ("mistral", ATTENTION | MLP, True),
    ("gemma3", ATTENTION | MLP, True),
    ("qwen3_moe", ATTENTION | EXPERTS, True),
    ("qwen3_5", ATTENTION | MLP | DELTA_NET, True),
    # peft 0.21 puts no per-expert adapter on transformers' fused Qwen3.5-MoE experts (it does for Qwen3-MoE's):
    # there the merged export alone is checked against the engine
    ("qwen3_5_moe", ATTENTION | DELTA_NET | EXPERTS | {f"mlp.shared_expert.{x}_proj" for x in ("gate", "up", "down")},
     False),
])
def test_every_architectures_adapter_loads_in_peft_as_the_merged_export(arch, modules, in_peft, tmp_path):
    """all-linear LoRA trained two steps: the merged export loaded by transformers gives the megatron engine's
    log-probs (1e-4), and peft with the exported adapter on the transformers model its logits (1e-5). For Qwen3-MoE
    the adapter holds each expert's projections, which peft puts on transformers' fused experts; for Qwen3.5 the
    gated delta-net's projections beside the full-attention layers' q/k/v/o. The checkpoint loads back bitwise."""
    from peft import PeftModel

    from rlcore.export import write_hf_model
    from rlcore.plugins.hf.common import model_outputs

    model = str(build_tiny_model(tmp_path / arch, arch=arch))
    engine = make_train_engine(model=model, learning_rate=1e-2, seed=0, **LORA)
    batch = _batch(seed=3)
    for _ in range(2):
        engine.train_step(batch, _nll, micro_batch_size=2)
    engine.export_adapter(str(tmp_path / "adapter"))
    write_hf_model(tmp_path / "merged", engine.export_weights(), model)
    adapted = {key.split(".layers.")[1].split(".", 1)[1].split(".lora_")[0] for key in engine.adapter_tensors()}
    assert adapted == modules  # the projections of every layer kind, named as transformers names them
    merged = _hf_model(tmp_path / "merged")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        base = _hf_model(model)(input_ids=ids, attention_mask=mask).logits
        mine = merged(input_ids=ids, attention_mask=mask).logits
        expected = model_outputs(merged, ids, mask, temperature=1.0).logprobs()
    assert (mine - base).abs().max() > 1e-3  # the adapters moved the model
    torch.testing.assert_close(engine.forward_logprobs(batch), expected, atol=1e-4, rtol=0)
    if in_peft:
        reference = PeftModel.from_pretrained(_hf_model(model), str(tmp_path / "adapter")).eval()
        with torch.no_grad():
            theirs = reference(input_ids=ids, attention_mask=mask).logits
        real = mask.bool()
        torch.testing.assert_close(mine[real], theirs[real], atol=1e-5, rtol=0)
    engine.save(str(tmp_path / "ckpt"))  # through Hugging Face names and back: every adapter bit for bit
    resumed = make_train_engine(model=model, learning_rate=1e-2, seed=1, **LORA)
    resumed.load(str(tmp_path / "ckpt"))
    loaded, trained = _adapters(resumed), _adapters(engine)
    assert loaded.keys() == trained.keys() and all(torch.equal(loaded[n], t) for n, t in trained.items())
