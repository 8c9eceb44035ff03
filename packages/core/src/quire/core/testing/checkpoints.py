"""Build small Hugging Face checkpoints (Llama, Qwen2, Qwen3, Phi-3 shapes) with a fixed seed.

The tokenizer is a byte-level BPE trained on CPython's own sources (present on every machine), with
ChatML special tokens and chat template. Weights are random but scaled so that logits are peaked: greedy
decoding then has clear top-1 margins, and float noise cannot flip an argmax.
"""

from __future__ import annotations

import dataclasses
import json
import sysconfig
from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Standard-library modules whose sources train the tokenizer (present in every CPython 3.10+).
CORPUS_MODULES = ["argparse.py", "dataclasses.py", "enum.py", "functools.py", "inspect.py",
                  "pathlib.py", "string.py", "textwrap.py", "typing.py", "json/decoder.py",
                  "json/encoder.py", "collections/__init__.py", "email/message.py", "csv.py"]


@dataclasses.dataclass(frozen=True)
class TinyModelSpec:
    """Shape and initialisation of a locally built checkpoint."""

    model_type: str = "llama"  # llama | qwen2 | qwen3 | phi3
    vocab_size: int = 2048
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None
    max_position_embeddings: int = 1024
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    # further config.json fields of the model type's (e.g. Phi-3's original_max_position_embeddings)
    extra_config: dict | None = None
    init_std: float = 0.15
    logit_std: float = 6.0  # the LM head is rescaled so logits have about this spread
    dtype: str = "float32"
    seed: int = 0


def corpus_text() -> str:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return "\n".join((stdlib / name).read_text(encoding="utf-8") for name in CORPUS_MODULES)


def build_tokenizer(vocab_size: int):
    """A byte-level BPE ``PreTrainedTokenizerFast`` with ChatML special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_text().splitlines(keepends=True), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
    )
    wrapped.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:]})
    wrapped.chat_template = CHATML_TEMPLATE
    return wrapped


def build_checkpoint(folder: str | Path, spec: TinyModelSpec, tokenizer=None) -> Path:
    """Write config, safetensors weights, tokenizer and chat template into ``folder``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(folder)
    tokenizer = tokenizer or build_tokenizer(spec.vocab_size)
    extra = {"head_dim": spec.head_dim} if spec.head_dim else {}
    if spec.rope_scaling:
        extra["rope_scaling"] = dict(spec.rope_scaling)
    eos_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    extra["rope_theta"] = spec.rope_theta
    extra.update(spec.extra_config or {})
    config = AutoConfig.for_model(
        spec.model_type,
        # the model may have more embedding rows than the tokenizer has tokens (like Qwen's padding)
        vocab_size=max(spec.vocab_size, len(tokenizer)), hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings, initializer_range=spec.init_std,
        bos_token_id=None, eos_token_id=eos_id, pad_token_id=eos_id, **extra,
    )
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _rescale(model, spec)
    model.to(getattr(torch, spec.dtype))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    _write_json(folder / "generation_config.json",
                {"eos_token_id": eos_id, "pad_token_id": eos_id, "do_sample": False})
    return folder


def _rescale(model, spec: TinyModelSpec) -> None:
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.normal_(0.0, spec.init_std)
        head = model.get_output_embeddings().weight
        # hidden states leave the final RMSNorm with unit RMS: logit spread ~ |row| of the head
        head.mul_(spec.logit_std / (head.norm(dim=-1).mean() + 1e-6))


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
