"""Multi-turn episodes, token in and token out: the prompts each turn sees, the loss mask, the caps, a failing
environment, state per episode, and log-prob parity between the hf rollout and train engines across turns."""

from __future__ import annotations

import time

import pytest

from rlcore import Batch, Environment, Generation, SamplingParams, Step, load_plugins
from rlcore.episodes import EpisodeRunner, EpisodeSetup, message_suffix_ids, run_episodes, run_turns
from rlcore.testing import build_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("episodes") / "tiny"))


@pytest.fixture(scope="module")
def plugins():
    return load_plugins()


class Observe(Environment):
    """Answers every turn with a tool message that counts this episode's turns (its own state)."""

    def __init__(self, turns: int = 3):
        self.seen, self.turns = 0, turns

    def step(self, turn):
        self.seen += 1
        if self.seen >= self.turns:
            return Step(done=True, reward=1.0)
        return Step(messages=[{"role": "tool", "name": "count", "content": f"seen {self.seen}"}], reward=0.5)


class Raises(Environment):
    def step(self, turn):
        raise RuntimeError("the game server is down")


class Hangs(Environment):
    def step(self, turn):
        time.sleep(30)




class Scripted:
    """A generate function replaying fixed turns and recording the prompts it was given."""

    def __init__(self, tokenizer, texts, eos=True):
        self.tokenizer, self.texts, self.prompts, self.eos = tokenizer, texts, [], eos

    def __call__(self, prompts, params):
        out = []
        for p in prompts:
            turn = sum(len(q) < len(p) and p[:len(q)] == q for q in self.prompts)  # this episode's earlier prompts
            self.prompts.append(list(p))
            text = self.texts[min(turn, len(self.texts) - 1)]
            ids = self.tokenizer.encode(text, add_special_tokens=False)[: params.max_tokens]
            finish = "length" if len(ids) == params.max_tokens else "stop"
            if self.eos and finish == "stop":
                ids = ids + [self.tokenizer.eos_token_id]
            out.append(Generation(0, ids, [-0.5] * len(ids), finish, self.tokenizer.decode(ids, skip_special_tokens=True)))
        return out


def runner(model, env, row=None, **setup):
    return EpisodeRunner(env, EpisodeSetup(model=model, **{"max_turns": 5, "max_turn_tokens": 32, "max_total_tokens": 200,
                                                           **setup}), row or {"prompt": "Hi"})


def test_each_turn_is_the_last_prompt_plus_its_tokens_plus_the_new_messages_and_only_the_models_are_trained(model):
    r = runner(model, Observe(turns=3))
    tok = r.tokenizer
    generate = Scripted(tok, ["ab", "cd", "ef"])
    run_turns(generate, [r], SamplingParams(max_tokens=16))
    episode = r.result()
    a, c, e = ([*tok.encode(t, add_special_tokens=False), tok.eos_token_id] for t in ("ab", "cd", "ef"))
    obs1 = message_suffix_ids(tok, [{"role": "tool", "name": "count", "content": "seen 1"}])
    obs2 = message_suffix_ids(tok, [{"role": "tool", "name": "count", "content": "seen 2"}])
    assert generate.prompts == [episode.prompt_ids, episode.prompt_ids + a + obs1, episode.prompt_ids + a + obs1 + c + obs2]
    assert episode.token_ids == a + obs1 + c + obs2 + e
    assert episode.loss_mask == [1] * len(a) + [0] * len(obs1) + [1] * len(c) + [0] * len(obs2) + [1] * len(e)
    assert [lp for lp, m in zip(episode.logprobs, episode.loss_mask) if not m] == [0.0] * (len(obs1) + len(obs2))
    # the tokens equal the chat template's rendering of the whole conversation: nothing was tokenised differently
    assert tok.decode(episode.prompt_ids + episode.token_ids) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nab<|im_end|>\n<|im_start|>tool\nseen 1<|im_end|>\n"
        "<|im_start|>assistant\ncd<|im_end|>\n<|im_start|>tool\nseen 2<|im_end|>\n<|im_start|>assistant\nef<|im_end|>")
    assert (episode.turns, episode.reward, episode.finish_reason) == (3, 2.0, "stop")
    assert [m["role"] for m in episode.messages] == ["assistant", "tool", "assistant", "tool", "assistant"]


def test_the_math_tip_cuts_the_answer_and_the_model_goes_on_in_the_same_message(model, plugins):
    from rlcore.episodes import make_environment

    setup = dict(environment="math_tip_trick", environment_kwargs={"reward": "toy", "threshold": 1.0})
    r = runner(model, make_environment(EpisodeSetup(model=model, **setup), plugins), {"prompt": "Hi", "target": "ae"},
               **setup)
    tok = r.tokenizer
    run_turns(Scripted(tok, ["xy<answer>z</answer>", " ae"]), [r], SamplingParams(max_tokens=32))
    episode = r.result()
    tip = tok.encode("But wait... It seems I made a mistake,", add_special_tokens=False)
    xy, ae = tok.encode("xy", add_special_tokens=False), tok.encode(" ae", add_special_tokens=False)
    assert episode.token_ids == xy + tip + ae + [tok.eos_token_id]  # cut at <answer>, its eos dropped, tip masked
    assert episode.loss_mask == [1] * len(xy) + [0] * len(tip) + [1] * (len(ae) + 1)
    assert episode.messages == [{"role": "assistant", "content": "xyBut wait... It seems I made a mistake, ae"}]
    assert episode.turns == 2 and episode.text.endswith(" ae")


def test_max_turns_and_the_total_cap_end_an_episode(model):
    r = runner(model, Observe(turns=10), max_turns=2)
    run_turns(Scripted(r.tokenizer, ["ab"]), [r], SamplingParams(max_tokens=16))
    assert (r.result().turns, r.result().finish_reason) == (2, "stop")

    capped = runner(model, Observe(turns=10), max_total_tokens=12)  # an observation past the cap is dropped
    run_turns(Scripted(capped.tokenizer, ["abcd"]), [capped], SamplingParams(max_tokens=16))
    episode = capped.result()
    assert episode.finish_reason == "length" and all(episode.loss_mask) and len(episode.token_ids) < 12
    assert [m["role"] for m in episode.messages] == ["assistant"]

    cut = runner(model, Observe(turns=10), max_turn_tokens=3)  # a turn cut at its cap is closed before the answer
    run_turns(Scripted(cut.tokenizer, ["abcdefgh"], eos=False), [cut], SamplingParams(max_tokens=16))
    first = cut.result().token_ids[:4]
    assert first[3] == cut.tokenizer.eos_token_id and cut.result().loss_mask[:4] == [1, 1, 1, 0]


def test_a_raising_or_hanging_environment_ends_only_its_episode_with_the_error(model):
    runners = [runner(model, Raises()), runner(model, Hangs(), environment_timeout=0.3), runner(model, Observe(2))]
    start = time.monotonic()
    run_turns(Scripted(runners[0].tokenizer, ["ab"]), runners, SamplingParams(max_tokens=16))
    assert time.monotonic() - start < 10
    raised, hung, fine = (r.result() for r in runners)
    assert "RuntimeError: the game server is down" in raised.error and raised.finish_reason == "error"
    assert "did not return within 0.3 s (environment_timeout)" in hung.error
    assert not fine.error and fine.turns == 2


def test_each_row_gets_a_fresh_environment_and_parity_with_the_train_engine_across_turns(model, plugins):
    """On the real hf rollout engine: episodes of one batch do not share state (each counts its own turns), the
    same seed gives the same episodes, and
    the train engine's log-probs of the generated tokens, read from the whole multi-turn sequence, are the
    sampler's."""
    import torch

    from rlcore.batch import pad_tokens
    from rlcore.plugins.hf.rollout import HFRolloutEngine
    from rlcore.plugins.hf.train import HFTrainEngine

    rollout = HFRolloutEngine(model=model, seed=0)
    setup = EpisodeSetup(model=model, environment=f"{__name__}:Observe", environment_kwargs={"turns": 3},
                         max_turns=3, max_turn_tokens=6, max_total_tokens=120)
    stops = [rollout.tokenizer.eos_token_id, *range(0, 250, 4)]  # turns of a random model end early
    episodes = run_episodes(rollout, [{"prompt": "Hi"}, {"prompt": "Word:"}] * 2, setup,
                            SamplingParams(max_tokens=6, seed=3, stop_token_ids=stops), plugins)
    assert [e.turns for e in episodes] == [3] * 4 and [e.reward for e in episodes] == [2.0] * 4
    assert all(0 in e.loss_mask for e in episodes)
    again = run_episodes(rollout, [{"prompt": "Hi"}, {"prompt": "Word:"}] * 2, setup,
                         SamplingParams(max_tokens=6, seed=3, stop_token_ids=stops), plugins)
    assert [e.token_ids for e in again] == [e.token_ids for e in episodes]  # a step's seed: a resumed run's episodes

    train = HFTrainEngine(model)
    ids, attention = pad_tokens([e.prompt_ids + e.token_ids for e in episodes], 0)
    got = train.forward_logprobs(Batch(input_ids=ids, attention_mask=attention))
    for i, e in enumerate(episodes):
        n = len(e.prompt_ids)
        mask = torch.tensor(e.loss_mask, dtype=torch.bool)
        torch.testing.assert_close(got[i, n:n + len(e.token_ids)][mask], torch.tensor(e.logprobs)[mask],
                                   atol=1e-4, rtol=1e-4)
