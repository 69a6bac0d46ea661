"""Environments: tool-call parsing, tool schemas, TRL's tools and environment_factory, the registration hook."""

from __future__ import annotations

import json

import pytest

from rlcore import ConfigError, Environment, EnvironmentSpec, NotRegistered, Step, Turn, hookimpl, load_plugins
from rlcore.environments import FactoryEnvironment, ToolEnvironment, parse_tool_calls, tool_schema


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def turn(text: str) -> Turn:
    calls, errors = parse_tool_calls(text)
    return Turn(text=text, token_ids=[], tool_calls=calls, tool_errors=errors, index=1, row={})


def test_hermes_tool_calls_parse_and_malformed_ones_become_error_lines():
    text = ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
            '<tool_call>{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}</tool_call>'
            '<tool_call>{"name": add}</tool_call><tool_call>["add"]</tool_call><tool_call>{"name": "add", "argu')
    calls, errors = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in calls] == [("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})]
    assert len(errors) == 3 and "not valid JSON" in errors[0] and '{"name": "<tool>"' in errors[1]
    assert parse_tool_calls("no call here") == ([], [])


def test_tool_schema_is_transformers_and_an_undocumented_function_is_one_line():
    schema = tool_schema(add)
    assert schema["function"]["name"] == "add"
    assert schema["function"]["parameters"]["properties"]["a"] == {"type": "integer", "description": "the first"}

    def bare(x):
        return x

    with pytest.raises(ConfigError, match="tool '.*bare' cannot be described.*type hints"):
        tool_schema(bare)


def test_tools_run_and_bad_calls_are_told_to_the_model_not_raised():
    env = ToolEnvironment([add])
    step = env.step(turn('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
                         '<tool_call>{"name": "mul", "arguments": {}}</tool_call>'
                         '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call><tool_call>{oops</tool_call>'))
    contents = [m["content"] for m in step.messages]
    assert [m["role"] for m in step.messages] == ["tool"] * 4
    assert "not valid JSON" in contents[0] and contents[1] == "3"
    assert "unknown tool 'mul'; known: add" in contents[2] and "TypeError" in contents[3]
    assert (step.tool_calls, step.tool_errors, step.done) == (4, 3, False)
    assert env.step(turn("The answer is 3.")).done  # no call: the model answered


class Counter:
    """TRL's environment_factory shape: reset() starts it, public documented methods are the tools."""

    def reset(self, start: int = 0, **kwargs) -> str:
        self.value = start
        return f" Start at {start}."

    def increment(self, by: int) -> int:
        """Increase the counter.

        Args:
            by: the amount
        """
        self.value += by
        return self.value

    def get_reward(self) -> float:
        return float(self.value)


def test_environment_factory_makes_a_fresh_instance_with_its_methods_as_tools():
    one, two = FactoryEnvironment(Counter), FactoryEnvironment(Counter)
    assert one.instance is not two.instance
    assert [s["function"]["name"] for s in one.tool_schemas()] == ["increment"]  # not reset, get_reward
    assert one.reset({"start": 5, "prompt": "p"}) == " Start at 5."
    two.reset({"start": 0})
    step = one.step(turn('<tool_call>{"name": "increment", "arguments": {"by": 2}}</tool_call>'))
    assert json.loads(step.messages[0]["content"]) == 7 and two.instance.value == 0
    assert one.step(turn("done")).reward == 7.0  # get_reward when the episode ends
    with pytest.raises(ConfigError, match="no reset"):
        FactoryEnvironment(dict)


class Guess(Environment):
    def step(self, turn):
        return Step(done=True)


def test_rlcore_environments_registers_by_name_and_refuses_a_duplicate():
    class Plugin:
        @hookimpl
        def rlcore_environments(self):
            yield EnvironmentSpec("guess", factory=Guess)

    plugins = load_plugins()
    assert {"math_tip_trick", "tool_call"} <= set(plugins.environments.names())
    plugins.register(Plugin(), "guesser")
    assert plugins.environments.get("guess").factory is Guess and plugins.environments.owner("guess") == "guesser"
    with pytest.raises(NotRegistered, match="environment 'gess' is not registered.*Did you mean 'guess'"):
        plugins.environments.get("gess")


def test_an_environment_from_a_users_plugin_file_runs_by_name(tmp_path):
    """`rlcore run --with my_env.py`: a file registering an environment, no rlcore change; episodes made with the
    run's plugins (what a worker gets) find it by name, with environment_kwargs."""
    from rlcore.episodes import EpisodeSetup, make_environment

    plugin = tmp_path / "my_env.py"
    plugin.write_text(
        "from rlcore import Environment, EnvironmentSpec, Step, hookimpl\n"
        "class Countdown(Environment):\n"
        "    def __init__(self, start=3):\n"
        "        self.left = start\n"
        "    def step(self, turn):\n"
        "        self.left -= 1\n"
        "        return Step(done=self.left == 0, messages=[{'role': 'user', 'content': str(self.left)}])\n"
        "@hookimpl\n"
        "def rlcore_environments():\n"
        "    yield EnvironmentSpec('countdown', factory=Countdown)\n")
    plugins = load_plugins(extra=(str(plugin),))
    env = make_environment(EpisodeSetup(model="m", environment="countdown", environment_kwargs={"start": 2}), plugins)
    assert [env.step(turn("x")).done for _ in range(2)] == [False, True]
    assert plugins.environments.owner("countdown") == "my_env"
