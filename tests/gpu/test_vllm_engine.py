"""VLLMRolloutEngine on a GPU against a Hugging Face forward of the same tiny Qwen2 model.

One engine serves the whole module (vLLM starts in ~15 s). The model's final norm is scaled up so that its
next-token distributions are peaked (random weights alone give nearly uniform ones, against which a
wrong temperature or a stale weight would go unnoticed).
"""

from __future__ import annotations

import pytest
import torch

from rlcore import Batch, RlcoreError, SamplingParams
from rlcore.runtime.weight_sync import check_weight_sync, iter_buckets, sync_in_process

GiB = 1 << 30
PROMPTS = [[5, 17, 42, 99, 7], [120, 3, 3, 64, 200, 11, 9, 31], [250, 1]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A Qwen2 model vLLM accepts (head_dim 64), with peaked next-token distributions, in bf16."""
    from transformers import AutoModelForCausalLM

    from rlcore.testing import build_tiny_model

    path = build_tiny_model(
        tmp_path_factory.mktemp("qwen2") / "model", hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.fill_(8.0)
    model.to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()


@pytest.fixture(scope="module")
def engine(model_dir):
    from rlcore.plugins.vllm import VLLMRolloutEngine

    return VLLMRolloutEngine(
        model=str(model_dir),
        vllm_gpu_memory_utilization=0.3,
        vllm_max_model_len=256,
        vllm_enforce_eager=True,
        dtype="bfloat16",
        seed=0,
    )


def hf_logprobs(model, sequence: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log p(sequence[t] | sequence[:t]) / temperature-scaled, for t = 1..L-1, as float32 on CPU."""
    ids = torch.tensor([sequence], device="cuda")
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return logprobs.gather(-1, ids[0, 1:, None])[:, 0].cpu()


def greedy(engine) -> list[list[int]]:
    return [g.token_ids for g in engine.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0))]


def test_generate_returns_n_completions_per_prompt_in_prompt_major_order(engine, hf_model):
    gens = engine.generate(PROMPTS, SamplingParams(n=4, max_tokens=16, temperature=1.0, seed=1))
    assert [g.prompt_index for g in gens] == [0] * 4 + [1] * 4 + [2] * 4
    for g in gens:
        assert 1 <= len(g.token_ids) <= 16 and len(g.logprobs) == len(g.token_ids)
        assert all(lp <= 0.0 and lp > -100 for lp in g.logprobs)
        assert g.finish_reason == ("length" if len(g.token_ids) == 16 else "stop")
    assert len({tuple(g.token_ids) for g in gens[:4]}) > 1  # sampled, not four copies

    stop_all = SamplingParams(max_tokens=16, stop_token_ids=list(range(hf_model.config.vocab_size)))
    stopped = engine.generate(PROMPTS[:1], stop_all)
    assert stopped[0].finish_reason == "stop" and len(stopped[0].token_ids) == 1


def test_logprobs_are_the_samplers_after_temperature(engine, hf_model):
    temperature = 0.7
    gens = engine.generate(PROMPTS, SamplingParams(n=2, max_tokens=24, temperature=temperature, seed=3))
    diffs, vs_untempered = [], []
    for g in gens:
        sequence = PROMPTS[g.prompt_index] + g.token_ids
        start = len(PROMPTS[g.prompt_index]) - 1
        want = hf_logprobs(hf_model, sequence, temperature)[start:]
        got = torch.tensor(g.logprobs)
        diffs.append((got - want).abs())
        vs_untempered.append((got - hf_logprobs(hf_model, sequence, 1.0)[start:]).abs())
    diffs, vs_untempered = torch.cat(diffs), torch.cat(vs_untempered)
    print(f"processed logprobs vs HF at T={temperature}: mean {diffs.mean():.4f} max {diffs.max():.4f}")
    assert diffs.mean() < 0.05 and diffs.max() < 0.3
    assert vs_untempered.max() > 0.5  # the comparison can tell temperature 0.7 from 1.0


def test_prompt_topk_has_exactly_k_columns_and_matches_hf(engine, hf_model):
    k = 5
    sequences = [PROMPTS[1] + [77, 78, 79, 80], PROMPTS[0]]
    result = engine.prompt_topk_logprobs(sequences, k)
    width = max(len(s) for s in sequences)
    assert result.ids.shape == result.logprobs.shape == (2, width, k)  # [B, T, k], right-padded
    for index, sequence in enumerate(sequences):
        assert result.ids[index, 0].eq(0).all() and result.logprobs[index, 0].eq(0).all()  # row 0: no prefix
        assert result.ids[index, len(sequence):].eq(0).all() and result.logprobs[index, len(sequence):].eq(0).all()
        ids, values = result.ids[index, 1:len(sequence)], result.logprobs[index, 1:len(sequence)]
        tokens = torch.tensor([sequence], device="cuda")
        with torch.no_grad():
            ref = torch.log_softmax(hf_model(input_ids=tokens).logits[0, :-1].float(), dim=-1).topk(k, dim=-1)
        assert (values - ref.values.cpu()).abs().max() < 0.3
        assert torch.all(values[:, :-1] >= values[:, 1:])  # sorted, best first
        clear = (ref.values[:, 0] - ref.values[:, 1]).cpu() > 0.3  # a top-1 that bf16 cannot flip
        assert clear.any() and torch.equal(ids[clear, 0], ref.indices[clear, 0].cpu())
    with pytest.raises(RlcoreError, match="max_logprobs"):
        engine.prompt_topk_logprobs(sequences, 50)


def test_sleep_level_1_frees_memory_and_wake_up_restores_generation(engine):
    before_tokens = greedy(engine)
    free_before = torch.cuda.mem_get_info()[0]
    engine.sleep(level=1)
    freed = torch.cuda.mem_get_info()[0] - free_before
    print(f"sleep level 1 freed {freed / GiB:.2f} GiB")
    assert freed > 1 * GiB
    with pytest.raises(RlcoreError, match="call wake_up"):
        greedy(engine)
    engine.wake_up()
    assert greedy(engine) == before_tokens


def test_sleep_level_2_then_update_weights_restores_the_model(engine, hf_model):
    before_tokens = greedy(engine)
    free_before = torch.cuda.mem_get_info()[0]
    engine.sleep(level=2)
    assert torch.cuda.mem_get_info()[0] - free_before > 1 * GiB
    engine.wake_up(tags=["weights"])
    weights = [(name, p.detach().to(torch.bfloat16)) for name, p in hf_model.named_parameters()]
    buckets = list(iter_buckets(weights, bucket_bytes=1 << 20))
    assert len(buckets) > 1
    for bucket in buckets:
        engine.update_weights(bucket)
    engine.wake_up(tags=["kv_cache"])
    engine.finish_weight_update()
    assert greedy(engine) == before_tokens


def test_update_weights_from_a_trained_hf_engine_passes_the_weight_sync_check(engine, model_dir):
    from rlcore.plugins.hf.train import HFTrainEngine

    train = HFTrainEngine(model=str(model_dir), dtype="bfloat16", device="cuda")
    sequence = PROMPTS[1] + [77, 78, 79, 80, 81, 82]
    assert check_weight_sync(train, engine, sequence) < 0.5  # same weights so far
    generator = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for p in train.model.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=generator, device=p.device, dtype=p.dtype) * 0.05)
    with pytest.raises(RlcoreError, match="weight sync check failed") as stale:
        check_weight_sync(train, engine, sequence)
    print(f"before sync: {stale.value}")

    stats = sync_in_process(train, engine, bucket_bytes=1 << 20)
    assert stats["weight_sync/buckets"] > 1
    diff = check_weight_sync(train, engine, sequence)
    print(f"after sync: top-4 log-prob difference {diff:.4f}; {stats}")

    gens = engine.generate([sequence], SamplingParams(n=2, max_tokens=16, temperature=1.0, seed=5))
    batch_ids = [sequence + g.token_ids for g in gens]
    for ids, g in zip(batch_ids, gens):
        t = torch.tensor([ids])
        want = train.forward_logprobs(Batch(input_ids=t, attention_mask=torch.ones_like(t)))[0, len(sequence):]
        assert (torch.tensor(g.logprobs) - want.float().cpu()).abs().mean() < 0.05


def test_the_installed_vllm_registry_refuses_a_text_only_qwen3_5_before_it_starts(model_dir, tmp_path):
    """vLLM 0.26 serves Qwen3.5 only as Qwen3_5ForConditionalGeneration: `rlcore run` on a text-only checkpoint
    stopped inside the rollout actor with vLLM's list of every architecture; the check says it in one line."""
    from rlcore.plugins.vllm.engine import check_options
    from rlcore.testing import build_tiny_model

    (problem,) = check_options(model=str(build_tiny_model(tmp_path / "q35", "qwen3_5")))
    assert problem[0] == "model" and "Qwen3_5ForCausalLM" in problem[1]
    assert check_options(model=str(model_dir)) == []
