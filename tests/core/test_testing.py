"""build_tiny_model writes an ordinary Hugging Face directory: offline loading, ChatML, determinism, caching."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch

from rlcore import ConfigError
from rlcore.testing import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.getbasetemp() / "tiny-qwen2")


def _digest(path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_loads_offline_with_auto_classes(tiny_model, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.hidden_size == 64 and model.config.num_hidden_layers == 2
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")]
    assert ids == list(range(len(tokenizer) - 3, len(tokenizer)))  # after the bytes and merges, in Qwen's order
    for token, token_id in zip(("<|endoftext|>", "<|im_start|>", "<|im_end|>"), ids):
        assert tokenizer(token)["input_ids"] == [token_id] and tokenizer.decode([token_id]) == token


def test_byte_level_tokenizer_round_trips_any_text(tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    text = "The answer is 42.\n\tünïcödé ✓ 数学  double  spaces"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text.encode())  # the merges shorten English text
    assert "the" in tokenizer.convert_ids_to_tokens(tokenizer(" the")["input_ids"])[0]


def test_chat_template_is_chatml(tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "system\nBe brief.\nuser\n2+3?\nassistant\n"


def test_same_arguments_are_cached_and_seed_is_deterministic(tiny_model, tmp_path):
    before = (tiny_model / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model(tiny_model) == tiny_model
    assert (tiny_model / "model.safetensors").stat().st_mtime_ns == before

    again = build_tiny_model(tmp_path / "again")
    assert _digest(again) == _digest(tiny_model)
    other_seed = build_tiny_model(tmp_path / "again", seed=1)  # other arguments rebuild in place
    assert _digest(other_seed) != _digest(tiny_model)
    assert json.loads((other_seed / "rlcore_tiny.json").read_text())["seed"] == 1
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no temporary directory left


def test_llama_and_sequence_classification(tmp_path):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    llama = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "llama", arch="llama", hidden_size=32))
    assert llama.config.model_type == "llama" and llama.config.hidden_size == 32
    orm = AutoModelForSequenceClassification.from_pretrained(build_tiny_model(tmp_path / "orm", num_labels=1))
    assert orm.config.num_labels == 1 and orm.score.weight.shape == (1, 64)


def test_bad_arguments_are_reported_together(tmp_path):
    with pytest.raises(ConfigError) as err:
        build_tiny_model(tmp_path / "bad", arch="gpt9", hidden_size=30, num_heads=4, num_labels=0)
    message = str(err.value)
    assert "arch='gpt9'" in message and "num_labels=0" in message
    assert not (tmp_path / "bad").exists()
    with pytest.raises(ConfigError, match="multiple of num_heads"):
        build_tiny_model(tmp_path / "bad", hidden_size=30)
    with pytest.raises(ConfigError, match="num_layers=1 must be >= 2 for qwen3_5: its layers alternate linear and full"):
        build_tiny_model(tmp_path / "bad", arch="qwen3_5", num_layers=1)


def test_refuses_to_overwrite_a_foreign_directory(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="not built by build_tiny_model"):
        build_tiny_model(tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_vocab_size_and_dtype_shape_a_real_sized_model(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny_model(tmp_path / "wide", vocab_size=4096, dtype="bfloat16")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert len(tokenizer) == model.config.vocab_size == 4096
    assert model.dtype == torch.bfloat16
    text = "every id decodes; the text round-trips"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert tokenizer.decode(list(range(4096)))  # synthetic merges decode like any token
    with pytest.raises(ConfigError, match="vocab_size"):
        build_tiny_model(tmp_path / "small", vocab_size=10)


def test_a_model_of_other_settings_is_not_rebuilt_with_replace_false(tmp_path):
    built = build_tiny_model(tmp_path / "tiny-model", seed=1)  # a demo model another run uses
    with pytest.raises(ConfigError, match=r"other settings \(seed 1 \(now 2\)\).*not rebuilt"):
        build_tiny_model(tmp_path / "tiny-model", seed=2, replace=False)
    assert json.loads((built / "rlcore_tiny.json").read_text())["seed"] == 1
    assert build_tiny_model(tmp_path / "tiny-model", seed=1, replace=False) == built


ARCH_BLOCKS = {  # a module name each architecture's tiny model must have: the block that sets it apart
    "qwen2": "self_attn.q_proj", "qwen2_untied": "self_attn.q_proj", "llama": "self_attn.q_proj",
    "mistral": "self_attn.q_proj", "qwen3": "self_attn.q_norm", "qwen3_moe": "mlp.experts",
    "qwen3_5": "linear_attn", "qwen3_5_moe": "mlp.shared_expert", "gemma3": "pre_feedforward_layernorm",
}


@pytest.mark.parametrize("arch", sorted(ARCH_BLOCKS))
def test_every_architecture_builds_offline_and_generates(tmp_path, arch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlcore.testing import ARCHS

    assert set(ARCHS) == set(ARCH_BLOCKS)
    path = build_tiny_model(tmp_path / arch, arch=arch)
    model = AutoModelForCausalLM.from_pretrained(path)
    names = [name for name, _ in model.named_modules()]
    assert any(name.endswith(ARCH_BLOCKS[arch]) for name in names), arch
    assert model.config.tie_word_embeddings == (arch != "qwen2_untied")
    ids = AutoTokenizer.from_pretrained(path)(["Write a word:"], return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 4)


def test_tiny_names_resolve_to_what_they_build(tmp_path):
    """`model: tiny` and `dataset: tiny:toy` in a config become a model directory in `root` and a JSONL file of
    the toy task's rows (the config's seed); other values stay; an unknown tiny name says which are known."""
    import json

    from pydantic import BaseModel

    from rlcore.testing import resolve_tiny, toy_dataset

    class Section(BaseModel):
        model: str | None = None

    class Config(BaseModel):
        model: str = "tiny"
        dataset: str | list[str] = "tiny:toy"
        orm_model: str = "toy"
        seed: int = 3
        teacher: Section = Section()

    resolved = resolve_tiny(Config(), tmp_path)
    assert resolved.model == str(tmp_path / "tiny-model") and (tmp_path / "tiny-model" / "config.json").is_file()
    assert json.loads((tmp_path / "tiny-model" / "rlcore_tiny.json").read_text())["seed"] == 3
    rows = [json.loads(line) for line in open(resolved.dataset)]
    assert rows == toy_dataset(seed=3) and resolved.orm_model == "toy" and resolved.teacher.model is None
    plain = Config(model="/some/model", dataset=["a.jsonl"])
    assert resolve_tiny(plain, tmp_path) is plain
    with pytest.raises(ConfigError, match="known: tiny:toy, tiny:chat, tiny:sft, tiny:pt"):
        resolve_tiny(Config(dataset="tiny:nope"), tmp_path)


def test_a_full_disk_while_the_tiny_model_is_written_is_one_error_naming_the_folder(tmp_path):
    import subprocess
    import sys

    code = ("import resource; from rlcore.testing import build_tiny_model\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.RLIM_INFINITY))\n"
            "try:\n    build_tiny_model('m')\nexcept Exception as exc:\n    print(type(exc).__name__, exc)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.stdout.startswith("RlcoreError cannot write the tiny model to m: ") and "free space" in done.stdout, \
        done.stdout + done.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing half-written is left


def test_a_refused_build_removes_only_the_tiny_models_this_process_built(tmp_path):
    """What `rlcore run` does when a run is refused while it is built: the tiny model it built goes, and the
    output_dir where it made it; a tiny model another run built, and the user's files, stay."""
    from rlcore.testing import remove_built_tiny_models, tiny_model

    made = tmp_path / "new"
    tiny_model("tiny", made)
    remove_built_tiny_models(made, made_root=True)
    assert not made.exists()
    theirs = tmp_path / "theirs"
    tiny_model("tiny", theirs)
    (theirs / "notes.txt").write_text("the user's")
    remove_built_tiny_models(tmp_path / "elsewhere")  # another root: nothing of theirs goes
    assert (theirs / "tiny-model" / "config.json").is_file()
    mine = tmp_path / "mine"
    mine.mkdir()
    tiny_model("tiny", mine)
    remove_built_tiny_models(mine, made_root=False)  # the folder was there before the run: it stays, empty
    assert mine.is_dir() and list(mine.iterdir()) == []
    again = tmp_path / "again"
    build_tiny_model(again / "tiny-model", replace=False)  # another run's, with the same settings
    tiny_model("tiny", again)  # found, not built: this process did not write it
    remove_built_tiny_models(again, made_root=True)
    assert (again / "tiny-model" / "config.json").is_file()
