"""The ``LLM`` class: generate for a list of prompts (or chat conversations) in one call."""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import os
import time
import typing
from collections.abc import Sequence
from typing import Any

import msgspec
from tqdm.auto import tqdm

from quire.core.engine.llm_engine import LLMEngine
from quire.core.engine.protocol import SyncEngineClient
from quire.core.engine_args import EngineArgs
from quire.core.errors import ValidationError
from quire.core.lora.request import LoRARequest
from quire.core.outputs import (
    EngineMetrics,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from quire.core.parsers.output import OutputParser
from quire.core.parsers.reasoning import get_reasoning_parser_class
from quire.core.parsers.tool_calls import get_tool_parser_class
from quire.core.parsers.tool_choice import tool_request
from quire.core.pooling_params import PoolingParams, cosine_similarity, score_pairs
from quire.core.renderer import ChatPrompt, Conversation, PromptType, is_token_ids
from quire.core.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """A model loaded for batch generation; with no ``model``, the embedded quire-demo model.

    Every engine option is a keyword (``quire.core.EngineArgs`` lists them: ``dtype``, ``max_model_len``,
    ``max_num_seqs``, ``kv_cache_memory``, ``stream_interval``…). The engine core runs in its own process;
    ``multiprocess=False`` keeps it in this one (default: ``QUIRE_MULTIPROCESS_ENGINE``, else True).

    >>> llm = LLM("path/to/checkpoint", dtype="bfloat16")
    >>> outputs = llm.generate(["Hello"], SamplingParams(max_tokens=16))
    """

    def __init__(self, model: str | os.PathLike | None = None, *, multiprocess: bool | None = None,
                 **engine_options: Any):
        args = engine_args(model, engine_options)
        self.engine_args = args
        self.llm_engine: SyncEngineClient = LLMEngine.from_engine_args(args, multiprocess=multiprocess)
        self._request_counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.get_tokenizer()

    def shutdown(self) -> None:
        """Stop the engine core (its process, when it has one). Also happens at exit."""
        self.llm_engine.shutdown()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix (returns False if requests are still running)."""
        return self.llm_engine.reset_prefix_cache()

    def get_metrics(self) -> EngineMetrics:
        """Latest scheduler statistics (running, waiting, KV usage, prefix-cache counters, preemptions)
        and the timings of recently finished requests."""
        return self.llm_engine.get_metrics()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
        data_parallel_rank: int | Sequence[int | None] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids, a prompt dict or a ``ChatPrompt``); outputs in input
        order. A vision-language model also takes ``{"prompt": "...<image>...", "multi_modal_data": {"image":
        pil_image_or_list}}``: one image per placeholder, in order.

        ``priority`` (one per prompt; lower runs first) matters with ``scheduling_policy="priority"``.
        ``data_parallel_rank`` (one for all prompts, or one per prompt; None: the least loaded) pins prompts
        to engine cores with ``data_parallel_size`` > 1. ``lora_request`` (one for all prompts, or one per
        prompt; None: the base model) names the LoRA adapter they run with (``enable_lora=True``).
        """
        prompt_list = _as_prompt_list(prompts)
        params_list = self._params_list(sampling_params, len(prompt_list))
        if priority is not None and len(priority) != len(prompt_list):
            raise ValidationError(f"got {len(priority)} priorities for {len(prompt_list)} prompts",
                                  param="priority")
        if data_parallel_rank is None or isinstance(data_parallel_rank, int):
            data_parallel_rank = [data_parallel_rank] * len(prompt_list)
        elif len(data_parallel_rank) != len(prompt_list):
            raise ValidationError(f"got {len(data_parallel_rank)} data_parallel_rank values for "
                                  f"{len(prompt_list)} prompts", param="data_parallel_rank")
        return self._run(prompt_list, params_list, use_tqdm, priority, data_parallel_rank,
                         _per_prompt(lora_request, len(prompt_list), "lora_request"))

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        priority: Sequence[int] | None = None,
        use_tqdm: bool = True,
    ) -> list[PoolingRequestOutput]:
        """One vector per prompt (text, token ids or a prompt dict), in input order, from an embedding model
        (``task="embed"``, or a folder the task is read from): ``outputs[i].outputs.embedding``.

        ``pooling_params`` (one for all prompts, or one per prompt) set ``dimensions`` and ``normalize``;
        ``truncate_prompt_tokens`` (-1: the model's limit, k: the first k tokens; None: a longer prompt is a
        ``ValidationError``) applies to every prompt.
        """
        prompt_list = _as_prompt_list(prompts)
        params_list = _per_prompt(pooling_params if pooling_params is not None else PoolingParams(),
                                  len(prompt_list), "pooling_params")
        if not all(isinstance(params, PoolingParams) for params in params_list):
            raise ValidationError("pooling_params must be PoolingParams", param="pooling_params")
        if truncate_prompt_tokens is not None:
            params_list = [msgspec.structs.replace(params, truncate_prompt_tokens=truncate_prompt_tokens)
                           for params in params_list]
        if priority is not None and len(priority) != len(prompt_list):
            raise ValidationError(f"got {len(priority)} priorities for {len(prompt_list)} prompts",
                                  param="priority")
        return self._run(prompt_list, params_list, use_tqdm, priority)

    def score(
        self,
        text_1: str | Sequence[str],
        text_2: str | Sequence[str],
        *,
        truncate_prompt_tokens: int | None = None,
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[ScoringRequestOutput]:
        """The relevance of text pairs, as vLLM pairs them: one text against one, one ``text_1`` against each of
        ``text_2``, or ``text_1[i]`` against ``text_2[i]``. A cross-encoder (task "score") scores each pair in one
        pass (the sigmoid of its logit); an embedding model gives the cosine of the two texts' embeddings, each
        distinct text embedded once."""
        pairs = score_pairs(text_1, text_2)
        if self.llm_engine.task == "score":
            params = pooling_params or PoolingParams()
            if truncate_prompt_tokens is not None:
                params = msgspec.structs.replace(params, truncate_prompt_tokens=truncate_prompt_tokens)
            prompts = [{"text": a, "text_pair": b} for a, b in pairs]
            return [ScoringRequestOutput(output.request_id, output.prompt_token_ids,
                                         ScoringOutput(output.outputs.embedding[0]))
                    for output in self._run(prompts, [params] * len(prompts), use_tqdm)]
        distinct = list(dict.fromkeys(text for pair in pairs for text in pair))
        outputs = self.embed(distinct, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
                             use_tqdm=use_tqdm)
        by_text = dict(zip(distinct, outputs))
        results = []
        for a, b in pairs:
            left, right = by_text[a], by_text[b]
            results.append(ScoringRequestOutput(
                request_id=f"{left.request_id}-{right.request_id}",
                prompt_token_ids=left.prompt_token_ids + right.prompt_token_ids,
                outputs=ScoringOutput(cosine_similarity(left.outputs.embedding, right.outputs.embedding))))
        return results

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool | None = None,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate a reply to one conversation (a list of messages) or to each of several. Content may be a
        list of parts: text (``{"type": "text", "text": ...}``) and, for vision-language models, images
        (``{"type": "image_pil", "image_pil": pil_image}`` or ``{"type": "image_url", "image_url": {"url":
        "data:image/png;base64,..."}}``).

        ``add_generation_prompt`` (default: unless ``continue_final_message``) opens an assistant turn;
        ``continue_final_message`` lets the model continue the last (assistant) message instead.
        ``tools`` (OpenAI function tools) reach the chat template; ``tool_choice`` is ``auto`` (the default:
        needs ``tool_call_parser``), ``none``, ``required`` or ``{"type": "function", "function": {"name":
        ...}}`` (the last two constrain the output). With tools or a ``reasoning_parser`` each completion
        carries ``content``, ``reasoning`` and ``tool_calls`` (``quire.core.parsers.tool_calls.ToolCall``).
        ``lora_request``: as ``generate``'s.
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        params = self._params_list(sampling_params, len(conversations))
        tool_requests = [tool_request(conversation, tools, tool_choice, parallel_tool_calls,
                                      auto_available=self.engine_args.tool_call_parser is not None)
                         for conversation in conversations]
        prompts = []
        for index, (conversation, tool_req) in enumerate(zip(conversations, tool_requests)):
            prompts.append(ChatPrompt(conversation, chat_template, add_generation_prompt, continue_final_message,
                                      chat_template_kwargs, tools=None if tool_req is None else tool_req.tools))
            constraint = None if tool_req is None else tool_req.constraint()
            if (tool_req is not None and tool_req.choice == "auto"
                    and get_tool_parser_class(self.engine_args.tool_call_parser).needs_special_tokens):
                params[index] = msgspec.structs.replace(params[index], skip_special_tokens=False)
            if constraint is not None:
                if params[index].structured_outputs is not None:
                    raise ValidationError(f"tool_choice {tool_req.choice} constrains the output already; it "
                                          "cannot be combined with structured_outputs", param="tool_choice")
                params[index] = msgspec.structs.replace(params[index], structured_outputs=constraint)
        outputs = self._run(prompts, params, use_tqdm,
                            lora_requests=_per_prompt(lora_request, len(prompts), "lora_request"))
        for output, tool_req in zip(outputs, tool_requests):
            self._parse(output, tool_req)
        return outputs

    def _parse(self, output: RequestOutput, tools) -> None:
        """Split each completion into content, reasoning and tool calls (when there is anything to split)."""
        args = self.engine_args
        tools = tools if tools is not None and tools.choice != "none" else None
        if tools is None and args.reasoning_parser is None:
            return
        for completion in output.outputs:
            reasoning = get_reasoning_parser_class(args.reasoning_parser)() if args.reasoning_parser else None
            tool_parser = (get_tool_parser_class(args.tool_call_parser)()
                           if tools is not None and tools.choice == "auto" else None)
            parsed = OutputParser(reasoning, tool_parser, named_tool=tools.named if tools else None,
                                  required=tools is not None and tools.choice == "required").parse(completion.text)
            completion.content, completion.reasoning = parsed.content, parsed.reasoning
            completion.tool_calls = parsed.tool_calls
            if parsed.tool_calls and completion.finish_reason == "stop":
                completion.finish_reason = "tool_calls"

    def _params_list(self, sampling_params, num_prompts: int) -> list[SamplingParams]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * num_prompts
        elif len(sampling_params) != num_prompts:
            raise ValidationError(
                f"got {len(sampling_params)} sampling_params for {num_prompts} prompts",
                param="sampling_params")
        # Offline callers want only the finished result.
        return [msgspec.structs.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
                for p in sampling_params]

    def _run(self, prompts: list[PromptType], params: list[SamplingParams] | list[PoolingParams], use_tqdm: bool,
             priority: Sequence[int] | None = None,
             data_parallel_rank: Sequence[int | None] | None = None,
             lora_requests: Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        engine = self.llm_engine
        request_ids = [str(next(self._request_counter)) for _ in prompts]
        priorities = priority or [0] * len(prompts)
        ranks = data_parallel_rank or [None] * len(prompts)
        adapters = lora_requests or [None] * len(prompts)
        try:
            for request_id, prompt, request_params, request_priority, rank, adapter in zip(
                    request_ids, prompts, params, priorities, ranks, adapters):
                engine.add_request(request_id, prompt, request_params, priority=request_priority,
                                   data_parallel_rank=rank, lora_request=adapter)
            desc = "Embedding" if params and isinstance(params[0], PoolingParams) else "Generating"
            finished = self._run_engine(len(prompts), use_tqdm, desc)
        except BaseException:
            engine.abort_request(request_ids)
            raise
        return [finished[request_id] for request_id in request_ids]

    def _run_engine(self, num_requests: int, use_tqdm: bool,
                    desc: str = "Generating") -> dict[str, RequestOutput | PoolingRequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput | PoolingRequestOutput] = {}
        progress = tqdm(total=num_requests, desc=desc, unit="req", disable=not use_tqdm,
                        dynamic_ncols=True)
        start = time.perf_counter()
        num_prompt_tokens = num_output_tokens = 0
        with progress:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if not output.finished:
                        continue
                    finished[output.request_id] = output
                    num_prompt_tokens += len(output.prompt_token_ids)
                    if isinstance(output, RequestOutput):
                        num_output_tokens += sum(len(o.token_ids) for o in output.outputs)
                    elapsed = max(time.perf_counter() - start, 1e-9)
                    progress.set_postfix_str(
                        f"input {num_prompt_tokens / elapsed:.1f} tok/s, "
                        f"output {num_output_tokens / elapsed:.1f} tok/s", refresh=False)
                    progress.update(1)
        return finished


def _as_prompt_list(prompts: Any) -> list[PromptType]:
    if isinstance(prompts, (str, dict, ChatPrompt)):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and is_token_ids(prompts):
        return [list(prompts)]  # one prompt of token ids
    if not isinstance(prompts, (list, tuple)):
        raise ValidationError("prompts must be a prompt (text, token ids or a prompt dict) or a list "
                              "of prompts", param="prompts")
    return list(prompts)


def engine_args(model: str | os.PathLike | None, options: dict[str, Any]) -> EngineArgs:
    """``EngineArgs`` from ``LLM``'s keywords; an unknown keyword is a ``TypeError`` naming it."""
    known = {field.name for field in dataclasses.fields(EngineArgs)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"LLM() got unexpected keyword arguments {unknown}; engine options are: "
                        f"{', '.join(sorted(known - {'model'}))}")
    return EngineArgs(model=None if model is None else str(model), **options)


def _signature() -> inspect.Signature:
    """``LLM(model=None, *, multiprocess=None, <every EngineArgs option>)``, for help() and editors."""
    parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
                  inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None),
                  inspect.Parameter("multiprocess", inspect.Parameter.KEYWORD_ONLY, default=None)]
    hints = typing.get_type_hints(EngineArgs)
    parameters += [inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, default=field.default,
                                     annotation=hints[field.name])
                   for field in dataclasses.fields(EngineArgs) if field.name != "model"]
    return inspect.Signature(parameters)


LLM.__init__.__signature__ = _signature()


def _per_prompt(value, num_prompts: int, param: str) -> list:
    """One value for every prompt (a single value, or a sequence of one per prompt)."""
    if value is None or not isinstance(value, (list, tuple)):
        return [value] * num_prompts
    if len(value) != num_prompts:
        raise ValidationError(f"got {len(value)} {param} values for {num_prompts} prompts", param=param)
    return list(value)
