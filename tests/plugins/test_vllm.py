"""The vllm plugin on a machine without vLLM: it registers, imports nothing heavy, rejects bad options
before vLLM is imported, and turns what vLLM returns into rlcore's layouts (over a stand-in for vLLM's
`LLM`). Its GPU behaviour is tested in tests/gpu/test_vllm_engine.py."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch

from rlcore import ConfigError, RlcoreError, load_plugins
from rlcore.plugins.vllm import VLLMRolloutEngine


def test_registers_a_rollout_and_a_teacher_engine():
    engines = load_plugins().engines
    assert engines.get("vllm", kind="rollout").factory is VLLMRolloutEngine
    assert engines.get("teacher/vllm").factory is VLLMRolloutEngine


def test_importing_the_plugin_imports_neither_vllm_nor_torch():
    code = "import sys, rlcore.plugins.vllm; print('vllm' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split() == ["False", "False"]


def test_bad_options_are_all_reported_before_vllm_is_imported(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # an import of vllm would raise ImportError
    with pytest.raises(ConfigError) as info:
        VLLMRolloutEngine(
            model="",
            vllm_tensor_parallel_size=0,
            vllm_gpu_memory_utilization=1.5,
            vllm_max_model_len=-4,
            vllm_engine_kwargs={"gpu_memory_utilization": 0.5, "logprobs_mode": "raw_logprobs"},
        )
    keys = [key for key, _ in info.value.problems]
    assert keys == [
        "model",
        "vllm_tensor_parallel_size",
        "vllm_gpu_memory_utilization",
        "vllm_max_model_len",
        "vllm_engine_kwargs.gpu_memory_utilization",
        "vllm_engine_kwargs.logprobs_mode",
    ]
    assert "use vllm_gpu_memory_utilization instead" in str(info.value)


def test_missing_vllm_is_a_clear_error_after_choosing_the_in_process_engine_core(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # restored after the test
    with pytest.raises(RlcoreError, match=r"the vllm engine needs vLLM: pip install 'rlcore\[vllm\]'"):
        VLLMRolloutEngine(model="/models/tiny")
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


class _Logprob:
    def __init__(self, logprob: float):
        self.logprob = logprob


class _FakeModel(torch.nn.Module):
    """A model with vLLM's `load_weights(weights=...)`: four 8 x 8 layers, copied in by name, names recorded."""

    def __init__(self, loaded: list[str]):
        super().__init__()
        self.layers = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(8, 8), requires_grad=False) for _ in range(4)])
        self.loaded = loaded

    def load_weights(self, weights):
        for name, tensor in weights:
            self.loaded.append(name)
            self.layers[int(name.split(".")[2])].data.copy_(tensor)


class _FakeLLM:
    """What the engine reads of vLLM's `LLM`: prompt log-probs as vLLM 0.2x returns them (position 0 None,
    then a dict per position of the top-k plus the prompt token's own entry when it is not among them), the
    in-process model's `load_weights` and `reset_prefix_cache`."""

    def __init__(self):
        self.loaded: list[str] = []
        self.resets = 0
        self.model = _FakeModel(self.loaded)
        worker = types.SimpleNamespace(worker=types.SimpleNamespace(model_runner=types.SimpleNamespace(model=self.model)))
        self.llm_engine = types.SimpleNamespace(model_executor=types.SimpleNamespace(driver_worker=worker))

    def generate(self, requests, sampling, use_tqdm=False):
        k = sampling.prompt_logprobs
        outputs = []
        for request in requests:
            ids = request["prompt_token_ids"]
            positions = [None]
            for t in range(1, len(ids)):
                top = {100 + t * 10 + j: _Logprob(-0.5 * j - t) for j in reversed(range(k))}  # not in order
                top[ids[t]] = _Logprob(-50.0)  # the prompt token, outside the top-k
                positions.append(top)
            outputs.append(types.SimpleNamespace(prompt_logprobs=positions))
        return outputs

    def reset_prefix_cache(self):
        self.resets += 1


def _engine_over(llm: _FakeLLM) -> VLLMRolloutEngine:
    engine = VLLMRolloutEngine.__new__(VLLMRolloutEngine)  # no vLLM here: the engine's own logic over a fake LLM
    engine.llm, engine._asleep, engine.max_logprobs = llm, set(), 20
    engine.in_process, engine.tensor_parallel_size = True, 1
    engine.weight_replay, engine._receiver_ranks, engine._ipc_sender = True, None, None
    engine.enable_lora, engine._lora_request, engine.layout = False, None, None
    engine._vllm = types.SimpleNamespace(SamplingParams=lambda **kw: types.SimpleNamespace(**kw))
    return engine


def test_prompt_topk_is_one_right_padded_batch_in_the_shared_layout():
    engine = _engine_over(_FakeLLM())
    sequences = [[1, 2, 3, 4], [5, 6]]
    top = engine.prompt_topk_logprobs(sequences, 3)
    assert top.ids.shape == top.logprobs.shape == (2, 4, 3)
    assert top.ids.dtype == torch.long and top.logprobs.dtype == torch.float32
    assert top.ids[:, 0].eq(0).all() and top.logprobs[:, 0].eq(0).all()  # row 0: no prefix
    assert top.ids[1, 2:].eq(0).all() and top.logprobs[1, 2:].eq(0).all()  # padding
    for t in range(1, 4):  # best first, the prompt token's own entry dropped
        assert top.ids[0, t].tolist() == [100 + t * 10, 101 + t * 10, 102 + t * 10]
        assert top.logprobs[0, t].tolist() == [-t, -0.5 - t, -1.0 - t]
    assert top.ids[1, 1].tolist() == [110, 111, 112]


def test_in_process_engine_receives_a_broadcast_and_resets_its_prefix_cache():
    import threading

    from rlcore.runtime.rendezvous import find_free_port
    from rlcore.runtime.weight_sync import BroadcastGroup, iter_buckets

    llm = _FakeLLM()
    engine = _engine_over(llm)
    weights = [(f"model.layers.{i}.weight", torch.full((8, 8), float(i))) for i in range(4)]
    port = find_free_port()

    def train_rank_0():
        BroadcastGroup("127.0.0.1", port, rank=0, world_size=2, backend="gloo", timeout_s=60).send(
            iter_buckets(weights, bucket_bytes=300)
        )

    sender = threading.Thread(target=train_rank_0)
    sender.start()
    engine.join_weight_group("127.0.0.1", port, 1, 2, "gloo")
    engine.receive_weights()
    sender.join(timeout=60)
    assert llm.loaded == [name for name, _ in weights] and llm.resets == 1
    assert all(torch.equal(layer, torch.full((8, 8), float(i))) for i, layer in enumerate(llm.model.layers))


def test_a_second_sync_replays_the_traced_load_with_the_new_values():
    """The engine's loader is traced on a layout's first bucket and replayed after: vLLM's Python loader runs
    once, the new values still arrive."""
    llm = _FakeLLM()
    engine = _engine_over(llm)
    for version in (1.0, 2.0):
        engine.update_weights([(f"model.layers.{i}.weight", torch.full((8, 8), version * i)) for i in range(4)])
    assert llm.loaded == [f"model.layers.{i}.weight" for i in range(4)]  # the second load was replayed
    assert engine.rlcore_loader.stats()["replayed"] == 1
    assert all(torch.equal(layer, torch.full((8, 8), 2.0 * i)) for i, layer in enumerate(llm.model.layers))


def test_a_sync_into_qwen3_5_as_published_takes_the_checkpoints_names(published_qwen3_5):
    """The train engines send the language model in causal-LM names; vLLM's Qwen3_5ForConditionalGeneration loads
    the checkpoint's (`model.language_model.*`, `lm_head.*`), which its own mapper maps."""
    from rlcore.engines import checkpoint_layout

    llm = _FakeLLM()
    engine = _engine_over(llm)
    engine.layout = checkpoint_layout(published_qwen3_5["qwen3_5"])
    loaded = []
    llm.model.load_weights = lambda weights: loaded.extend(name for name, _ in weights)
    engine.update_weights([("model.layers.0.mlp.down_proj.weight", torch.zeros(2)), ("model.norm.weight", torch.zeros(2)),
                           ("lm_head.weight", torch.zeros(2))])
    assert loaded == ["model.language_model.layers.0.mlp.down_proj.weight", "model.language_model.norm.weight",
                      "lm_head.weight"]


class _GeneratingLLM:
    """vLLM's `LLM.generate` for sampling, as far as the engine reads it: completions with FlatLogprobs when
    asked for (logprobs=0), none otherwise; the tokenizer is a real Hugging Face one."""

    def __init__(self, tokenizer):
        self.tokenizer, self.asked = tokenizer, []

    def get_tokenizer(self):
        return self.tokenizer

    def generate(self, requests, sampling, use_tqdm=False):
        self.asked.append(sampling.logprobs)
        outputs = []
        for i, request in enumerate(requests):
            completions = []
            for j in range(sampling.n):
                ids = [(request["prompt_token_ids"][0] + 7 * j + t) % 200 + 40 for t in range(3 + i + j)]
                flat = None if sampling.logprobs is None else types.SimpleNamespace(
                    token_ids=ids, logprobs=[-0.1 * t for t in range(len(ids))], start_indices=list(range(len(ids))))
                completions.append(types.SimpleNamespace(token_ids=ids, logprobs=flat, finish_reason="length"))
            outputs.append(types.SimpleNamespace(outputs=completions))
        return outputs


@pytest.mark.parametrize("logprobs", [True, False])
def test_generate_asks_for_log_probs_only_when_wanted_and_decodes_every_completion(tiny_model, logprobs):
    from transformers import AutoTokenizer

    from rlcore import SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    llm = _GeneratingLLM(tokenizer)
    engine = _engine_over(llm)
    engine.request_seeds, engine._detokenize = False, True
    out = engine.generate([[1, 2], [3]], SamplingParams(n=2, max_tokens=8, logprobs=logprobs))
    assert llm.asked == [0 if logprobs else None]
    assert [g.prompt_index for g in out] == [0, 0, 1, 1]
    for g in out:
        assert g.text == tokenizer.decode(g.token_ids, skip_special_tokens=True) and g.text
        assert g.logprobs == ([-0.1 * t for t in range(len(g.token_ids))] if logprobs else [])


def test_an_architecture_vllm_lacks_is_refused_in_one_line_before_it_starts(monkeypatch, tmp_path):
    """Over a stand-in for vLLM's model registry (the real one: tests/gpu/test_vllm_engine.py): Qwen3.5 as a text-only
    Qwen3_5ForCausalLM is refused by config validate's check, not 100 lines of vLLM's list of architectures later."""
    from rlcore.plugins.vllm.engine import check_options
    from rlcore.testing import build_tiny_model

    registry = types.SimpleNamespace(get_supported_archs=lambda: {"Qwen2ForCausalLM", "Qwen3_5ForConditionalGeneration"})
    for name, module in {"vllm": types.ModuleType("vllm"), "vllm.model_executor": types.ModuleType("vllm.model_executor"),
                         "vllm.model_executor.models": types.SimpleNamespace(ModelRegistry=registry)}.items():
        monkeypatch.setitem(sys.modules, name, module)
    text_only = build_tiny_model(tmp_path / "q35", "qwen3_5")
    (problem,) = check_options(model=str(text_only))
    assert problem[0] == "model" and "is a Qwen3_5ForCausalLM, which vLLM" in problem[1]
    assert "use the rollout engine hf" in problem[1] and "\n" not in problem[1]
    assert check_options(model=str(text_only), vllm_engine_kwargs={"model_impl": "transformers"}) == []  # the user's call
    assert check_options(model=str(build_tiny_model(tmp_path / "q2"))) == []


def test_vllms_failed_to_inspect_is_told_with_its_cause(monkeypatch, tiny_model, tmp_path):
    """vLLM says only "Model architectures [...] failed to be inspected. Please check the logs" when its model module
    does not import (Qwen3.5 on the GPU image: transformers 5.17's Qwen2-VL image processor imports torchvision, which
    the staged vLLM lacked). The engine imports the module vLLM's registry names and says what failed, and the fix,
    in one line; another error passes through as vLLM raised it. Over stand-ins for vLLM (the real one:
    tests/gpu/test_megatron_archs_gpu.py) and a real module that does not import."""
    (tmp_path / "rlcore_vllm_model_that_fails.py").write_text("import rlcore_package_that_is_not_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    arch = "Qwen2ForCausalLM"
    entry = types.SimpleNamespace(module_name="rlcore_vllm_model_that_fails", class_name=arch)
    registry = types.SimpleNamespace(models={arch: entry})

    def llm(**_):
        raise ValueError(f"Model architectures ['{arch}'] failed to be inspected. Please check the logs for more details.")

    for name, module in {"vllm": types.SimpleNamespace(LLM=llm), "vllm.model_executor": types.ModuleType("vllm.model_executor"),
                         "vllm.model_executor.models": types.ModuleType("vllm.model_executor.models"),
                         "vllm.model_executor.models.registry": types.SimpleNamespace(ModelRegistry=registry)}.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with pytest.raises(RlcoreError) as info:
        VLLMRolloutEngine(model=str(tiny_model))
    message = str(info.value)
    assert f"vLLM's {arch} (rlcore_vllm_model_that_fails) does not import: ModuleNotFoundError" in message
    assert "install rlcore_package_that_is_not_installed (vLLM requires it" in message and "\n" not in message
    assert isinstance(info.value.__cause__, ValueError)
    entry.module_name = "json"  # the module imports: nothing to add to vLLM's own error
    with pytest.raises(ValueError, match="failed to be inspected"):
        VLLMRolloutEngine(model=str(tiny_model))


class _EngineLoop:
    """vLLM's `LLMEngine` request loop as the engine drives it: `add_request` and `step()`, a request finishing
    after as many steps as its episode's `slowness` (episode 0 fast, episode 1 slow)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.pending, self.added, self.loras = tokenizer, {}, [], []

    def add_request(self, request_id, prompt, sampling, lora_request=None):
        self.loras.append(lora_request)
        ids = prompt["prompt_token_ids"]
        slowness = 1 if ids[: len(self.fast_prompt)] == self.fast_prompt else 5
        self.pending[request_id] = [slowness, ids]
        self.added.append((request_id, prompt["prompt_token_ids"]))

    def step(self):
        out = []
        for request_id in list(self.pending):
            self.pending[request_id][0] -= 1
            if self.pending[request_id][0] == 0:
                del self.pending[request_id]
                ids = [*self.tokenizer.encode("ab", add_special_tokens=False), self.tokenizer.eos_token_id]
                flat = types.SimpleNamespace(token_ids=ids, logprobs=[-0.25] * len(ids), start_indices=list(range(len(ids))))
                completion = types.SimpleNamespace(token_ids=ids, logprobs=flat, finish_reason="stop")
                out.append(types.SimpleNamespace(request_id=request_id, finished=True, outputs=[completion]))
        return out


def test_run_episodes_submits_an_episodes_next_turn_as_soon_as_its_last_one_ends(tiny_model):
    """The vLLM path shares the episode logic (EpisodeRunner.advance) with the hf path; only the scheduling
    differs: the fast episode takes all its turns while the slow one is still in its first."""
    from rlcore import Environment, SamplingParams, Step
    from rlcore.episodes import EpisodeRunner, EpisodeSetup

    class Observe(Environment):
        seen = 0

        def step(self, turn):
            self.seen += 1
            return Step(done=self.seen == 3, messages=[{"role": "tool", "name": "t", "content": str(self.seen)}])

    setup = EpisodeSetup(model=str(tiny_model), max_turns=3, max_turn_tokens=8, max_total_tokens=200)
    runners = [EpisodeRunner(Observe(), setup, {"prompt": p}, i) for i, p in enumerate(["Hi", "Word:"])]
    engine = _engine_over(_FakeLLM())
    engine.request_seeds, engine._detokenize = False, False
    loop = engine.llm.llm_engine = _EngineLoop(runners[0].tokenizer)
    loop.fast_prompt = runners[0].prompt_ids
    engine._lora_request = adapter = _LoRARequest("rlcore-2", 2, "/adapter")  # vllm_enable_lora: the synced adapter
    engine.run_episodes(runners, SamplingParams(max_tokens=8, seed=1))
    assert loop.loras == [adapter] * 6  # every turn runs with it
    fast, slow = (r.result() for r in runners)
    assert [request for request, _ in loop.added] == [f"rlcore-episode-{i}" for i in range(6)]
    whose = ["fast" if p[:len(fast.prompt_ids)] == fast.prompt_ids else "slow" for _, p in loop.added]
    assert whose == ["fast", "slow", "fast", "fast", "slow", "slow"]  # fast's turns 2 and 3 while slow is in its 1st
    assert loop.added[3][1] == fast.prompt_ids + fast.token_ids[: len(loop.added[3][1]) - len(fast.prompt_ids)]
    for episode in (fast, slow):
        assert episode.turns == 3 and episode.loss_mask.count(0) > 0 and not episode.error
        assert [lp for lp, m in zip(episode.logprobs, episode.loss_mask) if m] == [-0.25] * sum(episode.loss_mask)


# -- adapter-only sync (rollout.vllm_enable_lora) ---------------------------------------------------------------


class _LoRARequest:
    """vllm.lora.request.LoRARequest, as far as the engine builds it."""

    def __init__(self, lora_name: str, lora_int_id: int, lora_path: str):
        self.lora_name, self.lora_int_id, self.lora_path = lora_name, lora_int_id, lora_path


class _LoRALLM:
    """vLLM's `LLM(enable_lora=True)` as far as the engine uses it, over transformers and peft on the CPU: `add_lora`
    reads the PEFT folder when called, as vLLM does (here onto a fresh base model), `remove_lora` drops one, and prompt
    log-probs come from the adapter the request names (the base model without one)."""

    def __init__(self, base: str):
        from transformers import AutoModelForCausalLM

        self.load = lambda: AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
        self.served: dict[int, torch.nn.Module] = {0: self.load()}
        self.added: list[tuple[int, str]] = []
        self.removed: list[int] = []
        self.asked: list[int] = []  # the LoRA id of each generate call (0: none)
        self.resets = 0
        self.llm_engine = types.SimpleNamespace(add_lora=self.add_lora, remove_lora=self.remove_lora)

    def add_lora(self, request) -> bool:
        from peft import PeftModel

        self.served[request.lora_int_id] = PeftModel.from_pretrained(self.load(), request.lora_path).eval()
        self.added.append((request.lora_int_id, request.lora_path))
        return True

    def remove_lora(self, lora_id: int) -> bool:
        self.removed.append(lora_id)
        return self.served.pop(lora_id, None) is not None

    def generate(self, requests, sampling, use_tqdm=False, lora_request=None):
        lora_id = 0 if lora_request is None else lora_request.lora_int_id
        self.asked.append(lora_id)
        outputs = []
        for request in requests:
            ids = torch.tensor([request["prompt_token_ids"]])
            with torch.no_grad():
                logprobs = torch.log_softmax(self.served[lora_id](input_ids=ids).logits[0].float(), dim=-1)
            k = sampling.prompt_logprobs
            positions = [None] + [{int(t): _Logprob(float(v)) for v, t in zip(*logprobs[p - 1].topk(k))}
                                  for p in range(1, ids.shape[1])]
            outputs.append(types.SimpleNamespace(prompt_logprobs=positions))
        return outputs

    def reset_prefix_cache(self):
        self.resets += 1


@pytest.fixture
def lora_request_module(monkeypatch):
    """`from vllm.lora.request import LoRARequest` finds the stand-in."""
    for name, module in {"vllm": types.ModuleType("vllm"), "vllm.lora": types.ModuleType("vllm.lora"),
                         "vllm.lora.request": types.SimpleNamespace(LoRARequest=_LoRARequest)}.items():
        monkeypatch.setitem(sys.modules, name, module)


def _train_options(engine: str, model: str) -> dict:
    options = {"model": model, "lora_rank": 4, "lora_alpha": 8, "learning_rate": 5e-2, "seed": 0}
    return {**options, "device": "cpu"} if engine == "hf" else options


@pytest.mark.parametrize("train_engine", ["hf", "megatron"])
def test_each_sync_serves_the_train_engines_adapter_as_a_fresh_lora_request(tiny_model, tmp_path, train_engine,
                                                                          lora_request_module):
    """Through a session in this process: each sync writes the train engine's adapter (PEFT, Hugging Face names)
    under the root, vLLM (the stand-in) serves it under a new LoRA id and drops the one before, the folder of the sync
    before is removed and the last one when the session stops; served on the base, the adapter gives the train
    engine's log-probs, before and after a train step."""
    from safetensors.torch import load_file

    from rlcore import RoleSession, RoleSetup
    from rlcore.runtime.resources import plan_from_config
    from rlcore.runtime.roles import GenerateWorker, TrainWorker
    from rlcore.runtime.weight_sync import check_weight_sync
    from test_hf_train import make_batch, nll_loss

    plugins = load_plugins()
    llm = _LoRALLM(str(tiny_model))
    engine = _engine_over(llm)
    engine.enable_lora = True
    setups = {"train": RoleSetup(TrainWorker, train_engine, _train_options(train_engine, str(tiny_model))),
              "rollout": RoleSetup(GenerateWorker, lambda **_: engine, {})}
    session = RoleSession(plan_from_config({}, roles=list(setups), plugins=plugins), setups, use_ray=False, plugins=plugins)
    root, probe = tmp_path / "adapter_sync", list(range(3, 40, 3))
    with session.start():
        train = session["train"]
        folders = []
        for step in range(2):
            stats = session.sync_adapter("train", "rollout", str(root))
            (folder,) = root.iterdir()  # the sync before's folder is gone
            folders.append(folder)
            assert llm.added[-1] == (step + 1, str(folder)) and llm.removed == list(range(1, step + 1))
            assert stats["weight_sync/bytes"] == sum(f.stat().st_size for f in folder.iterdir())
            written = load_file(str(folder / "adapter_model.safetensors"))
            assert written and all(k.startswith("base_model.model.model.layers.") and ".lora_" in k for k in written)
            assert check_weight_sync(train, engine, probe, atol=1e-4) < 1e-4  # base + adapter = the train engine
            assert llm.asked[-1] == step + 1
            train.train_step(make_batch(), nll_loss, 3)
        assert check_weight_sync(train, engine, probe, atol=10.0) > 1e-3  # the step changed the adapter: stale until a sync
    assert folders[0] != folders[1] and not root.exists()


def test_vllm_enable_lora_starts_vllm_with_one_adapter_slot_and_checks_its_rank(monkeypatch, tiny_model):
    """vllm_enable_lora: vLLM starts with enable_lora, max_lora_rank and max_loras=1 (over a stand-in `vllm.LLM`
    that records its arguments); a rank vLLM lacks and LoRA arguments in vllm_engine_kwargs are refused first;
    load_adapter without it, or of a folder this node does not see, is refused in one line."""
    made = []
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=lambda **kw: made.append(kw) or _FakeLLM()))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    engine = VLLMRolloutEngine(model=str(tiny_model), vllm_enable_lora=True, vllm_max_lora_rank=32)
    assert {k: made[0][k] for k in ("enable_lora", "max_lora_rank", "max_loras")} == {
        "enable_lora": True, "max_lora_rank": 32, "max_loras": 1}
    with pytest.raises(RlcoreError, match=r"no PEFT adapter at '/nowhere' on .*must be a filesystem the train and rollout"):
        engine.load_adapter("/nowhere")
    VLLMRolloutEngine(model=str(tiny_model))
    assert "enable_lora" not in made[1]
    with pytest.raises(ConfigError, match="needs vllm_enable_lora=True"):
        _engine_over(_FakeLLM()).load_adapter(str(tiny_model))
    with pytest.raises(ConfigError) as info:
        VLLMRolloutEngine(model=str(tiny_model), vllm_enable_lora=True, vllm_max_lora_rank=12,
                          vllm_engine_kwargs={"enable_lora": True, "max_loras": 2})
    assert [key for key, _ in info.value.problems] == [
        "vllm_max_lora_rank", "vllm_engine_kwargs.enable_lora", "vllm_engine_kwargs.max_loras"]
    from rlcore.plugins.vllm.engine import check_options  # what `config validate` says, before a GPU is taken

    ((key, message),) = check_options(model=str(tiny_model), vllm_enable_lora=True, vllm_max_lora_rank=12)
    assert key == "vllm_max_lora_rank" and "is no rank vLLM takes; use one of 1, 8, 16" in message
    assert check_options(model=str(tiny_model), vllm_enable_lora=False, vllm_max_lora_rank=12) == []
