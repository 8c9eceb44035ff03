"""Shared pieces of the benchmark scripts: the locally built benchmark checkpoint."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def bench_checkpoint(folder: Path, size: str = "tiny") -> Path:
    """A bfloat16 benchmark checkpoint built with a fixed seed unless ``folder`` already holds one
    (nothing is downloaded): ``tiny`` is ~7M parameters (Llama shape, hidden 256, 4 layers, vocabulary
    8000); ``small`` has Qwen2.5-0.5B's shapes (hidden 896, 24 layers, 14 heads, 2 KV heads, MLP 4864,
    vocabulary 32,000, tied embeddings: 387M parameters)."""
    from quire.core.testing.checkpoints import build_checkpoint, build_tokenizer

    spec = CHECKPOINT_SPECS[size]()
    config = folder / "config.json"
    if config.is_file() and json.loads(config.read_text())["vocab_size"] == spec.vocab_size:
        return folder
    return build_checkpoint(folder, spec, build_tokenizer(8000))


def _tiny():
    from quire.core.testing.checkpoints import TinyModelSpec

    return TinyModelSpec(model_type="llama", vocab_size=8000, hidden_size=256, intermediate_size=768,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=1024, init_std=0.02, logit_std=4.0, dtype="bfloat16")


def _small():
    from quire.core.testing.checkpoints import TinyModelSpec

    return TinyModelSpec(model_type="qwen2", vocab_size=32000, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
                         max_position_embeddings=8192, tie_word_embeddings=True, rope_theta=1_000_000.0,
                         init_std=0.02, logit_std=4.0, dtype="bfloat16")


CHECKPOINT_SPECS = {"tiny": _tiny, "small": _small}


def workload(folder: str | Path, num_requests: int, prompt_len: tuple[int, int], output_len: tuple[int, int],
             seed: int = 0) -> list[tuple[list[int], int]]:
    """``(prompt token ids, output length)`` per request, lengths uniform in the given [min, max] ranges."""
    vocab_size = json.loads((Path(folder) / "config.json").read_text())["vocab_size"]
    rng = random.Random(seed)
    return [([rng.randrange(3, vocab_size) for _ in range(rng.randint(*prompt_len))], rng.randint(*output_len))
            for _ in range(num_requests)]


def workload_parser(description: str) -> argparse.ArgumentParser:
    """The options every offline benchmark shares: the workload, the dtype and the checkpoint folder."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--checkpoint", type=Path, help="reuse or create the checkpoint in this folder")
    return parser
