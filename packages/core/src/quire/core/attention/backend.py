"""The contract every attention backend keeps with the model and the model runner, and what it declares."""

from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from quire.core.attention.metadata import AttentionMetadata, BackendPlan


@dataclasses.dataclass(frozen=True)
class AttentionCapabilities:
    """What a backend offers beyond ``prepare`` and ``forward``; callers branch on these, never on types.

    ``cpu_decode_stack``: ``decode_stack_inputs`` can return the inputs of the C++ one-call decoder stack
    (``quire.kernels.decode_stack``), because this backend's plans decode with the same C++ kernel.
    ``supports_cuda_graphs``: ``graph_decode_plan`` builds a decode plan over caller-owned static buffers,
    so the runner may capture decode steps in CUDA graphs.
    ``supports_sliding_window``: ``forward`` takes a ``sliding_window``; without it the runner refuses, at
    start-up, a model with windowed layers.
    """

    cpu_decode_stack: bool = False
    supports_cuda_graphs: bool = False
    supports_sliding_window: bool = False


class AttentionBackend(abc.ABC):
    """Writes a step's new keys and values into the paged KV cache and runs attention over it.

    A backend is built once per runner as ``cls(dtype, device)`` (``dtype`` a ``ModelConfig.dtype`` name,
    ``device`` a torch device string) and shared by every attention layer. Per step the runner builds one
    ``AttentionMetadata`` and calls ``prepare(metadata)`` once, which stores the backend's own plan in
    ``metadata.plan``; each layer then calls ``forward`` with that metadata. Only the backend reads its
    plan: the model and runner ask through the methods below.

    ``name`` is the name the backend is registered under; ``capabilities`` (set by the class or by
    ``__init__``, since what a device offers may only be known then) says which optional methods work.
    A backend without a capability keeps the default behaviour documented on that method.
    """

    name: str
    capabilities: AttentionCapabilities = AttentionCapabilities()

    @abc.abstractmethod
    def __init__(self, dtype: str, device: str): ...

    @abc.abstractmethod
    def prepare(self, metadata: AttentionMetadata) -> None:
        """Once per step, before any layer: set ``metadata.plan`` to the work shared by every layer."""

    @abc.abstractmethod
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float, sliding_window: int | None = None) -> torch.Tensor:
        """Write ``key``/``value [T, Hk, D]`` at ``metadata.slot_mapping``, then return attention output
        ``[T, Hq, D]`` for ``query [T, Hq, D]`` (``kv_cache`` laid out as in ``quire.kernels.kv_cache``).

        With a ``sliding_window`` (only where ``capabilities.supports_sliding_window``), the query at position
        ``p`` sees the keys at positions ``p - sliding_window + 1 .. p`` only; the blocks of earlier keys may
        already belong to other requests and are never read.
        """

    def decode_stack_inputs(self, metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(block_tables [B, max_blocks] int64, seq_lens [B] int64)`` for the C++ decoder stack when every
        token of this prepared step is a decode the stack can run (row ``i`` is request ``i``), else None.

        Without ``capabilities.cpu_decode_stack`` this is always None: the model runs its modules.
        """
        return None

    def graph_decode_plan(self, slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                          query_start_loc: torch.Tensor, max_seq_len: int) -> BackendPlan:
        """A pure decode plan over tensors the caller owns and refills each step (a CUDA graph's static
        buffers); ``max_seq_len`` bounds every ``seq_lens`` entry the buffers will hold.

        Without ``capabilities.supports_cuda_graphs`` this raises NotImplementedError; the runner, which
        checks the capability first, then runs every step eagerly.
        """
        raise NotImplementedError(f"attention backend {self.name!r} does not support CUDA graphs")
