"""Prefix-cache hashes of full KV blocks, chained from the first block (deterministic across processes).

For block ``i`` holding token ids ``t_1 .. t_B`` (``B = block_size``)::

    H_i = sha256( H_{i-1}  ||  le_u32(t_1) || ... || le_u32(t_B)  ||  S_i )

where ``H_{-1} = sha256(b"quire-prefix-cache")``, ``le_u32`` is the 4-byte little-endian encoding and
``S_0 = b"salt:" + utf8(cache_salt)`` when the request has a ``cache_salt`` (empty otherwise, and always
empty for later blocks), then ``b"lora:" + utf8(lora_name + NUL + lora_path)`` when it runs with a LoRA
adapter (the same tokens under two adapters have other keys and values). Then, for each image whose
placeholder tokens the block holds (some of them),
``b"mm:" + utf8(identifier)`` in prompt order: equal placeholder ids stand for different images. A block's
hash therefore identifies the whole prefix up to its end.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from quire.core.lora.request import LoRARequest
from quire.core.wire import MultiModalFeature

ROOT_HASH = hashlib.sha256(b"quire-prefix-cache").digest()


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int], salt: str | None = None,
               mm_identifiers: Sequence[str] = (), lora_request: LoRARequest | None = None) -> bytes:
    payload = (parent_hash or ROOT_HASH) + struct.pack(f"<{len(token_ids)}I", *token_ids)
    if salt is not None:
        payload += b"salt:" + salt.encode("utf-8")
    if lora_request is not None:
        payload += b"lora:" + f"{lora_request.lora_name}\0{lora_request.lora_path}".encode()
    for identifier in mm_identifiers:
        payload += b"mm:" + identifier.encode("utf-8")
    return hashlib.sha256(payload).digest()


def extend_block_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int,
                        salt: str | None = None, mm_features: Sequence[MultiModalFeature] = (),
                        lora_request: LoRARequest | None = None) -> list[bytes]:
    """Append the hashes of the full blocks of ``token_ids`` not yet in ``hashes``; return ``hashes``."""
    for index in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else None
        start, end = index * block_size, (index + 1) * block_size
        images = [f.identifier for f in mm_features if f.offset < end and f.offset + f.length > start]
        first = index == 0
        hashes.append(hash_block(parent, token_ids[start:end], salt if first else None, images,
                                 lora_request if first else None))
    return hashes
