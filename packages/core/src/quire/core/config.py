"""Frozen engine configuration, split by consumer and built once at the edge.

``ModelConfig.from_hf`` normalises a Hugging Face checkpoint's ``config.json`` (transformers 4.x and 5.x
layouts) so model code never reads raw HF configs. This module imports no torch.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path
from typing import Any

from quire.core.errors import ConfigError
from quire.core.models.registry import architecture_for_model_type, get_model_entry
from quire.core.pooling_config import PoolingConfig

logger = logging.getLogger(__name__)

DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}
_DTYPE_ALIASES = {"float": "float32", "fp32": "float32", "bf16": "bfloat16", "half": "float16",
                  "fp16": "float16"}
_SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (``rope_type`` is one of default, linear, llama3, longrope)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # longrope (Phi-3): each frequency's divisor within the original context and beyond it (which list a
    # model uses: ``quire.kernels.rotary.rope_inv_freq``), and the factor cos and sin are scaled by.
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0
    # The leading fraction of each head that rotates (Phi-4-mini: 0.75); the rest passes through.
    partial_rotary_factor: float = 1.0

    def rotary_dim(self, head_dim: int) -> int:
        """How many of a head's dimensions rotate (transformers' ``int(head_dim * partial_rotary_factor)``)."""
        return int(head_dim * self.partial_rotary_factor)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """What the model code needs to know about a checkpoint, in one normalised shape."""

    path: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    max_model_len: int
    dtype: str
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_proj_bias: bool = False
    qk_norm: bool = False
    # Mixtures of experts (0 experts: a dense model): each token runs ``num_experts_per_tok`` of ``num_experts``
    # gated MLPs of width ``moe_intermediate_size``, weighted by the router's softmax over the chosen ones
    # (renormalised to sum to 1 if ``norm_topk_prob``); the layers in ``dense_mlp_layers`` keep one dense MLP of
    # width ``intermediate_size`` instead.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    dense_mlp_layers: tuple[int, ...] = ()
    # Gemma 3: attention scores scale by ``query_pre_attn_scalar ** -0.5`` (None: ``head_dim ** -0.5``); logits
    # become ``tanh(logits / cap) * cap`` with ``final_logit_softcapping`` = cap (None: left as computed);
    # sliding-window layers rotate by default rope of base ``local_rope_theta`` (None: by ``rope``, like the rest).
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    local_rope_theta: float | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # Sampling defaults from generation_config.json (temperature, top_p, top_k, min_p,
    # repetition_penalty), applied by front ends to fields a request leaves unset.
    sampling_defaults: dict[str, float] = dataclasses.field(default_factory=dict)
    # None: weights in ``dtype``; "int8": float linear layers quantized to int8 at load. A GGUF file (``path``
    # ends in .gguf) keeps its own quantized types whatever this says.
    quantization: str | None = None
    # Vision-language models: the prompt token that image placeholders use (None: the model takes text
    # only), and the architecture's own multimodal settings (vision tower config, projector, …) as its
    # registry entry reads them from config.json.
    image_token_id: int | None = None
    multimodal_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Sliding-window attention: a query at position p of a windowed layer sees the keys at positions
    # p - sliding_window + 1 .. p (transformers' ``sliding_window_causal_mask_function``). ``layer_types`` names
    # each layer's kind ("full_attention" or "sliding_attention", as transformers' configs do); empty: every
    # layer is windowed when ``sliding_window`` is set.
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    # Encoders (BERT) attend both ways (``is_causal`` False): every token sees every token of its own request
    # (they compute embeddings; the generating engine refuses them). Their LayerNorm
    # epsilon, number of token types (segments A/B) and MLP activation ("gelu": exact erf; "gelu_tanh": the tanh
    # approximation; "relu") come from config.json.
    is_causal: bool = True
    layer_norm_eps: float = 1e-12
    num_token_types: int = 0
    encoder_activation: str = "gelu"
    # Cross-encoders (BertForSequenceClassification): the classifier's outputs (0: no classification head).
    num_labels: int = 0

    @property
    def is_multimodal(self) -> bool:
        return self.image_token_id is not None

    def layer_sliding_window(self, layer_index: int) -> int | None:
        """The window of layer ``layer_index``, or None where it sees every earlier token (also when the
        window is at least ``max_model_len``, so never slides)."""
        window = self.sliding_window
        if window is None or window >= self.max_model_len:
            return None
        if self.layer_types and self.layer_types[layer_index] != "sliding_attention":
            return None
        return window

    @property
    def has_sliding_window(self) -> bool:
        """Some layer attends within a window."""
        return any(self.layer_sliding_window(i) is not None for i in range(self.num_hidden_layers))

    @property
    def kv_cache_sliding_window(self) -> int | None:
        """The window every layer keeps within (the widest), or None when some layer sees every token: only
        then may the KV cache drop the blocks a request's next token no longer sees."""
        windows = [self.layer_sliding_window(i) for i in range(self.num_hidden_layers)]
        if not windows or None in windows:
            return None
        return max(windows)

    @property
    def is_gguf(self) -> bool:
        return self.path.lower().endswith(".gguf")

    @classmethod
    def from_path(cls, path: str | Path, dtype: str = "auto", max_model_len: int | None = None,
                  quantization: str | None = None) -> ModelConfig:
        """A Hugging Face checkpoint folder (``from_hf``), or a GGUF file (or a folder holding one), whose
        metadata gives the same fields; the file is checked whole before any weight is read."""
        from quire.core.models.gguf import GGUFCheckpoint, gguf_path

        gguf_file = gguf_path(path)
        if gguf_file is None:
            return cls.from_hf(path, dtype, max_model_len, quantization)
        if quantization is not None:
            raise ConfigError(f"quantization {quantization!r} is for float checkpoints; the GGUF file "
                              f"{gguf_file.name!r} is computed on in its own quantized types")
        hf = GGUFCheckpoint.open(gguf_file).hf_config()
        return cls._from_dicts(gguf_file, hf, {}, dtype, max_model_len, None)

    @classmethod
    def from_hf(cls, path: str | Path, dtype: str = "auto", max_model_len: int | None = None,
                quantization: str | None = None) -> ModelConfig:
        """Read ``config.json`` (and ``generation_config.json`` if present) from a checkpoint folder.

        The fields every architecture shares are read here; the architecture's registry entry
        (``quire.core.models.registry``) supplies the rest and refuses variants its model cannot run.
        """
        folder = Path(path)
        config_file = folder / "config.json"
        if not config_file.is_file():
            raise ConfigError(f"no config.json in model folder {str(folder)!r}")
        hf = json.loads(config_file.read_text())
        generation = _read_json(folder / "generation_config.json")
        return cls._from_dicts(folder, hf, generation, dtype, max_model_len, quantization)

    @classmethod
    def _from_dicts(cls, path: Path, hf: dict[str, Any], generation: dict[str, Any], dtype: str,
                    max_model_len: int | None, quantization: str | None) -> ModelConfig:
        if quantization not in (None, "int8"):
            raise ConfigError(f"quantization must be int8 or unset, got {quantization!r}")
        architecture = _architecture(hf)
        entry = get_model_entry(architecture)
        architecture_fields = entry.config_fields(hf)
        if entry.text_config is not None:
            # the language model's fields as the entry completes them (a vision-language config nests them)
            hf = {**hf, **entry.text_config(hf)}
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        max_positions = int(hf.get("max_position_embeddings", 2048))
        return cls(
            path=str(path),
            architecture=architecture,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=_rope_config(hf),
            max_position_embeddings=max_positions,
            max_model_len=_max_model_len(hf, max_positions, max_model_len),
            dtype=_resolve_dtype(dtype, hf),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            eos_token_ids=_eos_ids(generation.get("eos_token_id", hf.get("eos_token_id"))),
            bos_token_id=hf.get("bos_token_id"),
            sampling_defaults={key: generation[key] for key in _SAMPLING_DEFAULT_KEYS if key in generation},
            quantization=quantization,
            **architecture_fields,
        )

    def shard(self, tensor_parallel_size: int) -> ModelConfig:
        """The part of the model one of ``tensor_parallel_size`` ranks computes: its attention heads, its KV
        heads (one, replicated, where there are fewer KV heads than ranks) and its MLP columns. The
        vocabulary stays whole: the embedding and LM head split it themselves."""
        if tensor_parallel_size == 1:
            return self
        return dataclasses.replace(
            self, num_attention_heads=self.num_attention_heads // tensor_parallel_size,
            num_key_value_heads=max(1, self.num_key_value_heads // tensor_parallel_size),
            intermediate_size=self.intermediate_size // tensor_parallel_size)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of KV cache one token takes across all layers."""
        per_layer = 2 * self.num_key_value_heads * self.head_dim * DTYPE_SIZES[self.dtype]
        return per_layer * self.num_hidden_layers


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _architecture(hf: dict[str, Any]) -> str:
    architectures = hf.get("architectures") or []
    if architectures:
        return architectures[0]
    model_type = hf.get("model_type", "")
    architecture = architecture_for_model_type(model_type)
    if architecture is not None:
        return architecture
    raise ConfigError(f"config.json names no architecture and model_type {model_type!r} is unknown")


def _rope_config(hf: dict[str, Any]) -> RopeConfig:
    # transformers 5.x: one `rope_parameters` dict holding rope_theta; 4.x: `rope_theta` at the top
    # level and an optional `rope_scaling` dict (whose type key was once called "type").
    params = dict(hf.get("rope_parameters") or {})
    if not params:
        params = dict(hf.get("rope_scaling") or {})
        params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "su":  # longrope's name in the first Phi-3 configs
        rope_type = "longrope"
    defaults = RopeConfig()
    # a top-level original_max_position_embeddings (where Phi-3 keeps it) wins, as in transformers
    original_max = int(hf.get("original_max_position_embeddings") or params.get(
        "original_max_position_embeddings", defaults.original_max_position_embeddings))
    partial_rotary_factor = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    rope = RopeConfig(
        theta=float(params.get("rope_theta", defaults.theta)),
        rope_type=rope_type,
        factor=float(params.get("factor", defaults.factor)),
        low_freq_factor=float(params.get("low_freq_factor", defaults.low_freq_factor)),
        high_freq_factor=float(params.get("high_freq_factor", defaults.high_freq_factor)),
        original_max_position_embeddings=original_max,
        partial_rotary_factor=partial_rotary_factor,
        **(_longrope_fields(hf, params, original_max) if rope_type == "longrope" else {}),
    )
    _check_rotary_dims(hf, rope)
    return rope


def _longrope_fields(hf: dict[str, Any], params: dict[str, Any], original_max: int) -> dict[str, Any]:
    """The factor lists, and ``attention_factor`` where a config leaves it out: sqrt(1 + ln(factor) /
    ln(original_max_position_embeddings)) for a ``factor`` (by default max_position_embeddings over the original
    context) above 1, else 1 (transformers' ``_compute_longrope_parameters``)."""
    fields: dict[str, Any] = {}
    for key in ("short_factor", "long_factor"):
        values = params.get(key)
        if not isinstance(values, list) or not all(
                isinstance(value, (int, float)) and not isinstance(value, bool) for value in values):
            raise ConfigError(f"rope_parameters.{key} must be a list of numbers for longrope, got {values!r}")
        fields[key] = tuple(float(value) for value in values)
    factor = params.get("factor")
    if factor is None:
        factor = int(hf.get("max_position_embeddings", 2048)) / original_max
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = math.sqrt(1 + math.log(factor) / math.log(original_max)) if factor > 1.0 else 1.0
    return {**fields, "attention_factor": float(attention_factor)}


def _check_rotary_dims(hf: dict[str, Any], rope: RopeConfig) -> None:
    head_dim = int(hf.get("head_dim") or int(hf["hidden_size"]) // int(hf["num_attention_heads"]))
    rotary_dim = rope.rotary_dim(head_dim)
    if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ConfigError(f"partial_rotary_factor {rope.partial_rotary_factor} leaves {rotary_dim} of the "
                          f"{head_dim} head dimensions to rotate; that must be a positive even number")
    for key in ("short_factor", "long_factor") if rope.rope_type == "longrope" else ():
        if len(getattr(rope, key)) != rotary_dim // 2:
            raise ConfigError(f"rope_parameters.{key} must have one entry per rotary frequency "
                              f"({rotary_dim // 2}), got {len(getattr(rope, key))}")


def _max_model_len(hf: dict[str, Any], max_positions: int, requested: int | None) -> int:
    limit = max_positions
    if requested is None:
        return limit
    if requested < 1:
        raise ConfigError(f"max_model_len must be at least 1, got {requested}")
    if requested > limit:
        raise ConfigError(f"max_model_len {requested} exceeds what the model supports ({limit})")
    return requested


def _resolve_dtype(requested: str, hf: dict[str, Any]) -> str:
    name = _DTYPE_ALIASES.get(requested, requested)
    if name == "auto":
        checkpoint = hf.get("dtype") or hf.get("torch_dtype") or "float32"
        checkpoint = _DTYPE_ALIASES.get(checkpoint, checkpoint)
        # float16 matrix work is slow on CPUs; bfloat16 has the same size and a wider range.
        name = "bfloat16" if checkpoint == "float16" else checkpoint
    if name not in DTYPE_SIZES:
        raise ConfigError(f"dtype must be one of auto, {', '.join(DTYPE_SIZES)}; got {requested!r}")
    return name


def _eos_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """KV cache shape and budget. ``kv_cache_memory`` is in bytes; None picks a default (on CUDA devices:
    what is left of ``gpu_memory_utilization`` of the GPU's memory after the weights and a profiled
    forward pass)."""

    block_size: int = 16
    kv_cache_memory: int | None = None
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Limits and policy of one engine step.

    ``long_prefill_token_threshold`` (0 = off) caps the tokens one request may compute per step while
    other requests are in flight, so a long prompt is spread over steps instead of starving decodes.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    policy: str = "fcfs"  # or "priority": lower priority value first
    long_prefill_token_threshold: int = 0
    # Admission limits, enforced by AsyncLLM.check_admission (None: unlimited): sequences and prompt
    # tokens accepted and not yet finished.
    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None
    # Seconds a request may wait before its first step; older ones finish with "queue_timeout" (None: no
    # limit). Preempted requests, which have started, are exempt.
    max_queue_time: float | None = None
    # Encoder models (bidirectional attention, no KV cache): a prompt runs whole in one step or waits; no
    # chunking, so ``max_num_batched_tokens`` is at least ``max_model_len``.
    whole_prompts: bool = False


SPECULATIVE_METHODS = ("ngram", "draft_model")
# Speculative decoding stops in steps with more running requests than this (measured in
# docs/performance.md: on two CPU cores a batch of 8 is already compute-bound).
DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE = 8


def parse_json_object(value: str | dict) -> dict:
    """JSON text (or an already parsed object) as a dict; ValueError saying what is wrong."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"not a JSON object: {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, in vLLM's ``speculative_config`` shape: ``method`` "ngram" (prompt lookup: the
    tokens that followed the latest earlier occurrence of the sequence's last ``prompt_lookup_min`` to
    ``prompt_lookup_max`` tokens) or "draft_model" (a smaller model of the same tokenizer at ``model``)
    proposes ``num_speculative_tokens`` tokens per step, which the target model verifies in one step.

    ``disable_by_batch_size``: no request speculates in a step that has more running requests than this
    (None: no limit), since verifying ``1 + k`` tokens per request stops being nearly free once a step is
    compute-bound. ``draft_model_config`` is not given by users: ``EngineArgs`` fills it from ``model``."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    model: str | None = None
    disable_by_batch_size: int | None = DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE
    draft_model_config: ModelConfig | None = None

    @classmethod
    def parse(cls, value: str | dict[str, Any]) -> SpeculativeConfig:
        """From ``--speculative-config``'s JSON text or ``LLM(speculative_config=...)``'s dict; ConfigError
        naming the field that is wrong."""
        try:
            value = parse_json_object(value)
        except ValueError as error:
            raise ConfigError(f"speculative_config: {error}") from None
        fields = {field.name for field in dataclasses.fields(cls)} - {"draft_model_config"}
        unknown = sorted(set(value) - fields)
        if unknown:
            raise ConfigError(f"speculative_config: unknown field(s) {', '.join(unknown)} (known: "
                              f"{', '.join(sorted(fields))})")
        method = value.get("method")
        if method not in SPECULATIVE_METHODS:
            raise ConfigError(f"speculative_config.method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                              f"got {method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            number = value.get(name, 1)
            if not isinstance(number, int) or isinstance(number, bool) or number < 1:
                raise ConfigError(f"speculative_config.{name} must be a whole number >= 1, got {number!r}")
        batch_size = value.get("disable_by_batch_size", 1)
        if batch_size is not None and (not isinstance(batch_size, int) or isinstance(batch_size, bool)
                                       or batch_size < 1):
            raise ConfigError(f"speculative_config.disable_by_batch_size must be a whole number >= 1 or null, "
                              f"got {batch_size!r}")
        if "num_speculative_tokens" not in value:
            raise ConfigError("speculative_config.num_speculative_tokens is required")
        config = cls(**value)
        if config.prompt_lookup_min > config.prompt_lookup_max:
            raise ConfigError(f"speculative_config.prompt_lookup_min ({config.prompt_lookup_min}) must not exceed "
                              f"prompt_lookup_max ({config.prompt_lookup_max})")
        if method == "draft_model":
            if not config.model:
                raise ConfigError("speculative_config.model (the draft model's folder) is required for "
                                  "method draft_model")
        elif config.model is not None:
            raise ConfigError("speculative_config.model is only for method draft_model")
        return config


@dataclasses.dataclass(frozen=True)
class MultiModalConfig:
    """Image inputs, as the front end checks and loads them (the engine core never reads this).

    ``limit_per_prompt``: most items of each modality in one prompt. Images come inline (``data:`` URLs),
    from files under ``allowed_local_media_path`` (``file://`` URLs; None: none) or over http(s) from the
    hosts in ``allowed_media_domains`` only (empty: no URL is fetched), each download within
    ``media_fetch_timeout`` seconds; an image may hold at most ``max_image_bytes`` encoded and
    ``max_image_pixels`` decoded.
    """

    limit_per_prompt: dict[str, int] = dataclasses.field(default_factory=lambda: {"image": 999})
    allowed_local_media_path: str | None = None
    allowed_media_domains: tuple[str, ...] = ()
    media_fetch_timeout: float = 5.0
    max_image_bytes: int = 20 * 2**20
    max_image_pixels: int = 8192 * 8192


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """How many engine cores serve the requests, which of them a config is for, and over how many
    processes each engine core splits its model.

    Each of the ``data_parallel_size`` engine cores is its own process with a whole copy of the model, its
    own scheduler and KV cache; ``data_parallel_rank`` (0 to size - 1) is the engine's index, which it
    stamps on everything it sends so that the front end knows where outputs came from. With
    ``tensor_parallel_size`` > 1 an engine core's model is split (attention heads, MLP columns, vocabulary)
    over that many ranks: the engine core computes rank 0 and worker processes the others.
    """

    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    tensor_parallel_size: int = 1
    # Where the tensor-parallel workers run: "mp" (processes of this machine) or "ray" (Ray actors).
    distributed_executor_backend: str = "mp"
    # Where the engine cores run: "mp" (processes started by the front end, or by headless launchers on other
    # machines that connect to it) or "ray" (Ray actors placed across the cluster's nodes).
    data_parallel_backend: str = "mp"
    # Several machines: the front end runs ranks [0, size_local) and waits for the others, which headless
    # launchers start (ranks [start_rank, start_rank + size_local) each) and connect over TCP to the front
    # end's address and RPC port. None: every engine core is local.
    data_parallel_size_local: int | None = None
    data_parallel_start_rank: int = 0
    data_parallel_address: str = "127.0.0.1"
    data_parallel_rpc_port: int = 29550

    @property
    def num_local_engines(self) -> int:
        """The engine cores this machine's front end (or headless launcher) starts as its own processes."""
        if self.data_parallel_backend == "ray":
            return 0
        if self.data_parallel_size_local is None:
            return self.data_parallel_size - self.data_parallel_start_rank
        return self.data_parallel_size_local

    @property
    def uses_engine_group(self) -> bool:
        """Whether the front end needs a data-parallel client: several engine cores, or any not its own."""
        return self.data_parallel_size > 1 or self.num_local_engines < self.data_parallel_size


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters (``enable_lora``): at most ``max_loras`` distinct adapters run in one step, each held in
    one of as many slots of the model's LoRA layers (least recently used evicted); ``max_cpu_loras`` loaded
    adapters are kept in host memory for reuse; an adapter's rank may be at most ``max_lora_rank``."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything an engine core needs, built once by ``EngineArgs.create_engine_config``."""

    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    tokenizer: str
    seed: int = 0
    device: str = "auto"  # "cpu", "cuda", "cuda:N" or "auto" (CUDA when torch sees a GPU)
    attention_backend: str | None = None  # None: "triton" on CUDA devices, "torch" elsewhere
    enforce_eager: bool = False  # CUDA devices: no CUDA graphs for decode steps
    max_logprobs: int = 20  # most logprobs a request may ask for (-1: no limit)
    num_threads: int | None = None  # intra-op threads on CPUs, per engine core; None: torch's default
    # Streaming outputs are handed over every this many tokens (after the first, and at the end); a request
    # may ask for a larger interval. 1: every token.
    stream_interval: int = 1
    # Structured outputs: the grammar library of requests that name none ("auto": xgrammar, and guidance
    # for what only guidance supports).
    structured_outputs_backend: str = "auto"
    # Chat outputs: the tool-call parser (tool_choice "auto") and the reasoning parser, by name (None: none).
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    # Image inputs (vision-language models): limits and where images may come from; front end only.
    multimodal: MultiModalConfig = dataclasses.field(default_factory=MultiModalConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig | None = None  # speculative decoding (None: off)
    lora: LoRAConfig | None = None  # LoRA adapters (None: off)
    # "generate" (text out) or "embed" (pooling requests: one vector per prompt, with ``pooling``'s pooling).
    task: str = "generate"
    pooling: PoolingConfig | None = None

    def for_data_parallel_rank(self, rank: int) -> EngineConfig:
        """This config as engine ``rank`` of its data-parallel group receives it."""
        return dataclasses.replace(self, parallel=dataclasses.replace(self.parallel, data_parallel_rank=rank))
