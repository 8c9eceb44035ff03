"""Validate a prompt and its sampling parameters into an ``EngineCoreRequest``: the one place that
truncates a prompt and checks it, and its output budget, against the context. Errors here are the
caller's (HTTP 400) and name the field."""

from __future__ import annotations

import dataclasses
import time

import msgspec

from quire.core.config import LoRAConfig, ModelConfig
from quire.core.errors import ValidationError
from quire.core.lora.adapter_config import read_adapter_config
from quire.core.lora.request import LoRARequest
from quire.core.parsers.reasoning import get_reasoning_parser_class
from quire.core.pooling_config import PoolingConfig
from quire.core.pooling_params import PoolingParams
from quire.core.renderer import PromptType, RenderedPrompt, Renderer
from quire.core.sampling_params import RequestOutputKind, SamplingParams
from quire.core.structured_outputs.validation import StructuredOutputValidator
from quire.core.wire import EngineCoreRequest, MultiModalFeature


class InputProcessor:
    """Renders prompts (through the ``Renderer``) and checks them against the model's limits."""

    def __init__(self, model_config: ModelConfig, renderer: Renderer, max_model_len: int | None = None,
                 max_logprobs: int = 20, structured_outputs_backend: str = "auto",
                 reasoning_parser: str | None = None, data_parallel_size: int = 1,
                 lora_config: LoRAConfig | None = None, task: str = "generate",
                 pooling: PoolingConfig | None = None):
        self.model_config = model_config
        self.task = task  # "generate" takes SamplingParams only; "embed" and "score" PoolingParams only
        self.pooling = pooling
        self.lora_config = lora_config
        self.lora_adapters: dict[int, LoRARequest] = {}  # every adapter checked so far, by id
        self.data_parallel_size = data_parallel_size
        self.structured_outputs = StructuredOutputValidator(structured_outputs_backend)
        # With a reasoning parser, a constraint waits for the thinking to end: its tags as token ids.
        self.reasoning_tags = None
        if reasoning_parser is not None:
            parser = get_reasoning_parser_class(reasoning_parser)
            self.reasoning_tags = (renderer.tokenize(parser.start_tag, add_special_tokens=False),
                                   renderer.tokenize(parser.end_tag, add_special_tokens=False))
        self.renderer = renderer
        self.max_model_len = max_model_len or model_config.max_model_len
        self.max_logprobs = max_logprobs
        eos_ids = set(model_config.eos_token_ids)
        if renderer.tokenizer.eos_token_id is not None:
            eos_ids.add(renderer.tokenizer.eos_token_id)
        self.eos_token_ids = sorted(eos_ids)

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        data_parallel_rank: int | None = None,
        lora_request: LoRARequest | None = None,
    ) -> tuple[EngineCoreRequest, str | None]:
        """Return the engine request and the prompt text (None when the prompt was token ids)."""
        if isinstance(params, PoolingParams):
            return self._process_pooling(request_id, prompt, params, arrival_time, priority, data_parallel_rank,
                                         lora_request)
        if self.task != "generate":
            raise ValidationError(f"this model is a pooling model (task {self.task}) and does not generate text: "
                                  "ask it for embeddings or scores (/v1/embeddings, /score, LLM.embed, LLM.score)",
                                  param="model")
        if not isinstance(params, SamplingParams):
            raise ValidationError("sampling_params must be a SamplingParams", param="sampling_params")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValidationError(f"priority must be an integer, got {priority!r}", param="priority")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValidationError("cache_salt must be a non-empty string", param="cache_salt")
        self._check_data_parallel_rank(data_parallel_rank)
        self._check_lora_request(lora_request)
        rendered = self.renderer.render(prompt)
        prompt_ids = self._truncate(rendered.token_ids, params.truncate_prompt_tokens)
        mm_features = _shift_features(rendered.mm_features, len(rendered.token_ids) - len(prompt_ids))
        self._check_context(rendered, len(prompt_ids))
        params = self._validate_params(params)
        params = self._resolve_max_tokens(params, len(prompt_ids))
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            priority=priority,
            cache_salt=cache_salt,
            bad_words_token_ids=self._bad_words_token_ids(params.bad_words),
            reasoning_tags=self.reasoning_tags if params.structured_outputs is not None else None,
            mm_features=mm_features,
            data_parallel_rank=data_parallel_rank,
            lora_request=lora_request,
        )
        return request, rendered.text

    def _process_pooling(self, request_id: str, prompt: PromptType, params: PoolingParams,
                         arrival_time: float | None, priority: int, data_parallel_rank: int | None,
                         lora_request: LoRARequest | None) -> tuple[EngineCoreRequest, str | None]:
        """A pooling request: its prompt, cut to ``truncate_prompt_tokens`` where asked, and no sampling. A
        cross-encoder's (task "score") is a text pair, ``{"text": ..., "text_pair": ...}``."""
        if self.task == "generate":
            raise ValidationError("this model generates text: start the engine with task embed (--task embed) to "
                                  "compute embeddings with it", param="model")
        is_pair = isinstance(prompt, dict) and "text_pair" in prompt
        if is_pair != (self.task == "score"):
            raise ValidationError("this model is a cross-encoder (task score): it scores text pairs (/score, "
                                  "/rerank, LLM.score)" if self.task == "score" else
                                  "text pairs are scored by cross-encoders (task score); this model embeds texts",
                                  param="model")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValidationError(f"priority must be an integer, got {priority!r}", param="priority")
        if lora_request is not None:
            raise ValidationError("embedding requests run the base model (no LoRA adapters)", param="lora_request")
        self._check_data_parallel_rank(data_parallel_rank)
        if is_pair:
            rendered, token_type_start = self._render_pair(prompt, params.truncate_prompt_tokens)
            params = msgspec.structs.replace(params, token_type_start=token_type_start)
        else:
            rendered = self._render_for_pooling(prompt, params.truncate_prompt_tokens)
        num_tokens = len(rendered.token_ids)
        if num_tokens == 0:
            raise ValidationError(f"{rendered.param} must not be empty", param=rendered.param)
        if num_tokens > self.max_model_len:
            raise ValidationError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your input has "
                f"{num_tokens} tokens. Please reduce the length of the input, or truncate it "
                "(truncate_prompt_tokens).", param=rendered.param, code="context_length_exceeded")
        hidden_size = self.model_config.hidden_size
        if params.dimensions is not None and params.dimensions > hidden_size:
            raise ValidationError(f"dimensions must be at most the model's {hidden_size}, got {params.dimensions}",
                                  param="dimensions")
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=rendered.token_ids,
            sampling_params=_POOLING_SAMPLING,
            eos_token_ids=[],
            arrival_time=time.time() if arrival_time is None else arrival_time,
            priority=priority,
            data_parallel_rank=data_parallel_rank,
            pooling_params=params,
        )
        return request, rendered.text

    def _render_pair(self, prompt: dict, keep: int | None) -> tuple[RenderedPrompt, int | None]:
        """A cross-encoder's ``[CLS] text [SEP] text_pair [SEP]`` and where the second text's token type 1 starts;
        with ``truncate_prompt_tokens`` the tokenizer cuts the longer text first, as sentence-transformers'
        CrossEncoder does."""
        texts = []
        for key in ("text", "text_pair"):
            text = prompt.get(key)
            if not isinstance(text, str) or not text:
                raise ValidationError(f"a text pair needs a non-empty string {key}", param="prompt")
            texts.append(text.lower() if self.pooling is not None and self.pooling.lowercase_input else text)
        limit = self.max_model_len if keep in (None, -1) else min(keep, self.max_model_len)
        encoded = self.renderer.tokenizer(texts[0], texts[1], truncation=keep is not None and "longest_first",
                                          max_length=limit if keep is not None else None)
        token_ids, token_types = encoded["input_ids"], encoded.get("token_type_ids")
        start = token_types.index(1) if token_types and 1 in token_types else None
        return RenderedPrompt(token_ids, f"{prompt['text']}\n{prompt['text_pair']}"), start

    def _render_for_pooling(self, prompt: PromptType, keep: int | None) -> RenderedPrompt:
        """An embedding prompt as token ids: text lowercased if the model folder says so, and with
        ``truncate_prompt_tokens`` its first tokens (a text prompt is tokenized with truncation, which keeps
        its closing special tokens, as sentence-transformers does)."""
        limit = self.max_model_len if keep in (None, -1) else min(keep, self.max_model_len)
        add_special_tokens = True
        if isinstance(prompt, dict) and "prompt" in prompt and "prompt_token_ids" not in prompt \
                and prompt.get("multi_modal_data") is None:
            add_special_tokens = prompt.get("add_special_tokens", True)
            prompt = prompt["prompt"]
        if isinstance(prompt, str) and prompt:
            text = prompt.lower() if self.pooling is not None and self.pooling.lowercase_input else prompt
            if keep is None:
                return RenderedPrompt(self.renderer.tokenize(text, add_special_tokens), prompt)
            token_ids = self.renderer.tokenizer.encode(text, add_special_tokens=add_special_tokens, truncation=True,
                                                       max_length=limit)
            return RenderedPrompt(token_ids, prompt)
        rendered = self.renderer.render(prompt)
        if keep is not None:
            rendered = dataclasses.replace(rendered, token_ids=rendered.token_ids[:limit])
        return rendered

    def _check_lora_request(self, lora_request: LoRARequest | None) -> None:
        """A LoRA adapter this engine can apply: the folder is read once per id (an id names one adapter)."""
        if lora_request is None:
            return
        if self.lora_config is None:
            raise ValidationError("this engine serves no LoRA adapters (start it with enable_lora)",
                                  param="lora_request")
        if not isinstance(lora_request, LoRARequest):
            raise ValidationError("lora_request must be a LoRARequest", param="lora_request")
        if not isinstance(lora_request.lora_int_id, int) or lora_request.lora_int_id < 1:
            raise ValidationError(f"lora_int_id must be a positive integer, got {lora_request.lora_int_id!r}",
                                  param="lora_request")
        known = self.lora_adapters.get(lora_request.lora_int_id)
        if known is not None and known != lora_request:
            raise ValidationError(f"lora_int_id {known.lora_int_id} already names adapter {known.lora_name!r} at "
                                  f"{known.lora_path!r}", param="lora_request")
        if known is None:
            read_adapter_config(lora_request.lora_path, self.lora_config.max_lora_rank, self.model_config)
            self.lora_adapters[lora_request.lora_int_id] = lora_request

    def _check_data_parallel_rank(self, rank: int | None) -> None:
        if rank is None:
            return
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < self.data_parallel_size:
            raise ValidationError(f"data_parallel_rank must be an engine index in [0, {self.data_parallel_size}) "
                                  f"(data_parallel_size is {self.data_parallel_size}), got {rank!r}",
                                  param="data_parallel_rank")

    def _truncate(self, prompt_ids: list[int], keep: int | None) -> list[int]:
        """The last ``keep`` tokens (-1: as many as leave room for one output token; None: all)."""
        if keep is None:
            return prompt_ids
        if keep == -1:
            keep = self.max_model_len - 1
        return prompt_ids[-keep:]

    def _check_context(self, rendered: RenderedPrompt, num_prompt_tokens: int) -> None:
        if num_prompt_tokens == 0:
            raise ValidationError(f"{rendered.param} must not be empty", param=rendered.param)
        if num_prompt_tokens >= self.max_model_len:
            raise ValidationError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your request "
                f"has {num_prompt_tokens} input tokens, which leaves no room for any output token. Please "
                "reduce the length of the input.", param=rendered.param, code="context_length_exceeded")

    def _resolve_max_tokens(self, params: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        """``max_tokens=None`` becomes the rest of the context; more than the rest is refused."""
        room = self.max_model_len - num_prompt_tokens
        if params.max_tokens is None:
            params = msgspec.structs.replace(params, max_tokens=room)
            if params.min_tokens > params.max_tokens:
                raise ValidationError(
                    f"min_tokens ({params.min_tokens}) exceeds the {params.max_tokens} tokens left in the "
                    f"context", param="min_tokens")
        elif params.max_tokens > room:
            raise ValidationError(
                f"'max_tokens' or 'max_completion_tokens' is too large: {params.max_tokens}. This model's "
                f"maximum context length is {self.max_model_len} tokens and your request has "
                f"{num_prompt_tokens} input tokens ({params.max_tokens} > {self.max_model_len} - "
                f"{num_prompt_tokens}).", param="max_tokens", code="context_length_exceeded")
        return params

    def _bad_words_token_ids(self, bad_words: list[str]) -> list[list[int]]:
        """Each bad word as token sequences, alone and after a space (as it appears mid-sentence)."""
        sequences = []
        for word in bad_words:
            for variant in (word, " " + word.lstrip()):
                ids = self.renderer.tokenize(variant, add_special_tokens=False)
                if ids and ids not in sequences:
                    sequences.append(ids)
        return sequences

    def _validate_params(self, params: SamplingParams) -> SamplingParams:
        """Check token ids and logprobs against the engine's limits and the constraint against its backend;
        return the params with the constraint's backend resolved."""
        for name, token_ids in (("stop_token_ids", params.stop_token_ids),
                                ("allowed_token_ids", params.allowed_token_ids or ()),
                                ("logit_bias", params.logit_bias or ())):
            self.renderer.check_token_ids(token_ids, name)
        for name in ("logprobs", "prompt_logprobs"):
            requested = getattr(params, name)
            if requested is None or self.max_logprobs == -1:
                continue
            if requested == -1 or requested > self.max_logprobs:
                raise ValidationError(
                    f"{name}={requested} is more than this engine's max_logprobs={self.max_logprobs}",
                    param=name)
        if params.structured_outputs is not None:
            constraint = self.structured_outputs.validate(params.structured_outputs)
            if constraint is not params.structured_outputs:
                params = msgspec.structs.replace(params, structured_outputs=constraint)
        return params


# A pooling request samples nothing: the engine core's request still carries sampling params, these.
_POOLING_SAMPLING = SamplingParams(max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY)


def _shift_features(features: list[MultiModalFeature] | None, num_dropped: int) -> list[MultiModalFeature] | None:
    """The images' placeholder offsets after truncation dropped the prompt's first ``num_dropped`` tokens."""
    if not features or not num_dropped:
        return features or None
    if features[0].offset < num_dropped:
        raise ValidationError("truncate_prompt_tokens would cut into an image's placeholder tokens",
                              param="truncate_prompt_tokens")
    return [msgspec.structs.replace(feature, offset=feature.offset - num_dropped) for feature in features]
