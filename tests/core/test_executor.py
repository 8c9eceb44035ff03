"""EngineCore runs the model only through an Executor chosen by name; a fake executor stands in for it."""

from __future__ import annotations

import time

import pytest

from quire.core.engine import executor as executor_module
from quire.core.engine.core import EngineCore
from quire.core.engine.executor import Executor, UniProcExecutor, default_executor_backend, get_executor_class
from quire.core.engine_args import EngineArgs
from quire.core.errors import ConfigError
from quire.core.sampling_params import SamplingParams
from quire.core.sched.output import ModelRunnerOutput
from quire.core.wire import EngineCoreRequest
from quire.offline import LLM

FAKE_TOKEN = 7


def engine_config(path, **options):
    return EngineArgs(model=str(path), dtype="float32", max_model_len=128, **options).create_engine_config()


class FakeExecutor(Executor):
    """Samples FAKE_TOKEN for every request whose scheduled tokens reach its end; no model, no torch."""

    def __init__(self, config):
        self.num_tokens: dict[str, int] = {}
        self.num_computed: dict[str, int] = {}
        self.removed: list[str] = []

    def num_kv_blocks(self) -> int:
        return 32

    def initialize_kv_cache(self, num_blocks: int) -> None:
        assert num_blocks == 32

    def execute_model(self, scheduler_output, timings=None) -> ModelRunnerOutput:
        self.remove_requests(scheduler_output.finished_request_ids)
        for data in scheduler_output.new_requests:
            self.num_tokens[data.request_id] = len(data.token_ids)
            self.num_computed[data.request_id] = data.num_computed_tokens
        sampled = {}
        for request_id, count in scheduler_output.num_scheduled_tokens.items():
            self.num_computed[request_id] += count
            if self.num_computed[request_id] == self.num_tokens[request_id]:
                sampled[request_id] = [FAKE_TOKEN]
                self.num_tokens[request_id] += 1
        return ModelRunnerOutput(sampled)

    def remove_requests(self, request_ids) -> None:
        for request_id in request_ids:
            self.removed.append(request_id)
            self.num_tokens.pop(request_id, None)
            self.num_computed.pop(request_id, None)

    def num_threads(self) -> int:
        return 1

    def num_runner_rows(self) -> int:
        return len(self.num_tokens)

    def shutdown(self) -> None:
        self.num_tokens.clear()


def test_unknown_executor_is_refused_by_name(llama_checkpoint):
    with pytest.raises(ConfigError, match="unknown executor 'nope'"):
        EngineCore(engine_config(llama_checkpoint), executor_backend="nope")
    with pytest.raises(ConfigError, match="'nope'.*mp, ray, uniproc"):
        get_executor_class("nope")
    assert get_executor_class("uniproc") is UniProcExecutor
    assert get_executor_class("mp").__name__ == "MultiprocExecutor"
    assert get_executor_class("ray").__name__ == "RayExecutor"


@pytest.mark.parametrize(("options", "expected"), [
    ({}, "uniproc"),
    ({"distributed_executor_backend": "ray"}, "uniproc"),
    ({"tensor_parallel_size": 2}, "mp"),
    ({"tensor_parallel_size": 2, "distributed_executor_backend": "ray"}, "ray"),
])
def test_default_executor_follows_the_parallel_config(llama_checkpoint, options, expected):
    assert default_executor_backend(engine_config(llama_checkpoint, **options)) == expected


def test_engine_core_drives_any_executor(llama_checkpoint, monkeypatch):
    monkeypatch.setitem(executor_module._EXECUTORS.entries, "fake", (__name__, "FakeExecutor"))
    core = EngineCore(engine_config(llama_checkpoint), executor_backend="fake")
    assert core.num_blocks == 32 and core.get_stats()["num_threads"] == 1
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    core.add_request(EngineCoreRequest("a", list(range(10, 30)), params, [], time.monotonic()))
    tokens = []
    while core.has_unfinished_requests():
        tokens += [t for output in core.step().outputs for t in output.new_token_ids]
    assert tokens == [FAKE_TOKEN] * 3
    assert core.executor.removed == ["a"] and core.check_idle_invariants()
    core.shutdown()


def test_uniproc_executor_holds_the_one_model_runner(llama_checkpoint, corpus_token_ids):
    llm = LLM(llama_checkpoint, dtype="float32", max_model_len=128)
    core = llm.llm_engine.engine_core.engine_core
    assert isinstance(core.executor, UniProcExecutor) and not hasattr(core, "model_runner")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([corpus_token_ids[:9], corpus_token_ids[50:70]], params, use_tqdm=False)
    assert core.executor.num_runner_rows() == 0 and core.check_idle_invariants()
    assert core.get_stats()["num_threads"] == core.executor.model_runner.num_threads()
