"""Where candidates come from: a sampler role (any registered rollout engine, one per worker) or a teacher
behind an OpenAI-compatible endpoint (`openai` client, bounded concurrency, retries with backoff)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import random
import threading
import time
from typing import Any

from rlcore import ConfigError, GenerateWorker, RlcoreError, SamplingParams, function, worker


@worker(group="sampler")
class SampleWorker(GenerateWorker):
    """A rollout engine per worker (rlcore's `GenerateWorker`). `generate(prompts, seeds, params)` ->
    `params.n` texts per prompt, prompt-major; with `seeds`, each prompt is drawn with its own seed in a call
    of its own, so its candidates do not depend on which worker, or which other prompts, it came with."""

    @function(dispatch="slice", collect="flatten")
    def generate(self, prompts: list[list[int]], seeds: list[int] | None, params: SamplingParams) -> list[tuple]:
        """(text, token ids) of every candidate."""
        if seeds is None:
            return [(g.text, g.token_ids) for g in self.engine.generate(prompts, params)]
        out: list[tuple] = []
        for prompt, seed in zip(prompts, seeds, strict=True):
            out += [(g.text, g.token_ids) for g in self.engine.generate([prompt], dataclasses.replace(params, seed=seed))]
        return out


def response_text(message: Any) -> str:
    """A chat message's answer; a `reasoning_content` becomes `<think>...</think>` before it, as ms-swift writes it."""
    content = getattr(message, "content", None) or ""
    reasoning = getattr(message, "reasoning_content", None)
    if reasoning is None:
        reasoning = (getattr(message, "model_extra", None) or {}).get("reasoning_content")
    if reasoning:
        return f"<think>{reasoning}</think>\n\n<answer>{content}</answer>"
    return content


class ApiTeacher:
    """Chat completions from an OpenAI-compatible endpoint, at most `max_concurrency` requests at once.

    A request failing with 429, a 5xx, a timeout or a dropped connection is retried after
    `backoff_s * 2**attempt` seconds (with jitter, at most 60); any other error, or the last retry's,
    stops the run naming the endpoint, the model and the cause.
    """

    def __init__(self, api_base: str, model: str, api_key: str | None = None, max_concurrency: int = 16,
                 max_retries: int = 5, backoff_s: float = 1.0, timeout_s: float = 300.0):
        import os

        try:
            import openai
        except ImportError as exc:
            raise ConfigError(f"distill with api_base needs the openai package: pip install 'rlcore[distill]' ({exc})") from None
        self.openai = openai
        key = api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
        self.client = openai.OpenAI(base_url=api_base, api_key=key, max_retries=0, timeout=timeout_s)
        self.api_base, self.model = api_base, model
        self.max_concurrency, self.max_retries, self.backoff_s = max_concurrency, max_retries, backoff_s
        self.retries = 0  # retried requests so far (a metric)
        self._lock = threading.Lock()

    def _retryable(self, exc: Exception) -> bool:
        o = self.openai
        if isinstance(exc, (o.RateLimitError, o.APITimeoutError, o.APIConnectionError)):
            return True
        return isinstance(exc, o.APIStatusError) and exc.status_code >= 500

    def _ask(self, messages: list[dict[str, Any]], params: SamplingParams, rng: random.Random) -> list[str]:
        for attempt in range(self.max_retries + 1):
            try:
                response = self.client.chat.completions.create(
                    model=self.model, messages=messages, n=params.n, max_tokens=params.max_tokens,
                    temperature=params.temperature, top_p=params.top_p, seed=params.seed,
                )
                texts = [response_text(choice.message) for choice in response.choices]
                if len(texts) != params.n:
                    raise RlcoreError(f"the endpoint {self.api_base} returned {len(texts)} choices for n={params.n}")
                return texts
            except Exception as exc:
                if not self._retryable(exc):
                    raise RlcoreError(f"the teacher {self.model} at {self.api_base} refused a request: {exc}") from exc
                if attempt == self.max_retries:
                    raise RlcoreError(
                        f"the teacher {self.model} at {self.api_base} failed {attempt + 1} times in a row "
                        f"(last: {type(exc).__name__}: {exc}); raise max_retries or check the endpoint"
                    ) from exc
                with self._lock:
                    self.retries += 1
                time.sleep(min(60.0, self.backoff_s * 2**attempt) * (0.5 + rng.random() / 2))
        raise AssertionError("unreachable")

    def generate(self, conversations: list[list[dict[str, Any]]], seeds: list[int], params: SamplingParams) -> list[str]:
        """`params.n` responses per conversation, conversation-major."""
        with concurrent.futures.ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="rlcore-teacher") as pool:
            futures = [pool.submit(self._ask, c, dataclasses.replace(params, seed=s), random.Random(s))
                       for c, s in zip(conversations, seeds, strict=True)]
            try:
                return [text for future in futures for text in future.result()]
            except BaseException:
                for future in futures:
                    future.cancel()
                raise
