"""``PoolingParams``: what a pooling (embedding) request asks for, beside the engine's pooling config.

A pooling request runs its prompt once (no decode, no sampling) and returns one vector. This module imports
no torch.
"""

from __future__ import annotations

import math

import msgspec

from quire.core.errors import ValidationError


class PoolingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One embedding request's options. Invalid values raise ``ValidationError`` naming the field.

    - ``dimensions``: keep the vector's first ``dimensions`` values (Matryoshka), before normalising; None:
      all of them.
    - ``normalize``: scale the vector to unit L2 norm; None: as the model folder says (sentence-transformers'
      ``Normalize`` module), or the ``pooler_config`` option.
    - ``truncate_prompt_tokens``: None refuses a prompt longer than the model's limit; ``k`` keeps the first
      ``k`` tokens (a text prompt is tokenized with truncation, so its closing special tokens stay, as
      sentence-transformers does); -1 keeps as many as the model allows.

    ``token_type_start`` is set by the front end for a cross-encoder's text pair: the prompt's tokens from this
    index on (the second text) have token type 1.
    """

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    token_type_start: int | None = None

    def __post_init__(self) -> None:
        for name in ("dimensions", "truncate_prompt_tokens", "token_type_start"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValidationError(f"{name} must be an integer, got {value!r}", param=name)
        if self.dimensions is not None and self.dimensions < 1:
            raise ValidationError(f"dimensions must be at least 1, got {self.dimensions}", param="dimensions")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1 \
                and self.truncate_prompt_tokens != -1:
            raise ValidationError(f"truncate_prompt_tokens must be -1 or at least 1, got "
                                  f"{self.truncate_prompt_tokens}", param="truncate_prompt_tokens")
        if self.token_type_start is not None and self.token_type_start < 1:
            raise ValidationError(f"token_type_start must be at least 1, got {self.token_type_start}",
                                  param="token_type_start")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValidationError(f"normalize must be a boolean, got {self.normalize!r}", param="normalize")


def score_pairs(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[str, str]]:
    """vLLM's pairing of ``/score`` and ``LLM.score``: one text against one, one against N (``text_1``
    repeated), or N against N; ``ValidationError`` naming ``text_1`` or ``text_2`` otherwise."""
    sides = []
    for name, texts in (("text_1", text_1), ("text_2", text_2)):
        texts = [texts] if isinstance(texts, str) else texts
        if not isinstance(texts, (list, tuple)) or not texts or not all(isinstance(t, str) and t for t in texts):
            raise ValidationError(f"{name} must be a non-empty string or a non-empty list of them", param=name)
        sides.append(list(texts))
    firsts, seconds = sides
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    elif len(firsts) != len(seconds):
        raise ValidationError(f"text_2 must hold one text or as many as text_1 ({len(firsts)}), got "
                              f"{len(seconds)}", param="text_2")
    return list(zip(firsts, seconds))


def cosine_similarity(a: list[float], b: list[float]) -> float:
    """The cosine of the angle between two vectors (0.0 when either is all zeros); ``ValueError`` when their
    lengths differ."""
    if len(a) != len(b):
        raise ValueError(f"vectors of {len(a)} and {len(b)} values have no cosine similarity")
    dot = math.fsum(x * y for x, y in zip(a, b))
    norms = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    return dot / norms if norms else 0.0
