"""Shared pieces of the benchmark scripts: the locally built benchmark checkpoint."""

from __future__ import annotations

import random
from pathlib import Path


def bench_checkpoint(folder: Path) -> Path:
    """A ~7M-parameter Llama-shaped bfloat16 checkpoint (hidden 256, 4 layers, vocabulary ~8000),
    built with a fixed seed unless ``folder`` already holds one. Nothing is downloaded."""
    from quire.core.testing.checkpoints import TinyModelSpec, build_checkpoint, build_tokenizer

    if (folder / "config.json").is_file():
        return folder
    spec = TinyModelSpec(model_type="llama", hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
                         init_std=0.02, logit_std=4.0, dtype="bfloat16")
    return build_checkpoint(folder, spec, build_tokenizer(8000))


def workload(folder: str | Path, num_requests: int, prompt_len: tuple[int, int], output_len: tuple[int, int],
             seed: int = 0) -> list[tuple[list[int], int]]:
    """``(prompt token ids, output length)`` per request, lengths uniform in the given [min, max] ranges."""
    import json

    vocab_size = json.loads((Path(folder) / "config.json").read_text())["vocab_size"]
    rng = random.Random(seed)
    return [([rng.randrange(3, vocab_size) for _ in range(rng.randint(*prompt_len))], rng.randint(*output_len))
            for _ in range(num_requests)]
