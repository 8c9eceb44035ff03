"""Stop conditions decided in the engine: EOS, stop token ids, ``max_tokens`` and the model's length.

Stop strings need text, so they are decided in the front end.
"""

from __future__ import annotations

from quire.core.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Look at the request's newest token; mark the request finished and return True if it should stop."""
    params = request.sampling_params
    last_token_id = request.output_token_ids[-1]
    if request.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and last_token_id in request.eos_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if last_token_id in request.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last_token_id
            return True
    max_tokens = params.max_tokens
    if request.num_tokens >= max_model_len or (
        max_tokens is not None and request.num_output_tokens >= max_tokens
    ):
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False
