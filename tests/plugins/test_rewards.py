"""The built-in rewards (against TRL's where TRL has one), TRL-signature compatibility both ways,
options (a dataclass's fields, a function's keyword arguments) checked against the reward,
module:function loading, error accounting in call_reward (a failure on every completion is fatal, on some is
counted), and the ORM scorer on a real tiny model."""

from __future__ import annotations

import logging
import pickle
import random
import textwrap

import pytest

from rlcore import ConfigError, NotRegistered, RewardSpec, RlcoreError, hookimpl, load_plugins
from rlcore.testing import PROMPTS, RANDOM_POLICY_REWARD, chance_reward, toy_dataset, toy_reward
from rlcore.plugins.rewards import (
    CosineReward,
    RepetitionPenalty,
    RewardFailed,
    SoftOverlong,
    accuracy_reward,
    call_reward,
    format_reward,
    resolve_reward,
    reward_options,
)
from rlcore import rewards as calling_module

SOLUTIONS = [r"\frac{1}{3}", r"\frac{1}{3}", "no math here"]
ANSWERS = [r"So it is \boxed{\frac{1}{3}}", r"I think \boxed{\frac{1}{2}}", r"\boxed{1}"]


def conversational(texts):
    return [[{"role": "assistant", "content": t}] for t in texts]


@pytest.fixture(scope="module")
def plugins():
    return load_plugins(strict=True)


def test_registered_with_their_defaults(plugins):
    assert {"accuracy", "format", "cosine", "repetition", "soft_overlong", "toy"} <= set(plugins.rewards.names())
    assert plugins.rewards.owner("accuracy") == "rewards"
    assert plugins.rewards.get("cosine").options == {
        "max_len": 1000, "min_value_wrong": -1.0, "max_value_wrong": -0.5, "min_value_correct": 0.5, "max_value_correct": 1.0,
    }
    assert plugins.rewards.get("repetition").options == {"ngram_size": 3, "max_penalty": -1.0}


def test_accuracy_matches_trl_and_skips_an_unparsable_solution():
    from trl.rewards import accuracy_reward as trl_accuracy

    completions = conversational(ANSWERS)
    ours = accuracy_reward(prompts=["q"] * 3, completions=completions, solution=SOLUTIONS)
    assert ours == [1.0, 0.0, None]
    assert ours == trl_accuracy(completions, SOLUTIONS)
    assert accuracy_reward(prompts=["q"] * 3, completions=ANSWERS, solution=SOLUTIONS) == ours  # plain strings


def test_accuracy_without_a_solution_column_is_a_config_error():
    with pytest.raises(ConfigError, match="reward 'accuracy' needs a 'solution' column"):
        call_reward(accuracy_reward, "accuracy", ["q"], ["1"], None, {})


def test_format():
    texts = [
        "<think>\nstep one\n</think>\n<answer>42</answer>",
        "<think>x</think><answer>y</answer>",
        "<think>x</think> stray <answer>y</answer>",
        "<answer>y</answer>",
        "<think>x</think><answer>y</answer> trailing",
    ]
    assert format_reward(prompts=[""] * 5, completions=texts) == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_cosine_matches_trl():
    from trl.rewards import get_cosine_scaled_reward

    options = dict(max_len=40, min_value_wrong=-1.0, max_value_wrong=-0.3, min_value_correct=0.4, max_value_correct=1.0)
    ids = [[7] * 10, [7] * 30, [7] * 60]
    ours = CosineReward(**options)(prompts=["q"] * 3, completions=conversational(ANSWERS), completion_ids=ids, solution=SOLUTIONS)
    assert ours == pytest.approx(get_cosine_scaled_reward(**options)(conversational(ANSWERS), SOLUTIONS, ids), nan_ok=True)
    # shorter correct answers earn more; shorter wrong answers are punished more
    short, long = (CosineReward(max_len=40)(prompts=["q"], completions=[ANSWERS[1]], completion_ids=[[1] * n], solution=[SOLUTIONS[1]])[0]
                   for n in (4, 36))
    assert short < long < 0


def test_repetition_penalty_counts_word_ngrams():
    penalty = RepetitionPenalty(ngram_size=3, max_penalty=-1.0)
    texts = ["a b c a b c", "one two three four", "hi", "go go go go go"]
    # a b c a b c: 4 trigrams, 3 unique; go x5: 3 trigrams, 1 unique
    assert penalty(prompts=[""] * 4, completions=texts) == pytest.approx([-0.25, 0.0, 0.0, -2 / 3])
    with pytest.raises(ConfigError, match="max_penalty must be <= 0"):
        RepetitionPenalty(max_penalty=0.5)


def test_soft_overlong_matches_trl():
    from trl.rewards import get_soft_overlong_punishment

    ids = [[1] * n for n in (10, 80, 81, 90, 100, 101)]
    ours = SoftOverlong(max_completion_length=100, soft_cache_length=20)(prompts=[""] * 6, completions=[""] * 6, completion_ids=ids)
    assert ours == get_soft_overlong_punishment(100, 20)(ids)
    assert ours == pytest.approx([0.0, 0.0, -0.05, -0.5, -1.0, -1.0])


def test_toy_reward_and_its_chance_level():
    assert toy_reward(prompts=["p"] * 4, completions=["aeiou", "xyz", "", "ab"]) == [1.0, 0.0, 0.0, 0.5]
    assert toy_reward(prompts=["p"], completions=["ab"], target=["b"]) == [0.5]  # the row's target column
    rng = random.Random(0)
    texts = [bytes(rng.randrange(256) for _ in range(20)).decode("utf-8", errors="replace") for _ in range(3000)]
    mean = sum(toy_reward(prompts=[""] * len(texts), completions=texts)) / len(texts)
    assert mean == pytest.approx(RANDOM_POLICY_REWARD, rel=0.2)
    from rlcore.testing import build_tokenizer

    tiny_chance = chance_reward(build_tokenizer(), samples=300)
    assert tiny_chance == chance_reward(build_tokenizer(), samples=300)  # seeded
    assert 0.03 < tiny_chance < 0.06  # the merges carry vowels: above the pure-byte 5/256
    rows = toy_dataset(64, seed=3)
    assert rows == toy_dataset(64, seed=3) and rows != toy_dataset(64, seed=4)
    assert all(r["prompt"] in PROMPTS and r["target"] == "aeiou" for r in rows)


# ---------------------------------------------------------------------------------------------------------
# TRL compatibility and loading
# ---------------------------------------------------------------------------------------------------------

TRL_DOCS_REWARD = textwrap.dedent(
    '''
    def reward_len(completions, **kwargs):
        """TRL's documentation example, as written there."""
        return [-abs(20 - len(completion)) for completion in completions]

    not_a_function = 3
    '''
)


def test_a_trl_reward_function_works_unchanged(tmp_path, plugins):
    path = tmp_path / "my_rewards.py"
    path.write_text(TRL_DOCS_REWARD)
    fn = resolve_reward(f"{path}:reward_len", plugins)
    rewards, errors = call_reward(fn, "reward_len", ["p", "p"], ["x" * 20, "x" * 5], [[1], [2]], {"solution": ["a", "b"]})
    assert (rewards, errors) == ([0.0, -15.0], 0)
    # TRL's own functions and factories, from the installed trl package
    think = resolve_reward("trl.rewards:think_format_reward", plugins)
    assert call_reward(think, "think", [""], conversational(["<think>r</think>a"]), None, {}) == ([1.0], 0)
    overlong = resolve_reward("trl.rewards:get_soft_overlong_punishment", plugins,
                              {"max_completion_len": 100, "soft_punish_cache": 20})
    assert call_reward(overlong, "overlong", [""], [""], [[1] * 90], {})[0] == [-0.5]


def test_our_rewards_take_what_trl_passes(plugins):
    """GRPOTrainer calls with keywords only, plus trainer_state, log_extra and log_metric."""
    extra = dict(trainer_state=object(), log_extra=lambda *a: None, log_metric=lambda *a: None)
    for name in plugins.rewards.names():
        fn = plugins.rewards.get(name).fn
        out = fn(prompts=["q"], completions=conversational([ANSWERS[0]]), completion_ids=[[1, 2]],
                 solution=[SOLUTIONS[0]], **extra)
        assert len(out) == 1 and (out[0] is None or isinstance(out[0], float)), name


def test_options_override_defaults(plugins):
    fn = resolve_reward("soft_overlong", plugins, {"max_completion_length": 16, "soft_cache_length": 4})
    assert fn(prompts=[""], completions=[""], completion_ids=[[1] * 14]) == [-0.5]
    assert plugins.rewards.get("soft_overlong").fn.max_completion_length == 256  # the registered one is untouched
    with pytest.raises(ConfigError, match=r"reward_kwargs.cosine.max_lenght: reward 'cosine' has no option 'max_lenght'; "
                                          r"it takes max_len, min_value_wrong, .*Did you mean 'max_len'"):
        resolve_reward("cosine", plugins, {"max_lenght": 10})
    with pytest.raises(ConfigError, match="reward 'format' takes no options"):
        resolve_reward("format", plugins, {"x": 1})


def char_ratio(prompts, completions, completion_ids=None, *, letter="e", **columns):
    return [c.count(letter) / len(c) if c else 0.0 for c in completions]


def scaled(prompts, completions, solution, scale=1.0, *, offset, **kwargs):
    """A column without a default (`solution`) is not an option; `scale` (a default) and `offset` (keyword-only) are."""
    return [scale * (c == s) + offset for c, s in zip(completions, solution)]


class FunctionsPlugin:
    @hookimpl
    def rlcore_rewards(self):
        yield RewardSpec("char_ratio", fn=char_ratio)
        yield RewardSpec("scaled", fn=scaled)


@pytest.fixture(scope="module")
def with_functions():
    plugins = load_plugins(strict=True)
    plugins.register(FunctionsPlugin(), "functions")
    return plugins


def test_a_plain_functions_keyword_arguments_are_its_options(with_functions):
    assert reward_options(char_ratio) == ["letter"]
    assert reward_options(scaled) == ["scale", "offset"]
    assert reward_options(format_reward) == [] and reward_options(CosineReward())[0] == "max_len"
    fn = resolve_reward("char_ratio", with_functions, {"letter": "a"})
    assert call_reward(fn, "char_ratio", ["p"] * 2, ["abba", "xyz"], None, {"solution": [1, 2]}) == ([0.5, 0.0], 0)
    assert resolve_reward("char_ratio", with_functions) is char_ratio  # no options: the function itself
    fn = resolve_reward("scaled", with_functions, {"scale": 2.0, "offset": -1.0})
    assert fn(prompts=["p"] * 2, completions=["4", "5"], completion_ids=None, solution=["4", "4"]) == [1.0, -1.0]
    assert pickle.loads(pickle.dumps(fn))(prompts=["p"], completions=["4"], solution=["4"]) == [1.0]  # for Ray


def test_an_unknown_function_option_names_the_function_the_option_and_the_options_it_takes(with_functions):
    with pytest.raises(ConfigError, match=r"reward_kwargs.char_ratio.leter: reward 'char_ratio' has no option "
                                          r"'leter'; it takes letter. Did you mean 'letter'\?") as caught:
        resolve_reward("char_ratio", with_functions, {"leter": "a", "letter": "b"})
    assert caught.value.problems == [("reward_kwargs.char_ratio.leter", "reward 'char_ratio' has no option 'leter'; "
                                      "it takes letter. Did you mean 'letter'?")]
    with pytest.raises(ConfigError, match=r"scaled.solution: reward 'scaled' has no option 'solution'; it takes scale, "
                                          r"offset\.; reward_kwargs.scaled.completions: .*no option 'completions'"):
        resolve_reward("scaled", with_functions, {"solution": ["4"], "completions": []})


def test_an_option_that_is_also_a_dataset_column_is_an_error(with_functions):
    fn = resolve_reward("char_ratio", with_functions, {"letter": "a"})
    with pytest.raises(ConfigError, match=r"reward 'char_ratio': option 'letter' \(reward_kwargs.char_ratio.letter\) "
                                          r"is also a dataset column"):
        call_reward(fn, "char_ratio", ["p"], ["a"], None, {"letter": ["b"]})


def test_a_module_function_takes_options_too_and_a_factory_is_called_with_them(tmp_path, plugins):
    path = tmp_path / "mine.py"
    path.write_text(TRL_DOCS_REWARD + textwrap.dedent(
        '''
        def near(completions, target=20, **kwargs):
            return [-abs(target - len(c)) for c in completions]

        def make_near(target):
            return lambda completions, **kwargs: [-abs(target - len(c)) for c in completions]
        '''
    ))
    near = resolve_reward(f"{path}:near", plugins, {"target": 3})
    assert call_reward(near, "near", ["p"], ["abcde"], None, {}) == ([-2.0], 0)
    made = resolve_reward(f"{path}:make_near", plugins, {"target": 3})
    assert call_reward(made, "make_near", ["p"], ["abcde"], None, {}) == ([-2.0], 0)
    with pytest.raises(ConfigError, match=rf"reward_kwargs.{path}:near.traget: .*it takes target. Did you mean 'target'"):
        resolve_reward(f"{path}:near", plugins, {"traget": 3})
    with pytest.raises(ConfigError, match=rf"reward '{path}:reward_len' takes no options"):
        resolve_reward(f"{path}:reward_len", plugins, {"target": 3})


def test_loading_errors_name_the_string(tmp_path, plugins):
    with pytest.raises(NotRegistered, match=r"reward 'acuracy' is not registered; known: .*Did you mean 'accuracy'"):
        resolve_reward("acuracy", plugins)
    with pytest.raises(ConfigError, match="reward function 'no_such_module:f': module 'no_such_module' cannot be imported"):
        resolve_reward("no_such_module:f", plugins)
    with pytest.raises(ConfigError, match="reward function 'json:nope': module 'json' has no attribute 'nope'"):
        resolve_reward("json:nope", plugins)
    path = tmp_path / "r.py"
    path.write_text(TRL_DOCS_REWARD)
    with pytest.raises(ConfigError, match=f"reward function '{path}:not_a_function' is a int, not a function"):
        resolve_reward(f"{path}:not_a_function", plugins)
    with pytest.raises(ConfigError, match="file 'missing.py' does not exist"):
        resolve_reward("missing.py:f", plugins)


# ---------------------------------------------------------------------------------------------------------
# call_reward: errors are counted (or fatal in strict mode), never silent
# ---------------------------------------------------------------------------------------------------------


def broken(prompts, completions, **kwargs):
    raise ValueError("judge offline")


def choosy(prompts, completions, **kwargs):
    """Fails on a batch holding the completion 'x' (as a batch-level grader would), else scores lengths."""
    if "x" in completions:
        raise ValueError("cannot judge 'x'")
    return [float(len(c)) for c in completions]


def test_a_function_failing_on_every_completion_stops_the_run():
    with pytest.raises(RewardFailed, match=r"reward function 'judge' failed on all 3 completions of this step: "
                                           r"ValueError\('judge offline'\); fix it, or remove it from reward_funcs"):
        call_reward(broken, "judge", ["p"] * 3, ["c"] * 3, None, {})
    with pytest.raises(RewardFailed, match="failed on all 1 completions"):
        call_reward(broken, "judge", ["p"], ["c"], None, {})
    assert issubclass(RewardFailed, RlcoreError)


def test_a_failing_batch_is_scored_one_by_one_and_failures_are_counted_and_logged_once(caplog, monkeypatch):
    monkeypatch.setattr(calling_module, "_logged", set())
    calls = []

    def counted(prompts, completions, **kwargs):
        calls.append(len(completions))
        return choosy(prompts, completions, **kwargs)

    with caplog.at_level(logging.WARNING, logger="rlcore.rewards"):
        first = call_reward(counted, "judge", ["p"] * 3, ["ab", "x", "abc"], None, {"solution": [1, 2, 3]})
        second = call_reward(counted, "judge", ["p"] * 4, ["x", "a", "x", "b"], None, {})
    assert first == ([2.0, None, 3.0], 1)
    assert second == ([None, 1.0, None, 1.0], 2)
    assert calls == [3, 1, 1, 1, 4, 1, 1, 1, 1]  # the batch, then each completion on its own
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1
    assert "reward function 'judge' failed on 1 of 3 completions: ValueError(\"cannot judge 'x'\")" in messages[0]


def test_strict_mode_raises_naming_the_function():
    with pytest.raises(RewardFailed, match=r"reward function 'judge' failed: ValueError\('judge offline'\) \(strict_rewards"):
        call_reward(broken, "judge", ["p"], ["c"], None, {}, strict=True)
    with pytest.raises(RewardFailed, match=r"reward function 'choosy' failed: .*cannot judge 'x'.* \(strict_rewards"):
        call_reward(choosy, "choosy", ["p"] * 2, ["a", "x"], None, {}, strict=True)


def test_wrong_length_or_type_is_an_error_naming_the_function():
    short = lambda prompts, completions, **kw: [1.0]  # noqa: E731
    with pytest.raises(RlcoreError, match="reward function 'short' failed: returned 1 rewards for 2 completions"):
        call_reward(short, "short", ["p"] * 2, ["c"] * 2, None, {}, strict=True)
    with pytest.raises(RewardFailed, match="'short' failed on all 2 completions of this step: returned 1 rewards"):
        call_reward(short, "short", ["p"] * 2, ["c"] * 2, None, {})  # a wrong shape is not retried one by one
    words = lambda prompts, completions, **kw: ["good"]  # noqa: E731
    with pytest.raises(RlcoreError, match="reward function 'words' failed: .*a reward must be a number or None; got str"):
        call_reward(words, "words", ["p"], ["c"], None, {}, strict=True)
    some_words = lambda prompts, completions, **kw: [1.0, "good"]  # noqa: E731
    assert call_reward(some_words, "some_words", ["p"] * 2, ["c"] * 2, None, {}) == ([1.0, None], 1)


def test_none_and_numpy_values_are_normalised_and_a_nonfinite_reward_is_an_error():
    import numpy as np

    fn = lambda prompts, completions, **kw: [np.float32(0.5), None, float("nan"), True]  # noqa: E731
    assert call_reward(fn, "f", ["p"] * 4, ["c"] * 4, None, {}) == ([0.5, None, None, 1.0], 1)
    for bad in (float("nan"), float("inf"), -float("inf"), 1e200):
        every = lambda prompts, completions, bad=bad, **kw: [bad] * len(completions)  # noqa: E731
        with pytest.raises(RewardFailed, match=r"failed on all 3 completions.*finite number within"):
            call_reward(every, "every", ["p"] * 3, ["c"] * 3, None, {})


def test_a_reward_function_cannot_end_the_process():
    import sys

    def leaving(prompts, completions, **kw):
        sys.exit(0)

    with pytest.raises(RewardFailed, match=r"'leaving' failed on all 2 .*tried to end the process \(SystemExit\(0\)\)"):
        call_reward(leaving, "leaving", ["p"] * 2, ["c"] * 2, None, {})


def test_a_reward_past_its_time_limit_is_an_error_and_a_stop_signal_ends_the_wait_at_once():
    import threading
    import time

    from rlcore import watchdog

    never = threading.Event()

    def stuck(prompts, completions, **kw):
        never.wait()  # a judge that never answers
        return [1.0] * len(completions)

    started = time.monotonic()
    with pytest.raises(RewardFailed, match=r"'stuck' failed on all 3 .*did not return within reward_timeout_s=0.3s"):
        call_reward(stuck, "stuck", ["p"] * 3, ["c"] * 3, None, {}, timeout_s=0.3)
    assert time.monotonic() - started < 2  # the batch timed out: not retried one by one

    def slow_on_x(prompts, completions, **kw):
        if "x" in completions:
            if len(completions) > 1:
                raise ValueError("batch")
            never.wait()
        return [1.0] * len(completions)

    assert call_reward(slow_on_x, "slow", ["p"] * 3, ["a", "x", "b"], None, {}, timeout_s=0.3) == ([1.0, None, 1.0], 1)

    timer = threading.Timer(0.3, watchdog.stopping)  # a SIGINT's handler, as StopOnSignal runs it
    timer.start()
    started = time.monotonic()
    try:
        with pytest.raises(calling_module.RewardInterrupted):
            call_reward(stuck, "stuck", ["p"] * 3, ["c"] * 3, None, {}, timeout_s=600)
    finally:
        timer.join()
        watchdog.stopping(False)
        never.set()
    assert time.monotonic() - started < 2


# ---------------------------------------------------------------------------------------------------------
# the outcome reward model
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def orm_path(tmp_path_factory):
    from rlcore.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("orm") / "model", num_labels=1)


def test_orm_scores_pairs_like_an_unpadded_forward(orm_path):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rlcore.plugins.rewards.orm import OrmScorer

    scorer = OrmScorer(str(orm_path), batch_size=2)
    prompts = ["Write a word:", "Say something:", "Q:"]
    completions = [" apple", " a much longer completion than the others", " b"]
    scores = scorer.score(prompts, completions)
    tokenizer = AutoTokenizer.from_pretrained(orm_path)
    model = AutoModelForSequenceClassification.from_pretrained(orm_path).eval()
    for p, c, s in zip(prompts, completions, scores):
        ids = tokenizer(p + c, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            assert s == pytest.approx(model(**ids).logits[0, 0].item(), abs=1e-5)
    assert len(set(scores)) == 3
    # it is a TRL-signature reward function too, and takes conversations through the chat template
    rewards, errors = call_reward(scorer, "orm", [[{"role": "user", "content": "hi"}]],
                                  conversational(["hello"]), None, {})
    assert errors == 0 and isinstance(rewards[0], float)


def test_orm_refuses_a_model_with_several_labels(tmp_path):
    from rlcore.testing import build_tiny_model
    from rlcore.plugins.rewards.orm import OrmScorer

    path = build_tiny_model(tmp_path / "two", num_labels=2)
    with pytest.raises(ConfigError, match="has num_labels=2; a reward model has one"):
        OrmScorer(str(path))
    with pytest.raises(ConfigError, match="cannot be loaded"):
        OrmScorer(str(tmp_path / "nowhere"))


def test_check_reward_reads_a_users_code_without_running_it(tmp_path, monkeypatch):
    from rlcore.plugins.rewards import check_reward

    ran = tmp_path / "ran"
    top = f"open({str(ran)!r}, 'a').write('ran')\n"
    (tmp_path / "evil.py").write_text(top + "def f(prompts, completions, scale=1.0, **columns):\n    return []\n")
    (tmp_path / "evilpkg").mkdir()
    (tmp_path / "evilpkg" / "__init__.py").write_text(top)
    (tmp_path / "evilpkg" / "mod.py").write_text(top + "from math import sqrt as g\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    plugins = load_plugins()
    check_reward(f"{tmp_path}/evil.py:f", plugins, {"scale": 2.0})
    check_reward("evilpkg.mod:g", plugins)
    for spec, match in ((f"{tmp_path}/evil.py:h", "defines no 'h'"), ("evilpkg.mod:f", "defines no 'f'"),
                        ("evilpkg.nope:f", "no module 'evilpkg.nope'"), (f"{tmp_path}/no.py:f", "does not exist")):
        with pytest.raises(ConfigError, match=match):
            check_reward(spec, plugins)
    assert not ran.exists()
