"""The built-in environments: ms-swift's math tip scheduler and a tool-calling one (TRL's `tools`)."""

from __future__ import annotations

from typing import Any

from rlcore.environments import Environment, Step, ToolEnvironment, Turn


class MathTipTrick(Environment):
    """ms-swift's MathTipsScheduler (`math_tip_trick`): a wrong answer is cut at its `<answer>` (or `</think>`) and
    the model goes on in the same message after "But wait... It seems I made a mistake,", once.

    `reward` (a registered reward or `module:function`, default `accuracy` against the row's `solution`) judges
    the answer; one at or above `threshold` ends the episode.
    """

    tips_prompt = "But wait... It seems I made a mistake,"

    def __init__(self, reward: str = "accuracy", threshold: float = 1.0, **reward_options: Any):
        from rlcore.rewards import resolve_reward
        from rlcore import worker_plugins

        self.reward_name, self.threshold = reward, threshold
        self.judge = resolve_reward(reward, worker_plugins(), reward_options or None)
        self.row: dict[str, Any] = {}

    def reset(self, row: dict[str, Any]) -> None:
        self.row = row

    def step(self, turn: Turn) -> Step:
        if self.tips_prompt in turn.text or turn.finish_reason == "length":  # the tip is given once; a cut turn ends
            return Step(done=True)
        columns = {k: [v] for k, v in self.row.items() if k != "prompt"}
        score = self.judge([self.row.get("prompt")], [turn.text], [turn.token_ids], **columns)[0]
        if score is not None and score >= self.threshold:
            return Step(done=True)
        cut = min([turn.text.index(tag) for tag in ("<answer>", "</think>") if tag in turn.text] + [len(turn.text)])
        return Step(continuation=self.tips_prompt, keep_text=turn.text[:cut])


def tool_call(tools: list[Any] = ()) -> ToolEnvironment:
    """TRL's `tools`: the model's `<tool_call>`s run the functions (`module:function` names); results are `tool`
    messages; a turn without calls ends the episode."""
    return ToolEnvironment(list(tools))


def environment_reward(prompts: list[Any], completions: list[Any], completion_ids: list[list[int]] | None = None,
                       **columns: Any) -> list[float | None]:
    """The environment's reward parts summed over the episode (column `environment_reward`); None where it gave none."""
    values = columns.get("environment_reward") or [None] * len(completions)
    return [None if v is None else float(v) for v in values]
