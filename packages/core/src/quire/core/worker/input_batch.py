"""The persistent batch: one row of numpy state per request, changed only when requests join or leave.

Rows are kept dense (``0 .. num_reqs - 1``): removing a request moves the last row into its place.
Several requests leave in one canonical order (highest row first), so that every tensor-parallel rank, given
the same set of finished requests, ends with the same rows whatever order its set iterates in.
"""

from __future__ import annotations

import numpy as np

from quire.core.sched.output import NewRequestData


class InputBatch:
    """Token ids, block table and sampling parameters of every request the runner holds."""

    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int):
        self.req_ids: list[str] = []
        self.index: dict[str, int] = {}
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)
        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int32)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.min_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.presence_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.frequency_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.repetition_penalty = np.ones(max_num_reqs, dtype=np.float32)
        self.lora_ids = np.zeros(max_num_reqs, dtype=np.int64)  # the LoRA adapter's id (0: the base model)
        # Python objects per row (not numeric); None or empty where unused.
        self.seeds: list[int | None] = [None] * max_num_reqs
        self.min_tokens_blocked_ids: list[list[int]] = [[] for _ in range(max_num_reqs)]
        self.bad_words_token_ids: list[list[list[int]]] = [[] for _ in range(max_num_reqs)]
        self.allowed_token_ids: list[list[int] | None] = [None] * max_num_reqs
        self.logit_bias: list[tuple[list[int], list[float]] | None] = [None] * max_num_reqs
        self.num_logprobs: list[int | None] = [None] * max_num_reqs
        self.num_prompt_logprobs: list[int | None] = [None] * max_num_reqs
        self._row_arrays = [self.token_ids, self.num_tokens, self.num_prompt_tokens,
                            self.num_computed_tokens, self.block_table, self.num_blocks,
                            self.temperature, self.top_k, self.top_p, self.min_p, self.min_tokens,
                            self.presence_penalty, self.frequency_penalty, self.repetition_penalty,
                            self.lora_ids]
        self._row_lists = [self.seeds, self.min_tokens_blocked_ids, self.bad_words_token_ids,
                           self.allowed_token_ids, self.logit_bias, self.num_logprobs,
                           self.num_prompt_logprobs]

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def add(self, data: NewRequestData) -> None:
        row = len(self.req_ids)
        self.req_ids.append(data.request_id)
        self.index[data.request_id] = row
        num_tokens = len(data.token_ids)
        self.token_ids[row, :num_tokens] = data.token_ids
        self.num_tokens[row] = num_tokens
        self.num_prompt_tokens[row] = data.num_prompt_tokens
        self.num_computed_tokens[row] = data.num_computed_tokens
        self.num_blocks[row] = 0
        self.append_blocks(row, data.block_ids)
        params = data.sampling_params
        self.temperature[row] = params.temperature
        self.top_k[row] = params.top_k if params.top_k > 0 else 0
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        self.min_tokens[row] = params.min_tokens
        self.presence_penalty[row] = params.presence_penalty
        self.frequency_penalty[row] = params.frequency_penalty
        self.repetition_penalty[row] = params.repetition_penalty
        self.seeds[row] = params.seed
        self.lora_ids[row] = data.lora_request.lora_int_id if data.lora_request is not None else 0
        blocked = set(params.stop_token_ids)
        if not params.ignore_eos:
            blocked.update(data.eos_token_ids)
        self.min_tokens_blocked_ids[row] = sorted(blocked)
        self.bad_words_token_ids[row] = data.bad_words_token_ids
        self.allowed_token_ids[row] = params.allowed_token_ids
        self.logit_bias[row] = (None if not params.logit_bias else
                                (list(params.logit_bias), list(params.logit_bias.values())))
        self.num_logprobs[row] = params.logprobs
        self.num_prompt_logprobs[row] = params.prompt_logprobs

    def remove_many(self, request_ids) -> None:
        """Remove several requests (unknown ids are ignored); the rows left do not depend on the order of
        ``request_ids``: a set of strings iterates in a different order in each process."""
        rows = sorted((self.index[request_id] for request_id in request_ids if request_id in self.index),
                      reverse=True)
        for row in rows:  # highest first: the row moved into a freed place is never one still to remove
            self.remove(self.req_ids[row])

    def remove(self, request_id: str) -> None:
        row = self.index.pop(request_id, None)
        if row is None:
            return
        last = len(self.req_ids) - 1
        moved_id = self.req_ids.pop()
        if row != last:
            self.req_ids[row] = moved_id
            self.index[moved_id] = row
            for array in self._row_arrays:
                array[row] = array[last]
            for values in self._row_lists:
                values[row] = values[last]

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        start = self.num_blocks[row]
        self.block_table[row, start:start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def append_tokens(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        self.token_ids[rows, self.num_tokens[rows]] = token_ids
        self.num_tokens[rows] += 1
