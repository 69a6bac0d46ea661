"""HFTrainEngine on a real tiny Qwen2: log-probs, top-k, the model outputs a loss reads, training,
micro-batches, DDP, LoRA, export, save/load, and the forward-only kind."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch

from rlcore import Batch, ConfigError, RlcoreError, load_plugins
from rlcore.engines import ModelOutputs
from rlcore.plugins.hf.train import HFTrainEngine

# With a huge Adam epsilon the first step moves each weight by about -lr/eps * grad: parameter deltas
# then compare gradients (a plain first Adam step would only show their signs).
LINEAR_ADAM = dict(learning_rate=1e3, adam_epsilon=1e3, max_grad_norm=0)


@pytest.fixture(scope="module")
def engine(tiny_model):
    return HFTrainEngine(tiny_model)


def make_batch(rows: int = 6, width: int = 10, seed: int = 0) -> Batch:
    """Right-padded random sequences of different lengths, with a per-row weight 1/rows for the loss."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, 256, (rows, width), generator=g)
    lengths = torch.randint(width // 2, width + 1, (rows,), generator=g)
    lengths[0] = width
    attention_mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    input_ids = input_ids.masked_fill(attention_mask == 0, 265)
    completion_mask = attention_mask.clone()
    completion_mask[:, :3] = 0
    return Batch(
        input_ids=input_ids, attention_mask=attention_mask, completion_mask=completion_mask,
        weight=torch.full((rows,), 1.0 / rows),
    )


def nll_loss(outputs: ModelOutputs, micro: Batch):
    """Mean over rows of the completion's summed NLL: each micro-batch gives its rows' share."""
    per_row = -(outputs.logprobs() * micro["completion_mask"]).sum(dim=1)
    loss = (per_row * micro["weight"]).sum()
    return loss, {"nll": float(per_row.detach().mean())}


def reference_logprobs(model, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    logprobs = torch.log_softmax(logits[:, :-1] / temperature, dim=-1)
    picked = logprobs.gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(picked, (1, 0)) * batch["attention_mask"]


def params(engine: HFTrainEngine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.model.named_parameters()}


def test_registered_lazily_and_options_checked(tiny_model):
    plugins = load_plugins()
    assert {plugins.engines.owner(f"{kind}/hf") for kind in ("train", "forward", "rollout", "teacher")} == {"hf"}
    code = "import sys, rlcore.plugins.hf; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    factory = plugins.engines.get("hf", kind="train").factory
    with pytest.raises(ConfigError, match="no option 'learning_rte'.*Did you mean 'learning_rate'"):
        factory(model=str(tiny_model), learning_rte=1e-3)
    with pytest.raises(ConfigError) as err:
        factory(model=str(tiny_model), dtype="float8", lr_scheduler_type="cosine", lora_rank=-1)
    assert {key for key, _ in err.value.problems} == {"dtype", "max_steps", "lora_rank"}
    with pytest.raises(ConfigError, match="is not a directory"):
        factory(model=str(tiny_model / "missing"))
    with pytest.raises(ConfigError, match="CUDA is not available"):
        factory(model=str(tiny_model), device="cuda")


def test_forward_logprobs_match_a_plain_reference(engine):
    batch = make_batch()
    for temperature in (1.0, 0.7):
        got = engine.forward_logprobs(batch, temperature)
        assert got.shape == batch["input_ids"].shape and got.dtype == torch.float32
        assert not got.is_inference()  # the loss may save old log-probs for backward
        assert torch.all(got[:, 0] == 0)
        want = reference_logprobs(engine.model, batch, temperature)
        mask = batch["attention_mask"].bool()
        torch.testing.assert_close(got[mask], want[mask], atol=1e-5, rtol=1e-5)
        assert torch.all(got[~mask] == 0)
    assert not torch.allclose(engine.forward_logprobs(batch, 0.7), engine.forward_logprobs(batch, 1.0))
    with pytest.raises(RlcoreError, match="temperature"):
        engine.forward_logprobs(batch, 0.0)


def test_forward_logprobs_chunks_rows(tiny_model):
    chunked = HFTrainEngine(tiny_model, logprob_micro_batch_size=2)
    batch = make_batch(rows=5)
    torch.testing.assert_close(chunked.forward_logprobs(batch), HFTrainEngine(tiny_model).forward_logprobs(batch))


def test_forward_topk_and_full_vocabulary(engine):
    batch = make_batch()
    full = engine.forward_topk(batch, None, temperature=0.7)
    assert full.shape == (*batch["input_ids"].shape, engine.model.config.vocab_size)
    padding = batch["attention_mask"] == 0
    assert padding.any() and torch.all(full[:, 0] == 0) and torch.all(full[padding] == 0)
    torch.testing.assert_close(full[:, 1:].exp().sum(-1)[batch["attention_mask"][:, 1:].bool()], torch.ones(
        int(batch["attention_mask"][:, 1:].sum())), atol=1e-5, rtol=0)
    gathered = full.gather(-1, batch["input_ids"][..., None]).squeeze(-1) * batch["attention_mask"]
    gathered[:, 0] = 0
    torch.testing.assert_close(gathered, engine.forward_logprobs(batch, 0.7), atol=1e-5, rtol=1e-5)
    top = engine.forward_topk(batch, 5, temperature=0.7)
    assert top.ids.shape == top.logprobs.shape == (*batch["input_ids"].shape, 5)
    assert top.ids[:, 0].eq(0).all() and top.ids[padding].eq(0).all() and top.logprobs[padding].eq(0).all()
    want = full.topk(5, dim=-1)
    mask = batch["attention_mask"].bool()
    mask[:, 0] = False
    torch.testing.assert_close(top.logprobs[mask], want.values[mask])
    # top-k is the k largest logits less the normaliser (no log-softmax over the vocabulary): equal to rounding
    torch.testing.assert_close(full.gather(-1, top.ids)[mask], top.logprobs[mask], atol=1e-6, rtol=0)


def test_a_train_steps_model_outputs_agree_with_forward_topk_and_with_each_other(tiny_model):
    """The loss sees the step's forward pass: log-probs at a teacher's top-k ids are forward_topk's values,
    and the full vocabulary gathered at input_ids is the per-token log-probs, padding and row 0 zero."""
    engine = HFTrainEngine(tiny_model)
    batch = make_batch()
    teacher = engine.forward_topk(batch, 4, temperature=0.7)
    batch["topk_ids"], batch["topk_logprobs"] = teacher.ids, teacher.logprobs  # [B, T, k] columns, split and trimmed
    seen = []

    def loss_fn(outputs: ModelOutputs, micro: Batch):
        at_topk = outputs.logprobs_at(micro["topk_ids"])
        full = outputs.full_logprobs()
        seen.append((at_topk.detach(), micro["topk_logprobs"], full.detach(), outputs.logprobs().detach(), micro))
        return -(at_topk.exp() * micro["topk_logprobs"]).sum() / len(batch), {}

    metrics = engine.train_step(batch, loss_fn, micro_batch_size=4, temperature=0.7)
    assert len(seen) == 2 and metrics["grad_norm"] > 0
    for at_topk, want, full, logprobs, micro in seen:
        width = micro["input_ids"].shape[1]
        assert at_topk.shape == want.shape == (len(micro), width, 4) and full.shape[:2] == (len(micro), width)
        torch.testing.assert_close(at_topk, want, atol=1e-5, rtol=1e-5)
        gathered = full.gather(-1, micro["input_ids"][..., None]).squeeze(-1)
        torch.testing.assert_close(gathered, logprobs, atol=1e-5, rtol=1e-5)
        padding = micro["attention_mask"] == 0
        assert full[:, 0].eq(0).all() and full[padding].eq(0).all() and logprobs[padding].eq(0).all()
        assert at_topk[:, 0].eq(0).all() and at_topk[padding].eq(0).all()
        full_mask = micro["attention_mask"].bool().clone()
        full_mask[:, 0] = False
        torch.testing.assert_close(full[full_mask].exp().sum(-1), torch.ones(int(full_mask.sum())), atol=1e-5, rtol=0)


def test_gradients_flow_through_every_model_output_alike(tiny_model):
    """Per-token, at-ids and full-vocabulary log-probs are one quantity three ways: same values, same gradients."""
    from rlcore.plugins.hf.common import model_outputs

    engine = HFTrainEngine(tiny_model)
    batch = make_batch()
    ids, mask, completion = batch["input_ids"], batch["attention_mask"], batch["completion_mask"]
    weight = engine.model.get_parameter("model.layers.0.mlp.up_proj.weight")
    ways = {
        "logprobs": lambda out: out.logprobs(),
        "logprobs_at": lambda out: out.logprobs_at(ids[..., None]).squeeze(-1),
        "full_logprobs": lambda out: out.full_logprobs().gather(-1, ids[..., None]).squeeze(-1),
    }
    grads = {}
    for name, way in ways.items():
        outputs = model_outputs(engine.model, ids, mask, temperature=0.7)
        loss = -(way(outputs) * completion).sum()
        (grads[name],) = torch.autograd.grad(loss, weight)
        assert grads[name].abs().sum() > 0, name
    torch.testing.assert_close(grads["logprobs_at"], grads["logprobs"], atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(grads["full_logprobs"], grads["logprobs"], atol=1e-6, rtol=1e-4)
    outputs = model_outputs(engine.model, ids, mask)
    assert outputs.logprobs() is outputs.logprobs() and outputs.full_logprobs() is outputs.full_logprobs()  # cached
    with pytest.raises(RlcoreError, match=r"ids must be \[B, T, k\] with \[B, T\] = \[6, 10\].*got \[6, 9, 2\]"):
        outputs.logprobs_at(ids[:, :9, None].expand(-1, -1, 2))


def test_the_forward_engine_holds_the_model_alone(tiny_model, tmp_path):
    """Kind "forward" (reference and teacher models): the train engine's forward passes, no optimizer."""
    factory = load_plugins().engines.get("hf", kind="forward").factory
    with pytest.raises(ConfigError, match="hf forward engine has no option 'learning_rate'"):
        factory(model=str(tiny_model), learning_rate=1e-3)
    forward = factory(model=str(tiny_model), logprob_micro_batch_size=4)
    assert forward.optimizer is None and forward.scheduler is None and forward.state()["forward_only"]
    assert forward.state()["num_trainable_parameters"] == 0
    assert not any(p.requires_grad for p in forward.model.parameters())
    train = HFTrainEngine(tiny_model)
    batch = make_batch()
    torch.testing.assert_close(forward.forward_logprobs(batch, 0.7), train.forward_logprobs(batch, 0.7))
    assert torch.equal(forward.forward_topk(batch, 3).ids, train.forward_topk(batch, 3).ids)
    with pytest.raises(RlcoreError, match="train_step on a forward-only hf engine"):
        forward.train_step(batch, nll_loss, micro_batch_size=6)
    with pytest.raises(RlcoreError, match="save: a forward-only hf engine"):
        forward.save(tmp_path / "ckpt")
    forward.offload()
    forward.reload()
    assert [n for b in forward.export_weights() for n, _ in b] == [n for n, _ in train.model.named_parameters()]
    with pytest.raises(ConfigError, match="lora_rank=4 must be 0 for a forward-only engine"):
        HFTrainEngine(tiny_model, forward_only=True, lora_rank=4)


def test_train_step_lowers_the_loss(tiny_model):
    engine = HFTrainEngine(tiny_model, learning_rate=1e-2, lr_scheduler_type="cosine", warmup_steps=2, max_steps=6)
    batch = make_batch()
    losses, lrs = [], []
    for _ in range(6):
        metrics = engine.train_step(batch, nll_loss, micro_batch_size=4)
        losses.append(metrics["loss"])
        lrs.append(metrics["learning_rate"])
        assert metrics["grad_norm"] > 0 and set(metrics) == {"loss", "nll", "grad_norm", "learning_rate"}
    assert losses[-1] < losses[0] - 1.0, losses
    assert lrs[:3] == pytest.approx([0.0, 5e-3, 1e-2]) and lrs[3] < lrs[2]  # warmup, then cosine decay
    assert engine.state()["global_step"] == 6


def test_micro_batches_accumulate_to_the_full_batch_gradient(tiny_model):
    batch = make_batch(rows=6)
    deltas, metrics = [], []
    for micro_batch_size in (6, 2, 4):  # one pass, three equal passes, two unequal passes (3 + 3)
        engine = HFTrainEngine(tiny_model, **LINEAR_ADAM)
        before = params(engine)
        metrics.append(engine.train_step(batch, nll_loss, micro_batch_size))
        deltas.append({n: p - before[n] for n, p in params(engine).items()})
    for other, other_metrics in zip(deltas[1:], metrics[1:]):
        assert other_metrics["grad_norm"] == pytest.approx(metrics[0]["grad_norm"], rel=1e-5)
        assert other_metrics["loss"] == pytest.approx(metrics[0]["loss"], rel=1e-5)
        for name, delta in deltas[0].items():
            torch.testing.assert_close(other[name], delta, atol=1e-6, rtol=1e-4)
    with pytest.raises(RlcoreError, match="micro_batch_size=0"):
        engine.train_step(batch, nll_loss, 0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_worker(rank: int, model: str, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    engine = HFTrainEngine(model, **LINEAR_ADAM, seed=rank)  # different seeds: DDP broadcasts rank 0's weights
    shard = make_batch(rows=6).split(2)[rank]
    shard["weight"] = torch.full((len(shard),), 1.0 / len(shard))  # each rank's share of its own batch
    metrics = engine.train_step(shard, nll_loss, micro_batch_size=2)  # two micro-batches: no_sync, then sync
    torch.save({"params": params(engine), "metrics": metrics, "state": engine.state()}, f"{out}/rank{rank}.pt")
    torch.distributed.destroy_process_group()


def test_ddp_over_two_processes_equals_one_process_on_the_whole_batch(tiny_model, tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_ddp_worker, args=(str(tiny_model), _free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert [r["state"]["world_size"] for r in ranks] == [2, 2] and ranks[1]["state"]["rank"] == 1
    for name, value in ranks[0]["params"].items():
        assert torch.equal(value, ranks[1]["params"][name]), name
    single = HFTrainEngine(tiny_model, **LINEAR_ADAM)
    before = params(single)
    metrics = single.train_step(make_batch(rows=6), nll_loss, micro_batch_size=6)
    assert ranks[0]["metrics"]["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-5)
    for name, value in params(single).items():
        torch.testing.assert_close(ranks[0]["params"][name] - before[name], value - before[name], atol=1e-6, rtol=1e-4)


def test_lora_trains_adapters_and_exports_merged_base_weights(tiny_model):
    from rlcore.plugins.hf.rollout import HFRolloutEngine

    engine = HFTrainEngine(tiny_model, lora_rank=4, lora_alpha=8, learning_rate=5e-2)
    base_names = {n for n, _ in HFTrainEngine(tiny_model).model.named_parameters()}
    state = engine.state()
    assert state["lora"] and state["num_trainable_parameters"] < state["num_parameters"] // 5
    before = params(engine)
    batch = make_batch()
    for _ in range(2):
        engine.train_step(batch, nll_loss, micro_batch_size=3)
    after = params(engine)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed and all(".lora_" in n for n in changed)

    exported = [item for bucket in engine.export_weights() for item in bucket]
    assert {n for n, _ in exported} == base_names and len(exported) == len(base_names)
    rollout = HFRolloutEngine(tiny_model)
    rollout.update_weights(exported)
    recomputed = HFTrainEngine(tiny_model)
    recomputed.model.load_state_dict(rollout.model.state_dict())
    torch.testing.assert_close(recomputed.forward_logprobs(batch), engine.forward_logprobs(batch), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(HFTrainEngine(tiny_model).forward_logprobs(batch), engine.forward_logprobs(batch))


TIED_HEAD = ("lora_target_modules names lm_head, but {} ties it to the input embedding (tie_word_embeddings): merged, "
             "its adapter would change the embedding too, and the weight sync cannot send it as a tensor of its own; "
             "drop lm_head from lora_target_modules, or use a checkpoint with tie_word_embeddings false")


def test_lora_on_a_tied_lm_head_is_refused_before_the_run(tiny_model, tmp_path, monkeypatch):
    """A LoRA target that reaches the LM head of a tied model is one problem of the engine's check (what `rlcore
    config validate` runs) with the key, why and the fix; all-linear (the head left out), no LoRA, and an untied
    model are fine. A model whose config cannot be read before the build is refused at the build, from the model."""
    from rlcore import engine_checks
    from rlcore.testing import build_tiny_model

    check = load_plugins().engines.get("hf", kind="train").check
    expected = [("lora_target_modules", TIED_HEAD.format(tiny_model))]
    for targets in (["q_proj", "lm_head"], ["model.lm_head"], "lm_.*"):
        assert check(model=str(tiny_model), lora_rank=4, lora_target_modules=targets) == expected, targets
    assert check(model=str(tiny_model), lora_rank=4) == []
    assert check(model=str(tiny_model), lora_rank=4, lora_target_modules=["q_proj", "v_proj"]) == []
    assert check(model=str(tiny_model), lora_target_modules=["lm_head"]) == []  # lora_rank 0: no adapter
    untied = build_tiny_model(tmp_path / "untied", arch="qwen2_untied")
    assert check(model=str(untied), lora_rank=4, lora_target_modules=["q_proj", "lm_head"]) == []
    monkeypatch.setattr(engine_checks, "tied_embeddings", lambda model: None)  # no config.json to read ahead
    assert check(model=str(tiny_model), lora_rank=4, lora_target_modules=["lm_head"]) == []
    with pytest.raises(ConfigError) as caught:
        HFTrainEngine(tiny_model, lora_rank=4, lora_target_modules=["lm_head"])
    assert str(caught.value) == "hf train engine: " + TIED_HEAD.format(tiny_model)


def test_export_buckets_respect_the_size(engine):
    sizes = {n: p.numel() * p.element_size() for n, p in engine.model.named_parameters()}
    limit = 20_000
    buckets = list(engine.export_weights(bucket_bytes=limit))
    assert len(buckets) > 1
    for bucket in buckets:
        total = sum(t.numel() * t.element_size() for _, t in bucket)
        assert total <= limit or len(bucket) == 1
        assert all(t.device.type == "cpu" and not t.requires_grad for _, t in bucket)
    names = [n for bucket in buckets for n, _ in bucket]
    assert names == list(sizes)
    assert torch.equal(dict(buckets[0])[names[0]], engine.model.get_parameter(names[0]))
    with pytest.raises(RlcoreError, match="bucket_bytes"):
        next(engine.export_weights(bucket_bytes=0))


def test_save_load_round_trip_restores_weights_and_optimizer(tiny_model, tmp_path):
    batch = make_batch()
    engine = HFTrainEngine(tiny_model, learning_rate=1e-2, lr_scheduler_type="linear", max_steps=10)
    for _ in range(2):
        engine.train_step(batch, nll_loss, micro_batch_size=6)
    engine.save(tmp_path / "ckpt")
    engine.save(tmp_path / "ckpt")  # saving again replaces the directory whole
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]

    restored = HFTrainEngine(tiny_model, learning_rate=1e-2, lr_scheduler_type="linear", max_steps=10)
    restored.load(tmp_path / "ckpt")
    for name, value in params(engine).items():
        assert torch.equal(value, restored.model.get_parameter(name)), name
    assert restored.global_step == 2 and restored.scheduler.get_last_lr() == engine.scheduler.get_last_lr()
    first = next(iter(engine.optimizer.state.values()))
    assert torch.equal(next(iter(restored.optimizer.state.values()))["exp_avg_sq"], first["exp_avg_sq"])
    engine.train_step(batch, nll_loss, micro_batch_size=6)
    restored.train_step(batch, nll_loss, micro_batch_size=6)
    for name, value in params(engine).items():
        torch.testing.assert_close(restored.model.get_parameter(name), value, atol=0, rtol=0)
    with pytest.raises(RlcoreError, match="not a checkpoint"):
        restored.load(tmp_path)


def test_offload_on_cpu_drops_grads_and_is_harmless(tiny_model):
    engine = HFTrainEngine(tiny_model, learning_rate=1e-2)
    batch = make_batch()
    engine.train_step(batch, nll_loss, micro_batch_size=6)
    engine.model.get_parameter("model.norm.weight").grad = torch.ones(64)
    engine.offload()
    assert all(p.grad is None for p in engine.model.parameters())
    engine.reload()
    assert engine.train_step(batch, nll_loss, micro_batch_size=6)["grad_norm"] > 0


def test_bad_batches_are_clear_errors(engine):
    with pytest.raises(RlcoreError, match="no attention_mask column"):
        engine.forward_logprobs(Batch(input_ids=torch.zeros(2, 3, dtype=torch.long)))
    with pytest.raises(RlcoreError, match="k=0"):
        engine.forward_topk(make_batch(), 0)


def test_liger_kernel_keeps_the_torch_modules_off_cuda_and_trains(tiny_model, caplog):
    """liger-kernel's kernels are Triton's: on the CPU the option leaves the model as it is, says so, and the step
    equals one without it; on CUDA a missing package is named before any weight is read."""
    import logging

    from rlcore.plugins.hf.train import HFOptions

    batch = make_batch()

    def loss_fn(outputs, micro):
        return -(outputs.logprobs() * micro["attention_mask"]).sum() / micro["attention_mask"].sum(), {}

    with caplog.at_level(logging.INFO, logger="rlcore"):
        liger = HFTrainEngine(tiny_model, liger_kernel=True, learning_rate=1e-3)
    plain = HFTrainEngine(tiny_model, learning_rate=1e-3)
    assert "liger-kernel's kernels run on CUDA only" in caplog.text
    assert type(liger.model.model.norm) is type(plain.model.model.norm)
    assert liger.train_step(batch, loss_fn, 2) == plain.train_step(batch, loss_fn, 2)
    import importlib.util

    from rlcore.plugins.hf import make_forward_engine, make_train_engine

    # a config's engine_kwargs reach both engines (the factories once refused the hf engine's own keys)
    assert make_train_engine(model=tiny_model, liger_kernel=True, chunked_lm_head=False).chunked_lm_head is False
    assert make_forward_engine(model=tiny_model, liger_kernel=True, chunked_lm_head=False).forward_only
    problems = dict(HFOptions(model=tiny_model, device="cuda", liger_kernel=True).problems())
    if importlib.util.find_spec("liger_kernel") is None:  # this machine's case: CI installs no liger-kernel
        assert "pip install liger-kernel" in problems["liger_kernel"]
    else:
        assert "liger_kernel" not in problems


@pytest.mark.parametrize("chunked", [True, False])
def test_a_right_padded_batch_reaches_the_model_without_a_mask_and_gives_the_same_step(tiny_model, chunked, monkeypatch):
    """Right padding under causal attention: no real token sees a pad, so the decoder is called without a mask
    (transformers then builds none and SDPA runs causal) and the step equals the masked one; a mask with a pad
    before a real token is passed on."""
    import rlcore.plugins.hf.common as common

    def decoder_masks(engine: HFTrainEngine) -> list:
        seen: list = []
        engine.model.base_model.register_forward_pre_hook(
            lambda module, args, kwargs: seen.append(kwargs.get("attention_mask")), with_kwargs=True)
        return seen

    batch = make_batch()
    unmasked = HFTrainEngine(tiny_model, chunked_lm_head=chunked, **LINEAR_ADAM)
    want = reference_logprobs(unmasked.model, batch)  # the model given the mask
    seen = decoder_masks(unmasked)
    got = unmasked.forward_logprobs(batch)
    assert len(seen) == 1 and seen[0] is None
    mask = batch["attention_mask"].bool()
    torch.testing.assert_close(got[mask], want[mask], atol=1e-5, rtol=1e-5)
    before = params(unmasked)
    unmasked.train_step(batch, nll_loss, micro_batch_size=3)
    assert len(seen) == 3 and all(m is None for m in seen)

    with monkeypatch.context() as patch:  # the same step with the mask given to the model
        patch.setattr(common, "right_padded", lambda host_mask: False)
        masked = HFTrainEngine(tiny_model, chunked_lm_head=chunked, **LINEAR_ADAM)
        seen = decoder_masks(masked)
        masked.train_step(batch, nll_loss, micro_batch_size=3)
    assert len(seen) == 2 and all(isinstance(m, torch.Tensor) for m in seen)
    after_masked, after = params(masked), params(unmasked)
    assert any(not torch.equal(after[n], before[n]) for n in before)
    for name in before:
        torch.testing.assert_close(after[name] - before[name], after_masked[name] - before[name], atol=1e-5, rtol=1e-4)

    holed = make_batch()
    holed["attention_mask"][1, 0] = 0  # a pad before real tokens: not right padding
    engine = HFTrainEngine(tiny_model, chunked_lm_head=chunked)
    seen = decoder_masks(engine)
    engine.forward_logprobs(holed)
    assert len(seen) == 1 and isinstance(seen[0], torch.Tensor)


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.prelease)])
def test_torch_compile_compiles_each_decoder_layer_in_place_and_gives_the_same_step(tiny_model, backend):
    """`torch_compile` compiles every decoder layer in place: the parameter names stay (weight sync and saving
    see the same model), dynamo runs at each layer's call, and the log-probs and a train step over micro-batches
    of two widths equal the eager engine's. aot_eager traces through dynamo and AOTAutograd like inductor does,
    without the code generation (inductor: `prelease`)."""
    import torch._dynamo

    torch._dynamo.reset()
    batch = make_batch(rows=6, width=12)
    batch["attention_mask"][3:, 9:] = 0  # the second micro-batch trims to another width
    eager = HFTrainEngine(tiny_model, **LINEAR_ADAM)
    compiled = HFTrainEngine(tiny_model, torch_compile=True, torch_compile_backend=backend, **LINEAR_ADAM)
    layers = [m for m in compiled.model.modules() if type(m).__name__ == "Qwen2DecoderLayer"]
    assert layers and all(layer._compiled_call_impl is not None for layer in layers)
    assert [n for n, _ in compiled.model.named_parameters()] == [n for n, _ in eager.model.named_parameters()]
    frames: list = []
    from torch._dynamo import callback_handler

    def on_compile(*_args) -> None:
        frames.append(1)

    callback_handler.register_start_callback(on_compile)
    try:
        torch.testing.assert_close(compiled.forward_logprobs(batch), eager.forward_logprobs(batch), atol=1e-5, rtol=1e-5)
        before = params(eager)
        stats_eager = eager.train_step(batch, nll_loss, micro_batch_size=3)
        stats_compiled = compiled.train_step(batch, nll_loss, micro_batch_size=3)
    finally:
        callback_handler.remove_start_callback(on_compile)
    assert frames, "dynamo compiled nothing"
    assert stats_compiled["nll"] == pytest.approx(stats_eager["nll"], rel=1e-5)
    after_eager, after = params(eager), params(compiled)
    assert any(not torch.equal(after_eager[n], before[n]) for n in before)
    for name in before:
        torch.testing.assert_close(after[name] - before[name], after_eager[name] - before[name], atol=1e-5, rtol=1e-4)


def test_torch_compile_options_are_checked(tiny_model):
    with pytest.raises(ConfigError, match="torch_compile_backend.*'inducter' is not a torch.compile backend"):
        HFTrainEngine(tiny_model, torch_compile=True, torch_compile_backend="inducter")
    with pytest.raises(ConfigError, match="torch_compile_mode.*'fast' is not a torch.compile mode"):
        HFTrainEngine(tiny_model, torch_compile=True, torch_compile_mode="fast")
    for mode in ("reduce-overhead", "max-autotune"):  # CUDA graphs: GKD crashed with them on the H200
        with pytest.raises(ConfigError, match=f"torch_compile_mode='{mode}' replays CUDA graphs.*max-autotune-no-cudagraphs"):
            HFTrainEngine(tiny_model, torch_compile=True, torch_compile_mode=mode)


@pytest.mark.parametrize("plugin", ["gkd", "grpo"])
def test_the_train_engines_options_are_checked_before_any_engine_is_built(plugin, tmp_path, capsys, monkeypatch):
    """`train.engine_kwargs` is checked by the hf engine's `EngineSpec.check` with the config: `rlcore config
    validate` refuses a typo (naming the closest option) and a bad value (naming the choices) at their key paths,
    and `rlcore run` stops with the same error before it builds any engine (on a GPU run: before any worker takes
    a GPU)."""
    from rlcore.cli import main

    typo, bad = tmp_path / "typo.yaml", tmp_path / "bad.yaml"
    models = "model: tiny\n" + ("teacher_model: tiny:teacher\n" if plugin == "gkd" else "")
    typo.write_text(models + "train:\n  engine_kwargs: {chunked_lm_hed: false}\n")
    bad.write_text(models + "train:\n  engine_kwargs: {torch_compile: true, torch_compile_mode: fast}\n")
    assert main(["config", "validate", "--plugin", plugin, "--config", str(typo)]) == 2
    assert ("train.engine_kwargs.chunked_lm_hed: hf train engine has no option 'chunked_lm_hed'. "
            "Did you mean 'chunked_lm_head'?") in capsys.readouterr().err
    assert main(["config", "validate", "--plugin", plugin, "--config", str(bad)]) == 2
    mode = "train.engine_kwargs.torch_compile_mode: torch_compile_mode='fast' is not a torch.compile mode; one of None"
    assert mode in capsys.readouterr().err

    def built(*args, **kwargs):
        raise AssertionError("an engine was built")

    monkeypatch.setattr(HFTrainEngine, "__init__", built)
    assert main(["run", "--plugin", plugin, "--config", str(bad), f"output_dir={tmp_path / 'run'}"]) == 2
    assert mode in capsys.readouterr().err
    good = tmp_path / "good.yaml"
    good.write_text(models + "train:\n  engine_kwargs: {torch_compile: true, torch_compile_mode: max-autotune-no-cudagraphs}\n")
    assert main(["config", "validate", "--plugin", plugin, "--config", str(good)]) == 0
