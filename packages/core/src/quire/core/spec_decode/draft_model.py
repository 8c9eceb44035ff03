"""The draft-model proposer: a small model of the target's tokenizer, run by the engine core beside the
target, proposes the next ``k`` tokens of each speculating request by greedy decoding.

The draft keeps its own paged KV cache (its blocks, its block tables) and remembers, per request, which
tokens its cache holds: the request's tokens known at its last proposal, then the proposals it wrote
after them. The next proposal reuses the cache up to the first token that differs from the request's
tokens now (the first rejected proposal) and feeds the rest in one pass, so a round costs ``k`` draft
passes: one that catches up and proposes the first token, then one per further token.

Proposals are the draft's argmax: a deterministic function of the context, which the rejection sampler
verifies as a one-hot draft distribution; that keeps random sampling exactly the target's (see
``quire.core.worker.rejection_sampler``) without carrying the draft's probabilities.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from quire.core.attention import get_attention_backend
from quire.core.attention.metadata import AttentionMetadata
from quire.core.config import EngineConfig
from quire.core.request import Request
from quire.core.worker.gpu_memory import resolve_device
from quire.core.worker.kv_cache import allocate_kv_caches
from quire.core.worker.model_runner import load_model
from quire.kernels.sampling import argmax

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _DraftState:
    blocks: list[int] = dataclasses.field(default_factory=list)
    num_known: int = 0  # the request's tokens that the cache holds, from position 0
    drafts: list[int] = dataclasses.field(default_factory=list)  # proposals cached after them


@dataclasses.dataclass
class _Row:
    state: _DraftState
    tokens: list[int]  # what the draft computes in its first pass
    start: int  # the position of tokens[0]
    num_proposals: int
    proposals: list[int] = dataclasses.field(default_factory=list)


class DraftModelProposer:
    """Loads the draft model of ``config.speculative`` on the engine's device, with a KV cache of
    ``num_blocks`` (the target's count, so it holds every token the target holds) plus room for the
    proposals of every running request."""

    def __init__(self, config: EngineConfig, num_blocks: int):
        speculative = config.speculative
        self.model_config = speculative.draft_model_config
        self.num_speculative_tokens = speculative.num_speculative_tokens
        self.max_model_len = config.model.max_model_len
        self.vocab_size = min(config.model.vocab_size, self.model_config.vocab_size)
        self.block_size = config.cache.block_size
        self.device = resolve_device(config.device)
        backend = config.attention_backend or ("triton" if self.device.type == "cuda" else "torch")
        self.attn_backend = get_attention_backend(backend)(self.model_config.dtype, str(self.device))
        self.model = load_model(self.model_config, self.attn_backend, self.device)
        room = config.scheduler.max_num_seqs * (-(-self.num_speculative_tokens // self.block_size) + 1)
        self.num_blocks = num_blocks + room
        self.kv_caches = allocate_kv_caches(self.model_config, self.num_blocks, self.block_size, self.device)
        self.free_blocks = list(range(self.num_blocks - 1, 0, -1))  # block 0 pads block tables
        self.states: dict[str, _DraftState] = {}
        logger.info("draft model %s: %s, %d KV blocks", self.model_config.path, self.model_config.architecture,
                    self.num_blocks)

    @torch.inference_mode()
    def propose_requests(self, requests: list[Request]) -> list[list[int]]:
        """Up to ``num_speculative_tokens`` proposals for each request (fewer near ``max_model_len``; none
        when the draft's cache has no room left)."""
        rows, proposals = [], []
        for request in requests:
            row = self._plan(request)
            proposals.append(row.proposals if row is not None else [])
            if row is not None:
                rows.append(row)
        if not rows:
            return proposals
        tokens = self._forward(rows, [row.tokens for row in rows], [row.start for row in rows])
        for row, token in zip(rows, tokens):
            row.proposals.append(token)
        for j in range(1, max(row.num_proposals for row in rows)):
            active = [row for row in rows if row.num_proposals > j]
            tokens = self._forward(active, [[row.proposals[-1]] for row in active],
                                   [row.start + len(row.tokens) + j - 1 for row in active])
            for row, token in zip(active, tokens):
                row.proposals.append(token)
        for row in rows:
            row.state.num_known = row.start + len(row.tokens)
            row.state.drafts = row.proposals[:-1]  # the last proposal was never fed back
        return proposals

    def _plan(self, request: Request) -> _Row | None:
        tokens = request.all_token_ids
        num_tokens = len(tokens)
        num_proposals = min(self.num_speculative_tokens, self.max_model_len - num_tokens)
        if num_proposals < 1:
            return None
        state = self.states.setdefault(request.request_id, _DraftState())
        valid = min(state.num_known, num_tokens)
        for draft in state.drafts:  # cached proposals stay valid while the request's tokens agree
            if valid >= num_tokens or tokens[valid] != draft:
                break
            valid += 1
        valid = min(valid, num_tokens - 1)  # the last token is always fed: its logits give the first proposal
        # positions up to num_tokens + num_proposals - 2 are written (the last proposal is not fed back)
        needed = -(-(num_tokens + num_proposals - 1) // self.block_size) - len(state.blocks)
        if needed > len(self.free_blocks):
            self.remove_requests([request.request_id])
            return None
        for _ in range(needed):
            state.blocks.append(self.free_blocks.pop())
        return _Row(state, tokens[valid:], valid, num_proposals)

    def _forward(self, rows: list[_Row], tokens: list[list[int]], starts: list[int]) -> list[int]:
        """One draft pass: ``tokens[i]`` at positions from ``starts[i]`` for row ``i``; the argmax after each
        row's last token."""
        counts = np.array([len(t) for t in tokens], dtype=np.int64)
        query_start_loc = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(counts, out=query_start_loc[1:])
        starts_array = np.array(starts, dtype=np.int64)
        positions = np.repeat(starts_array - query_start_loc[:-1], counts) + np.arange(int(query_start_loc[-1]))
        seq_lens = starts_array + counts
        max_blocks = int(-(-seq_lens.max() // self.block_size))
        block_tables = np.zeros((len(rows), max_blocks), dtype=np.int64)
        for i, row in enumerate(rows):
            blocks = row.state.blocks[:max_blocks]
            block_tables[i, :len(blocks)] = blocks
        token_rows = np.repeat(np.arange(len(rows)), counts)
        slots = block_tables[token_rows, positions // self.block_size] * self.block_size + positions % self.block_size
        metadata = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(self.device),
            block_tables=torch.from_numpy(block_tables).to(self.device),
            query_start_loc=query_start_loc.tolist(),
            seq_lens=seq_lens.tolist(),
            max_query_len=int(counts.max()),
            block_size=self.block_size,
        )
        self.attn_backend.prepare(metadata)
        input_ids = torch.tensor([token for row_tokens in tokens for token in row_tokens], dtype=torch.int64,
                                 device=self.device)
        hidden = self.model(input_ids, torch.from_numpy(positions).to(self.device), self.kv_caches, metadata)
        logits = self.model.compute_logits(hidden[torch.from_numpy(query_start_loc[1:] - 1).to(self.device)])
        return argmax(logits[:, :self.vocab_size].float()).tolist()

    def remove_requests(self, request_ids) -> None:
        for request_id in request_ids:
            state = self.states.pop(request_id, None)
            if state is not None:
                self.free_blocks.extend(reversed(state.blocks))
