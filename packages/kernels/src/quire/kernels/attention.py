"""Paged attention over block tables: prompt chunks that attend to a cached prefix, and decode.

A batch is flat: the queries of request ``i`` are rows ``query_start_loc[i]:query_start_loc[i+1]`` of
``query``; the request has ``seq_lens[i]`` tokens in the cache (its cached prefix plus these queries, whose
keys and values were already written), stored in the blocks listed in ``block_tables[i]``. Query ``j`` of a
request sits at position ``seq_len - query_len + j`` and attends causally to every cached token up to it, or,
in a layer with a sliding window ``W``, to the last ``W`` of them (positions ``p - W + 1 .. p`` for a query at
``p``, as transformers' ``sliding_window_causal_mask_function``). A windowed plan reads only the blocks that
hold keys inside some query's window: the blocks before them may have been freed and handed to other requests.

The work is split in two: ``plan_paged_attention`` decides, once per step, how to run the batch (which
requests decode together, their masks, which blocks each reads), and ``run_paged_attention`` runs that plan
for one layer (a model with windowed layers plans once per distinct window). ``paged_attention`` does both and
is the reference the other kernels are checked against.

A whole prompt with no cached prefix (and no window to apply) attends only to its own keys: given this step's
``key``/``value`` rows, and a kernel module with ``prefill_attention`` (the C++ one: AMX tiles; on other
AVX-512 CPUs a kernel in the order of PyTorch's own, taken where it gives PyTorch's bits; AVX2 FMA on CPUs
without AVX-512 BF16), it runs there on those rows instead of gathering them back from the cache for
``scaled_dot_product_attention``. Where no such kernel takes them (float32, a head size none takes), the whole
prompts of each length run as one batch through ``scaled_dot_product_attention`` on the same rows, with the
bits each gets alone.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

_MAX_DECODE_GROUPS = 4
_MIN_DECODE_GROUP = 16
# With a decode kernel, a request with at most this many queries after a cached prefix (a speculative
# verification step, a short chunk) runs as that many one-query decodes, query j seeing the first
# ``seq_len - query_len + j + 1`` tokens: the same causal attention, and a step of such requests stays on the
# C++ decoder stack. A whole prompt, however short, keeps the prefill path.
MAX_SPLIT_QUERY_LEN = 16


@dataclasses.dataclass
class DecodeGroup:
    """Requests with one query each, run together, their contexts padded to the longest."""

    token_rows: torch.Tensor  # [B] rows of the query/output tensors
    block_ids: torch.Tensor  # [B * num_blocks] the blocks each request reads, row by row
    num_blocks: int
    max_len: int
    mask: torch.Tensor  # [B, 1, 1, max_len] True where a request has a token


@dataclasses.dataclass
class FusedDecode:
    """Every one-query decode (a request's single query, or each query of a short one), for a kernel that
    reads the paged cache in place (no padding, no copy)."""

    token_rows: torch.Tensor | None  # [B] rows of the query/output tensors; None: all rows, in order
    block_tables: torch.Tensor  # [B, max_blocks] int64: the block table of each query's request
    seq_lens: torch.Tensor  # [B] int64: the tokens each query sees


@dataclasses.dataclass
class PrefillItem:
    """One request with several queries (a prompt or a chunk of one)."""

    start: int
    end: int
    block_ids: torch.Tensor  # [num_blocks]
    seq_len: int
    # [query_len, seq_len - key_offset]; None when there is no cached prefix and no window (plain causal)
    mask: torch.Tensor | None
    key_offset: int = 0  # position of the first key read: the start of the first block inside the window

    @property
    def whole_prompt(self) -> bool:
        """A prompt with no cached prefix and no window to apply: it attends only to its own keys."""
        return self.mask is None and self.seq_len == self.end - self.start


@dataclasses.dataclass
class PromptBatch:
    """Whole prompts of one length (no cached prefix, no window), run as one batch of that length."""

    rows: torch.Tensor  # [count * length] int64: their rows of the step, prompt by prompt
    count: int
    length: int


@dataclasses.dataclass
class AttentionPlan:
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillItem]
    num_tokens: int
    fused_decode: FusedDecode | None = None
    decode_kernel: object = None  # the module whose paged_decode runs fused_decode
    prefill_kernel: object = None  # the module whose prefill_attention runs whole prompts without a prefix
    whole_prompts: torch.Tensor | None = None  # [n, 2] (start, end) rows of those prompts, with prefill_kernel
    # the same prompts by length, for scaled_dot_product_attention where prefill_kernel does not take them
    prompt_batches: list[PromptBatch] = dataclasses.field(default_factory=list)
    # The plans of this step's windowed layers, by window, built by the backend on first use.
    windowed_plans: dict[int, AttentionPlan] = dataclasses.field(default_factory=dict)


def plan_paged_attention(block_tables: torch.Tensor, seq_lens: list[int], query_start_loc: list[int],
                         block_size: int, decode_kernel=None, sliding_window: int | None = None) -> AttentionPlan:
    """How to run one step's batch; the same plan serves every layer (with the same ``sliding_window``).

    With a ``decode_kernel`` (``quire.kernels.cpu_extension``), one-query requests, and each query of
    requests with up to ``MAX_SPLIT_QUERY_LEN`` after a cached prefix, go to its ``paged_decode``; otherwise
    one-query requests are gathered and run through ``scaled_dot_product_attention``. With a ``sliding_window``
    the decode kernel is not used (it reads whole contexts): decodes are gathered, each reading only its
    window's blocks.
    """
    if sliding_window is not None:
        decode_kernel = None
    prefill_kernel = decode_kernel if hasattr(decode_kernel, "prefill_attention") else None
    query_lens = [query_start_loc[i + 1] - query_start_loc[i] for i in range(len(seq_lens))]
    split = decode_kernel is not None
    is_decode = [n == 1 or (split and n <= MAX_SPLIT_QUERY_LEN and seq_lens[i] > n)
                 for i, n in enumerate(query_lens)]
    prefills = [_prefill_item(i, block_tables, seq_lens, query_start_loc, block_size, sliding_window)
                for i, decode in enumerate(is_decode) if not decode]
    decode_rows = [i for i, decode in enumerate(is_decode) if decode]
    if decode_kernel is not None and decode_rows:
        fused = _fused_decode(decode_rows, block_tables, seq_lens, query_start_loc, not prefills)
        return AttentionPlan([], prefills, query_start_loc[-1], fused, decode_kernel, prefill_kernel,
                             _whole_prompts(prefills, prefill_kernel), _prompt_batches(prefills))
    # Decodes run together, padded to the longest context; requests of similar length are grouped so
    # that short ones do not pay for copying the long ones' padding.
    num_groups = min(_MAX_DECODE_GROUPS, max(1, len(decode_rows) // _MIN_DECODE_GROUP))
    if num_groups > 1:
        decode_rows.sort(key=seq_lens.__getitem__)
    groups = [_decode_group(group, block_tables, seq_lens, query_start_loc, block_size, sliding_window)
              for group in _split(decode_rows, num_groups)]
    return AttentionPlan(groups, prefills, query_start_loc[-1], prefill_kernel=prefill_kernel,
                         whole_prompts=_whole_prompts(prefills, prefill_kernel),
                         prompt_batches=_prompt_batches(prefills))


def _whole_prompts(prefills: list[PrefillItem], prefill_kernel) -> torch.Tensor | None:
    rows = [(item.start, item.end) for item in prefills if item.whole_prompt]
    return torch.tensor(rows, dtype=torch.int64) if rows and prefill_kernel is not None else None


def _prompt_batches(prefills: list[PrefillItem]) -> list[PromptBatch]:
    by_length: dict[int, list[PrefillItem]] = {}
    for item in prefills:
        if item.whole_prompt:
            by_length.setdefault(item.end - item.start, []).append(item)
    return [PromptBatch(torch.cat([torch.arange(item.start, item.end) for item in items]), len(items), length)
            for length, items in by_length.items()]


def run_paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        plan: AttentionPlan, scale: float, key: torch.Tensor | None = None,
                        value: torch.Tensor | None = None) -> torch.Tensor:
    """Attention output ``[T, num_heads, head_dim]`` for queries ``[T, num_heads, head_dim]`` under a plan.

    ``key_cache``/``value_cache`` are ``[num_blocks, block_size, num_kv_heads, head_dim]`` (see
    ``quire.kernels.kv_cache``); ``num_heads`` must be a multiple of ``num_kv_heads``. ``key``/``value``
    (``[T, num_kv_heads, head_dim]``): the step's own rows, already in the cache, which whole prompts without a
    prefix then read directly (see the module docstring).
    """
    fused = plan.fused_decode
    if fused is not None and fused.token_rows is None:  # a pure decode step: no gather, no scatter
        return plan.decode_kernel.paged_decode(query, key_cache, value_cache, fused.block_tables,
                                               fused.seq_lens, scale)
    if len(plan.decode_groups) == 1 and not plan.prefills:
        # a pure decode step in one group: the rows are in token order, no scatter needed
        return _decode(query, key_cache, value_cache, plan.decode_groups[0], scale)
    output = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # contiguous, whatever query is
    if fused is not None:
        output[fused.token_rows] = plan.decode_kernel.paged_decode(
            query[fused.token_rows], key_cache, value_cache, fused.block_tables, fused.seq_lens, scale)
    for group in plan.decode_groups:
        output[group.token_rows] = _decode(query[group.token_rows], key_cache, value_cache, group, scale)
    prefills = plan.prefills
    kernel = plan.prefill_kernel
    if (plan.whole_prompts is not None and key is not None and query.dtype == torch.bfloat16
            and kernel.prefill_attention_available(query.shape[-1])):
        kernel.prefill_attention(query, key, value, scale, plan.whole_prompts, output)  # one call for all
        prefills = [item for item in prefills if not item.whole_prompt]
    elif plan.prompt_batches and key is not None:
        for batch in plan.prompt_batches:
            output[batch.rows] = _prompt_batch(query, key, value, batch, scale)
        prefills = [item for item in prefills if not item.whole_prompt]
    for item in prefills:
        output[item.start:item.end] = _prefill(query[item.start:item.end], key_cache, value_cache, item, scale)
    return output


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: list[int], query_start_loc: list[int],
                    scale: float, decode_kernel=None, sliding_window: int | None = None) -> torch.Tensor:
    """Plan and run in one call (``block_tables`` is ``[num_requests, max_blocks]``, host lists for the rest)."""
    plan = plan_paged_attention(block_tables, seq_lens, query_start_loc, key_cache.shape[1], decode_kernel,
                                sliding_window)
    return run_paged_attention(query, key_cache, value_cache, plan, scale)


def _split(items: list[int], num_groups: int) -> list[list[int]]:
    size = -(-len(items) // num_groups) if items else 1
    return [items[start:start + size] for start in range(0, len(items), size)]


def _fused_decode(rows, block_tables, seq_lens, query_start_loc, all_rows: bool) -> FusedDecode:
    """One decode per query of ``rows`` (``all_rows``: every request of the step, so every query row)."""
    query_lens = [query_start_loc[i + 1] - query_start_loc[i] for i in rows]
    if all(n == 1 for n in query_lens):  # one query each: query row i of the step is request rows[i]
        token_rows = [query_start_loc[i] for i in rows]
        lens = [seq_lens[i] for i in rows]
        tables = block_tables if all_rows else block_tables[torch.tensor(rows, dtype=torch.int64)]
    else:
        token_rows, lens = [], []
        for i, n in zip(rows, query_lens):
            token_rows.extend(range(query_start_loc[i], query_start_loc[i] + n))
            lens.extend(range(seq_lens[i] - n + 1, seq_lens[i] + 1))
        tables = block_tables[torch.tensor(rows, dtype=torch.int64).repeat_interleave(torch.tensor(query_lens))]
    return FusedDecode(
        token_rows=None if all_rows else torch.tensor(token_rows, dtype=torch.int64),
        block_tables=tables.to(torch.int64).contiguous(),
        seq_lens=torch.tensor(lens, dtype=torch.int64),
    )


def _decode_group(rows, block_tables, seq_lens, query_start_loc, block_size, window=None) -> DecodeGroup:
    lens = [seq_lens[i] for i in rows]
    max_len = max(lens)
    token_rows = torch.tensor([query_start_loc[i] for i in rows], dtype=torch.int64)
    row_index = torch.tensor(rows, dtype=torch.int64)
    if window is not None and max_len > window:
        return _windowed_decode_group(token_rows, block_tables[row_index], torch.tensor(lens), block_size, window)
    num_blocks = -(-max_len // block_size)
    block_ids = block_tables[row_index, :num_blocks].reshape(-1).to(torch.int64)
    mask = torch.arange(max_len)[None, :] < torch.tensor(lens)[:, None]
    return DecodeGroup(token_rows, block_ids, num_blocks, max_len, mask[:, None, None, :])


def _windowed_decode_group(token_rows, block_tables, lens, block_size, window) -> DecodeGroup:
    """Each request reads from the block holding its window's first key (``seq_len - window``) on; the rows
    are padded to the widest span with the null block, masked out."""
    first_blocks = (lens - window).clamp(min=0) // block_size
    num_blocks = int(((lens + block_size - 1) // block_size - first_blocks).max())
    tables = torch.cat([block_tables.to(torch.int64),
                        torch.zeros(len(lens), num_blocks, dtype=torch.int64)], dim=1)
    block_ids = tables.gather(1, first_blocks[:, None] + torch.arange(num_blocks)).reshape(-1)
    max_len = num_blocks * block_size
    positions = first_blocks[:, None] * block_size + torch.arange(max_len)
    mask = (positions >= (lens - window)[:, None]) & (positions < lens[:, None])
    return DecodeGroup(token_rows, block_ids, num_blocks, max_len, mask[:, None, None, :])


def _prefill_item(i, block_tables, seq_lens, query_start_loc, block_size, window=None) -> PrefillItem:
    start, end, seq_len = query_start_loc[i], query_start_loc[i + 1], seq_lens[i]
    context_len = seq_len - (end - start)
    if window is not None and seq_len > window:  # the last query's window starts after position 0
        first_block = max(0, context_len - window + 1) // block_size
        key_offset = first_block * block_size
        key_positions = torch.arange(key_offset, seq_len)[None, :]
        query_positions = torch.arange(context_len, seq_len)[:, None]
        mask = (key_positions <= query_positions) & (key_positions > query_positions - window)
        num_blocks = -(-seq_len // block_size)
        return PrefillItem(start, end, block_tables[i, first_block:num_blocks].to(torch.int64), seq_len, mask,
                           key_offset)
    mask = None
    if context_len:
        mask = torch.arange(seq_len)[None, :] <= torch.arange(context_len, seq_len)[:, None]
    num_blocks = -(-seq_len // block_size)
    return PrefillItem(start, end, block_tables[i, :num_blocks].to(torch.int64), seq_len, mask)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, num_rows: int, num_tokens: int) -> torch.Tensor:
    # Whole blocks, flattened to rows: index_select is several times faster on the CPU than advanced
    # indexing. Result: [num_rows, num_tokens, H, D].
    blocks = cache.view(cache.shape[0], -1).index_select(0, block_ids)
    return blocks.view(num_rows, -1, *cache.shape[-2:])[:, :num_tokens]


def _decode(query, key_cache, value_cache, group: DecodeGroup, scale: float) -> torch.Tensor:
    batch = group.token_rows.shape[0]
    keys = _gather(key_cache, group.block_ids, batch, group.max_len)  # [B, L, Hk, D]
    values = _gather(value_cache, group.block_ids, batch, group.max_len)
    out = F.scaled_dot_product_attention(
        query[:, :, None, :], keys.transpose(1, 2), values.transpose(1, 2),  # [B, H, 1 or L, D]
        attn_mask=group.mask, scale=scale, enable_gqa=True,
    )
    return out[:, :, 0, :]


def _prompt_batch(query, key, value, batch: PromptBatch, scale: float) -> torch.Tensor:
    """Causal attention of whole prompts of one length over the step's own key/value rows (no gather from the
    cache), in one call: each prompt's output has the bits it has alone (torch's CPU kernel splits the work by
    prompt, head and block of queries), at a fraction of the calls."""
    def batched(x):  # [count * length, heads, D] rows -> [count, heads, length, D]
        return x.index_select(0, batch.rows).view(batch.count, batch.length, *x.shape[1:]).transpose(1, 2)

    out = F.scaled_dot_product_attention(batched(query), batched(key), batched(value), is_causal=True, scale=scale,
                                         enable_gqa=True)
    return out.transpose(1, 2).reshape(-1, *query.shape[1:])


def _prefill(query, key_cache, value_cache, item: PrefillItem, scale: float) -> torch.Tensor:
    num_keys = item.seq_len - item.key_offset
    keys = _gather(key_cache, item.block_ids, 1, num_keys)
    values = _gather(value_cache, item.block_ids, 1, num_keys)
    # NOTE: 4-D inputs (a batch of one): with 3-D ones torch's CPU kernel takes a path ~10x slower.
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1)[None], keys.transpose(1, 2), values.transpose(1, 2),
        attn_mask=item.mask, is_causal=item.mask is None, scale=scale, enable_gqa=True,
    )
    return out[0].transpose(0, 1)
