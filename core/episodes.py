"""Multi-turn episodes, token in and token out, for any rollout engine.

An `EpisodeRunner` holds one episode: its environment, the prompt's ids and every token since. Each turn's
prompt is the previous turn's tokens plus the new messages' tokens (the chat template's rendering of just those
messages, cut after the model's end-of-turn token, as TRL does): what the model generated is never tokenised
again. Tokens the model did not generate (tool results, observations, hints) carry loss mask 0 and log-prob 0.

A rollout engine runs a batch of runners with `RolloutEngine.run_episodes`: the default (`run_turns`) generates
every unfinished episode's next turn in one `generate` call per turn; vLLM's submits an episode's next turn as
soon as its previous one ends. Either way the runner's `advance(generation)` is the one piece of episode logic.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from .engines import Generation, SamplingParams
from .environments import Environment, FactoryEnvironment, Step, ToolEnvironment, Turn, import_object, parse_tool_calls
from .errors import ConfigError


@dataclass(frozen=True)
class EpisodeSetup:
    """What a rollout worker needs to run episodes: the environment (a registered name, `module:Class` or
    `file.py:Class`, with its options), TRL's `tools` and `environment_factory`, the limits and the prompt's
    encoding. Small and picklable: it travels to Ray actors, which build the environments themselves."""

    model: str
    environment: str | None = None
    environment_kwargs: dict[str, Any] = field(default_factory=dict)
    tools: tuple[str, ...] = ()
    environment_factory: str | None = None
    max_turns: int = 1
    max_turn_tokens: int = 256  # new tokens per turn at most
    max_total_tokens: int = 256  # tokens after the prompt at most, the environment's included
    environment_timeout: float = 60.0  # seconds one reset or step may take
    use_chat_template: bool = True
    max_prompt_length: int | None = None
    system: str | None = None
    truncation: str = "left"
    template_kwargs: tuple[tuple[str, Any], ...] = ()  # the chat template's options, as (name, value) pairs


@dataclass
class Episode(Generation):
    """A finished episode, as a `Generation` whose `token_ids` are everything after the prompt: the model's turns
    and the environment's messages, told apart by `loss_mask` (1: generated). `logprobs` holds the sampler's
    log-prob per token (0 where the mask is 0); `text` is the last assistant message; `messages` the conversation
    after the prompt (what rewards see as the completion)."""

    prompt_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    reward: float | None = None  # the environment's reward parts, summed; None where it gave none
    error: str = ""  # why the environment ended the episode early: it raised or timed out


class EnvironmentFailed(Exception):
    """An environment's reset or step raised or did not return within the timeout."""


def call_with_timeout(fn: Callable[..., Any], timeout: float, *args: Any) -> Any:
    """`fn(*args)` on a daemon thread; raises EnvironmentFailed when it raises or outlives `timeout` (the thread is
    left behind: Python cannot stop it, and as a daemon it never holds the process)."""
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - reported as the episode's error
            out["error"] = exc

    thread = threading.Thread(target=target, daemon=True, name="rlcore-environment")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise EnvironmentFailed(f"{getattr(fn, '__qualname__', fn)} did not return within {timeout:g} s "
                                "(environment_timeout)")
    if "error" in out:
        exc = out["error"]
        raise EnvironmentFailed(f"{getattr(fn, '__qualname__', fn)} raised {type(exc).__name__}: {exc}")
    return out.get("value")


def make_environment(setup: EpisodeSetup, plugins: Any) -> Environment:
    """A fresh environment for one episode, from the setup's spelling of it."""
    kwargs = dict(setup.environment_kwargs)
    if setup.environment_factory:
        return FactoryEnvironment(setup.environment_factory, list(setup.tools))
    if setup.environment:
        if ":" in setup.environment:
            factory = import_object(setup.environment, "multi_turn_scheduler")
        else:
            factory = plugins.environments.get(setup.environment).factory
        import inspect

        try:
            takes_tools = "tools" in inspect.signature(factory).parameters
        except (TypeError, ValueError):
            takes_tools = False
        if takes_tools and setup.tools:
            kwargs.setdefault("tools", list(setup.tools))
        return factory(**kwargs)
    return ToolEnvironment(list(setup.tools))


@lru_cache(maxsize=4)
def _encoder(model: str, use_chat_template: bool, max_prompt_length: int | None, system: str | None,
             truncation: str = "left", template_kwargs: tuple[tuple[str, Any], ...] = ()) -> Any:
    from .data import PromptEncoder

    return PromptEncoder(model, use_chat_template, max_prompt_length, system, truncation, dict(template_kwargs))


class EpisodeRunner:
    """One episode in progress; `advance` takes the model's turn and readies the next prompt."""

    def __init__(self, environment: Environment | None, setup: EpisodeSetup, row: dict[str, Any], index: int = 0,
                 error: str = ""):
        self.env, self.setup, self.row, self.index = environment, setup, dict(row), index
        self.encoder = _encoder(setup.model, setup.use_chat_template, setup.max_prompt_length, setup.system,
                                setup.truncation, setup.template_kwargs)
        self.tokenizer = self.encoder.tokenizer
        self.tools = environment.tool_schemas() if environment is not None and hasattr(environment, "tool_schemas") else None
        self.token_ids: list[int] = []
        self.loss_mask: list[int] = []
        self.logprobs: list[float] = []
        self.messages: list[dict[str, Any]] = []
        self.turns = self.tool_calls = self.tool_errors = 0
        self.reward: float | None = None
        self.error, self.finish_reason, self.done, self.truncated = error, "stop", bool(error), False
        self.turn_start = 0  # where the current assistant message's tokens begin (a continuation extends it)
        prompt = self.row.get("prompt")
        if environment is not None and not self.done:
            try:
                extra = call_with_timeout(environment.reset, setup.environment_timeout, self.row)
            except EnvironmentFailed as exc:
                self._fail(str(exc))
            else:
                prompt = _with_reset(prompt, extra)
        self.prompt_ids = self.encoder.encode(prompt, tools=self.tools)

    # -- what the engine asks -----------------------------------------------------------------------------

    def next_prompt(self) -> list[int]:
        return self.prompt_ids + self.token_ids

    def budget(self) -> int:
        """The next turn's max_tokens: the per-turn cap, within what the total cap leaves."""
        return max(1, min(self.setup.max_turn_tokens, self.setup.max_total_tokens - len(self.token_ids)))

    def advance(self, generation: Generation) -> None:
        """Take the model's turn: append its tokens, ask the environment, append its answer's tokens (masked)."""
        self.turns += 1
        ids, logprobs = list(generation.token_ids), list(generation.logprobs) or [0.0] * len(generation.token_ids)
        self.token_ids += ids
        self.loss_mask += [1] * len(ids)
        self.logprobs += logprobs
        text = self.tokenizer.decode(self.token_ids[self.turn_start:], skip_special_tokens=True)
        calls, call_errors = parse_tool_calls(generation.text if generation.text else text)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = [c.message() for c in calls]
        if self.messages and self.messages[-1]["role"] == "assistant" and self.turn_start < len(self.token_ids) - len(ids):
            self.messages[-1] = message  # a continuation: the same message goes on
        else:
            self.messages.append(message)
        if len(self.token_ids) >= self.setup.max_total_tokens:  # no room left: cut mid-turn, nothing to answer
            self._end("length", truncated=True)
            return
        if self.env is None:
            self._end("stop")
            return
        turn = Turn(text=text, token_ids=ids, tool_calls=calls, tool_errors=call_errors, index=self.turns, row=self.row,
                    finish_reason=generation.finish_reason)
        try:
            step: Step = call_with_timeout(self.env.step, self.setup.environment_timeout, turn)
        except EnvironmentFailed as exc:
            self._fail(str(exc))
            return
        if not isinstance(step, Step):
            self._fail(f"{type(self.env).__name__}.step returned {type(step).__name__}, not a Step")
            return
        self.tool_calls += step.tool_calls
        self.tool_errors += step.tool_errors
        if step.reward is not None:
            self.reward = (self.reward or 0.0) + float(step.reward)
        if step.keep_text is not None:
            self._keep(step.keep_text, len(ids))
        if step.done or self.turns >= self.setup.max_turns or not (step.messages or step.continuation):
            self._end("stop")
            return
        before = len(self.token_ids)
        if step.continuation:
            self._continue(step.continuation)
        else:
            self._observe(step.messages)
        if len(self.token_ids) >= self.setup.max_total_tokens:  # no room for another turn: the answer is dropped
            del self.token_ids[before:], self.loss_mask[before:], self.logprobs[before:]
            if step.messages:
                del self.messages[len(self.messages) - len(step.messages):]
            self._end("length", truncated=True)

    def result(self) -> Episode:
        last = next((m["content"] for m in reversed(self.messages) if m["role"] == "assistant"), "")
        return Episode(
            prompt_index=self.index, token_ids=self.token_ids, logprobs=self.logprobs, finish_reason=self.finish_reason,
            text=last, prompt_ids=self.prompt_ids, loss_mask=self.loss_mask, messages=self.messages, turns=self.turns,
            tool_calls=self.tool_calls, tool_errors=self.tool_errors, reward=self.reward, error=self.error,
        )

    # -- the pieces -----------------------------------------------------------------------------------------

    def _observe(self, messages: list[dict[str, Any]]) -> None:
        ids = message_suffix_ids(self.tokenizer, messages, self.tools)
        if self.token_ids and self.token_ids[-1] not in self.encoder.stop_ids:  # a turn cut at max_turn_length: closed
            ids = [self.tokenizer.eos_token_id, *ids]
        self.token_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.messages.extend(messages)
        self.turn_start = len(self.token_ids)

    def _continue(self, text: str) -> None:
        """The model's message goes on after `text` (masked): its end-of-turn token, if it wrote one, is dropped."""
        if self.token_ids and self.loss_mask[-1] and self.token_ids[-1] in self.encoder.stop_ids:
            del self.token_ids[-1], self.loss_mask[-1], self.logprobs[-1]
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        self.token_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.messages[-1]["content"] += text

    def _keep(self, prefix: str, turn_tokens: int) -> None:
        """Cut this turn's tokens to the fewest whose message text covers `prefix` (ms-swift's MathTipsScheduler
        cuts a wrong answer at its `<answer>` before the tip)."""
        start = len(self.token_ids) - turn_tokens
        keep = next((n for n in range(turn_tokens + 1) if len(self.tokenizer.decode(
            self.token_ids[self.turn_start:start + n], skip_special_tokens=True)) >= len(prefix)), turn_tokens)
        del self.token_ids[start + keep:], self.loss_mask[start + keep:], self.logprobs[start + keep:]
        self.messages[-1]["content"] = self.tokenizer.decode(self.token_ids[self.turn_start:], skip_special_tokens=True)

    def _end(self, reason: str, truncated: bool = False) -> None:
        self.done, self.finish_reason, self.truncated = True, reason, truncated
        if self.env is not None:
            try:
                call_with_timeout(self.env.close, self.setup.environment_timeout)
            except (EnvironmentFailed, AttributeError):
                pass

    def _fail(self, error: str) -> None:
        self.error = error
        self._end("error")


def _with_reset(prompt: Any, extra: Any) -> Any:
    """The prompt after `reset`: a string is appended to the last message (TRL), messages to the conversation."""
    if isinstance(extra, str) and extra:
        if isinstance(prompt, list):
            return [*prompt[:-1], {**prompt[-1], "content": f"{prompt[-1]['content']}{extra}"}]
        return f"{prompt}{extra}"
    if isinstance(extra, list) and extra:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        return [*messages, *extra]
    return prompt


def message_suffix_ids(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict] | None = None) -> list[int]:
    """The tokens `messages` add after a model's turn, up to the next assistant turn's opening: the chat template
    renders a dummy conversation with and without them, cut after the dummy turn's end-of-turn token."""
    name = next((m.get("name") for m in messages if m.get("role") == "tool" and m.get("name")), "tool")
    dummy = [{"role": "user", "content": "dummy"},
             {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": name, "arguments": {}}}]}]

    def render(conversation: list[dict[str, Any]], generation_prompt: bool) -> list[int]:
        ids = tokenizer.apply_chat_template(conversation, tools=tools, add_generation_prompt=generation_prompt,
                                            tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    prefix, full = render(dummy, False), render(dummy + list(messages), True)
    eos = [i for i, t in enumerate(prefix) if t == tokenizer.eos_token_id]
    if eos:
        prefix = prefix[: eos[-1] + 1]
    if full[: len(prefix)] != prefix:
        raise ConfigError("the chat template renders a conversation's start differently once messages follow it, so "
                          "the environment's messages cannot be appended token by token; use a template that keeps "
                          "earlier turns as they are")
    return full[len(prefix):]


def episode_metrics(episodes: list[Any]) -> dict[str, float]:
    """Turns per episode, tool calls and errors, truncated and failed episodes, over a round."""
    n = max(1, len(episodes))
    return {
        "episodes/turns": sum(e.turns for e in episodes) / n,
        "episodes/tool_calls": sum(e.tool_calls for e in episodes) / n,
        "episodes/tool_errors": sum(e.tool_errors for e in episodes) / n,
        "episodes/truncated": sum(e.finish_reason == "length" for e in episodes) / n,
        "episodes/environment_errors": float(sum(bool(e.error) for e in episodes)),
        "episodes/generated_tokens": sum(sum(e.loss_mask) for e in episodes) / n,
    }


def run_turns(generate: Callable[[list[list[int]], SamplingParams], list[Generation]], runners: list[EpisodeRunner],
              params: SamplingParams) -> None:
    """Every unfinished episode's next turn in one `generate` call per turn and per token budget, until all end."""
    turn = 0
    while True:
        active = [r for r in runners if not r.done]
        if not active:
            return
        by_budget: dict[int, list[EpisodeRunner]] = {}
        for runner in active:
            by_budget.setdefault(runner.budget(), []).append(runner)
        for budget, group in sorted(by_budget.items()):
            seed = None if params.seed is None else params.seed + 7919 * turn + budget
            turn_params = dataclasses.replace(params, n=1, max_tokens=budget, seed=seed)
            for runner, generation in zip(group, generate([r.next_prompt() for r in group], turn_params), strict=True):
                runner.advance(generation)
        turn += 1


def run_episodes(engine: Any, rows: list[dict[str, Any]], setup: EpisodeSetup, params: SamplingParams,
                 plugins: Any, first_index: int = 0) -> list[Episode]:
    """One episode per row on `engine` (a `RolloutEngine`), each with a fresh environment."""
    runners = []
    for i, row in enumerate(rows):
        try:
            environment, error = make_environment(setup, plugins), ""
        except ConfigError:
            raise
        except Exception as exc:  # the environment's own constructor failed: this episode's error, not the run's
            environment, error = None, f"the environment could not be made: {type(exc).__name__}: {exc}"
        runners.append(EpisodeRunner(environment, setup, row, first_index + i, error=error))
    if hasattr(engine, "run_episodes"):  # an engine's own loop (vLLM's)
        engine.run_episodes(runners, params)
    else:
        run_turns(engine.generate, runners, params)
    return [r.result() for r in runners]


__all__ = ["Episode", "EpisodeRunner", "EpisodeSetup", "episode_metrics", "message_suffix_ids", "run_episodes", "run_turns"]
