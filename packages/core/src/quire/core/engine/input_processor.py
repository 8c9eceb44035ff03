"""Validate and tokenize a prompt into an ``EngineCoreRequest``. Errors here are the caller's (HTTP 400)."""

from __future__ import annotations

import time
from typing import Any, Union

import msgspec

from quire.core.config import ModelConfig
from quire.core.errors import ValidationError
from quire.core.sampling_params import SamplingParams
from quire.core.wire import EngineCoreRequest

# A prompt is text, token ids, or a dict with "prompt" (text) or "prompt_token_ids".
PromptType = Union[str, list[int], dict[str, Any]]


class InputProcessor:
    """Checks prompts and sampling parameters against the model's limits."""

    def __init__(self, model_config: ModelConfig, tokenizer, max_model_len: int | None = None,
                 max_logprobs: int = 20):
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len or model_config.max_model_len
        self.max_logprobs = max_logprobs
        eos_ids = set(model_config.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            eos_ids.add(tokenizer.eos_token_id)
        self.eos_token_ids = sorted(eos_ids)

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> tuple[EngineCoreRequest, str | None]:
        """Return the engine request and the prompt text (None when the prompt was token ids)."""
        if not isinstance(params, SamplingParams):
            raise ValidationError("sampling_params must be a SamplingParams", param="sampling_params")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValidationError(f"priority must be an integer, got {priority!r}", param="priority")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValidationError("cache_salt must be a non-empty string", param="cache_salt")
        prompt_text, prompt_ids = self._tokenize(prompt)
        prompt_ids = self._truncate(prompt_ids, params.truncate_prompt_tokens)
        self._validate_prompt(prompt_ids)
        self._validate_params(params)
        if params.max_tokens is None:
            params = msgspec.structs.replace(params, max_tokens=self.max_model_len - len(prompt_ids))
            if params.min_tokens > params.max_tokens:
                raise ValidationError(
                    f"min_tokens ({params.min_tokens}) exceeds the {params.max_tokens} tokens left in the "
                    f"context", param="min_tokens")
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            priority=priority,
            cache_salt=cache_salt,
            bad_words_token_ids=self._bad_words_token_ids(params.bad_words),
        )
        return request, prompt_text

    def _truncate(self, prompt_ids: list[int], keep: int | None) -> list[int]:
        if keep is None:
            return prompt_ids
        if keep == -1:
            keep = self.max_model_len - 1
        return prompt_ids[-keep:]

    def _bad_words_token_ids(self, bad_words: list[str]) -> list[list[int]]:
        """Each bad word as token sequences, alone and after a space (as it appears mid-sentence)."""
        sequences = []
        for word in bad_words:
            for variant in (word, " " + word.lstrip()):
                ids = self.tokenizer.encode(variant, add_special_tokens=False)
                if ids and ids not in sequences:
                    sequences.append(ids)
        return sequences

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValidationError("a prompt dict needs 'prompt' or 'prompt_token_ids'", param="prompt")
        if isinstance(prompt, str):
            if not prompt:
                raise ValidationError("prompt must not be empty", param="prompt")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            return None, list(prompt)
        raise ValidationError("prompt must be a string or a list of token ids", param="prompt")

    def _validate_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise ValidationError("prompt must not be empty", param="prompt")
        vocab_size = self.model_config.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValidationError(f"token id {bad} is out of vocabulary (0..{vocab_size - 1})",
                                  param="prompt")
        if len(prompt_ids) >= self.max_model_len:
            raise ValidationError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                f"prompt has {len(prompt_ids)} tokens, which leaves no room for any output token. Please "
                "reduce the length of the prompt.", param="prompt", code="context_length_exceeded")

    def _validate_params(self, params: SamplingParams) -> None:
        vocab_size = self.model_config.vocab_size
        for name, token_ids in (("stop_token_ids", params.stop_token_ids),
                                ("allowed_token_ids", params.allowed_token_ids or ()),
                                ("logit_bias", params.logit_bias or ())):
            bad = next((t for t in token_ids if t >= vocab_size), None)
            if bad is not None:
                raise ValidationError(f"token id {bad} in {name} is out of vocabulary (0..{vocab_size - 1})",
                                      param=name)
        for name in ("logprobs", "prompt_logprobs"):
            requested = getattr(params, name)
            if requested is None or self.max_logprobs == -1:
                continue
            if requested == -1 or requested > self.max_logprobs:
                raise ValidationError(
                    f"{name}={requested} is more than this engine's max_logprobs={self.max_logprobs}",
                    param=name)
