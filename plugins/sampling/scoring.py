"""The orm and prm roles: what scores a prompt's candidates.

`ScoreRows` is the worker class of both roles (bound to `orm` or `prm` when its group is made): a group
shares the candidates (dispatch `slice`), each with its dataset row, so a reward function sees the
row's columns (`solution` for `accuracy`). What a worker runs is built by `scorer`:

- `orm_model` naming a registered reward function (or `module:function`): that function, called as GRPO
  calls it (`rlcore.rewards.call_reward`);
- `orm_model` naming a model: the registered `reward` engine `hf` (the rewards plugin's `OrmScorer`), a
  sequence-classification reward model (one label);
- `prm_model`: `PrmScorer`, a token-classification process reward model scoring each step;
- a role's `engine` other than `hf`: a registered engine of kind `reward`, built with the same options.

An ORM scores one float per candidate; a PRM a list of step scores per candidate.
"""

from __future__ import annotations

from typing import Any

from rlcore import ConfigError, RlcoreError, function, worker, worker_plugins
from rlcore.data import completion_text
from rlcore.engines import resolve_dtype, torch_device
from rlcore.memory import EngineMemory, MemoryQuery
from rlcore.rewards import call_reward, resolve_reward


def is_reward_function(name: str, plugins: Any) -> bool:
    """`name` is a registered reward or a `module:function`, not a model."""
    return ":" in name or name in plugins.rewards


def scorer(kind: str, model: str, engine: str = "hf", device: str = "cpu", dtype: str = "auto",
                batch_size: int = 16, options: dict[str, Any] | None = None, strict: bool = False,
                reward_timeout_s: float | None = None, **engine_kwargs: Any) -> Any:
    """The scorer a `kind` ("orm" or "prm") worker runs, built where the worker runs."""
    plugins = worker_plugins()
    options = dict(options or {})
    if kind == "orm" and is_reward_function(model, plugins):
        return FunctionScorer(model, options, strict, reward_timeout_s)
    if engine != "hf" or kind == "orm":  # an ORM on hf: the rewards plugin's reward-model engine
        factory = plugins.engines.get(engine, kind="reward").factory
        return factory(model_path=model, device=device, dtype=dtype, batch_size=batch_size, **options, **engine_kwargs)
    return PrmScorer(model, device=device, dtype=dtype, batch_size=batch_size, **options, **engine_kwargs)


@worker(group="orm")
class ScoreRows:
    """A scorer per worker: `score(prompts, completions, rows)` -> one score (ORM) or one list of step scores
    (PRM) per candidate; `rows` are the candidates' dataset rows."""

    holds_state = False  # a fixed scorer: a lost worker is rebuilt from its options (max_restarts)

    def __init__(self, engine: Any, options: dict[str, Any]):
        self.setup(engine, options)

    @function()
    def setup(self, engine: Any, options: dict[str, Any]) -> None:
        self.scorer = engine(**options)

    @function(dispatch="slice", collect="flatten")
    def score(self, prompts: list, completions: list, rows: list[dict[str, Any]],
              completion_ids: list[list[int]] | None = None) -> list:
        if isinstance(self.scorer, FunctionScorer):
            return self.scorer.score(prompts, completions, rows, completion_ids)
        return list(self.scorer.score(prompts, completions))


class FunctionScorer:
    """A registered reward function (or `module:function`) as an ORM; None (a failed candidate) scores 0."""

    @staticmethod
    def memory(q: MemoryQuery) -> EngineMemory:
        """The memory plan's terms (`RoleUse.engine`'s `memory`): a function runs in its worker's Python and takes
        nothing on the GPU."""
        return EngineMemory({}, {})

    def __init__(self, name: str, options: dict[str, Any], strict: bool = False, timeout_s: float | None = None):
        self.name, self.strict, self.timeout_s = name, strict, timeout_s
        self.fn = resolve_reward(name, worker_plugins(), options or None)

    def score(self, prompts: list, completions: list, rows: list[dict[str, Any]],
              completion_ids: list[list[int]] | None = None) -> list[float]:
        columns = {k: [r.get(k) for r in rows] for k in (rows[0] if rows else {}) if k not in ("prompt", "messages")}
        values, _ = call_reward(self.fn, self.name, prompts, completions, completion_ids, columns, strict=self.strict,
                                timeout_s=self.timeout_s)
        return [0.0 if v is None else float(v) for v in values]


class PrmScorer:
    """A process reward model (token classification) scoring each step of a candidate.

    The candidate is cut at `step_separator`; the model reads prompt + steps, each step followed by
    `step_token` when given (Qwen2.5-Math-PRM's `<extra_0>`). A step's score is read at that token (else at the
    step's last token): P(label 1) for a two-label model, sigmoid of the logit for a one-label model.
    """

    def __init__(self, model_path: str, device: str = "cpu", dtype: str = "auto", batch_size: int = 16,
                 step_separator: str = "\n\n", step_token: str | None = None, trust_remote_code: bool = False):
        import torch
        from transformers import AutoTokenizer

        try:
            torch_dtype = getattr(torch, resolve_dtype(dtype, model_path, str(device).startswith("cuda")))
        except AttributeError:
            raise ConfigError(f"prm dtype '{dtype}' is not a torch dtype; use float32, bfloat16 or float16") from None
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
            self.model = _load_prm(model_path, torch_dtype, trust_remote_code)
        except (OSError, ValueError) as exc:
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(f"prm model '{model_path}' cannot be loaded as a token-classification model: {reason[:300]}",
                              [("prm_model", reason[:200])]) from None
        if self.model.config.num_labels not in (1, 2):
            raise ConfigError(f"prm model '{model_path}' has num_labels={self.model.config.num_labels}; a PRM has 1 or 2")
        self.step_ids: list[int] = []
        if step_token is not None:
            self.step_ids = self.tokenizer(step_token, add_special_tokens=False)["input_ids"]
            if len(self.step_ids) != 1:
                raise ConfigError(f"prm_step_token {step_token!r} is {len(self.step_ids)} tokens for prm model "
                                  f"'{model_path}'; give a single token of its vocabulary")
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        if self.pad_id is None:
            raise ConfigError(f"prm model '{model_path}': its tokenizer has neither a pad nor an eos token")
        self.step_separator, self.batch_size = step_separator, batch_size
        self.device = torch_device(device)
        self.model.to(self.device).eval()

    def _encode(self, prompt: Any, completion: Any) -> tuple[list[int], list[int]]:
        """Token ids of prompt + steps, and the position scored for each step."""
        tok = self.tokenizer
        if isinstance(prompt, list):
            ids = list(tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)) \
                if tok.chat_template else tok("".join(str(m.get("content") or "") for m in prompt))["input_ids"]
        else:
            ids = tok(prompt, add_special_tokens=False)["input_ids"]
        steps = [s for s in completion_text(completion).split(self.step_separator) if s.strip()]
        positions = []
        for i, step in enumerate(steps):
            text = step + (self.step_separator if i + 1 < len(steps) and not self.step_ids else "")
            ids += tok(text, add_special_tokens=False)["input_ids"] + self.step_ids
            positions.append(len(ids) - 1)
        return ids, positions

    def score(self, prompts: list[Any], completions: list[Any]) -> list[list[float]]:
        """The step scores of each candidate (an empty list for an empty candidate)."""
        import torch

        encoded = [self._encode(p, c) for p, c in zip(prompts, completions, strict=True)]
        out: list[list[float]] = []
        for start in range(0, len(encoded), self.batch_size):
            chunk = encoded[start : start + self.batch_size]
            width = max(len(ids) for ids, _ in chunk)
            input_ids = torch.full((len(chunk), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, (ids, _) in enumerate(chunk):
                input_ids[row, : len(ids)] = torch.tensor(ids)
                mask[row, : len(ids)] = 1
            with torch.inference_mode():
                outputs = self.model(input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device))
            logits = (outputs.logits if hasattr(outputs, "logits") else outputs[0]).float()
            probs = logits.softmax(-1)[..., 1] if logits.shape[-1] == 2 else logits[..., 0].sigmoid()
            for row, (_, positions) in enumerate(chunk):
                out.append([float(probs[row, p]) for p in positions])
        return out


def _load_prm(model_path: str, dtype: Any, trust_remote_code: bool) -> Any:
    """A token-classification model; with trust_remote_code, a model whose own code gives per-token logits
    (Qwen2.5-Math-PRM registers only AutoModel)."""
    from transformers import AutoModel, AutoModelForTokenClassification

    try:
        return AutoModelForTokenClassification.from_pretrained(model_path, dtype=dtype, trust_remote_code=trust_remote_code)
    except ValueError:
        if not trust_remote_code:
            raise
        return AutoModel.from_pretrained(model_path, dtype=dtype, trust_remote_code=True)


def check_scores(kind: str, scores: list, expected: int) -> None:
    """The scorers gave one score per candidate."""
    if len(scores) != expected:
        raise RlcoreError(f"the {kind} role returned {len(scores)} scores for {expected} candidates")
