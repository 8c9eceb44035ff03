"""Pooling a flat batch of prompts' hidden states into one vector per prompt, and the vectors' Matryoshka
truncation and L2 normalisation (embedding models).

The batch is laid out as the attention kernels take it: prompt ``i`` owns rows
``query_start_loc[i] : query_start_loc[i + 1]`` of ``hidden`` ``[num_tokens, hidden_size]``. NOTE: PyTorch ops
on every device (gathers and one segment sum), so there is no ``*_reference`` twin; the tests check them
against per-prompt loops.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def pool(hidden: torch.Tensor, query_start_loc: torch.Tensor | Sequence[int], pooling_type: str) -> torch.Tensor:
    """``[num_prompts, hidden_size]`` in ``hidden``'s dtype: each prompt's first token ("cls"), the mean of its
    tokens ("mean") or its last token ("last")."""
    starts = torch.as_tensor(query_start_loc, device=hidden.device, dtype=torch.long)
    if pooling_type == "cls":
        return cls_pool(hidden, starts)
    if pooling_type == "mean":
        return mean_pool(hidden, starts)
    if pooling_type == "last":
        return last_pool(hidden, starts)
    raise ValueError(f"pooling_type must be cls, mean or last; got {pooling_type!r}")


def cls_pool(hidden: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
    """Each prompt's first token (BERT's ``[CLS]``)."""
    return hidden[query_start_loc[:-1]]


def last_pool(hidden: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
    """Each prompt's last token (decoder embedding models: the only token that has seen the whole prompt)."""
    return hidden[query_start_loc[1:] - 1]


def mean_pool(hidden: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
    """The mean over each prompt's tokens, summed in float32 (as sentence-transformers accumulates bfloat16 and
    float16) and rounded to ``hidden``'s dtype at the end."""
    lengths = query_start_loc[1:] - query_start_loc[:-1]
    num_prompts = lengths.shape[0]
    # output_size: the token count is known, so CUDA need not synchronise to size the result
    prompt_of_token = torch.repeat_interleave(torch.arange(num_prompts, device=hidden.device), lengths,
                                              output_size=hidden.shape[0])
    sums = torch.zeros(num_prompts, hidden.shape[1], device=hidden.device, dtype=torch.float32)
    sums.index_add_(0, prompt_of_token, hidden.float())
    return (sums / lengths.clamp(min=1).unsqueeze(1)).to(hidden.dtype)


def truncate_and_normalize(embeddings: torch.Tensor, dimensions: int | None = None,
                           normalize: bool = True) -> torch.Tensor:
    """``embeddings`` ``[num_prompts, hidden_size]`` as float32, cut to their first ``dimensions`` values
    (Matryoshka; None: all) and then, if ``normalize``, scaled to unit L2 norm (``F.normalize``, eps 1e-12).

    NOTE: truncation comes first, so a truncated vector is a unit vector again: sentence-transformers'
    ``encode(truncate_dim=d, normalize_embeddings=True)``, and the OpenAI API's ``dimensions``.
    """
    if dimensions is not None:
        if not 1 <= dimensions <= embeddings.shape[-1]:
            raise ValueError(f"dimensions must be between 1 and {embeddings.shape[-1]}, got {dimensions}")
        embeddings = embeddings[..., :dimensions]
    embeddings = embeddings.float()
    return F.normalize(embeddings, p=2, dim=-1, eps=1e-12) if normalize else embeddings
