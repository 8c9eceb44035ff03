"""Write GGUF files from the tiny Hugging Face checkpoints (``checkpoints.build_checkpoint``), for tests.

The file holds what llama.cpp's converter writes for these architectures: hyperparameters under the
architecture's keys, the byte-level BPE tokenizer (tokens, types, merges, special ids, chat template) and
the tensors under GGUF names, with Llama's q/k rows reordered for llama.cpp's rotary layout. Weight matrices
are stored in one type (F32, F16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K); norms and biases stay F32, as llama.cpp
keeps them. The ``gguf`` package quantizes Q8_0, Q4_0 and Q4_1; Q4_K and Q6_K, which it only dequantizes,
are quantized here (simple min/max scales: what matters for tests is a valid file, not the best error).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
          "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
          "self_attn.v_proj.weight": "attn_v.weight", "self_attn.q_proj.bias": "attn_q.bias",
          "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
          "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
          "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
          "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


def write_gguf(checkpoint: str | Path, path: str | Path, qtype: str = "F32", *, architecture: str | None = None,
               tensor_types: dict[str, str] | None = None) -> Path:
    """Write ``checkpoint`` (a tiny float checkpoint folder) as a GGUF file with weights in ``qtype``.

    ``tensor_types`` overrides the type of single tensors by GGUF name (e.g. ``{"blk.0.attn_v.weight":
    "Q6_K"}``, as Q4_K_M files mix types); ``architecture`` overrides ``general.architecture`` (to write a
    file of an architecture Quire does not run).
    """
    import gguf
    from safetensors.numpy import load_file

    checkpoint, path = Path(checkpoint), Path(path)
    config = json.loads((checkpoint / "config.json").read_text())
    arch = architecture or GGUF_ARCH[config["model_type"]]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(checkpoint.name)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(config.get("rope_theta") or (config.get("rope_parameters") or {})
                                    .get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_vocab_size(config["vocab_size"])
    _add_tokenizer(writer, checkpoint, config)
    weights = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        weights.update(load_file(str(file)))
    for name, array in weights.items():
        gguf_name = _gguf_name(name)
        if config.get("tie_word_embeddings") and gguf_name == "output.weight":
            continue
        array = array.astype(np.float32)
        if arch == "llama" and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            array = _permute(array, heads if "attn_q" in gguf_name else kv_heads)
        kind = (tensor_types or {}).get(gguf_name, qtype if array.ndim == 2 else "F32")
        _add_tensor(writer, gguf_name, array, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gguf_name(name: str) -> str:
    if name in _GLOBAL:
        return _GLOBAL[name]
    _, _, layer, rest = name.split(".", 3)
    return f"blk.{layer}.{_LAYER[rest]}"


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: within each head, the two rotary halves interleaved pairwise."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _add_tokenizer(writer, checkpoint: Path, config: dict) -> None:
    data = json.loads((checkpoint / "tokenizer.json").read_text())
    vocab = dict(data["model"]["vocab"])
    special = {token["content"]: token["id"] for token in data.get("added_tokens", [])}
    vocab.update(special)
    size = config["vocab_size"]
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [5] * size  # unused padding rows (like Qwen's) are "unused"
    for token, index in vocab.items():
        tokens[index] = token
        types[index] = 3 if token in special else 1  # control or normal
    merges = [merge if isinstance(merge, str) else " ".join(merge) for merge in data["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(int(config["eos_token_id"]))
    writer.add_add_bos_token(False)
    template_file = checkpoint / "chat_template.jinja"
    if template_file.is_file():
        writer.add_chat_template(template_file.read_text())
    else:
        tokenizer_config = json.loads((checkpoint / "tokenizer_config.json").read_text())
        if tokenizer_config.get("chat_template"):
            writer.add_chat_template(tokenizer_config["chat_template"])


def _add_tensor(writer, name: str, array: np.ndarray, qtype: str) -> None:
    import gguf

    kind = gguf.GGMLQuantizationType[qtype]
    if qtype == "F32":
        writer.add_tensor(name, array)
    elif qtype == "F16":
        writer.add_tensor(name, array.astype(np.float16))
    elif qtype == "I8":  # an integer tensor: a type no model file uses for weights
        writer.add_tensor(name, np.clip(np.rint(array * 64), -128, 127).astype(np.int8))
    elif qtype == "Q4_K":
        writer.add_tensor(name, quantize_q4_k(array), raw_dtype=kind)
    elif qtype == "Q6_K":
        writer.add_tensor(name, quantize_q6_k(array), raw_dtype=kind)
    else:
        writer.add_tensor(name, gguf.quants.quantize(array, kind), raw_dtype=kind)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """Q4_K blocks of ``x`` ([rows, K], K a multiple of 256): uint8 ``[rows, K / 256 * 144]``."""
    rows = x.shape[0]
    blocks = x.reshape(-1, 8, 32).astype(np.float32)
    low = np.minimum(blocks.min(axis=2), 0.0)  # w = d*sc*q - dmin*m with m >= 0
    scales = (blocks.max(axis=2) - low) / 15.0
    d = (scales.max(axis=1) / 63.0).astype(np.float16)
    dmin = ((-low).max(axis=1) / 63.0).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.rint(np.divide(scales, d32, out=np.zeros_like(scales), where=d32 > 0)), 0, 63).astype(np.uint8)
    mins = np.clip(np.rint(np.divide(-low, dmin32, out=np.zeros_like(low), where=dmin32 > 0)), 0, 63)
    mins = mins.astype(np.uint8)
    step = (d32 * sc)[:, :, None]
    shifted = blocks + (dmin32 * mins)[:, :, None]
    q = np.clip(np.rint(np.divide(shifted, step, out=np.zeros_like(shifted), where=step > 0)), 0, 15)
    q = q.astype(np.uint8).reshape(-1, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    packed = np.zeros((len(d), 12), dtype=np.uint8)
    packed[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = mins[:, 0:4] | ((mins[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:8] & 0xF) | ((mins[:, 4:8] & 0xF) << 4)
    out = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), packed, qs], axis=1)
    return out.reshape(rows, -1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """Q6_K blocks of ``x`` ([rows, K], K a multiple of 256): uint8 ``[rows, K / 256 * 210]``."""
    rows = x.shape[0]
    blocks = x.reshape(-1, 16, 16).astype(np.float32)
    index = np.abs(blocks).argmax(axis=2)
    peak = np.take_along_axis(blocks, index[:, :, None], axis=2)[:, :, 0]
    scales = peak / -32.0  # the largest magnitude maps to -32, the widest end of [-32, 31]
    d = (np.abs(scales).max(axis=1) / 127.0).astype(np.float16)
    d32 = d.astype(np.float32)[:, None]
    sc = np.clip(np.rint(np.divide(scales, d32, out=np.zeros_like(scales), where=d32 > 0)), -128, 127)
    sc = sc.astype(np.int8)
    step = (d32 * sc)[:, :, None]
    q = np.clip(np.rint(np.divide(blocks, step, out=np.zeros_like(blocks), where=step != 0)), -32, 31)
    q = (q.astype(np.int16) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # [block, half, quarter, l]
    ql = np.concatenate([(q[:, :, 0] & 0xF) | ((q[:, :, 2] & 0xF) << 4),
                         (q[:, :, 1] & 0xF) | ((q[:, :, 3] & 0xF) << 4)], axis=2).reshape(-1, 128)
    qh = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4)
          | ((q[:, :, 3] >> 4) << 6)).reshape(-1, 64)
    out = np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8).reshape(-1, 2)], axis=1)
    return out.reshape(rows, -1)


def gguf_to_checkpoint(path: str | Path, folder: str | Path, dtype: str = "bfloat16") -> Path:
    """A Hugging Face checkpoint folder (config, safetensors in ``dtype``, tokenizer) holding a GGUF file's
    weights dequantized: the same model as a float checkpoint (``--quantization int8`` tests and benchmarks
    run on it). Reuses ``folder`` if it already holds one."""
    import torch
    from safetensors.torch import save_file

    from quire.core.models.gguf import GGUFCheckpoint
    from quire.core.models.gguf_weights import iterate_gguf_float_weights
    from quire.core.tokenizer import load_tokenizer

    folder = Path(folder)
    if (folder / "model.safetensors").is_file() and (folder / "config.json").is_file():
        return folder
    checkpoint = GGUFCheckpoint.open(path)
    config = checkpoint.hf_config()
    config.update(model_type=checkpoint.gguf_architecture, torch_dtype=dtype, hidden_act="silu")
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {name: tensor.to(getattr(torch, dtype)).contiguous()
               for name, tensor in iterate_gguf_float_weights(checkpoint)}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    load_tokenizer(str(path)).save_pretrained(str(folder))
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder
