"""The memory plan: the engines' terms against hand-computed cases (Qwen2.5-0.5B's shape), how they scale, the plan's
table for the shipped examples, and a plan that will not fit refused with its fixes, or fitted (`--fit`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from rlcore import EngineSpec
from rlcore.cli import main
from rlcore.manager import plugins as loaded_plugins
from rlcore.memory import GiB, MemoryQuery, ModelShape, RoleUse, plan_memory
from rlcore.runtime.resources import plan_from_config

from rlcore.plugins.hf.memory import forward_memory, head_working_set, train_memory
from rlcore.plugins.megatron.memory import train_memory as megatron_memory
from rlcore.plugins.vllm.memory import vllm_memory

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "ray"
# Qwen2.5-0.5B-Instruct's config.json (the keys the plan reads)
QWEN_05B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
            "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2, "vocab_size": 151936,
            "max_position_embeddings": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16"}
QWEN_15B = {**QWEN_05B, "hidden_size": 1536, "intermediate_size": 8960, "num_attention_heads": 12, "num_hidden_layers": 28}
P_05B = 494_032_768  # Qwen2.5-0.5B's parameter count (its model card: 0.49B)
# LoRA rank 16 on q, k, v, o, gate, up, down of 24 layers: r x (in + out) each
LORA_05B = 24 * 16 * ((896 + 896) + 2 * (896 + 128) + (896 + 896) + 2 * (896 + 4864) + (4864 + 896))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """Model directories holding only config.json: nothing else is read."""
    out = {}
    prm = {**QWEN_05B, "architectures": ["Qwen2ForProcessRewardModel"], "tie_word_embeddings": False}
    for name, config in (("q05", QWEN_05B), ("q15", QWEN_15B), ("prm", prm)):
        path = tmp_path_factory.mktemp(name)
        (path / "config.json").write_text(json.dumps(config))
        out[name] = str(path)
    return out


def query(use: RoleUse, *, workers: int = 1, colocated: bool = False, gpu: int = 80 * GiB, **session) -> MemoryQuery:
    return MemoryQuery("train", use, ModelShape.from_config(QWEN_05B), gpu, workers, colocated, **session)


def train_use(micro: int = 4, length: int = 1024, **options) -> RoleUse:
    return RoleUse("hf", "train", {"model": "m", "dtype": "bfloat16", **options}, "training", "m", micro, 1, length)


def test_the_shape_counts_qwen_05b_parameters():
    shape = ModelShape.from_config(QWEN_05B)
    assert shape.params == P_05B
    assert shape.lora_params(16) == LORA_05B
    assert shape.kv_bytes_per_token(2) == 2 * 24 * 2 * 64 * 2  # K and V, 24 layers, 2 KV heads of 64, bf16


def test_lora_counts_the_modules_lora_target_modules_names():
    shape, r = ModelShape.from_config(QWEN_05B), 16
    assert shape.lora_params(r, "all-linear") == shape.lora_params(r, ["all-linear"]) == LORA_05B
    assert shape.lora_params(r, ["q_proj", "v_proj"]) == 24 * r * ((896 + 896) + (896 + 128))
    # megatron's fused linears hold the projections: linear_qkv is q, k and v; linear_fc1 is gate and up
    assert shape.lora_params(r, ["linear_qkv"]) == shape.lora_params(r, ["q_proj", "k_proj", "v_proj"])
    assert shape.lora_params(r, ["linear_fc1", "linear_fc2"]) == shape.lora_params(r, ["gate_proj", "up_proj", "down_proj"])
    untied = ModelShape.from_config({**QWEN_05B, "tie_word_embeddings": False})
    head = r * (896 + 151936)  # A: hidden -> r, B: r -> vocab
    assert untied.lora_params(r, ["all-linear", "lm_head"]) == untied.lora_params(r, ["model.lm_head", "all-linear"]) \
        == LORA_05B + head
    assert untied.lora_params(r, ["output_layer"]) == head
    # a pattern, or a name this shape does not count: every linear and the untied head, an upper bound
    assert untied.lora_params(r, ".*proj") == untied.lora_params(r, ["in_proj_qkv"]) == LORA_05B + head
    assert shape.lora_params(r, ".*proj") == LORA_05B  # a tied head takes no adapter (refused before a run)


def test_an_adapter_on_the_lm_head_is_sized_on_both_train_engines():
    untied = {**QWEN_05B, "tie_word_embeddings": False}
    head = 16 * (896 + 151936)
    for memory in (train_memory, megatron_memory):
        def state(targets):
            use = train_use(lora_rank=16, lora_target_modules=targets)
            q = MemoryQuery("train", use, ModelShape.from_config(untied), 80 * GiB, 1, False)
            return memory(q).active["optimizer state"]
        assert state(["all-linear", "lm_head"]) - state("all-linear") == 8 * head  # two float32 moments


def test_hf_full_training_of_05b_by_hand():
    got = train_memory(query(train_use(chunked_lm_head=False)))
    a = got.active  # the peak is backward's: weights, last step's moments, what the forward kept, the logits
    assert a["weights"] == 2 * P_05B and a["optimizer state"] == 4 * P_05B  # bf16 weights, AdamW's moments in bf16
    assert "gradients" not in a  # dropped after every step; a layer's arrive as its saved tensors go
    norm = 4 * 896 + 4 + 2 * 896 * 2  # float32 input and rsqrt, bf16 normalized states and output
    per_layer = 2 * norm + (2 * 896 + 2 * 128 + 4 * 4864) * 2 + 4 * 14  # norms, q/k/v/out, SwiGLU, logsumexp
    final_norm = 4 * 896 + 4 + 896 * 2  # its output is not kept: the head takes a copy of its rows (896 * 2)
    assert a["activations"] == 4 * 1024 * (24 * per_layer + final_norm + 896 * 2)
    assert a["logits"] == 4 * 1024 * 151936 * 10  # bf16 logits, each row's float32 copy, the logits' gradient
    assert a["cublas workspaces"] == 2 * 32 * 2**20  # the forward's thread and autograd's
    assert "ddp buckets" not in a  # one worker: no DDP
    # while a colocated role works: gradients are dropped, weights and optimizer state stay unless offloaded
    assert set(got.resident) == {"cuda context", "weights", "optimizer state"}


def test_hf_gradient_checkpointing_peaks_at_the_optimizer_step():
    a = train_memory(query(train_use(gradient_checkpointing=True))).active
    # weights, gradients, both moments and foreach AdamW's temporary of the second moment: five bf16 copies
    assert {k: a[k] for k in ("weights", "gradients", "optimizer state", "optimizer step")} == {
        "weights": 2 * P_05B, "gradients": 2 * P_05B, "optimizer state": 4 * P_05B, "optimizer step": 2 * P_05B}
    assert "activations" not in a


def test_hf_lora_removes_the_base_weights_optimizer_state_and_gradients():
    full = train_memory(query(train_use())).active
    lora = train_memory(query(train_use(lora_rank=16))).active
    assert lora["optimizer state"] == 8 * LORA_05B  # float32 adapters: two float32 moments
    assert lora["weights"] == 2 * P_05B + 4 * LORA_05B  # the frozen base and the float32 adapters
    assert full["optimizer state"] == 4 * P_05B  # the base's, gone with LoRA
    # the adapters keep float32 copies of their inputs: more activations than full training's
    assert lora["activations"] > 1.3 * full["activations"]
    both = train_memory(query(train_use(lora_rank=16, gradient_checkpointing=True))).active
    assert both["layer backward"] > both["activations"]  # one layer recomputed outweighs every layer's input


def test_offload_keeps_nothing_of_the_train_engine_but_its_context():
    both = train_memory(query(train_use(), colocated=True, offload_model=True, offload_optimizer=True)).resident
    assert set(both) == {"cuda context"}
    weights_only = train_memory(query(train_use(), colocated=True, offload_optimizer=True)).resident
    assert weights_only["weights"] == 2 * P_05B and "optimizer state" not in weights_only


def test_terms_scale_with_the_workload():
    one, two = (train_memory(query(train_use(micro=m))).active for m in (4, 8))
    assert two["activations"] == 2 * one["activations"]
    assert two["weights"] == one["weights"] and two["optimizer state"] == one["optimizer state"]
    longer = train_memory(query(train_use(length=2048))).active
    assert longer["activations"] == 2 * one["activations"]
    unchunked = train_memory(query(train_use(chunked_lm_head=False))).active
    assert one["logits"] < unchunked["logits"] / 4  # tiles of the head, not [B, T, V]


def test_the_chunked_head_s_working_set_is_trl_s_tile_or_rlcore_s_chunks():
    shape = ModelShape.from_config(QWEN_05B)
    tokens, V, h = 4 * 1024, 151936, 896
    trl = head_working_set(shape, 2, tokens, 4, chunked=True, trl=True, trainable=True)
    assert trl == 4096 * 32768 * 2 + tokens * h * 6 + V * h * 6  # a bf16 tile; float32 gradients and their casts
    torch_chunks = head_working_set(shape, 2, tokens, 4, chunked=True, trl=False, trainable=False)
    assert torch_chunks == 1024 * V * 16 + tokens * h * 4  # float32 logits and logsumexp backward's three temporaries


def test_megatron_keeps_fp32_master_weights_and_moments_split_over_data_parallel_ranks():
    use = RoleUse("megatron", "train", {"model": "m", "dtype": "bfloat16"}, "training", "m", 1, 1, 512)
    one = megatron_memory(query(use)).active
    assert one["master weights"] == 4 * P_05B and one["optimizer state"] == 8 * P_05B and one["gradients"] == 4 * P_05B
    four = megatron_memory(query(use, workers=4)).active  # the distributed optimizer over 4 data-parallel ranks
    assert four["optimizer state"] == 8 * P_05B // 4 and four["master weights"] == 4 * P_05B // 4
    tp2 = RoleUse("megatron", "train", {**use.options, "tensor_model_parallel_size": 2}, "training", "m", 1, 1, 512)
    assert megatron_memory(query(tp2, workers=2)).active["weights"] == 2 * P_05B // 2


def test_vllm_takes_its_share_awake_and_frees_it_asleep():
    use = RoleUse("vllm", "rollout", {"model": "m", "dtype": "bfloat16", "vllm_gpu_memory_utilization": 0.4},
                  "generation", "m", seq_len=1024, sequences=64)
    got = vllm_memory(query(use, colocated=True, sleep_level=1))
    assert sum(got.active.values()) == int(0.4 * 80 * GiB)
    assert got.active["vllm weights"] == 2 * P_05B
    assert sum(got.resident.values()) < GiB  # weights and KV cache off the GPU
    assert got.sync["vllm weights"] == 2 * P_05B  # a weight sync wakes the weights only
    awake = vllm_memory(query(use, colocated=True, sleep_level=0))
    assert awake.resident == awake.active
    shares = [f.options["vllm_gpu_memory_utilization"] for f in got.fixes]
    assert shares == sorted(shares, reverse=True) and shares[0] == 0.35 and shares[-1] >= 0.05


def test_vllm_s_lowest_share_holds_the_kv_cache_of_the_sequences_it_runs_at_once():
    """The shares proposed stop where the KV cache of the sequences in flight no longer fits, counting at most vLLM's
    max_num_seqs of them (its default 1024 on an H100/H200-sized GPU, 256 below; or vllm_engine_kwargs')."""
    def lowest(sequences, gpu=80 * GiB, **options):
        use = RoleUse("vllm", "rollout", {"model": "m", "dtype": "bfloat16", "vllm_gpu_memory_utilization": 0.9,
                                          **options}, "generation", "m", seq_len=2048, sequences=sequences)
        return vllm_memory(query(use, gpu=gpu)).fixes[-1].options["vllm_gpu_memory_utilization"]

    per_token = 2 * 24 * 2 * 64 * 2  # K and V, 24 layers, 2 KV heads of 64, bf16
    floor = (2 * P_05B + 1024 * 2048 * per_token + GiB // 2) / (80 * GiB)
    assert lowest(4096) == lowest(1024) == round(0.05 * -(-floor // 0.05), 2) > lowest(512)  # 1024 run at once
    assert lowest(4096, vllm_engine_kwargs={"max_num_seqs": 64}) == lowest(64)
    assert lowest(4096, gpu=40 * GiB) == lowest(256, gpu=40 * GiB)  # a smaller GPU: vLLM's default is 256


def test_a_change_that_lowers_no_gpu_is_not_proposed(models, capsys):
    """Sampling on one GPU, vLLM awake beside the PRM: the offloads lower nothing (no train engine), so they are
    never proposed, not even as the closest; the PRM's batch_size and vLLM's share are."""
    args = ["plan", "--plugin", "sample", "--config", str(EXAMPLES / "sample/sampling.yaml"), f"model={models['q05']}",
            "dataset=tiny:toy", "prm.batch_size=64",
            "device_groups={nproc_per_node: 1, one: {device: GPU, ranks: [0], workers: [sampler, prm, orm]}}"]
    # vLLM takes 0.95 of the GPU and holds its share (its floor: 1024 sequences of 16896 tokens); a 1.5B PRM beside
    assert main([*args, f"prm_model={models['q15']}", "max_prompt_length=16384",
                 "sampler.vllm_gpu_memory_utilization=0.95"]) == 2
    err = capsys.readouterr().err
    assert "GPU 0 in scoring needs" in err and "no change rlcore knows of fits" in err and "offload" not in err
    assert "Closest: prm.batch_size=32 -> " in err  # halving the candidates per forward, cost 1
    assert main([*args, f"prm_model={models['prm']}"]) == 2
    err = capsys.readouterr().err
    proposed = [line.split()[0] for line in err.splitlines() if "-> peak" in line]
    assert proposed and "offload" not in err
    assert all(p.startswith(("sampler.vllm_gpu_memory_utilization=", "prm.batch_size=")) for p in proposed)


def test_a_forward_only_reference_keeps_its_weights():
    use = RoleUse("hf", "forward", {"model": "m", "dtype": "bfloat16"}, "training", "m", seq_len=1024)
    got = forward_memory(query(use))
    assert got.resident["weights"] == got.active["weights"] == 2 * P_05B


def test_the_gpu_s_memory_is_the_key_then_this_machine_s_then_80_gib(monkeypatch):
    from types import SimpleNamespace

    from rlcore.memory import gpu_memory

    assert gpu_memory(SimpleNamespace(gpu_memory_gib=140)) == (140 * GiB, "gpu_memory_gib")
    monkeypatch.setenv("PATH", "")  # no nvidia-smi: a CPU-only machine plans for 80 GiB GPUs
    assert gpu_memory(SimpleNamespace(gpu_memory_gib=None))[0] == 80 * GiB


def test_an_engine_that_gives_no_terms_is_unknown_never_zero(models):
    class Plugins:
        engines = [EngineSpec("mine", kind="train", factory=dict)]

    from rlcore.plugins.grpo.config import GRPOConfig

    config = GRPOConfig(model=models["q05"], train={"gpus": 1, "engine": "mine"}, rollout={"gpus": 1},
                        colocate_groups=[["train", "rollout"]])
    resources = plan_from_config(config, roles=["train", "rollout"], plugins=loaded_plugins())
    uses = {"train": train_use(), "rollout": RoleUse("mine", "rollout", {}, "generation", models["q05"])}
    plan = plan_memory(config, resources, {"train": RoleUse("mine", "train", {}, "training", models["q05"]),
                                           "rollout": uses["rollout"]}, Plugins(), gpu_bytes=80 * GiB)
    assert plan.rows and all(row.unknown == ["rollout", "train"] for row in plan.rows)
    assert "unknown (rollout, train)" in plan.table() and "reports no memory terms" in plan.table()


def test_a_role_on_a_gpu_whose_use_is_not_described_is_unknown_and_the_plan_says_why(models):
    """A role the algorithm gives no use of (a plugin's algorithm that describes only some roles) on the policy's GPU
    is unknown there: never a false "ok"."""
    from rlcore.plugins.grpo.config import GRPOConfig

    config = GRPOConfig(model=models["q05"], reward_funcs=["orm"], orm={"model": models["q05"], "gpus": 4},
                        train={"gpus": 4}, rollout={"gpus": 4},
                        colocate_groups=[["train", "rollout", "orm"]])
    resources = plan_from_config(config, roles=["train", "rollout", "orm"], plugins=loaded_plugins())
    uses = {"train": RoleUse("hf", "train", {"dtype": "bfloat16"}, "training", models["q05"], 4, 1, 1024),
            "rollout": RoleUse("vllm", "rollout", {"dtype": "bfloat16"}, "generation", models["q05"])}
    plan = plan_memory(config, resources, uses, loaded_plugins(), gpu_bytes=80 * GiB)
    assert plan.rows and all(row.unknown == ["orm"] for row in plan.rows) and not plan.known
    assert plan.unknown_reason() == ("the memory plan cannot size orm, so it cannot say whether the run fits: orm: the "
                                     "algorithm describes no memory use of it")


def test_grpo_s_reward_model_is_planned_beside_the_policy(models, capsys):
    """GRPO's `orm` on the policy's GPUs: its weights (no LM head: a score head) and one layer's working set over
    `orm.batch_size` candidates, added to the training phase as the reference's are."""
    args = ["plan", "--plugin", "grpo", "--config", str(EXAMPLES / "grpo/colocate.yaml"), f"model={models['q05']}",
            "reward_funcs=[orm]", f"orm.model={models['q05']}", "orm.gpus=4", "orm.batch_size=8",
            "colocate_groups=[[train, rollout, orm]]", "--json"]
    assert main(args) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] and plan["known"]
    training = next(r for r in plan["rows"] if r["phase"] == "training")
    orm = {t["component"]: t["bytes"] for t in training["terms"] if t["role"] == "orm"}
    assert orm["weights"] == 2 * (P_05B + 896 * 896)  # tied: the embedding stays; a hidden x hidden score head
    tokens = 8 * (512 + 1024)  # orm.batch_size candidates of max_prompt_length + max_completion_length
    assert orm["activations"] == tokens * 2 * ((4 * 896 + 3 * 896 + 3 * 128 + 4 * 4864) + 896)
    generation = next(r for r in plan["rows"] if r["phase"] == "generation")
    assert {t["component"] for t in generation["terms"] if t["role"] == "orm"} == {"cuda context", "weights"}


def test_a_hub_model_that_is_not_cached_is_no_ok_but_a_failure_with_the_fix(tmp_path, monkeypatch, capsys):
    """Issue 52: `peak 0.0 GiB + unknown ... [ok]` and exit 0 for a hub id whose config.json is not here."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = ["plan", "--plugin", "grpo", "--config", str(EXAMPLES / "grpo/colocate.yaml"), "model=org/not-cached"]
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert "[ok]" not in out and "[UNKNOWN]" in out
    assert "cannot size rollout, train" in err and "org/not-cached's config.json cannot be read here" in err
    assert "`hf download NAME config.json`" in err


@pytest.mark.parametrize("plugin, example", [
    ("grpo", "grpo/colocate.yaml"), ("grpo", "grpo/colocate_device_groups.yaml"), ("grpo", "grpo/separate.yaml"),
    ("grpo", "grpo/separate_device_groups.yaml"), ("gkd", "gkd/teacher_colocated.yaml"),
    ("gkd", "gkd/teacher_standalone.yaml"), ("gkd", "gkd/teacher_shared.yaml"), ("sft", "sft/lora.yaml"),
])
def test_the_plan_of_each_shipped_example(plugin, example, models, capsys):
    teacher = {"gkd/teacher_colocated.yaml": [f"teacher_model={models['q15']}"]}.get(
        example, [f"teacher.model={models['q15']}"] if plugin == "gkd" else [])
    code = main(["plan", "--plugin", plugin, "--config", str(EXAMPLES / example), f"model={models['q05']}", *teacher,
                 "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    plan = json.loads(out)
    assert plan["fits"] and plan["gpu_bytes"] == 80 * GiB  # no GPU here: the documented default
    phases = {row["phase"] for row in plan["rows"]}
    assert "training" in phases
    train = next(r for r in plan["rows"]
                 if r["phase"] == "training" and any(t["role"] in ("train", "default") for t in r["terms"]))
    weights = next(t["bytes"] for t in train["terms"] if t["component"] == "weights")
    assert weights == 2 * P_05B + (4 * LORA_05B if example == "sft/lora.yaml" else 0)
    if "colocate" in example:  # vLLM sleeps while the policy trains; its share is taken while it generates
        generation = next(r for r in plan["rows"] if r["phase"] == "generation")
        assert {t["role"] for t in generation["terms"]} >= {"train", "rollout"}
        assert sum(t["bytes"] for t in generation["terms"] if t["role"] == "rollout") == int(0.4 * 80 * GiB)


def test_the_sampling_example_plans_its_sampler_and_its_reward_models(models, capsys):
    """examples/ray/sample/sampling.yaml: vLLM generates on GPUs 0-1 (awake throughout: nothing trains); the PRM
    scores on 2-3 beside the ORM, here the `accuracy` function (nothing on the GPU), then a reward model."""
    args = ["plan", "--plugin", "sample", "--config", str(EXAMPLES / "sample/sampling.yaml"), f"model={models['q05']}",
            f"prm_model={models['prm']}", "dataset=tiny:toy", "--json"]
    assert main(args) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] and plan["known"]
    rows = {(tuple(r["gpus"]), r["phase"]): {(t["role"], t["component"]): t["bytes"] for t in r["terms"]}
            for r in plan["rows"]}
    assert set(rows) == {((0, 1), "generation"), ((2, 3), "scoring")}
    assert sum(rows[(0, 1), "generation"].values()) == int(0.9 * 80 * GiB)  # sampler.vllm_gpu_memory_utilization
    prm = rows[(2, 3), "scoring"]
    assert {role for role, _ in prm} == {"prm"}  # the accuracy function takes nothing
    assert prm["prm", "weights"] == 2 * (P_05B + 896 * 896)  # untied: the LM head is left out, a score head added
    tokens = 16 * (2048 + 512)  # prm.batch_size candidates of max_prompt_length + max_new_tokens
    assert prm["prm", "activations"] == tokens * 2 * ((4 * 896 + 3 * 896 + 3 * 128 + 4 * 4864) + 896)
    assert main([*args[:-1], f"orm_model={models['prm']}", "--json"]) == 0  # a reward model as the ORM: sized too
    both = json.loads(capsys.readouterr().out)
    scoring = next(r for r in both["rows"] if r["phase"] == "scoring")
    assert {t["role"] for t in scoring["terms"]} == {"prm", "orm"}


def test_the_sampler_holds_one_prompt_s_candidates_with_seed_per_prompt(models):
    """seed_per_prompt (the default) calls the engine once per prompt: its N candidates are what is in flight; without
    it, the batch's prompts on each sampler GPU at once."""
    from rlcore.plugins.sampling.config import SampleConfig
    from rlcore.plugins.sampling.trainer import SampleTrainer

    def sequences(**keys):
        config = SampleConfig(model=models["q05"], batch_size=64, num_return_sequences=8, **keys)
        return SampleTrainer.memory_use(config)["sampler"].sequences

    assert sequences() == 8
    assert sequences(seed_per_prompt=False) == 64 * 8
    assert sequences(seed_per_prompt=False, sampler={"gpus": 3}) == 22 * 8  # rows split whole: 22, 21, 21


def test_a_plan_that_will_not_fit_is_refused_with_the_changes_that_fit(models, capsys):
    args = ["plan", "--plugin", "grpo", "--config", str(EXAMPLES / "grpo/colocate.yaml"), f"model={models['q05']}",
            "per_device_train_batch_size=64", "max_completion_length=4096"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "GPU 0-3 in training needs" in err and "largest part is train activations" in err
    lines = [line.strip() for line in err.splitlines() if "-> peak" in line]
    assert lines[0].startswith("train.gradient_checkpointing=true")  # the cheapest that fits comes first
    assert any(line.startswith("per_device_train_batch_size=8 gradient_accumulation_steps=8") for line in lines)


def test_sft_plans_transformers_trainer_s_fused_adamw_and_cross_entropy(models, capsys):
    """SFT's workers step the Trainer's default AdamW (fused from torch 2.8: no temporary of the state) and take
    transformers' cross-entropy over the logits (d + 8 bytes a logit), not the hf engine's row-by-row normaliser."""
    args = ["plan", "--plugin", "sft", "--config", str(EXAMPLES / "sft/pretrain.yaml"), f"model={models['q05']}",
            "max_length=1024", "per_device_train_batch_size=1", "gpu_memory_gib=140", "--json"]
    assert main(args) == 0
    terms = {t["component"]: t["bytes"] for t in json.loads(capsys.readouterr().out)["rows"][0]["terms"]}
    assert terms["logits"] == 1024 * 151936 * (2 + 8)
    assert main([*args[:-1], "max_length=256", "gradient_checkpointing=true", "--json"]) == 0  # the step is the worse
    terms = {t["component"]: t["bytes"] for t in json.loads(capsys.readouterr().out)["rows"][0]["terms"]}
    assert terms["gradients"] == 2 * P_05B and "optimizer step" not in terms
    assert main([*args[:-1], "max_length=256", "gradient_checkpointing=true", "trainer_kwargs={optim: adamw_torch}",
                 "--json"]) == 0  # the user's optim: foreach AdamW's temporary of the state
    terms = {t["component"]: t["bytes"] for t in json.loads(capsys.readouterr().out)["rows"][0]["terms"]}
    assert terms["optimizer step"] == 2 * P_05B


def test_fit_applies_the_first_change_and_writes_a_config_that_plans_to_fit(models, tmp_path, capsys):
    fitted = tmp_path / "fitted.yaml"
    args = ["plan", "--plugin", "sft", "--config", str(EXAMPLES / "sft/pretrain.yaml"), f"model={models['q15']}",
            "max_length=8192", "per_device_train_batch_size=8", "gpu_memory_gib=140"]
    assert main(args) == 2
    capsys.readouterr()
    assert main([*args, "--fit", "-o", str(fitted)]) == 0
    out = capsys.readouterr().out
    assert "--fit: gradient_checkpointing=true" in out
    config = yaml.safe_load(fitted.read_text())
    assert config["gradient_checkpointing"] is True and config["gpu_memory_gib"] == 140
    assert main(["plan", "--plugin", "sft", "--config", str(fitted), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fits"]
    assert main([*args, "--fit", "-o", str(fitted)]) == 2  # never over a file that is there


def test_where_no_one_change_fits_the_changes_add_up(models, capsys):
    args = ["plan", "--plugin", "sft", "--config", str(EXAMPLES / "sft/pretrain.yaml"), f"model={models['q15']}",
            "max_length=8192", "per_device_train_batch_size=8", "gpu_memory_gib=40"]
    assert main(args) == 2
    first = next(line.strip() for line in capsys.readouterr().err.splitlines() if "-> peak" in line)
    assert first.startswith("gradient_checkpointing=true per_device_train_batch_size=")  # checkpointing, then smaller
    assert main([*args, "--fit"]) == 0
    assert "[OVER]" not in capsys.readouterr().out.split("--fit:")[1]


def test_run_refuses_before_any_model_loads_and_fit_goes_on_to_the_run_s_checks(models, tmp_path, capsys):
    """The model directory holds only config.json: a run that reached the model's checks would fail there."""
    args = ["run", "--plugin", "sft", "--config", str(EXAMPLES / "sft/pretrain.yaml"), f"model={models['q15']}",
            "max_length=8192", "per_device_train_batch_size=8", "gpu_memory_gib=140", f"output_dir={tmp_path / 'out'}"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "the plan will not fit in GPU memory" in err and "gradient_checkpointing=true" in err
    assert "without weights" not in err and not (tmp_path / "out").exists()
    assert main([*args, "--fit"]) == 2  # fitted, the run's own checks come next: this model has no weights
    err = capsys.readouterr().err
    assert "--fit: gradient_checkpointing=true" in err and "without weights" in err
    assert not (tmp_path / "out" / "config.fit.yaml").exists()  # written once the run's checks pass
