"""The output processor's one-call path for plain streamed requests (``_plain_step``: a delta stream of
its own, every token sent, no logprobs) gives exactly the outputs, aborts and metrics of the general path,
stop strings, multi-token steps, cached prefixes and the final output included."""

from __future__ import annotations

import dataclasses

import pytest

from quire.core.engine.output_processor import OutputProcessor
from quire.core.sampling_params import RequestOutputKind, SamplingParams
from quire.core.wire import EngineCoreEvent, EngineCoreOutput, EngineCoreRequest, EventType, FinishReason

TEXT = "Plain steps: 中文 and 😀 arrive whole, a stop word may end it, and the end is flushed."


class Counting(OutputProcessor):
    """Counts the outputs that took the plain path; ``force_general`` turns it off."""

    def __init__(self, tokenizer, force_general: bool):
        super().__init__(tokenizer)
        self.force_general = force_general
        self.plain_outputs = 0

    def add_request(self, request, prompt, *args, **kwargs):
        super().add_request(request, prompt, *args, **kwargs)
        if self.force_general:
            self.request_states[request.request_id].plain = False

    def _plain_step(self, state, new_token_ids, now):
        self.plain_outputs += 1
        return super()._plain_step(state, new_token_ids, now)


def run(tokenizer, params: SamplingParams, pattern: list[int], force_general: bool, cached: int = 0):
    """Two requests fed TEXT's tokens in steps of sizes repeating ``pattern`` (the last step finishes on
    length, the first has an event); returns every output (as dicts, metrics without times), the aborts and
    the processor."""
    ids = tokenizer.encode(TEXT)
    steps = []
    while sum(steps) < len(ids):
        steps += pattern
    processor = Counting(tokenizer, force_general)
    for name in ("a", "b"):
        processor.add_request(EngineCoreRequest(name, tokenizer.encode("Say:"), params, [], 0.0), "Say:")
    outputs, aborts, position = [], [], 0
    for number, size in enumerate(steps):
        new = ids[position:position + size]
        position += size
        last = number == len(steps) - 1
        events = [EngineCoreEvent(EventType.SCHEDULED, 1.0)] if number == 0 else None
        batch = [EngineCoreOutput(name, new, FinishReason.LENGTH if last else None, num_cached_tokens=cached,
                                  events=events) for name in ("a", "b") if name in processor.request_states]
        out, to_abort = processor.process_outputs(batch, engine_index=1)
        outputs += [dataclasses.asdict(o) for o in out]
        aborts += to_abort
    for output in outputs:
        metrics = output["metrics"]
        metrics["token_times"] = len(metrics["token_times"])
        metrics["first_token_time"] = metrics["first_token_time"] is not None
        metrics["arrival_time"] = metrics["finished_time"] = None
    return outputs, aborts, processor


@pytest.mark.parametrize("params,steps,cached", [
    (SamplingParams(max_tokens=100, output_kind=RequestOutputKind.DELTA), [1], 0),
    (SamplingParams(max_tokens=100, output_kind=RequestOutputKind.DELTA), [1, 3, 1, 2, 1, 5, 1, 1], 0),
    (SamplingParams(max_tokens=100, output_kind=RequestOutputKind.DELTA), [1], 4),
    (SamplingParams(max_tokens=100, output_kind=RequestOutputKind.DELTA, stop=["stop word"]), [1], 0),
    (SamplingParams(max_tokens=100, output_kind=RequestOutputKind.DELTA, stop=["whole"],
                    include_stop_str_in_output=True), [2], 0),
])
def test_plain_outputs_equal_the_general_paths(tiny_tokenizer, params, steps, cached):
    plain, plain_aborts, fast = run(tiny_tokenizer, params, steps, force_general=False, cached=cached)
    general, general_aborts, slow = run(tiny_tokenizer, params, steps, force_general=True, cached=cached)
    assert plain == general and plain_aborts == general_aborts
    assert fast.plain_outputs > 0 and slow.plain_outputs == 0
    assert [m.num_generation_tokens for m in fast.finished_metrics] == \
        [m.num_generation_tokens for m in slow.finished_metrics]
    assert not fast.has_unfinished_requests()
    if params.stop:
        assert plain_aborts == ["a", "b"] and plain[-1]["finished"] and plain[-1]["outputs"][0]["stop_reason"]


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=100, output_kind=RequestOutputKind.CUMULATIVE),
    SamplingParams(max_tokens=100, output_kind=RequestOutputKind.FINAL_ONLY),
    SamplingParams(max_tokens=100, output_kind=RequestOutputKind.DELTA, logprobs=1),
    SamplingParams(max_tokens=100, output_kind=RequestOutputKind.DELTA, stream_interval=2),
])
def test_other_requests_keep_the_general_path(tiny_tokenizer, params):
    _, _, processor = run(tiny_tokenizer, params, [1], force_general=False)
    assert processor.plain_outputs == 0


def steps_of(tokenizer, params: SamplingParams, pattern: list[int], take=None):
    """Like ``run``, but per request the (text, token ids, finish reason, stop reason) of each step in order,
    whether an output carried it or, with ``take`` (step number -> whether the sink takes it), the text sink;
    also the steps the sink was offered, and ``set_text_sink``'s answers."""
    ids = tokenizer.encode(TEXT)
    steps = []
    while sum(steps) < len(ids):
        steps += pattern
    processor = OutputProcessor(tokenizer)
    seen = {"a": [], "b": []}
    offered, answers, number = [], [], 0
    for name in ("a", "b"):
        processor.add_request(EngineCoreRequest(name, tokenizer.encode("Say:"), params, [], 0.0), "Say:")
        if take is not None:
            def sink(text, token_ids, name=name):
                offered.append(number)
                if not take(number):
                    return False
                seen[name].append((text, token_ids, None, None))
                return True
            answers.append(processor.set_text_sink(name, sink))
    position = 0
    for number, size in enumerate(steps):
        new = ids[position:position + size]
        position += size
        last = number == len(steps) - 1
        batch = [EngineCoreOutput(name, new, FinishReason.LENGTH if last else None)
                 for name in ("a", "b") if name in processor.request_states]
        for out in processor.process_outputs(batch)[0]:
            completion = out.outputs[0]
            seen[out.request_id].append((completion.text, completion.token_ids, completion.finish_reason,
                                         completion.stop_reason))
    return seen, offered, answers, len(steps)


@pytest.mark.parametrize("stop", [None, ["stop word"]])
@pytest.mark.parametrize("pattern", [[1], [1, 3, 2]])
def test_a_text_sink_takes_plain_steps_in_place_of_their_outputs(tiny_tokenizer, stop, pattern):
    params = SamplingParams(max_tokens=100, output_kind=RequestOutputKind.DELTA, stop=stop)
    general, _, _, _ = steps_of(tiny_tokenizer, params, pattern)
    taken, offered, answers, num_steps = steps_of(tiny_tokenizer, params, pattern, take=lambda n: n % 3 != 1)
    assert answers == [True, True]
    assert taken == general  # the same steps, texts and token ids, whichever way each went
    assert offered and num_steps - 1 not in offered  # the final step is never offered
    if stop:  # the stop string's step is not offered either: it ends the request early
        assert max(offered) < len(general["a"]) - 1
    # declined steps (every third) still reach the caller as outputs
    assert any(n % 3 == 1 for n in offered)


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=100, output_kind=RequestOutputKind.CUMULATIVE),
    SamplingParams(max_tokens=100, output_kind=RequestOutputKind.DELTA, logprobs=1),
    SamplingParams(max_tokens=100, output_kind=RequestOutputKind.DELTA, stream_interval=2),
])
def test_a_text_sink_is_refused_for_requests_that_are_not_plain(tiny_tokenizer, params):
    taken, offered, answers, _ = steps_of(tiny_tokenizer, params, [1], take=lambda n: True)
    assert answers == [False, False] and offered == []
    assert taken == steps_of(tiny_tokenizer, params, [1])[0]
