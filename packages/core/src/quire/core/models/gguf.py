"""GGUF files (llama.cpp's format): what the engine reads from one before loading any weight.

``GGUFCheckpoint.open(path)`` parses the header and the tensor table (the ``gguf`` package memory-maps the
file, so nothing is read into memory yet) and refuses, with one ``ConfigError`` naming the problem, a file
that is not GGUF, a file cut short, an architecture Quire does not run, and a tensor type it cannot load.
``hf_config()`` turns the metadata into the ``config.json`` fields ``ModelConfig`` reads, and
``hf_tensors()`` names each tensor as the Hugging Face checkpoint of the same model would, with the row
order transformers uses (llama.cpp's converter interleaves the rotary halves of Llama's q/k rows; reading
them back undoes that). This module imports no torch.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path
from typing import Any

import numpy as np

from quire.core.errors import ConfigError

logger = logging.getLogger(__name__)

# GGUF ``general.architecture`` → the registered architecture that runs it. llama.cpp writes Mistral and
# SmolLM files as ``llama``.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# Weight types the model computes on as they are (``quire.kernels.quant``).
KEPT_QUANTIZED = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
FLOAT_TYPES = ("F32", "F16", "BF16")
# Everything else the ``gguf`` package can dequantize is widened to float at load, with a log line.
_DEQUANTIZED_AT_LOAD = ("Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q5_K", "IQ4_NL", "IQ4_XS", "IQ2_XXS", "IQ2_XS",
                        "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0")

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(.+)")


def gguf_path(path: str | Path) -> Path | None:
    """The GGUF file ``path`` names (the file itself, or the one ``*.gguf`` in a folder without
    ``config.json``), or None when ``path`` is a Hugging Face folder."""
    path = Path(path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        files = sorted(path.glob("*.gguf"))
        if len(files) > 1:
            raise ConfigError(f"model folder {str(path)!r} holds several GGUF files "
                              f"({', '.join(f.name for f in files)}); name one")
        if files:
            return files[0]
    return None


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file, under its Hugging Face name: ``data`` is the raw memory-mapped array as the
    ``gguf`` package exposes it (rows of quantized blocks, or floats), ``shape`` is ``[rows, columns]``
    (PyTorch order), ``qtype`` the GGML type name; ``permute_heads`` is the number of heads whose rotary
    halves must be de-interleaved (0: none)."""

    name: str
    gguf_name: str
    qtype: str
    shape: tuple[int, ...]
    data: np.ndarray
    permute_heads: int = 0


class GGUFCheckpoint:
    """A parsed GGUF file: its metadata and tensor table, checked."""

    def __init__(self, path: Path, reader: Any):
        self.path = path
        self._reader = reader
        self.metadata = {name: _field_value(field) for name, field in reader.fields.items()
                         if not name.startswith("tokenizer.ggml.")}
        self.gguf_architecture = str(self.metadata.get("general.architecture", ""))
        if self.gguf_architecture not in GGUF_ARCHITECTURES:
            raise ConfigError(f"GGUF file {path.name!r}: architecture {self.gguf_architecture!r} is not "
                              f"supported; supported: {', '.join(GGUF_ARCHITECTURES)}")
        self.architecture = GGUF_ARCHITECTURES[self.gguf_architecture]
        self._tensors = {tensor.name: tensor for tensor in reader.tensors}
        self._check_tensors()

    @classmethod
    def open(cls, path: str | Path) -> GGUFCheckpoint:
        path = Path(path)
        try:
            from gguf import GGUFReader
        except ImportError as error:  # a dependency of quire-core; only a broken install lacks it
            raise ConfigError("reading GGUF files needs the gguf package (pip install gguf)") from error
        try:
            reader = GGUFReader(path)
        except FileNotFoundError as error:
            raise ConfigError(f"GGUF file {str(path)!r} does not exist") from error
        except (ValueError, IndexError, KeyError, OSError, TypeError) as error:
            raise ConfigError(f"{str(path)!r} is not a readable GGUF file (corrupt or truncated): "
                              f"{error or type(error).__name__}") from error
        return cls(path, reader)

    def _check_tensors(self) -> None:
        size = self.path.stat().st_size
        supported = (*KEPT_QUANTIZED, *FLOAT_TYPES, *_DEQUANTIZED_AT_LOAD)
        widened = []
        for tensor in self._reader.tensors:
            qtype = tensor.tensor_type.name
            if int(tensor.data_offset) + int(tensor.n_bytes) > size or tensor.data.nbytes != int(tensor.n_bytes):
                raise ConfigError(f"GGUF file {self.path.name!r} is truncated: tensor {tensor.name!r} ends past "
                                  f"the end of the file ({size} bytes)")
            if qtype not in supported:
                raise ConfigError(f"GGUF file {self.path.name!r}: tensor {tensor.name!r} has type {qtype}, "
                                  f"which Quire cannot load; supported: {', '.join(supported)}")
            if tensor.name == "rope_freqs.weight":
                raise ConfigError(f"GGUF file {self.path.name!r}: per-frequency rope scaling (rope_freqs, as in "
                                  "Llama 3.1 files) is not supported")
            if tensor.name not in _GLOBAL_NAMES and not _LAYER_TENSOR.fullmatch(tensor.name):
                raise ConfigError(f"GGUF file {self.path.name!r}: tensor {tensor.name!r} has no place in "
                                  f"{self.architecture}")
            match = _LAYER_TENSOR.fullmatch(tensor.name)
            if match and match.group(2) not in _LAYER_NAMES:
                raise ConfigError(f"GGUF file {self.path.name!r}: tensor {tensor.name!r} has no place in "
                                  f"{self.architecture}")
            if qtype in _DEQUANTIZED_AT_LOAD:
                widened.append(qtype)
        if widened:
            logger.info("GGUF %s: %d tensors of type %s are dequantized to float at load (computed on "
                        "quantized: %s)", self.path.name, len(widened), ", ".join(sorted(set(widened))),
                        ", ".join(KEPT_QUANTIZED))

    def _meta(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.gguf_architecture}.{key}", default)

    def _require(self, key: str) -> Any:
        value = self._meta(key)
        if value is None:
            raise ConfigError(f"GGUF file {self.path.name!r} lacks {self.gguf_architecture}.{key}")
        return value

    def hf_config(self) -> dict[str, Any]:
        """The ``config.json`` (and ``generation_config.json``) fields of the same model."""
        heads = int(self._require("attention.head_count"))
        hidden = int(self._require("embedding_length"))
        names = set(self._tensors)
        scaling = self._meta("rope.scaling.type")
        rope: dict[str, Any] = {"rope_theta": float(self._meta("rope.freq_base", 10000.0))}
        if scaling not in (None, "none"):
            if scaling != "linear":
                raise ConfigError(f"GGUF file {self.path.name!r}: rope scaling {scaling!r} is not supported")
            rope.update(rope_type="linear", factor=float(self._meta("rope.scaling.factor", 1.0)))
        vocab = self._meta("vocab_size")
        if vocab is None:
            vocab = len(self._reader.fields["tokenizer.ggml.tokens"].data)
        config = {
            "architectures": [self.architecture],
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "intermediate_size": int(self._require("feed_forward_length")),
            "num_hidden_layers": int(self._require("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self._meta("attention.head_count_kv", heads)),
            "head_dim": int(self._meta("attention.key_length", hidden // heads)),
            "rms_norm_eps": float(self._meta("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_scaling": rope if "rope_type" in rope else None,
            "rope_theta": rope["rope_theta"],
            "max_position_embeddings": int(self._meta("context_length", 2048)),
            "tie_word_embeddings": "output.weight" not in names,
            "attention_bias": "blk.0.attn_q.bias" in names,
            "torch_dtype": "float32",
        }
        tokenizer_fields = self._reader.fields
        for key in ("bos_token_id", "eos_token_id"):
            field = tokenizer_fields.get(f"tokenizer.ggml.{key}")
            if field is not None:
                config[key] = int(_field_value(field))
        return config

    def tensor_types(self) -> dict[str, str]:
        """GGML type name of every tensor, by GGUF name."""
        return {name: tensor.tensor_type.name for name, tensor in self._tensors.items()}

    def hf_tensors(self) -> list[GGUFTensor]:
        """Every tensor under its Hugging Face name (no data is read: ``data`` stays memory-mapped)."""
        config = self.hf_config()
        heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        tensors = []
        for name, tensor in self._tensors.items():
            match = _LAYER_TENSOR.fullmatch(name)
            if match:
                part = match.group(2)
                hf_name = f"model.layers.{match.group(1)}.{_LAYER_NAMES[part]}"
            else:
                part, hf_name = name, _GLOBAL_NAMES[name]
            permute = 0
            # llama.cpp's converter reorders Llama's q/k rows for its rotary layout (pairs instead of
            # halves); Qwen files keep transformers' layout.
            if self.gguf_architecture == "llama" and part.startswith(("attn_q.", "attn_k.")):
                permute = heads if part.startswith("attn_q.") else kv_heads
            shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
            tensors.append(GGUFTensor(hf_name, name, tensor.tensor_type.name, shape, tensor.data, permute))
        return tensors


def _field_value(field: Any) -> Any:
    try:
        return field.contents()
    except (ValueError, IndexError, TypeError):
        return None
