"""Shared fixtures: tiny checkpoints built locally with fixed seeds (nothing is downloaded).

This file imports no torch at module level: the scheduler tests re-run in a torch-free interpreter.
"""

from __future__ import annotations

import os

import pytest

from tests.ray_cluster import ray_cluster  # noqa: F401 (a module's one-node Ray cluster, for the Ray tests)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Most tests run the engine core in-process (starting a process per LLM would add seconds each);
# tests/core/engine_process/ exercises the process boundary explicitly (multiprocess=True).
os.environ.setdefault("QUIRE_MULTIPROCESS_ENGINE", "0")
# Tests that name no model run quire-demo (5.8M parameters) even where SmolLM2-135M-Instruct, the default
# when installed, is present; tests/core/test_default_model.py checks the real default without this.
os.environ.setdefault("QUIRE_DEFAULT_MODEL", "quire-demo")
# Quire's cache (tokenizers converted from GGUF files) lives in a folder of this session's, not in ~/.cache.
if "QUIRE_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["QUIRE_CACHE_DIR"] = tempfile.mkdtemp(prefix="quire-test-cache-")
# Without an NVIDIA GPU, Triton kernels run in Triton's interpreter on CPU tensors (it must be on before
# any kernel module is imported); benchmarks/gpu_check.sh runs the same tests compiled on a GPU.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 128}


def checkpoint_specs():
    from quire.core.testing.checkpoints import TinyModelSpec

    # Seeds chosen so float32 greedy margins over the test prompts stay clear (asserted in tests).
    return {
        "llama": TinyModelSpec(model_type="llama", rope_scaling=LLAMA3_ROPE, logit_std=4, seed=0),
        "qwen2": TinyModelSpec(model_type="qwen2", logit_std=4, seed=1),
        "qwen3": TinyModelSpec(model_type="qwen3", tie_word_embeddings=True, init_std=0.3, head_dim=32,
                               logit_std=4, seed=2),
    }


@pytest.fixture(scope="session")
def demo_server():
    """The real server on the default model (quire-demo) in float32, with the debug routes on; shared by
    the server and CLI tests."""
    from tests.servers import ServerProcess

    server = ServerProcess("--dtype", "float32", "--enable-debug-routes", "--max-num-seqs", "64")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from quire.core.testing.checkpoints import build_tokenizer

    return build_tokenizer(2048)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, tiny_tokenizer):
    """``tiny_checkpoint(arch)`` → folder of a tiny float32 checkpoint (built once per session)."""
    from quire.core.testing.checkpoints import build_checkpoint

    specs = checkpoint_specs()
    built = {}

    def get(arch: str = "llama"):
        if arch not in built:
            folder = tmp_path_factory.mktemp(f"ckpt-{arch}")
            built[arch] = build_checkpoint(folder, specs[arch], tiny_tokenizer)
        return built[arch]

    return get


@pytest.fixture(scope="session")
def llama_checkpoint(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="session")
def corpus_token_ids(tiny_tokenizer):
    """A long run of token ids of ordinary Python source, for prompts."""
    from quire.core.testing.checkpoints import corpus_text

    return tiny_tokenizer.encode(corpus_text()[5000:60000])


@pytest.fixture(scope="session")
def llava_checkpoint(tmp_path_factory):
    """Folder of a tiny LLaVA-1.5-style checkpoint with its processor (CLIP image processor, ``<image>``
    token, chat template with image parts), built once per session."""
    from quire.core.testing.multimodal_checkpoints import build_llava_checkpoint

    return build_llava_checkpoint(tmp_path_factory.mktemp("ckpt-llava"))


@pytest.fixture(scope="session")
def qwen2_5_vl_checkpoint(tmp_path_factory):
    """Folder of a tiny Qwen2.5-VL checkpoint (windowed vision tower, M-RoPE) with its processor's files (Qwen2-VL
    image processor, vision tokens, chat template with image parts), built once per session."""
    from quire.core.testing.multimodal_checkpoints import build_qwen2_5_vl_checkpoint

    return build_qwen2_5_vl_checkpoint(tmp_path_factory.mktemp("ckpt-qwen2-5-vl"))


@pytest.fixture(scope="session")
def llava_server(llava_checkpoint, tmp_path_factory):
    """The real server on the tiny LLaVA checkpoint in float32 (debug routes on), shared by every image test.

    Images may come inline (data URLs), as files under ``server.media_folder`` (which holds ``cat.png``,
    ``tests.media_server.png_bytes()``), or over http from ``localhost`` only (``127.0.0.1`` is not allowed);
    at most 4 images per prompt and 1 MiB per image.
    """
    from tests.media_server import png_bytes
    from tests.servers import ServerProcess

    media_folder = tmp_path_factory.mktemp("llava-media")
    (media_folder / "cat.png").write_bytes(png_bytes())
    server = ServerProcess("--model", str(llava_checkpoint), "--dtype", "float32", "--enable-debug-routes",
                           "--allowed-media-domains", "localhost", "--allowed-local-media-path", str(media_folder),
                           "--max-image-bytes", "1MiB", "--limit-mm-per-prompt", '{"image": 4}')
    server.media_folder = media_folder
    yield server
    server.stop()
