"""HFRolloutEngine on a real tiny Qwen2: sampling, log-probs, stops, seeds, weight updates, sleep/wake, top-k; and on
every architecture `build_tiny_model` writes, against transformers' own forward."""

from __future__ import annotations

import pytest
import torch

from rlcore import Batch, RlcoreError, SamplingParams
from rlcore.batch import pad_tokens
from rlcore.plugins.hf.rollout import HFRolloutEngine
from rlcore.plugins.hf.train import HFTrainEngine
from rlcore.testing import ARCHS, build_tiny_model

PROMPTS = [[265, 84, 82, 260, 198], [5, 6, 7, 8, 9, 10, 11, 12, 13], [100]]  # different lengths: left padding


@pytest.fixture(scope="module")
def rollout(tiny_model):
    return HFRolloutEngine(tiny_model)


@pytest.fixture(scope="module")
def trainer(tiny_model):
    return HFTrainEngine(tiny_model)


def recompute(trainer: HFTrainEngine, prompts, generations, temperature: float) -> list[torch.Tensor]:
    """The train engine's log-probs of each completion's tokens, from one right-padded batch."""
    sequences = [prompts[g.prompt_index] + g.token_ids for g in generations]
    width = max(map(len, sequences))
    input_ids = torch.zeros(len(sequences), width, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, seq in enumerate(sequences):
        input_ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1
    logprobs = trainer.forward_logprobs(Batch(input_ids=input_ids, attention_mask=mask), temperature)
    return [
        logprobs[i, len(prompts[g.prompt_index]) : len(sequences[i])] for i, g in enumerate(generations)
    ]


def test_generate_shapes_order_and_text(rollout):
    generations = rollout.generate(PROMPTS, SamplingParams(n=3, max_tokens=7, seed=0))
    assert [g.prompt_index for g in generations] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    for g in generations:
        assert len(g.token_ids) == len(g.logprobs) <= 7
        assert g.finish_reason == ("length" if len(g.token_ids) == 7 else "stop")
        assert all(lp <= 0 for lp in g.logprobs)
        assert g.text == rollout.tokenizer.decode(g.token_ids, skip_special_tokens=True)
    assert len({tuple(g.token_ids) for g in generations}) > 3  # n samples of one prompt differ


def test_generate_passes_the_kv_cache_by_the_installed_transformers_name(rollout):
    """transformers 5.24 renamed forward's `past_key_values` to `cache` (the old name goes in 5.40): the engine
    must not use a name the installed version has deprecated."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rollout.generate(PROMPTS[:1], SamplingParams(n=2, max_tokens=4, seed=0))
    assert not [str(w.message) for w in caught if "past_key_values" in str(w.message)]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_the_train_engine(rollout, trainer, temperature):
    generations = rollout.generate(PROMPTS, SamplingParams(n=2, max_tokens=12, temperature=temperature, seed=1))
    for g, want in zip(generations, recompute(trainer, PROMPTS, generations, temperature)):
        torch.testing.assert_close(torch.tensor(g.logprobs), want, atol=1e-4, rtol=1e-4)


def test_stop_tokens_finish_with_stop(rollout):
    greedy = rollout.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0))
    first = greedy[1].token_ids[0]
    stopped = rollout.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0, stop_token_ids=[first]))
    assert stopped[1].token_ids == [first] and stopped[1].finish_reason == "stop"  # the stop token is kept
    for g, ref in zip(stopped, greedy):
        assert g.token_ids == ref.token_ids[: len(g.token_ids)]
        assert (g.finish_reason == "stop") == (first in g.token_ids)


def test_top_k_one_is_greedy_with_probability_one(rollout):
    greedy = rollout.generate(PROMPTS, SamplingParams(max_tokens=5, temperature=0))
    top1 = rollout.generate(PROMPTS, SamplingParams(max_tokens=5, temperature=0.9, top_k=1, seed=3))
    assert [g.token_ids for g in top1] == [g.token_ids for g in greedy]
    assert all(lp == 0 for g in top1 for lp in g.logprobs)


def test_top_p_renormalises_over_the_nucleus(rollout, trainer):
    params = SamplingParams(n=4, max_tokens=8, top_p=0.5, seed=4)
    generations = rollout.generate(PROMPTS, params)
    for g, full in zip(generations, recompute(trainer, PROMPTS, generations, 1.0)):
        assert torch.all(torch.tensor(g.logprobs) > full)  # same token, a smaller support


def test_seed_makes_sampling_deterministic(rollout):
    params = SamplingParams(n=2, max_tokens=10, seed=7)
    first, again = rollout.generate(PROMPTS, params), rollout.generate(PROMPTS, params)
    assert [g.token_ids for g in first] == [g.token_ids for g in again]
    assert [g.logprobs for g in first] == [g.logprobs for g in again]
    other = rollout.generate(PROMPTS, SamplingParams(n=2, max_tokens=10, seed=8))
    assert [g.token_ids for g in other] != [g.token_ids for g in first]
    unseeded = [rollout.generate(PROMPTS, SamplingParams(max_tokens=10)) for _ in range(2)]
    assert [g.token_ids for g in unseeded[0]] != [g.token_ids for g in unseeded[1]]  # the engine's stream moves on


def test_update_weights_from_the_train_engine(tiny_model):
    trainer = HFTrainEngine(tiny_model, learning_rate=5e-2)
    rollout = HFRolloutEngine(tiny_model)
    ids = torch.tensor([PROMPTS[1]])
    batch = Batch(input_ids=ids, attention_mask=torch.ones_like(ids), weight=torch.ones(1))
    for _ in range(2):
        trainer.train_step(batch, lambda outputs, mb: (-outputs.logprobs().sum(), {}), micro_batch_size=1)
    params = SamplingParams(n=2, max_tokens=8, seed=2)
    stale = rollout.generate(PROMPTS, params)
    assert not all(torch.allclose(torch.tensor(g.logprobs), w, atol=1e-3) for g, w in zip(stale, recompute(trainer, PROMPTS, stale, 1.0)))

    storage = {n: p.data_ptr() for n, p in rollout.model.named_parameters()}
    for bucket in trainer.export_weights(bucket_bytes=16_000):
        rollout.update_weights(bucket)
    rollout.finish_weight_update()
    assert {n: p.data_ptr() for n, p in rollout.model.named_parameters()} == storage  # in place
    fresh = rollout.generate(PROMPTS, params)
    for g, want in zip(fresh, recompute(trainer, PROMPTS, fresh, 1.0)):
        torch.testing.assert_close(torch.tensor(g.logprobs), want, atol=1e-4, rtol=1e-4)

    with pytest.raises(RlcoreError, match="no weight 'model.norm.weigth'.*Did you mean 'model.norm.weight'"):
        rollout.update_weights([("model.norm.weigth", torch.ones(64))])
    with pytest.raises(RlcoreError, match=r"shape \(3,\)"):
        rollout.update_weights([("model.norm.weight", torch.ones(3))])


def test_sleep_and_wake_up(tiny_model, trainer):
    rollout = HFRolloutEngine(tiny_model)
    params = SamplingParams(n=2, max_tokens=6, seed=5)
    before = rollout.generate(PROMPTS, params)

    rollout.sleep(level=1)
    with pytest.raises(RlcoreError, match="asleep"):
        rollout.generate(PROMPTS, params)
    rollout.wake_up()
    assert [g.logprobs for g in rollout.generate(PROMPTS, params)] == [g.logprobs for g in before]

    rollout.sleep(level=2)
    assert all(p.numel() == 0 for p in rollout.model.parameters())  # the weights are gone
    with pytest.raises(RlcoreError, match="wake_up"):
        rollout.update_weights([("model.norm.weight", torch.ones(64))])
    rollout.wake_up(tags=["kv_cache"])
    with pytest.raises(RlcoreError, match="asleep"):
        rollout.generate(PROMPTS, params)
    rollout.wake_up(tags=["weights"])
    with pytest.raises(RlcoreError, match="dropped by sleep"):
        rollout.generate(PROMPTS, params)
    for bucket in trainer.export_weights():  # the untrained weights, as the engine had them
        rollout.update_weights(bucket)
    after = rollout.generate(PROMPTS, params)
    assert [g.token_ids for g in after] == [g.token_ids for g in before]
    for g, ref in zip(after, before):
        assert g.logprobs == pytest.approx(ref.logprobs, abs=1e-5)

    with pytest.raises(RlcoreError, match="level=3"):
        rollout.sleep(level=3)
    with pytest.raises(RlcoreError, match="unknown tags"):
        rollout.wake_up(tags=["weigths"])


def test_prompt_topk_logprobs_are_the_top_of_the_full_distribution(rollout):
    sequences = [PROMPTS[1], PROMPTS[0] + [7, 8], [42]]
    top = rollout.prompt_topk_logprobs(sequences, k=4)
    width = max(len(s) for s in sequences)
    assert top.ids.shape == top.logprobs.shape == (3, width, 4)  # one [B, T, k] layout, right-padded
    assert top.ids.dtype == torch.long and top.logprobs.dtype == torch.float32
    assert not top.logprobs.is_inference()  # usable inside a loss that autograd saves
    for i, seq in enumerate(sequences):
        assert top.ids[i, 0].eq(0).all() and top.logprobs[i, 0].eq(0).all()  # row 0: no prefix
        assert top.ids[i, len(seq):].eq(0).all() and top.logprobs[i, len(seq):].eq(0).all()  # padding
        if len(seq) == 1:
            continue
        with torch.no_grad():
            logits = rollout.model(input_ids=torch.tensor([seq])).logits[0, :-1]
        want = torch.log_softmax(logits, dim=-1).topk(4, dim=-1)
        torch.testing.assert_close(top.logprobs[i, 1:len(seq)], want.values, atol=1e-5, rtol=1e-5)
        assert torch.equal(top.ids[i, 1:len(seq)], want.indices)


def test_prompt_topk_logprobs_match_the_train_engines_forward_topk(rollout, trainer):
    """Teacher top-k from a rollout engine and from a train engine share one layout and one set of values."""
    sequences = [PROMPTS[1], PROMPTS[0] + [7, 8]]
    served = rollout.prompt_topk_logprobs(sequences, k=3)
    input_ids, mask = pad_tokens(sequences, rollout.pad_token_id)
    local = trainer.forward_topk(Batch(input_ids=input_ids, attention_mask=mask), 3)
    assert torch.equal(served.ids, local.ids)
    torch.testing.assert_close(served.logprobs, local.logprobs, atol=1e-5, rtol=1e-5)


def test_bad_requests_are_clear_errors(rollout):
    with pytest.raises(RlcoreError, match="n=0.*top_p=1.5"):
        rollout.generate(PROMPTS, SamplingParams(n=0, top_p=1.5))
    with pytest.raises(RlcoreError, match=r"prompts\[1\] must be a non-empty"):
        rollout.generate([[1], []], SamplingParams())
    with pytest.raises(RlcoreError, match="outside"):
        rollout.generate([[1, 10_000]], SamplingParams())
    with pytest.raises(RlcoreError, match="k=0"):
        rollout.prompt_topk_logprobs([[1, 2]], k=0)
    assert rollout.generate([], SamplingParams()) == []


def test_receives_trained_weights_over_a_gloo_broadcast_group(tiny_model):
    """A separate rollout worker: it joins train rank 0's group and loads what rank 0 broadcasts."""
    import threading

    from rlcore.runtime.rendezvous import find_free_port
    from rlcore.runtime.weight_sync import BroadcastGroup

    trainer = HFTrainEngine(tiny_model, learning_rate=5e-2)
    ids = torch.tensor([PROMPTS[1]])
    trainer.train_step(Batch(input_ids=ids, attention_mask=torch.ones_like(ids)),
                       lambda outputs, mb: (-outputs.logprobs().sum(), {}), micro_batch_size=1)
    rollout = HFRolloutEngine(tiny_model)
    with pytest.raises(RlcoreError, match="receive_weights before join_weight_group"):
        rollout.receive_weights()
    port, sent = find_free_port(), {}

    def train_rank_0():
        group = BroadcastGroup("127.0.0.1", port, rank=0, world_size=2, backend="gloo", timeout_s=60)
        sent.update(group.send(trainer.export_weights(bucket_bytes=16_000)))

    sender = threading.Thread(target=train_rank_0)
    sender.start()
    rollout.join_weight_group("127.0.0.1", port, 1, 2, "gloo")
    received = rollout.receive_weights()
    sender.join(timeout=60)
    assert sent["weight_sync/buckets"] > 1
    # where a sync's time goes: the sender's export, packing and sending, the receiver's receiving and loading
    assert all(sent[f"weight_sync/{p}_s"] > 0 for p in ("export", "pack", "send"))
    assert sum(sent[f"weight_sync/{p}_s"] for p in ("export", "pack", "send")) <= sent["weight_sync/seconds"]
    assert set(received) == {"weight_sync/recv_s", "weight_sync/load_s"} and all(v > 0 for v in received.values())
    for name, value in trainer.model.named_parameters():
        assert torch.equal(rollout.model.get_parameter(name), value.detach()), name


# ------------------------------------------------------------------ every architecture build_tiny_model writes

STOPS = list(range(3, 267, 7))  # about one token in seven stops a row: some rows stop, some run to max_tokens


def teacher_forced(model, prompts, generations, temperature: float) -> list[torch.Tensor]:
    """transformers' own log-probs of each completion, one unpadded sequence per forward (no cache, no mask)."""
    out = []
    with torch.no_grad():
        for g in generations:
            prompt = prompts[g.prompt_index]
            logits = model(input_ids=torch.tensor([prompt + g.token_ids])).logits[0].float() / temperature
            logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
            out.append(logprobs.gather(1, torch.tensor(g.token_ids)[:, None]).squeeze(1))
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_every_architecture_generates_with_the_logprobs_of_a_teacher_forced_forward(arch, tmp_path_factory):
    """Left-padded prompts, n completions sharing a prefilled cache, rows dropped as they stop: Qwen3.5's hybrid
    cache (linear attention's conv and recurrent states beside full attention's keys) and Gemma 3's sliding
    windows (16 tokens, shorter than prompt + completion) included. The hf train engine agrees too."""
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(tmp_path_factory.getbasetemp() / f"tiny-{arch}", arch=arch)
    rollout = HFRolloutEngine(str(path), dtype="float32")
    generations = rollout.generate(PROMPTS, SamplingParams(n=3, max_tokens=10, temperature=0.8, seed=0,
                                                           stop_token_ids=STOPS))
    assert [g.prompt_index for g in generations] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert {g.finish_reason for g in generations} == {"stop", "length"}  # both the repeat and the drop ran
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    for g, want in zip(generations, teacher_forced(model, PROMPTS, generations, 0.8)):
        torch.testing.assert_close(torch.tensor(g.logprobs), want, atol=1e-4, rtol=1e-4)
    trainer = HFTrainEngine(str(path), dtype="float32")
    for g, want in zip(generations, recompute(trainer, PROMPTS, generations, 0.8)):
        torch.testing.assert_close(torch.tensor(g.logprobs), want, atol=1e-4, rtol=1e-4)


def test_a_moe_checkpoints_experts_one_by_one_fill_transformers_fused_experts(tmp_path):
    """The megatron engine and a checkpoint name experts one by one; transformers 5 fuses them: after a sleep
    that dropped the weights, the per-expert tensors of another seed's checkpoint make it that model exactly."""
    from safetensors.torch import load_file

    from rlcore.testing import build_tiny_model

    want_dir = build_tiny_model(tmp_path / "a", "qwen3_moe", seed=1)
    want = HFRolloutEngine(want_dir)
    rollout = HFRolloutEngine(build_tiny_model(tmp_path / "b", "qwen3_moe", seed=2))
    params = SamplingParams(n=2, max_tokens=6, seed=3)
    expected = want.generate(PROMPTS, params)
    assert [g.logprobs for g in rollout.generate(PROMPTS, params)] != [g.logprobs for g in expected]
    named = {k: v for f in sorted(want_dir.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in named and "model.layers.0.mlp.experts.gate_up_proj" not in named
    rollout.sleep(level=2)
    rollout.wake_up()
    experts = [(k, v) for k, v in named.items() if ".experts." in k]
    rollout.update_weights([(k, v) for k, v in named.items() if ".experts." not in k] + experts[:-1])
    with pytest.raises(RlcoreError, match="dropped by sleep"):  # one expert slice is still missing
        rollout.generate(PROMPTS, params)
    rollout.update_weights(experts[-1:])
    assert [g.logprobs for g in rollout.generate(PROMPTS, params)] == [g.logprobs for g in expected]
    with pytest.raises(RlcoreError, match="no weight 'model.layers.0.mlp.experts.99.gate_proj.weight'"):
        rollout.update_weights([("model.layers.0.mlp.experts.99.gate_proj.weight", named[experts[0][0]])])
