"""A rollout engine with a config key of its own: `echo` answers every prompt with its last token, `echo_repeat`
times. Registered with `EngineSpec(keys=EchoKeys)`, the key is `rollout.echo_repeat` (and `sampler.echo_repeat`) in
every algorithm with a rollout section: `rlcore config show` lists it, `rlcore config validate` checks it, and the
engine is built with it where `rollout.engine: echo`. No core file names it."""

from __future__ import annotations

from pydantic import BaseModel, Field

from rlcore import Generation, RolloutEngine, SamplingParams


class EchoKeys(BaseModel):
    echo_repeat: int = Field(2, ge=1, le=1 << 16, description="times the echo engine repeats a prompt's last token")


class EchoEngine(RolloutEngine):
    def __init__(self, model: str = "", echo_repeat: int = 2, **_: object):
        self.repeat = echo_repeat

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        length = min(self.repeat, params.max_tokens)
        return [Generation(prompt_index=i, token_ids=[prompt[-1]] * length, logprobs=[0.0] * length,
                           finish_reason="length" if length == params.max_tokens else "stop")
                for i, prompt in enumerate(prompts) for _ in range(params.n)]

    def prompt_topk_logprobs(self, sequences, k):
        raise NotImplementedError("the echo engine serves no teacher")

    def update_weights(self, named_tensors) -> None:  # no weights: a sync leaves it as it is
        for _ in named_tensors:
            pass

    def sleep(self, level: int = 1) -> None:
        pass

    def wake_up(self, tags=None) -> None:
        pass
