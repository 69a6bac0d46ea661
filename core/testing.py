"""What tests, demos and benchmarks run on without a download: a tiny model, an offline tokenizer, a toy task.

`build_tiny_model(path)` writes a tiny, randomly initialised Hugging Face model directory, offline and
deterministically; `build_tokenizer()` is its byte-level tokenizer, built without a download; `toy_dataset`
and `toy_reward` are the embedded "write vowels" task every algorithm's demo runs (see TOY TASK below).

The model directory is an ordinary one (config.json, model.safetensors, tokenizer files with a ChatML chat
template), so everything that loads a real model loads it: `AutoTokenizer.from_pretrained(path)`,
`AutoModelForCausalLM.from_pretrained(path)`, vLLM, TRL. Tests, the demos and the benchmarks use it instead
of downloading weights.

A config names them with `tiny` (see TINY NAMES below): `model: tiny` is the tiny model, `tiny:teacher` a wider
one with peaked distributions, `dataset: tiny:toy` (or `tiny:chat`, `tiny:sft`, `tiny:pt`) a small dataset.
`resolve_tiny(config, root)` builds the models a config names under `root` (a run's output_dir; the datasets in
the temporary directory) and returns the config with their paths, so every algorithm loads them as it loads any model or file; the demo presets
(`examples/demo/*.yaml`) are ordinary configs that name them.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

from .data import completion_text
from .errors import ConfigError

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen2's ChatML template, without the default system prompt (every token counts on a CPU).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# A few merges of frequent English pairs (in byte-level spelling) so that text is not one token per byte.
MERGES = (("Ġ", "t"), ("h", "e"), ("Ġ", "a"), ("i", "n"), ("e", "r"), ("Ġt", "he"), ("o", "n"), ("r", "e"))
# Architectures build_tiny_model writes: name -> (transformers config class, what the tiny shape adds to it). Each is
# transformers' default config with only the sizes changed (widths, heads, layers, experts, Gemma 3's window of 16 so
# that rows run past it), plus two choices: the embeddings tied (as the small published checkpoints of Qwen2.5,
# Qwen3, Llama 3.2 and Gemma 3 are; `qwen2_untied` is not), and in 2 layers one of each kind (Qwen3.5: linear, then
# full attention; Gemma 3: sliding, then full), where the default pattern would give only the first kind.
ARCH_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2": ("Qwen2Config", {}),
    "qwen2_untied": ("Qwen2Config", {"tie_word_embeddings": False}),
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {}),
    "qwen3": ("Qwen3Config", {}),
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_5": ("Qwen3_5TextConfig", {"linear_num_key_heads": 2, "linear_num_value_heads": 4,
                                      "linear_conv_kernel_dim": 4}),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", {"num_experts": 4, "num_experts_per_tok": 2,
                                             "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                                             "linear_conv_kernel_dim": 4}),
    "gemma3": ("Gemma3TextConfig", {"sliding_window": 16}),
}
ARCHS = tuple(ARCH_CONFIGS)
# Architectures published with a vision tower (`build_tiny_model(vision=True)`): name -> the published config class;
# the vision tower is transformers' default with only the sizes made tiny (`out_hidden_size`: the language model's width)
CONDITIONAL: dict[str, str] = {"qwen3_5": "Qwen3_5Config", "qwen3_5_moe": "Qwen3_5MoeConfig"}
VISION_SHAPE = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "num_position_embeddings": 64}
MARKER = "rlcore_tiny.json"


def build_tiny_model(
    path: str | os.PathLike,
    arch: str = "qwen2",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 1024,
    seed: int = 0,
    num_labels: int | None = None,
    vocab_size: int | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    replace: bool = True,
    vision: bool = False,
) -> Path:
    """Write a tiny `arch` model with random weights and a byte-level tokenizer to `path`; return it.

    `num_labels` builds a sequence-classification model (an outcome reward model) instead of a causal LM.
    `vocab_size` grows the tokenizer with synthetic merges to that many ids (a model shaped like a real
    one, e.g. Qwen2-0.5B's for the GPU benchmark); `dtype` is the dtype the weights are saved in.
    `device="cuda"` draws the random weights on the GPU: seconds for a 1.5B shape that takes minutes on the
    CPU (other random numbers, so another model; the directory records the device). `vision` (Qwen3.5 and
    Qwen3.5-MoE) builds the model as it is published, `*ForConditionalGeneration`: that language model and a
    two-block vision tower (`VISION_SHAPE`, transformers' default vision config otherwise).
    Calling again with the same arguments returns the existing directory without rebuilding it; with other
    arguments it is rebuilt, unless `replace=False` (a demo's model in a run's output_dir, which another run
    may be using): then that is a ConfigError.
    """
    args = dict(
        arch=arch, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
        num_kv_heads=num_kv_heads, intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings, seed=seed, num_labels=num_labels,
        vocab_size=vocab_size, dtype=dtype,
    )
    if device != "cpu":  # recorded only off the CPU, so directories built before this key still match
        args["device"] = device
    if vision:  # recorded only when set, as the device
        args["vision"] = True
    _check(args)
    path = Path(path)
    marker = path / MARKER
    if _built_as(path, args, replace):
        return path
    if path.exists() and any(path.iterdir()) and not marker.is_file():
        raise ConfigError(
            f"build_tiny_model: '{path}' exists and was not built by build_tiny_model; "
            "pass an empty or new directory"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        if vocab_size not in _TOKENIZERS:  # a student and a teacher of one vocabulary share the build
            _TOKENIZERS[vocab_size] = build_tokenizer(vocab_size)
        tokenizer = _TOKENIZERS[vocab_size]
        model = _build_model(tokenizer, args)
        try:
            tokenizer.save_pretrained(tmp)
            model.save_pretrained(tmp)
            (tmp / MARKER).write_text(json.dumps(args, indent=2))
        except Exception as exc:  # a full disk, a file size limit: safetensors' own error carries no path
            from .errors import RlcoreError

            reason = " ".join(str(exc).split())[:300] or type(exc).__name__
            raise RlcoreError(f"cannot write the tiny model to {path}: {reason}; free space there") from None
        if path.exists() and replace:
            shutil.rmtree(path)
        try:
            os.replace(tmp, path)  # fails where a non-empty directory is: another process built it meanwhile
        except OSError:
            if not _built_as(path, args, replace):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


_TOKENIZERS: dict[int | None, Any] = {}  # build_tiny_model's tokenizers by vocabulary size, built once a process


def _built_as(path: Path, args: dict[str, Any], replace: bool) -> bool:
    """`path` holds the tiny model of `args`; one of other arguments is a ConfigError unless `replace`."""
    marker = path / MARKER
    built = json.loads(marker.read_text()) if marker.is_file() else None
    if built is not None and built != args and not replace:
        changed = ", ".join(f"{k} {built.get(k)!r} (now {v!r})" for k, v in args.items() if built.get(k) != v)
        raise ConfigError(f"'{path}' holds a tiny model built with other settings ({changed}), which another run "
                          f"may be using, so it is not rebuilt; choose another output_dir, or remove {path}",
                          [("output_dir", f"'{path}' holds a tiny model built with {changed}")])
    return built == args


def _synthetic_merges(vocab: dict[str, int], merges: list[tuple[str, str]], size: int) -> None:
    """Grow `vocab` to `size` tokens with merges of existing tokens (seeded, so the same every time)."""
    import random

    rng = random.Random(0)
    draw = rng._randbelow  # what rng.choice draws with: the same sequence, without a call per choice
    tokens = list(vocab)
    lengths = [len(t) for t in tokens]
    while len(vocab) < size:
        i, j = draw(len(tokens)), draw(len(tokens))
        if lengths[i] + lengths[j] > 8:
            continue
        merged = tokens[i] + tokens[j]
        if merged in vocab:
            continue
        vocab[merged] = len(vocab)
        merges.append((tokens[i], tokens[j]))
        tokens.append(merged)
        lengths.append(len(merged))


def build_tokenizer(vocab_size: int | None = None) -> Any:
    """A byte-level BPE tokenizer (every byte is a token, plus a few merges) with ChatML special tokens;
    `vocab_size` adds synthetic merges until the tokenizer has that many ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    merges = list(MERGES)
    for left, right in merges:
        vocab[left + right] = len(vocab)
    if vocab_size is not None:
        _synthetic_merges(vocab, merges, vocab_size - len(SPECIAL_TOKENS))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 20,
    )
    return tokenizer


def _check(args: dict[str, Any]) -> None:
    problems = []
    if args["arch"] not in ARCHS:
        problems.append(f"arch={args['arch']!r} is not one of {', '.join(ARCHS)}")
    for key in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "max_position_embeddings"):
        if not isinstance(args[key], int) or args[key] < 1:
            problems.append(f"{key}={args[key]!r} must be a positive int")
    if not problems:
        if args["hidden_size"] % args["num_heads"]:
            problems.append(f"hidden_size={args['hidden_size']} must be a multiple of num_heads={args['num_heads']}")
        if args["num_heads"] % args["num_kv_heads"]:
            problems.append(f"num_heads={args['num_heads']} must be a multiple of num_kv_heads={args['num_kv_heads']}")
        if args.get("vision") and args["arch"] not in CONDITIONAL:
            problems.append(f"vision=True builds {', '.join(CONDITIONAL)} only, not {args['arch']}")
        if args["arch"].startswith("qwen3_5") and args["num_layers"] < 2:
            problems.append(f"num_layers={args['num_layers']} must be >= 2 for {args['arch']}: its layers alternate "
                            "linear and full attention, and with linear attention alone transformers' cache has no "
                            "attention layer to size masks by (generation stops in get_mask_sizes)")
    minimum = 256 + len(MERGES) + len(SPECIAL_TOKENS)
    if args["vocab_size"] is not None and (not isinstance(args["vocab_size"], int) or args["vocab_size"] < minimum):
        problems.append(f"vocab_size={args['vocab_size']!r} must be None or an int >= {minimum}")
    if args["dtype"] not in ("float32", "bfloat16", "float16"):
        problems.append(f"dtype={args['dtype']!r} is not one of float32, bfloat16, float16")
    if args["num_labels"] is not None and (not isinstance(args["num_labels"], int) or args["num_labels"] < 1):
        problems.append(f"num_labels={args['num_labels']!r} must be None or a positive int")
    if problems:
        raise ConfigError("build_tiny_model: " + "; ".join(problems), [(p.split("=")[0], p) for p in problems])


def _shape_keys(args: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """The architecture's own keys at the tiny shape: experts of half the MLP width, every other layer linear
    attention (Qwen3.5), `tie_word_embeddings` where the architecture overrides it."""
    keys = dict(extra)
    if "num_experts" in keys:
        keys["moe_intermediate_size"] = max(args["intermediate_size"] // 2, 1)
    if args["arch"] == "qwen3_5_moe":
        keys["shared_expert_intermediate_size"] = args["intermediate_size"]
    if args["arch"].startswith("qwen3_5"):
        keys["layer_types"] = ["linear_attention" if i % 2 == 0 else "full_attention" for i in range(args["num_layers"])]
        keys["linear_key_head_dim"] = keys["linear_value_head_dim"] = max(args["hidden_size"] // args["num_heads"], 4)
    if args["arch"] == "gemma3":
        keys["layer_types"] = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(args["num_layers"])]
    return keys


def _build_model(tokenizer: Any, args: dict[str, Any]) -> Any:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, GenerationConfig

    class_name, extra = ARCH_CONFIGS[args["arch"]]
    config = getattr(transformers, class_name)(
        vocab_size=len(tokenizer),
        hidden_size=args["hidden_size"],
        intermediate_size=args["intermediate_size"],
        num_hidden_layers=args["num_layers"],
        num_attention_heads=args["num_heads"],
        num_key_value_heads=args["num_kv_heads"],
        max_position_embeddings=args["max_position_embeddings"],
        **{"tie_word_embeddings": True, **_shape_keys(args, extra)},
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype=args["dtype"],
    )
    if args["arch"] in ("qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "gemma3"):
        config.head_dim = args["hidden_size"] // args["num_heads"]
    torch.manual_seed(args["seed"])
    if args.get("vision"):
        config = getattr(transformers, CONDITIONAL[args["arch"]])(
            text_config=config.to_dict(), vision_config={**VISION_SHAPE, "out_hidden_size": args["hidden_size"]},
            tie_word_embeddings=config.tie_word_embeddings, dtype=args["dtype"])
        from transformers import AutoModelForImageTextToText

        with torch.device(args.get("device", "cpu")):
            model = AutoModelForImageTextToText.from_config(config, dtype=getattr(torch, args["dtype"]))
        model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        return model
    if args["num_labels"] is not None:
        config.num_labels = args["num_labels"]
        return AutoModelForSequenceClassification.from_config(config)
    with torch.device(args.get("device", "cpu")):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args["dtype"]))
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    return model


# -------------------------------------------------------------------------------------------------
# TOY TASK: The embedded default task: "write vowels". What `rlcore run --plugin grpo` trains when no dataset is given.
# 
# Prompts ask for a word ("Write a word:", "Say something:", ...); the reward (`toy`, registered by the rewards
# plugin) is the fraction of the completion's characters that are in the row's `target` column ("aeiou").
# 
# Why this task: a tiny random-weight byte-level model (every byte a token, ~260 ids) starts near uniform,
# so a completion's reward is small but rarely zero over ~16-24 tokens, groups of 8 almost always differ
# (nonzero std, so GRPO gets a signal every step), and the policy only has to shift probability mass onto
# 5 of ~260 tokens, which it can do in a few dozen steps without understanding the prompt.
# 
# Chance level: a uniform policy over the 256 byte tokens emits a target byte with probability 5/256, so its
# expected reward is about 5/256 = 0.0195 (`RANDOM_POLICY_REWARD`). The tiny model's tokenizer
# (build_tokenizer: 267 ids, with merges such as "in", "he", "er" that carry vowels, and invalid UTF-8
# runs decoding to replacement characters) raises that to about 0.044; `chance_reward(tokenizer)` measures it
# for any tokenizer. A policy scoring several times that has visibly learned: a plain GRPO loop (8 prompts x 8
# generations, 20 tokens, AdamW lr 1e-3, 2 CPU threads) went from 0.045 to 0.26 in 40 steps (80 s).
# An empty completion scores 0, so stopping at once is not a way out.
# -------------------------------------------------------------------------------------------------

TARGET = "aeiou"
RANDOM_POLICY_REWARD = len(TARGET) / 256
PROMPTS = (
    "Write a word:",
    "Say something:",
    "Type a word:",
    "Write something:",
    "Give me a word:",
    "Say a word:",
    "Write:",
    "Word:",
)


def toy_dataset(n: int = 256, seed: int = 0) -> list[dict[str, Any]]:
    """`n` rows `{"prompt": ..., "target": "aeiou"}`, prompts drawn from PROMPTS with a seeded generator."""
    rng = random.Random(seed)
    return [{"prompt": rng.choice(PROMPTS), "target": TARGET} for _ in range(n)]


def chance_reward(tokenizer: Any, completion_length: int = 20, samples: int = 2000, seed: int = 0) -> float:
    """The toy reward a uniform random policy over `tokenizer`'s ids earns in expectation (a seeded estimate).

    Each sample is `completion_length` uniform ids, cut at the first eos as generation would cut it.
    """
    rng = random.Random(seed)
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    texts = []
    for _ in range(samples):
        ids = [rng.randrange(vocab) for _ in range(completion_length)]
        ids = ids[: ids.index(eos)] if eos in ids else ids
        texts.append(tokenizer.decode(ids, skip_special_tokens=True))
    rewards = toy_reward([""] * samples, texts)
    return sum(r for r in rewards if r is not None) / samples


def toy_reward(prompts: list[Any], completions: list[Any], completion_ids: list[list[int]] | None = None,
               **columns: Any) -> list[float | None]:
    """Fraction of the completion's characters found in its row's `target` (default "aeiou"); 0 when empty."""
    targets = columns.get("target") or [TARGET] * len(completions)
    rewards: list[float | None] = []
    for completion, target in zip(completions, targets):
        text = completion_text(completion)
        rewards.append(sum(ch in target for ch in text) / len(text) if text else 0.0)
    return rewards


# -------------------------------------------------------------------------------------------------------
# TINY NAMES: what `tiny` in a config's model and dataset keys builds, in the run's output_dir
# -------------------------------------------------------------------------------------------------------

TINY = "tiny"
TEACHER_SHARPNESS = 12.0  # `tiny:teacher`: its final norm scaled up, so that its distributions are peaked
CHAT_PROMPTS = ("Write a word:", "Say something:", "Name a color:", "Count:", "Give me a word:", "Say a word:",
                "Write:", "Word:", "Tell me a fact:", "Greet me:")
CHAT_COMPLETIONS = ("apple", "the sea is blue", "red and green", "one two three", "hello there", "a tree",
                    "sun", "the end", "water is wet", "hi")


def is_tiny(name: Any) -> bool:
    """`name` is one of the names `resolve_tiny` builds: `tiny` or `tiny:<what>`."""
    return isinstance(name, str) and (name == TINY or name.startswith(TINY + ":"))


def chat_rows(n: int = 256, seed: int = 0, heldout: int = 0) -> list[dict[str, Any]]:
    """`tiny:chat`: short prompt/completion pairs drawn from fixed lists with a seeded generator; the last
    `heldout` rows draw from the lists' last three entries, which the other rows never use."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        part = slice(-3, None) if i >= n - heldout else slice(None, -3)
        rows.append({"prompt": rng.choice(CHAT_PROMPTS[part]), "completion": rng.choice(CHAT_COMPLETIONS[part])})
    return rows


def arithmetic_rows(kind: str, n: int = 256, seed: int = 0) -> list[dict[str, Any]]:
    """`tiny:sft` and `tiny:pt`: toy arithmetic as conversations (`sft`) or sentences (`pt`), which a tiny model
    learns within a few dozen steps."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        if kind == "sft":
            rows.append({"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                                      {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]})
        else:
            rows.append({"text": f"The sum of {a} and {b} is {a + b}. "})
    return rows


def build_tiny_teacher(root: str | os.PathLike, seed: int = 0) -> Path:
    """`tiny:teacher`: a wider tiny model (the tokenizer of `tiny`, other weights) whose final norm is scaled up,
    so its distributions are peaked (a near-uniform random teacher would leave a student nothing to learn)."""
    root = Path(root)
    teacher = root / "tiny-teacher"
    base = build_tiny_model(root / "tiny-teacher-base", hidden_size=96, intermediate_size=192, num_layers=2,
                            num_heads=4, num_kv_heads=2, seed=seed + 1, replace=False)
    if not (teacher / "config.json").is_file():
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(base)
        with torch.no_grad():
            model.model.norm.weight.mul_(TEACHER_SHARPNESS)
        tmp = Path(tempfile.mkdtemp(prefix=".tiny-teacher.", dir=root))
        try:
            model.save_pretrained(tmp)
            AutoTokenizer.from_pretrained(base).save_pretrained(tmp)
            try:
                os.replace(tmp, teacher)
            except OSError:  # another process built it meanwhile
                if not (teacher / "config.json").is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return teacher


_FOLDERS = {TINY: ("tiny-model",), TINY + ":teacher": ("tiny-teacher", "tiny-teacher-base")}
_built: list[Path] = []  # the folders `tiny_model` made in this process (a run refused while built removes them)


def tiny_model(name: str, root: str | os.PathLike, seed: int = 0) -> str:
    """The directory `name` (`tiny`, `tiny:teacher`) names, built under `root` with `seed` (once)."""
    if name not in _FOLDERS:
        raise ConfigError(f"model '{name}' is not a tiny model; known: tiny, tiny:teacher")
    fresh = [Path(root) / folder for folder in _FOLDERS[name] if not (Path(root) / folder).exists()]
    if name == TINY:
        path = build_tiny_model(Path(root) / "tiny-model", seed=seed, replace=False)  # never another run's
    else:
        path = build_tiny_teacher(root, seed)
    _built.extend(fresh)
    return str(path)


def remove_built_tiny_models(root: str | os.PathLike, made_root: bool = False) -> None:
    """Remove the tiny models this process built under `root`, and with `made_root` (this run made `root`)
    `root` itself where that left it empty: what a run refused while it was built wrote there, and nothing
    else (another run's files stay)."""
    root = Path(root).resolve()
    for folder in [f for f in _built if f.resolve().parent == root]:
        shutil.rmtree(folder, ignore_errors=True)
        _built.remove(folder)
    if made_root:
        with contextlib.suppress(OSError):
            root.rmdir()  # only when empty


def tiny_dataset(name: str, seed: int = 0, heldout: int = 0) -> str:
    """The JSONL file `name` (`tiny:toy`, `tiny:chat`, `tiny:sft`, `tiny:pt`) names with `seed` (and, for
    `tiny:chat`, its last `heldout` rows held out), written once into the temporary directory's `rlcore-tiny`
    folder: a file per name and seed, never in a run's output_dir."""
    what = name.removeprefix(TINY + ":")
    rows = {"toy": lambda: toy_dataset(seed=seed), "chat": lambda: chat_rows(seed=seed, heldout=heldout),
            "sft": lambda: arithmetic_rows("sft", seed=seed), "pt": lambda: arithmetic_rows("pt", seed=seed)}
    if what not in rows:
        raise ConfigError(f"dataset '{name}' is not a tiny dataset; known: {', '.join('tiny:' + k for k in rows)}")
    held = f"-heldout{heldout}" if what == "chat" else ""
    path = Path(tempfile.gettempdir()) / "rlcore-tiny" / f"{what}-seed{seed}{held}.jsonl"
    text = "".join(json.dumps(r) + "\n" for r in rows[what]())
    if not (path.is_file() and path.read_text() == text):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    return str(path)


def resolve_tiny(config: Any, root: str | os.PathLike | None = None) -> Any:
    """`config` (a pydantic model) with each `tiny` name among its model and dataset keys (top level: `model`,
    `*_model`, `dataset`; a section's `model`) replaced by the path it names, built with the config's seed: models
    under `root` (default: the config's output_dir), datasets by `tiny_dataset`. A config without such names is
    returned as it is."""
    root = Path(root if root is not None else getattr(config, "output_dir", "output")).expanduser().resolve()
    seed, heldout = int(getattr(config, "seed", 0) or 0), int(getattr(config, "eval_size", 0) or 0)

    def model_keys(section: Any, top: bool) -> dict[str, Any]:
        update = {}
        for key in type(section).model_fields:
            value = getattr(section, key)
            if key == "dataset" and top:
                if is_tiny(value):
                    update[key] = tiny_dataset(value, seed, heldout)
                elif isinstance(value, list) and any(is_tiny(v) for v in value):
                    update[key] = [tiny_dataset(v, seed, heldout) if is_tiny(v) else v for v in value]
            elif (key == "model" or (top and key.endswith("_model"))) and is_tiny(value):
                update[key] = tiny_model(value, root, seed)
            elif top and hasattr(value, "model_fields") and "model" in type(value).model_fields:
                inner = model_keys(value, top=False)
                if inner:
                    update[key] = value.model_copy(update=inner)
        return update

    update = model_keys(config, top=True)
    return config.model_copy(update=update) if update else config


__all__ = [
    "PROMPTS", "RANDOM_POLICY_REWARD", "TARGET", "TINY", "arithmetic_rows", "build_tiny_model", "build_tiny_teacher",
    "build_tokenizer", "chance_reward", "chat_rows", "is_tiny", "resolve_tiny", "tiny_dataset", "tiny_model",
    "toy_dataset", "toy_reward",
]
