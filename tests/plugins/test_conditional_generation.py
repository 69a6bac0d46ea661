"""Qwen3.5 as published (`Qwen3_5ForConditionalGeneration`, and its MoE sibling) on the hf and megatron train
engines: they train its language model while its vision tower rides along unchanged; the engine's checkpoint and
`final/` hold every tensor of the published checkpoint in its names, so they load as their config says. What cannot
be trained is refused before any weight is read, in one line."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from rlcore import load_plugins
from rlcore.batch import Batch


def _tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def _batch() -> Batch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 260, (4, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    completion = mask.clone()
    completion[:, :3] = 0
    return Batch({"input_ids": ids * mask, "attention_mask": mask, "completion_mask": completion,
                  "batch_tokens": torch.full((4,), float(completion.sum()))})


def _nll(outputs, micro):
    mask = micro["completion_mask"].float()
    return -(outputs.logprobs() * mask).sum() / micro["batch_tokens"][0], {}


CASES = [("hf", "qwen3_5", 0), ("megatron", "qwen3_5", 0), ("hf", "qwen3_5", 4), ("megatron", "qwen3_5", 4),
         ("megatron", "qwen3_5_moe", 0), ("hf", "qwen3_5_moe", 0)]


@pytest.mark.parametrize("engine,arch,lora", CASES, ids=[f"{e}-{a}-lora{r}" for e, a, r in CASES])
def test_the_language_model_trains_and_the_vision_tower_comes_back_bit_for_bit(published_qwen3_5, tmp_path, engine, arch,
                                                                               lora):
    """Two train steps; the engine's checkpoint and `final/` (as a run writes it) against every tensor of the
    published checkpoint: the same names (the MoE's experts as the engine keeps them), the vision tower equal bit for
    bit, the language model's trained weights changed; `final/` loads as Qwen3.5 with its vision tower, and (full
    training) the checkpoint holds the same tensors and resumes into a new engine with the same log-probs."""
    from rlcore.export import write_hf_model

    if engine == "megatron":
        pytest.importorskip("megatron.core")
    make = load_plugins().engines.get(engine, kind="train").factory
    path = published_qwen3_5[arch]
    keys = dict(model=str(path), learning_rate=1e-2, seed=0)
    if lora:
        keys.update(lora_rank=lora, lora_alpha=2 * lora)
    trained = make(**keys)
    batch = _batch()
    for _ in range(2):
        trained.train_step(batch, _nll, micro_batch_size=2)
    write_hf_model(tmp_path / "final", trained.export_weights(), str(path))
    if not lora:
        trained.save(str(tmp_path / "checkpoint"))

    source, final = _tensors(path), _tensors(tmp_path / "final")
    fused = engine == "hf" and arch == "qwen3_5_moe"  # transformers 5 keeps a MoE's experts fused
    if not fused:
        assert final.keys() == source.keys()
    visual = [n for n in source if n.startswith("model.visual.")]
    assert visual and all(torch.equal(final[n], source[n]) for n in visual)
    language = [n for n in final if not n.startswith("model.visual.")]
    changed = {n for n in language if n in source and not torch.equal(final[n], source[n])}
    if lora:  # the merged adapters: attention's and the MLP's projections, nothing else
        assert changed and all(n.endswith("_proj.weight") or "in_proj" in n for n in changed), sorted(changed)
    else:  # every weight of the language model
        assert changed == {n for n in language if n in source}, sorted({n for n in language if n in source} - changed)
    from transformers import AutoModelForImageTextToText

    model, info = AutoModelForImageTextToText.from_pretrained(tmp_path / "final", output_loading_info=True)
    assert type(model).__name__.endswith("ForConditionalGeneration")
    assert not info["missing_keys"] and not info["unexpected_keys"], info

    if lora:  # its checkpoint holds the adapter alone, as for any checkpoint (test_hf_train, test_megatron_lora)
        return
    saved = _tensors(tmp_path / "checkpoint" / "model")
    assert saved.keys() == final.keys()
    assert all(torch.equal(saved[n], final[n]) for n in final)
    resumed = make(**keys)
    resumed.load(str(tmp_path / "checkpoint"))
    torch.testing.assert_close(resumed.forward_logprobs(batch), trained.forward_logprobs(batch), atol=0, rtol=0)


def test_what_cannot_be_trained_is_refused_before_any_weight_in_one_line(published_qwen3_5, tmp_path):
    """A conditional checkpoint that transformers has no causal LM for (Qwen2.5-VL): the hf engine's check names it;
    the megatron engine's names the architectures it maps; vLLM's LoRA sync, whose adapter names vLLM would not map
    into the conditional model, is refused for Qwen3.5 as published."""
    import transformers

    config = transformers.Qwen2_5_VLConfig(
        text_config={"vocab_size": 300, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                     "num_attention_heads": 2, "num_key_value_heads": 1},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 32})
    transformers.Qwen2_5_VLForConditionalGeneration(config).save_pretrained(tmp_path / "vl")
    engines = load_plugins().engines
    problems = engines.get("hf", kind="train").check(model=str(tmp_path / "vl"))
    assert len(problems) == 1 and problems[0][0] == "model" and "\n" not in problems[0][1]
    assert "(Qwen2_5_VLForConditionalGeneration): transformers" in problems[0][1]
    assert "has no causal LM for Qwen2_5_VLConfig, so its language model cannot be trained alone" in problems[0][1]
    assert engines.get("hf", kind="train").check(model=str(published_qwen3_5["qwen3_5"])) == []
    pytest.importorskip("megatron.core")
    megatron = engines.get("megatron", kind="train").check(model=str(tmp_path / "vl"))
    assert [key for key, _ in megatron] == ["model"]
    assert "Qwen2_5_VLForConditionalGeneration has no Hugging Face <-> megatron mapping" in megatron[0][1]
    assert engines.get("megatron", kind="train").check(model=str(published_qwen3_5["qwen3_5_moe"])) == []
    from rlcore.plugins.vllm.engine import check_options

    refused = check_options(model=str(published_qwen3_5["qwen3_5"]), vllm_enable_lora=True)
    assert [key for key, _ in refused] == ["vllm_enable_lora"] and "vllm_enable_lora: false" in refused[0][1]
