"""The front-end half both engine clients share: the ``Renderer``, the ``InputProcessor`` on the way in
and the ``OutputProcessor`` on the way out, and splitting ``n > 1`` requests into seeded children."""

from __future__ import annotations

import msgspec

from quire.core.config import EngineConfig
from quire.core.engine.input_processor import InputProcessor
from quire.core.engine.output_processor import OutputProcessor, ParentRequest
from quire.core.errors import ValidationError
from quire.core.lora.request import LoRARequest
from quire.core.pooling_params import PoolingParams
from quire.core.renderer import PromptType, Renderer
from quire.core.sampling_params import SamplingParams
from quire.core.tokenizer import load_tokenizer
from quire.core.wire import EngineCoreRequest


class FrontEnd:
    """Everything between a caller's prompt and the engine core's token ids, in the caller's process."""

    def __init__(self, config: EngineConfig, max_model_len: int):
        tokenizer = load_tokenizer(config.tokenizer)
        multimodal = None
        if config.model.is_multimodal:  # only then is an image library (and the processor) loaded
            from quire.core.multimodal.processing import MultiModalProcessor

            multimodal = MultiModalProcessor.from_model(config.model, config.multimodal)
        self.renderer = Renderer(tokenizer, config.model.vocab_size, multimodal)
        self.input_processor = InputProcessor(config.model, self.renderer, max_model_len, config.max_logprobs,
                                              config.structured_outputs_backend, config.reasoning_parser,
                                              config.parallel.data_parallel_size, config.lora, config.task,
                                              config.pooling)
        self.output_processor = OutputProcessor(tokenizer, config.stream_interval)

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams | PoolingParams,
                arrival_time: float | None,
                priority: int, cache_salt: str | None,
                data_parallel_rank: int | None = None,
                lora_request: LoRARequest | None = None) -> tuple[EngineCoreRequest, str | None]:
        """Render and validate a request whose id is not in use; return it and its prompt text."""
        if self.output_processor.is_in_flight(request_id):
            raise ValidationError(f"request id {request_id!r} is already in use", param="request_id")
        return self.input_processor.process(request_id, prompt, params, arrival_time, priority, cache_salt,
                                            data_parallel_rank, lora_request)

    def register(self, request: EngineCoreRequest, prompt_text: str | None) -> list[EngineCoreRequest]:
        """Track a request's outputs; return the engine requests to send.

        With ``n > 1`` the request becomes ``n`` children ``id#i`` under one ``ParentRequest``; child ``i``
        is seeded ``seed + i``, and only the first computes prompt logprobs (the prompt is shared).
        """
        params = request.sampling_params
        if params.n == 1 or request.pooling_params is not None:
            self.output_processor.add_request(request, prompt_text)
            return [request]
        children = []
        for index in range(params.n):
            child_params = msgspec.structs.replace(
                params, n=1, seed=None if params.seed is None else params.seed + index,
                prompt_logprobs=params.prompt_logprobs if index == 0 else None)
            children.append(msgspec.structs.replace(request, request_id=f"{request.request_id}#{index}",
                                                    sampling_params=child_params))
        parent = ParentRequest(request.request_id, [c.request_id for c in children], params.output_kind)
        for index, child in enumerate(children):
            self.output_processor.add_request(child, prompt_text, parent, index)
        return children
