"""Tiny GGUF files written from tiny checkpoints (fixed seeds), shared by the GGUF tests."""

from __future__ import annotations

import pytest

# Shapes whose rows are whole K-quant super-blocks (256 values): hidden 256, MLP 512.
GGUF_SPECS = {
    "llama": dict(model_type="llama", logit_std=4, seed=3),
    "qwen2": dict(model_type="qwen2", logit_std=4, seed=4),
    "qwen3": dict(model_type="qwen3", tie_word_embeddings=True, logit_std=4, seed=5),
}


@pytest.fixture(scope="session")
def gguf_source(tmp_path_factory, tiny_tokenizer):
    """``gguf_source(arch)`` → a tiny float32 checkpoint folder shaped for every GGUF type."""
    from quire.core.testing.checkpoints import TinyModelSpec, build_checkpoint

    built = {}

    def get(arch: str):
        if arch not in built:
            spec = TinyModelSpec(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                 num_key_value_heads=2, **GGUF_SPECS[arch])
            built[arch] = build_checkpoint(tmp_path_factory.mktemp(f"gguf-src-{arch}"), spec, tiny_tokenizer)
        return built[arch]

    return get


@pytest.fixture(scope="session")
def gguf_file(tmp_path_factory, gguf_source):
    """``gguf_file(arch, qtype, **write_options)`` → a GGUF file (written once per arguments)."""
    from quire.core.testing.gguf_files import write_gguf

    written = {}

    def get(arch: str, qtype: str, **options):
        key = (arch, qtype, repr(sorted(options.items())))
        if key not in written:
            folder = tmp_path_factory.mktemp(f"gguf-{arch}-{qtype}")
            written[key] = write_gguf(gguf_source(arch), folder / f"tiny-{arch}-{qtype}.gguf", qtype, **options)
        return written[key]

    return get
