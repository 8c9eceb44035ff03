"""A bad GGUF file is one clear error, raised before any weight is loaded."""

from __future__ import annotations

import pytest

from quire.core.config import ModelConfig
from quire.core.errors import ConfigError
from quire.offline import LLM


@pytest.fixture
def no_weight_loading(monkeypatch):
    """Fails the test if the engine gets as far as loading weights."""
    import quire.core.models.gguf_weights as gguf_weights

    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded before the error")

    monkeypatch.setattr(gguf_weights, "load_gguf_weights", refuse)


def check_refused(path, *fragments):
    with pytest.raises(ConfigError) as caught:
        LLM(str(path), max_model_len=256)
    message = str(caught.value)
    for fragment in fragments:
        assert fragment in message, message
    with pytest.raises(ConfigError):
        ModelConfig.from_path(path)


def test_a_file_that_is_not_gguf(tmp_path, no_weight_loading):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 this is a zip file, not a model" * 10)
    check_refused(path, "model.gguf", "not a readable GGUF file")


def test_a_truncated_file(gguf_file, tmp_path, no_weight_loading):
    whole = gguf_file("llama", "Q4_0").read_bytes()
    for keep in (len(whole) - 100, len(whole) // 2, 40):
        path = tmp_path / f"cut-{keep}.gguf"
        path.write_bytes(whole[:keep])
        with pytest.raises(ConfigError) as caught:
            ModelConfig.from_path(path)
        assert "truncated" in str(caught.value) and f"cut-{keep}.gguf" in str(caught.value)
    check_refused(tmp_path / f"cut-{len(whole) - 100}.gguf", "truncated")


def test_an_unknown_architecture(gguf_source, tmp_path, no_weight_loading):
    from quire.core.testing.gguf_files import write_gguf

    path = write_gguf(gguf_source("llama"), tmp_path / "falcon.gguf", "Q8_0", architecture="falcon")
    check_refused(path, "architecture 'falcon' is not supported", "llama, qwen2, qwen3")


def test_an_unsupported_tensor_type(gguf_source, tmp_path, no_weight_loading):
    from quire.core.testing.gguf_files import write_gguf

    path = write_gguf(gguf_source("llama"), tmp_path / "int-weights.gguf", "Q8_0",
                      tensor_types={"blk.1.ffn_up.weight": "I8"})
    check_refused(path, "'blk.1.ffn_up.weight'", "type I8", "cannot load")


def test_a_folder_with_two_gguf_files_must_name_one(gguf_file, tmp_path):
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(gguf_file("llama", "Q8_0").read_bytes())
    with pytest.raises(ConfigError, match="several GGUF files"):
        ModelConfig.from_path(tmp_path)


def test_int8_quantization_of_a_gguf_file_is_refused(gguf_file):
    with pytest.raises(ConfigError, match="quantization 'int8' is for float checkpoints"):
        LLM(str(gguf_file("llama", "Q8_0")), quantization="int8")
