"""Paged attention over block tables: prompt chunks that attend to a cached prefix, and decode.

A batch is flat: the queries of request ``i`` are rows ``query_start_loc[i]:query_start_loc[i+1]`` of
``query``; the request has ``seq_lens[i]`` tokens in the cache (its cached prefix plus these queries, whose
keys and values were already written), stored in the blocks listed in ``block_tables[i]``. Query ``j`` of a
request sits at position ``seq_len - query_len + j`` and attends causally to every cached token up to it.
"""

import torch
import torch.nn.functional as F

_MAX_DECODE_GROUPS = 4
_MIN_DECODE_GROUP = 16


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: list[int],
    query_start_loc: list[int],
    scale: float,
) -> torch.Tensor:
    """Attention output ``[T, num_heads, head_dim]`` for queries ``[T, num_heads, head_dim]``.

    ``key_cache``/``value_cache`` are ``[num_blocks, block_size, num_kv_heads, head_dim]`` (see
    ``quire.kernels.kv_cache``); ``num_heads`` must be a multiple of ``num_kv_heads`` (grouped-query
    attention). ``seq_lens`` and ``query_start_loc`` are host lists, ``block_tables`` is
    ``[num_requests, max_blocks]`` int tensor.
    """
    output = torch.empty_like(query)
    query_lens = [query_start_loc[i + 1] - query_start_loc[i] for i in range(len(seq_lens))]
    decode_rows = sorted((i for i, n in enumerate(query_lens) if n == 1), key=seq_lens.__getitem__)
    # Decodes run together, padded to the longest context; requests of similar length are grouped
    # so that short ones do not pay for copying the long ones' padding.
    num_groups = min(_MAX_DECODE_GROUPS, max(1, len(decode_rows) // _MIN_DECODE_GROUP))
    for group in _split(decode_rows, num_groups):
        rows = torch.tensor(group, dtype=torch.int64)
        token_rows = torch.tensor([query_start_loc[i] for i in group], dtype=torch.int64)
        output[token_rows] = _decode(
            query[token_rows], key_cache, value_cache, block_tables[rows],
            [seq_lens[i] for i in group], scale,
        )
    for i, query_len in enumerate(query_lens):
        if query_len > 1:
            start, end = query_start_loc[i], query_start_loc[i + 1]
            output[start:end] = _prefill_one(
                query[start:end], key_cache, value_cache, block_tables[i], seq_lens[i], scale
            )
    return output


def _split(items: list[int], num_groups: int) -> list[list[int]]:
    size = -(-len(items) // num_groups) if items else 1
    return [items[start:start + size] for start in range(0, len(items), size)]


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
    # [..., num_blocks_used] block ids -> [..., num_tokens, H, D]. index_select over whole blocks
    # flattened to rows is several times faster on the CPU than advanced indexing.
    rows = cache.view(cache.shape[0], -1).index_select(0, block_ids.reshape(-1))
    flat = rows.view(*block_ids.shape[:-1], -1, *cache.shape[-2:])
    return flat[..., :num_tokens, :, :]


def _prefill_one(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
) -> torch.Tensor:
    block_size = key_cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    keys = _gather(key_cache, block_table[:num_blocks], seq_len)
    values = _gather(value_cache, block_table[:num_blocks], seq_len)
    query_len = query.shape[0]
    context_len = seq_len - query_len
    if context_len == 0:
        mask = None
        is_causal = True
    else:
        query_pos = torch.arange(context_len, seq_len)[:, None]
        mask = torch.arange(seq_len)[None, :] <= query_pos
        is_causal = False
    # NOTE: 4-D inputs (a batch of one): with 3-D ones torch's CPU kernel takes a path ~10x slower.
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
        attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def _decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: list[int],
    scale: float,
) -> torch.Tensor:
    # One query per request: pad every request's context to the longest and mask the tail.
    block_size = key_cache.shape[1]
    max_len = max(seq_lens)
    num_blocks = -(-max_len // block_size)
    keys = _gather(key_cache, block_tables[:, :num_blocks], max_len)  # [B, L, Hk, D]
    values = _gather(value_cache, block_tables[:, :num_blocks], max_len)
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    mask = (torch.arange(max_len)[None, :] < lens[:, None])[:, None, None, :]  # [B, 1, 1, L]
    out = F.scaled_dot_product_attention(
        query[:, :, None, :],  # [B, Hq, 1, D]
        keys.transpose(1, 2), values.transpose(1, 2),
        attn_mask=mask, scale=scale, enable_gqa=True,
    )
    return out[:, :, 0, :]
