"""load_prompts on real JSONL, JSON and Parquet files; errors name file, row and column; PromptSampler order."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from rlcore import ConfigError
from rlcore.data import PromptSampler, load_prompts

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1?"}]
ROWS = [
    {"prompt": "Write a word:", "solution": "a"},
    {"prompt": CHAT, "solution": "2"},
    {"messages": CHAT + [{"role": "assistant", "content": "2"}], "solution": "2"},
]


def write_jsonl(path, rows, extra_lines=()):
    lines = [json.dumps(r) for r in rows] + list(extra_lines)
    path.write_text("\n".join(lines) + "\n")
    return path


def check_rows(rows):
    assert [r["prompt"] for r in rows] == ["Write a word:", CHAT, CHAT]  # the assistant answer is dropped
    assert [r["solution"] for r in rows] == ["a", "2", "2"]  # other columns pass through
    assert rows[2]["messages"][-1]["role"] == "assistant"


def test_jsonl(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n" + "\n".join(json.dumps(r) for r in ROWS[1:]) + "\n")
    check_rows(load_prompts(path))


@pytest.mark.parametrize("wrapped", [False, True])
def test_json(tmp_path, wrapped):
    path = tmp_path / "d.json"
    path.write_text(json.dumps({"data": ROWS} if wrapped else ROWS))
    check_rows(load_prompts(str(path)))


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": r.get("prompt"), "messages": r.get("messages"), "solution": r["solution"]}
                                         for r in ROWS[1:]] ), path)
    rows = load_prompts(path)
    assert [r["prompt"] for r in rows] == [CHAT, CHAT] and rows[0]["solution"] == "2"
    pq.write_table(pa.Table.from_pylist([{"question": "x"}, {"question": "y"}]), tmp_path / "bad.parquet")
    with pytest.raises(ConfigError, match=r"bad.parquet': rows 1, 2, column 'prompt' is missing"):
        load_prompts(tmp_path / "bad.parquet")


def test_jsonl_errors_name_file_line_and_column(tmp_path):
    path = write_jsonl(
        tmp_path / "bad.jsonl",
        [{"prompt": "ok"}],
        [
            "{not json",  # line 2
            "[1, 2]",  # line 3
            json.dumps({"prompt": 5}),  # line 4
            json.dumps({"question": "?"}),  # line 5
            json.dumps({"prompt": [{"role": "user"}]}),  # line 6
            json.dumps({"messages": [{"role": "assistant", "content": "x"}]}),  # line 7
            json.dumps({"prompt": ""}),  # line 8
        ],
    )
    with pytest.raises(ConfigError) as info:
        load_prompts(path)
    message = str(info.value)
    assert str(path) in message
    for expected in (
        "row 2 is not valid JSON",
        "row 3 is a list, not an object",
        "row 4, column 'prompt' must be a non-empty list of messages; got int",
        "row 5, column 'prompt' is missing or null (a row needs a 'prompt' or a 'messages' column)",
        "row 6, column 'prompt' message 1 has no 'content'",
        "row 7, column 'messages' has only an assistant message",
        "row 8, column 'prompt' is an empty string",
    ):
        assert expected in message
    assert len(info.value.problems) == 7  # every problem, each with its place
    assert info.value.problems[0] == (f"{path}: row 2", "is not valid JSON (Expecting property name enclosed in double quotes at column 2)")


def test_json_errors(tmp_path):
    (tmp_path / "a.json").write_text('{"rows": []}')
    with pytest.raises(ConfigError, match=r"a.json' must hold a list of objects or \{\"data\": \[...\]\}; it holds a dict"):
        load_prompts(tmp_path / "a.json")
    (tmp_path / "b.json").write_text("[{\"prompt\": 1},")
    with pytest.raises(ConfigError, match=r"b.json' is not valid JSON: .* at line 1"):
        load_prompts(tmp_path / "b.json")
    (tmp_path / "c.json").write_text(json.dumps([{"prompt": "x"}, {"prompt": ["hi"]}]))
    with pytest.raises(ConfigError, match=r"c.json': row 2, column 'prompt' message 1 is a str"):
        load_prompts(tmp_path / "c.json")
    (tmp_path / "d.json").write_text("[]")
    with pytest.raises(ConfigError, match="d.json' has no rows"):
        load_prompts(tmp_path / "d.json")


def test_missing_file_and_unknown_format(tmp_path):
    with pytest.raises(ConfigError, match=r"dataset 'nope.jsonl' is not a file; rlcore reads local .jsonl, .json, .parquet"):
        load_prompts("nope.jsonl")
    (tmp_path / "d.csv").write_text("prompt\nx\n")
    with pytest.raises(ConfigError, match="has suffix '.csv'"):
        load_prompts(tmp_path / "d.csv")


def test_many_problems_are_summarised(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"q": i} for i in range(25)])
    with pytest.raises(ConfigError, match=r"rows 1, 2, 3, 4, 5, \.\.\. \(25 in all\), column 'prompt' is missing") as info:
        load_prompts(path)
    assert len(info.value.problems) == 1  # one message: one problem, whatever the rows


# ---------------------------------------------------------------------------------------------------------
# PromptSampler
# ---------------------------------------------------------------------------------------------------------

DATA = [{"prompt": f"p{i}"} for i in range(10)]


def prompts(batches):
    return [[r["prompt"] for r in b] for b in batches]


def take(sampler, n):
    return prompts(sampler.next_batch() for _ in range(n))


def test_deterministic_for_a_seed_and_reshuffled_each_epoch():
    a, b, c = PromptSampler(DATA, 5, seed=1), PromptSampler(DATA, 5, seed=1), PromptSampler(DATA, 5, seed=2)
    first = take(a, 6)
    assert first == take(b, 6)
    assert first != take(c, 6)
    epochs = [sorted(first[i] + first[i + 1]) for i in (0, 2, 4)]
    assert all(e == sorted(r["prompt"] for r in DATA) for e in epochs)  # each epoch sees every row once
    assert len({tuple(first[i] + first[i + 1]) for i in (0, 2, 4)}) == 3  # in a new order


def test_batches_run_across_epoch_ends():
    sampler = PromptSampler(DATA, 4, seed=0)
    batches = take(sampler, 5)  # 20 rows = 2 epochs
    assert all(len(b) == 4 for b in batches)
    assert Counter(p for b in batches for p in b) == Counter({r["prompt"]: 2 for r in DATA})
    assert sampler.state_dict() == {"epoch": 1, "index": 10, "seed": 0, "num_rows": 10}
    big = PromptSampler(DATA[:3], 7, seed=0)  # a batch larger than the dataset
    assert len(big.next_batch()) == 7


def test_save_and_restore_continues_exactly():
    sampler = PromptSampler(DATA, 3, seed=7)
    take(sampler, 4)  # mid-way through the second epoch
    state = json.loads(json.dumps(sampler.state_dict()))  # as a checkpoint stores it
    expected = take(sampler, 5)
    resumed = PromptSampler(DATA, 3, seed=7)
    resumed.load_state_dict(state)
    assert take(resumed, 5) == expected


def test_restore_refuses_another_dataset_or_seed():
    state = PromptSampler(DATA, 3, seed=7).state_dict()
    with pytest.raises(ConfigError, match="taken with 10 rows and seed 7; this run has 9 rows and seed 7"):
        PromptSampler(DATA[:9], 3, seed=7).load_state_dict(state)
    with pytest.raises(ConfigError, match="this run has 10 rows and seed 8"):
        PromptSampler(DATA, 3, seed=8).load_state_dict(state)
    with pytest.raises(ConfigError, match="batch_size must be >= 1"):
        PromptSampler(DATA, 0)


def test_rows_handed_out_are_copies():
    sampler = PromptSampler(DATA, 2, seed=0)
    sampler.next_batch()[0]["completion"] = "x"
    assert all("completion" not in r for r in DATA)


def test_rows_load_once_and_serve_a_prompt_view_and_a_conversation_view(tmp_path):
    from rlcore.data import conversation_view, load_rows, prompt_view

    path = tmp_path / "chat.jsonl"
    chat = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    path.write_text(
        json.dumps({"messages": chat, "solution": "4"}) + "\n"
        + json.dumps({"prompt": "hi", "completion": "hello", "solution": "x"}) + "\n"
    )
    rows = load_rows(path)
    prompts = prompt_view(rows, path)
    assert prompts[0]["prompt"] == chat[:1] and prompts[1]["prompt"] == "hi"  # the answer is not in the prompt
    talks = conversation_view(rows, path)
    assert talks[0]["messages"] == chat and talks[0]["solution"] == "4"  # SFT keeps the assistant turn
    assert talks[1]["messages"] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert "messages" not in rows[1]  # the views copy; the loaded rows stay as they were


def test_a_conversation_view_needs_an_assistant_turn(tmp_path):
    from rlcore.data import conversation_view

    rows = [{"messages": [{"role": "user", "content": "q"}]}, {"prompt": "only a prompt"}]
    with pytest.raises(ConfigError) as err:
        conversation_view(rows, "d.jsonl")
    assert "row 1, column 'messages' ends with a 'user' message" in str(err.value)
    assert "row 2 has neither a 'messages' column nor 'prompt' and 'completion'" in str(err.value)


# ---------------------------------------------------------------------------------------------------------
# from the CLI: a flood of row errors is one line with the fix; a hub model with no network fails at once
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from rlcore.testing import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("data-cli") / "tiny"))


def test_a_text_dataset_given_to_sft_is_one_line_pointing_to_pt(python_m_rlcore, tmp_path, tiny):
    write_jsonl(tmp_path / "corpus.jsonl", [{"text": f"line {i}"} for i in range(5000)])
    done = python_m_rlcore("run", "--plugin", "sft", f"model={tiny}", "dataset=corpus.jsonl")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "rlcore: error: invalid configuration (1 problem):",
        "  corpus.jsonl: rows 1, 2, 3, 4, 5, ... (5000 in all): has neither a 'messages' column nor 'prompt' and "
        "'completion' columns; plain text trains with --plugin pt",
    ]


def test_a_hub_model_without_a_network_fails_at_once(python_m_rlcore, tmp_path):
    """No Hub (a closed local port stands for no network) and an empty cache: one problem, not a minute of retries."""
    import time

    write_jsonl(tmp_path / "chats.jsonl", [{"messages": [{"role": "user", "content": "a"},
                                                         {"role": "assistant", "content": "b"}]}])
    no_hub = {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf")}
    started = time.monotonic()
    done = python_m_rlcore("run", "--plugin", "sft", "model=someone/no-such-model", "dataset=chats.jsonl", env=no_hub)
    assert done.returncode == 2 and time.monotonic() - started < 60
    lines = done.stderr.splitlines()
    assert lines[0] == "rlcore: error: invalid configuration (1 problem):" and len(lines) == 2
    assert lines[1].startswith("  model: 'someone/no-such-model' is neither a local directory nor in the local Hugging "
                               "Face cache, and this machine is offline: the Hub (http://127.0.0.1:9) cannot be reached")
    assert "hf download someone/no-such-model" in lines[1] and "Retrying" not in done.stderr


@pytest.mark.parametrize("example", ["sft/lora.yaml", "grpo/colocate.yaml"])
def test_config_validate_of_a_shipped_example_is_quick_without_a_network(python_m_rlcore, tmp_path, example):
    import time
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "ray" / example
    no_hub = {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf")}
    started = time.monotonic()
    done = python_m_rlcore("config", "validate", "--plugin", example.split("/")[0], "--config", str(path), env=no_hub)
    assert done.returncode == 2 and time.monotonic() - started < 60
    assert done.stderr.startswith("rlcore: error: invalid configuration") and "cannot be reached" in done.stderr


THINKING_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}"
                     "<assistant>{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
                     "{% endif %}")


@pytest.mark.parametrize("strategy", ["left", "right", "delete"])
def test_a_long_prompt_is_cut_or_its_row_dropped_as_truncation_strategy_says(tiny, strategy):
    from rlcore.data import PromptEncoder

    full = PromptEncoder(tiny, use_chat_template=False)
    long, short = "one two three four five six seven eight nine ten", "one"
    ids = full.encode(long)
    cut = PromptEncoder(tiny, use_chat_template=False, max_prompt_length=4, truncation=strategy)
    rows = [{"prompt": long}, {"prompt": short}]
    if strategy == "delete":
        assert cut.keep(rows) == [{"prompt": short}]
        with pytest.raises(ConfigError, match="truncation_strategy delete drops such rows"):
            cut.keep(rows[:1])
    else:
        assert cut.keep(rows) == rows
        assert cut.encode(long) == (ids[-4:] if strategy == "left" else ids[:4])


def test_chat_template_kwargs_reach_the_template(tiny):
    from rlcore.data import PromptEncoder

    encoders = [PromptEncoder(tiny, template_kwargs=kwargs) for kwargs in ({}, {"enable_thinking": False})]
    for encoder in encoders:
        encoder.tokenizer.chat_template = THINKING_TEMPLATE
    plain, quiet = (encoder.tokenizer.decode(encoder.encode("hi")) for encoder in encoders)
    assert plain.endswith("<assistant>") and quiet.endswith("<assistant><think></think>")


def test_a_chat_template_that_is_not_jinja_or_refuses_a_prompt_is_one_line_naming_the_model(tiny, tmp_path):
    """A Jinja syntax error in the model's chat template was a 49-line traceback from `encode`: one problem at
    load, naming the model, the line and the file; a template's own raise_exception on a prompt is one line too."""
    import shutil

    from rlcore import RlcoreError
    from rlcore.data import PromptEncoder

    model = tmp_path / "model"
    shutil.copytree(tiny, model)
    (model / "chat_template.jinja").write_text("{% for m in messages %}\n{{ m.content }\n{% endfor %}")
    with pytest.raises(ConfigError) as refused:
        PromptEncoder(str(model))
    assert str(refused.value) == (f"model '{model}': its chat template is not valid Jinja: line 2: unexpected '}}'; "
                                  "fix chat_template.jinja (or tokenizer_config.json's chat_template) there, or give "
                                  "another model")
    assert refused.value.problems[0][0] == "model"
    (model / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system role here') }}{% endif %}"
        "{{ m.content }}{% endfor %}")
    encoder = PromptEncoder(str(model), system="be brief")
    with pytest.raises(RlcoreError, match=r"its chat template refused a prompt: no system role here; fix") as refused:
        encoder.encode("1+1?")
    assert "\n" not in str(refused.value)
    assert PromptEncoder(str(model)).encode("1+1?")  # without a system message it renders
