"""``stream_interval``: streamed outputs carry the first token at once, then at least k tokens each, and
together they are exactly what an interval of 1 delivers."""

from __future__ import annotations

import pytest

from quire.core.engine.output_processor import OutputProcessor
from quire.core.errors import ValidationError
from quire.core.sampling_params import RequestOutputKind, SamplingParams
from quire.core.wire import EngineCoreOutput, EngineCoreRequest, FinishReason

TEXT = "Streaming in larger chunks: 中文 and 😀 still arrive whole, and nothing is lost at the end."


def run(tokenizer, engine_interval: int, kind: RequestOutputKind, request_interval: int | None = None,
        steps=None):
    """Feed the tokens of TEXT one step at a time (or in the given step sizes); return the outputs."""
    ids = tokenizer.encode(TEXT)
    processor = OutputProcessor(tokenizer, engine_interval)
    params = SamplingParams(max_tokens=len(ids), output_kind=kind, stream_interval=request_interval)
    processor.add_request(EngineCoreRequest("r", tokenizer.encode("Say:"), params, [], 0.0), "Say:")
    outputs, position = [], 0
    for size in steps or [1] * len(ids):
        new = ids[position:position + size]
        position += size
        last = position >= len(ids)
        out, _ = processor.process_outputs(
            [EngineCoreOutput("r", new, FinishReason.LENGTH if last else None)])
        outputs += out
        if last:
            break
    assert not processor.has_unfinished_requests()
    return ids, outputs


@pytest.mark.parametrize("interval", [1, 3, 5, 10])
def test_delta_chunks_hold_the_first_token_then_at_least_the_interval(tiny_tokenizer, interval):
    ids, outputs = run(tiny_tokenizer, interval, RequestOutputKind.DELTA)
    _, every_token = run(tiny_tokenizer, 1, RequestOutputKind.DELTA)
    sizes = [len(o.outputs[0].token_ids) for o in outputs]
    assert sizes[0] == 1 and all(size >= interval for size in sizes[1:-1]) and sizes[-1] >= 1
    assert len(outputs) == 1 + -(-(len(ids) - 1) // interval)  # no output is held back needlessly
    assert [t for o in outputs for t in o.outputs[0].token_ids] == ids
    assert "".join(o.outputs[0].text for o in outputs) == "".join(o.outputs[0].text for o in every_token)
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]


def test_cumulative_outputs_follow_the_interval_and_end_complete(tiny_tokenizer):
    ids, outputs = run(tiny_tokenizer, 4, RequestOutputKind.CUMULATIVE)
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    assert lengths[0] == 1 and all(b - a >= 4 for a, b in zip(lengths[1:-1], lengths[2:-1]))
    assert outputs[-1].outputs[0].token_ids == ids and outputs[-1].finished


def test_steps_of_several_tokens_count_towards_the_interval(tiny_tokenizer):
    ids, outputs = run(tiny_tokenizer, 4, RequestOutputKind.DELTA, steps=[1, 3, 2, 2] + [1] * 100)
    sizes = [len(o.outputs[0].token_ids) for o in outputs]
    assert sizes[:3] == [1, 5, 4]  # 3 < 4 waits, 3 + 2 goes out; then 2 + 1 + 1
    assert [t for o in outputs for t in o.outputs[0].token_ids] == ids


def test_a_request_may_raise_the_interval_but_not_lower_it(tiny_tokenizer):
    _, raised = run(tiny_tokenizer, 2, RequestOutputKind.DELTA, request_interval=6)
    assert all(len(o.outputs[0].token_ids) >= 6 for o in raised[1:-1])
    _, clamped = run(tiny_tokenizer, 4, RequestOutputKind.DELTA, request_interval=1)
    assert all(len(o.outputs[0].token_ids) >= 4 for o in clamped[1:-1])


def test_final_only_is_unaffected(tiny_tokenizer):
    ids, outputs = run(tiny_tokenizer, 5, RequestOutputKind.FINAL_ONLY)
    assert len(outputs) == 1 and outputs[0].outputs[0].token_ids == ids


@pytest.mark.parametrize("bad", [0, -3, 1.5, "2"])
def test_an_invalid_interval_names_the_field(bad):
    with pytest.raises(ValidationError) as info:
        SamplingParams(stream_interval=bad)
    assert info.value.param == "stream_interval"


def test_the_engine_interval_comes_from_the_server_flag_and_engine_args(tiny_checkpoint):
    from quire.core.engine.llm_engine import LLMEngine
    from quire.core.engine_args import EngineArgs
    from quire.core.errors import ConfigError
    from quire.openai_server.cli import build_parser, settings_from_args

    engine_args, _ = settings_from_args(build_parser().parse_args(["--stream-interval", "4"]))
    assert engine_args.stream_interval == 4
    with pytest.raises(ConfigError, match="stream_interval"):
        EngineArgs(model=tiny_checkpoint("llama"), stream_interval=0).create_engine_config()
    engine = LLMEngine.from_engine_args(EngineArgs(model=tiny_checkpoint("llama"), stream_interval=3,
                                                   max_model_len=64), multiprocess=False)
    assert engine.output_processor.stream_interval == 3
    engine.shutdown()
