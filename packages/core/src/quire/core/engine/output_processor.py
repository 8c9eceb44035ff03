"""Engine outputs (token ids) to user outputs (text, finish reasons), one request state per request."""

from __future__ import annotations

import dataclasses

from quire.core.engine.detokenizer import IncrementalDetokenizer
from quire.core.errors import ValidationError
from quire.core.outputs import CompletionOutput, RequestOutput
from quire.core.request import FinishReason
from quire.core.sampling_params import RequestOutputKind
from quire.core.wire import EngineCoreOutput, EngineCoreRequest


@dataclasses.dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind
    detokenizer: IncrementalDetokenizer
    sent_token_offset: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


class OutputProcessor:
    """Detokenizes, applies stop strings and builds ``RequestOutput``s for the requests in flight."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}

    def add_request(self, request: EngineCoreRequest, prompt: str | None) -> None:
        if request.request_id in self.request_states:
            raise ValidationError(f"request id {request.request_id!r} is already in use",
                                  param="request_id")
        params = request.sampling_params
        self.request_states[request.request_id] = RequestState(
            request_id=request.request_id,
            prompt=prompt,
            prompt_token_ids=request.prompt_token_ids,
            output_kind=params.output_kind,
            detokenizer=IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params),
        )

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.request_states)

    def abort_requests(self, request_ids) -> list[str]:
        """Forget the given requests; return those that were in flight."""
        return [rid for rid in request_ids if self.request_states.pop(rid, None) is not None]

    def process_outputs(
        self, engine_outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestOutput], list[str]]:
        """Return the outputs to hand to users and the ids the engine must abort (stop strings)."""
        request_outputs, to_abort = [], []
        for output in engine_outputs:
            state = self.request_states.get(output.request_id)
            if state is None:
                continue  # aborted by the user meanwhile
            stop_terminated = output.finish_reason == FinishReason.STOP
            stop_string = state.detokenizer.update(output.new_token_ids, stop_terminated)
            if stop_string is not None:
                state.finish_reason, state.stop_reason = FinishReason.STOP, stop_string
                if not output.finished:
                    to_abort.append(output.request_id)
            elif output.finished:
                state.finish_reason, state.stop_reason = output.finish_reason, output.stop_reason
                state.detokenizer.finish(stop_terminated)
            request_output = self._make_output(state)
            if request_output is not None:
                request_outputs.append(request_output)
            if state.finish_reason is not None:
                del self.request_states[output.request_id]
        return request_outputs, to_abort

    def _make_output(self, state: RequestState) -> RequestOutput | None:
        finished = state.finish_reason is not None
        if state.output_kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = state.output_kind == RequestOutputKind.DELTA
        detokenizer = state.detokenizer
        text = detokenizer.next_text(finished, delta)
        token_ids = detokenizer.token_ids
        if delta:
            token_ids, state.sent_token_offset = token_ids[state.sent_token_offset:], len(token_ids)
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(token_ids),
            finish_reason=str(state.finish_reason) if finished else None,
            stop_reason=state.stop_reason,
        )
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, [completion],
                             finished)
