"""Attention backends declare what they offer; the model and the runner go by the declarations."""

from __future__ import annotations

import pytest
import torch

from quire.core.attention import (
    AttentionBackend,
    AttentionCapabilities,
    check_attention_backend,
    get_attention_backend,
)
from quire.core.attention.metadata import AttentionMetadata
from quire.core.attention.torch_backend import TorchAttentionBackend
from quire.core.config import ModelConfig
from quire.core.errors import ConfigError
from quire.core.models import get_model_entry
from quire.core.models.weights import iterate_weights, load_weights
from quire.kernels import cpu_extension
from quire.kernels import decode_stack as decode_stack_module

BLOCK_SIZE = 4


class ModulesOnlyBackend(AttentionBackend):
    """The torch backend's attention, declaring no optional capability."""

    name = "modules-only"

    def __init__(self, dtype: str = "float32", device: str = "cpu"):
        self.inner = TorchAttentionBackend(dtype, device)

    def prepare(self, metadata):
        self.inner.prepare(metadata)

    def forward(self, query, key, value, kv_cache, metadata, scale, sliding_window=None):
        return self.inner.forward(query, key, value, kv_cache, metadata, scale, sliding_window)


def step_metadata(query_lens: list[int], seq_lens: list[int]) -> AttentionMetadata:
    """Request ``i`` owns blocks ``1 + i * 8 ...``; its new tokens are the last ``query_lens[i]`` of ``seq_lens[i]``."""
    tables = 1 + torch.arange(len(seq_lens) * 8, dtype=torch.int64).reshape(len(seq_lens), 8)
    slots = [int(tables[i, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
             for i, (q, s) in enumerate(zip(query_lens, seq_lens)) for p in range(s - q, s)]
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return AttentionMetadata(slot_mapping=torch.tensor(slots), block_tables=tables, query_start_loc=starts,
                             seq_lens=seq_lens, max_query_len=max(query_lens), block_size=BLOCK_SIZE)


def test_declared_capabilities():
    torch_backend = get_attention_backend("torch")
    assert torch_backend("bfloat16", "cpu").capabilities == AttentionCapabilities(
        cpu_decode_stack=cpu_extension.load() is not None, supports_sliding_window=True)
    assert not torch_backend("float16", "cpu").capabilities.cpu_decode_stack  # no C++ decode kernel for it
    triton = get_attention_backend("triton")("float32", "cpu")  # Triton's interpreter on CPUs
    assert triton.capabilities == AttentionCapabilities(supports_cuda_graphs=True, supports_sliding_window=True)
    with pytest.raises(NotImplementedError, match="CUDA graphs"):
        torch_backend("float32", "cpu").graph_decode_plan(*[torch.zeros(1)] * 4, 16)


def test_registry_checks_the_contract():
    with pytest.raises(ConfigError, match="'flash'.*torch, triton"):
        get_attention_backend("flash")

    class NoForward(AttentionBackend):
        name = "no-forward"

        def __init__(self, dtype, device): ...

        def prepare(self, metadata): ...

    with pytest.raises(ConfigError, match="does not implement: forward"):
        check_attention_backend(NoForward, "no-forward")
    with pytest.raises(ConfigError, match="not a subclass of AttentionBackend"):
        check_attention_backend(object, "object")
    with pytest.raises(ConfigError, match="calls itself 'modules-only'"):
        check_attention_backend(ModulesOnlyBackend, "torch")
    check_attention_backend(ModulesOnlyBackend, "modules-only")


def test_decode_stack_inputs_only_when_every_token_decodes():
    backend = TorchAttentionBackend("float32", "cpu")
    if not backend.capabilities.cpu_decode_stack:
        pytest.skip("the C++ decode kernel is not available")
    decodes = step_metadata([1, 1], [5, 9])
    backend.prepare(decodes)
    tables, lens = backend.decode_stack_inputs(decodes)
    assert torch.equal(tables, decodes.block_tables) and lens.tolist() == [5, 9]
    verification = step_metadata([1, 3], [5, 9])  # 3 queries after 6 cached tokens: one decode per query
    backend.prepare(verification)
    tables, lens = backend.decode_stack_inputs(verification)
    assert lens.tolist() == [5, 7, 8, 9]
    assert torch.equal(tables, verification.block_tables[[0, 1, 1, 1]])
    for query_lens, seq_lens in (([1, 20], [5, 25]), ([1, 3], [5, 3])):  # a long chunk; a whole short prompt
        mixed = step_metadata(query_lens, seq_lens)
        backend.prepare(mixed)
        assert backend.decode_stack_inputs(mixed) is None
    other = ModulesOnlyBackend()
    other.prepare(decodes)
    assert other.decode_stack_inputs(decodes) is None


def build_model(path, backend):
    config = ModelConfig.from_hf(path, dtype="float32")
    entry = get_model_entry(config.architecture)
    with torch.device("cpu"):
        model = entry.model_class()(config, backend)
    load_weights(model, iterate_weights(path), entry.weights, config)
    model.prepack()
    return model


class NeverCalled:
    def forward(self, *args):
        raise AssertionError("the decode stack ran for a backend that does not offer it")


def test_the_backend_not_the_model_chooses_the_decode_stack(llama_checkpoint, monkeypatch):
    built = []
    # pretend every linear layer runs on the C++ kernel path, so only the backend's answer decides
    monkeypatch.setattr(decode_stack_module, "kernel_weight", lambda packed: torch.zeros(1))
    monkeypatch.setattr(decode_stack_module, "build", lambda *args: built.append(args) or NeverCalled())
    modules_only = build_model(llama_checkpoint, ModulesOnlyBackend())
    assert modules_only.model.decode_stack is None and not built
    capable = TorchAttentionBackend("float32", "cpu")
    if capable.capabilities.cpu_decode_stack:
        assert build_model(llama_checkpoint, capable).model.decode_stack is not None and len(built) == 1

    # a stack left on a model whose backend lacks the capability is never asked to run
    reference = build_model(llama_checkpoint, TorchAttentionBackend("float32", "cpu"))
    reference.model.decode_stack = None
    modules_only.model.decode_stack = NeverCalled()
    config = modules_only.config
    kv_caches = [torch.zeros(2, 32, BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
                 for _ in range(config.num_hidden_layers)]
    input_ids, positions = torch.tensor([11, 12]), torch.tensor([0, 0])
    outputs = []
    for model in (modules_only, reference):
        metadata = step_metadata([1, 1], [1, 1])
        model.model.backend.prepare(metadata)
        outputs.append(model(input_ids, positions, [c.clone() for c in kv_caches], metadata))
    torch.testing.assert_close(outputs[0], outputs[1], atol=0, rtol=0)
