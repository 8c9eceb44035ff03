"""LLMEngine driven by hand: output kinds, abort, duplicate ids, the SyncEngineClient protocol."""

import pytest

from quire.core import EngineArgs, EngineClient, LLMEngine, RequestOutputKind, SamplingParams, SyncEngineClient
from quire.core.errors import EngineUtilityError, ValidationError


@pytest.fixture(scope="module")
def engine(llama_checkpoint):
    return LLMEngine.from_engine_args(EngineArgs(model=str(llama_checkpoint), dtype="float32",
                                                 max_model_len=256))


def drain(engine, limit=500):
    outputs = []
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            return outputs
        outputs += engine.step()
    raise AssertionError("engine did not finish")


def params(kind, n=6):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, output_kind=kind)


def test_is_an_engine_client(engine):
    assert isinstance(engine, SyncEngineClient) and not isinstance(engine, EngineClient)
    engine.check_health()
    assert engine.is_running and not engine.errored


def test_output_kinds(engine):
    engine.add_request("cumulative", "x = 1", params(RequestOutputKind.CUMULATIVE))
    engine.add_request("delta", "x = 1", params(RequestOutputKind.DELTA))
    engine.add_request("final", "x = 1", params(RequestOutputKind.FINAL_ONLY))
    outputs = drain(engine)
    by_id = {}
    for output in outputs:
        by_id.setdefault(output.request_id, []).append(output)
    assert len(by_id["final"]) == 1 and by_id["final"][0].finished
    final = by_id["final"][0].outputs[0]
    cumulative = [o.outputs[0] for o in by_id["cumulative"]]
    assert [len(c.token_ids) for c in cumulative] == [1, 2, 3, 4, 5, 6]
    assert cumulative[-1].token_ids == final.token_ids and cumulative[-1].text == final.text
    deltas = [o.outputs[0] for o in by_id["delta"]]
    assert sum((d.token_ids for d in deltas), []) == final.token_ids
    assert "".join(d.text for d in deltas) == final.text
    assert [d.finish_reason for d in deltas][-1] == "length"


def test_abort_frees_everything(engine):
    engine.add_request("a", "import sys", params(RequestOutputKind.DELTA, 50))
    engine.add_request("b", "import os", params(RequestOutputKind.DELTA, 50))
    engine.step()
    engine.step()
    engine.abort_request(["a", "missing"])
    assert engine.has_unfinished_requests()
    outputs = drain(engine)
    assert {o.request_id for o in outputs} == {"b"}
    scheduler = engine.engine_core.engine_core.scheduler
    assert scheduler.requests == {} and scheduler.kv_cache_manager.num_free_blocks == engine.engine_core.num_blocks - 1


def test_duplicate_request_ids_are_refused(engine):
    engine.add_request("dup", "a", params(RequestOutputKind.FINAL_ONLY))
    with pytest.raises(ValidationError) as info:
        engine.add_request("dup", "b", params(RequestOutputKind.FINAL_ONLY))
    assert info.value.param == "request_id"
    drain(engine)


def test_utility_failures_have_one_type(engine):
    with pytest.raises(EngineUtilityError, match="unknown utility method"):
        engine.engine_core.call_utility("no_such_method")
    engine.add_request("left", "x", params(RequestOutputKind.FINAL_ONLY))
    with pytest.raises(EngineUtilityError, match="front end still tracks requests"):
        engine.check_idle_invariants()
    drain(engine)
    engine.check_idle_invariants()
    assert engine.get_step_timings()["num_steps"] >= 1
