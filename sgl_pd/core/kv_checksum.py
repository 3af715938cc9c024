"""Keyed checksums of transferred KV (`--pd-kv-checksum`): what a decoder verifies before
it decodes from pages another server wrote.

The sum of one region (a layer's K, V or latent part) over tokens [start, stop) and model
heads [head_lo, head_hi) reads each token's row of each head as unsigned 32-bit pieces
x[t, h, j] and adds, modulo 2**64,

    sum = sum over t, h, j of  token_weight[t] * head_weight[h, j] * x[t, h, j]

with weights drawn from the key, the request's room and the region (splitmix64). The
coordinates are the model's (absolute token position, model-wide head), never a rank's
page or slot, so a prefill rank and a decode rank sharded differently compute the same
sum over the same bytes; and the sum is additive, so a request's sum is the sum of its
chunks' and of its links'. Pieces of 32 bits in a 64-bit sum: a change whose pieces are
all multiples of 2**v (v < 32: flipping only sign bits, say) still leaves 64 - v >= 33
bits for the weights to catch it, so a byte changed, a token or head landed in the wrong
place, or another request's KV gives a different sum but for a chance of about 2**-33
per region (whole 64-bit words would let two flips of bit 63 cancel for every key).

Keyed with the cluster secret, a party without the secret cannot compute the sum of
bytes it would forge; it does not authenticate the data plane itself (a forged write is
found before decoding, not prevented).

Pure numpy (the reference); `backend.kv_sums` computes the same on the pool's device.
"""

from __future__ import annotations

import hashlib

import numpy as np
import numpy.typing as npt

U64 = npt.NDArray[np.uint64]
MASK = (1 << 64) - 1
WORD_BYTES = 4  # the pieces a row is summed in (see above)
ROW_ALIGN = 8  # a KV row must be whole 64-bit words (every dtype SGLang pools use)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def checksum_key(secret: bytes | None) -> int:
    """The 64-bit key both sides derive from the cluster secret (a fixed key without one:
    then the sums find corruption, not forgery)."""
    digest = hashlib.blake2b(secret or b"", digest_size=8, person=b"sgl_pd kv sum").digest()
    return int.from_bytes(digest, "little")


def splitmix64(x: U64) -> U64:
    """Vigna's splitmix64 finaliser, element-wise (uint64 wraps as the algorithm needs)."""
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _seed(key: int, room: int, region: int, axis: int) -> np.uint64:
    mixed = splitmix64(np.array([key ^ (room * 0x100000001B3 & MASK)], dtype=np.uint64))
    return np.uint64((int(mixed[0]) ^ (region << 8) ^ axis) & MASK)


def token_weights(key: int, room: int, region: int, start: int, stop: int) -> U64:
    """(stop - start,) odd weights of tokens [start, stop)."""
    base = _seed(key, room, region, 1)
    with np.errstate(over="ignore"):
        positions = np.arange(start, stop, dtype=np.uint64) + base
    return splitmix64(positions) | np.uint64(1)


def head_weights(
    key: int, room: int, region: int, head_lo: int, head_hi: int, row_bytes: int
) -> U64:
    """(head_hi - head_lo, row_bytes / 4) odd weights of those heads' pieces."""
    if row_bytes % ROW_ALIGN:
        raise ValueError(f"a row of {row_bytes} bytes is not whole 64-bit words")
    words = row_bytes // WORD_BYTES
    base = _seed(key, room, region, 2)
    index = np.arange(head_lo * words, head_hi * words, dtype=np.uint64)
    with np.errstate(over="ignore"):
        weights = splitmix64(index + base) | np.uint64(1)
    return weights.reshape(head_hi - head_lo, words)


def region_sum(rows: npt.NDArray[np.uint8], tokens: U64, heads: U64) -> int:
    """The sum of `rows` ((tokens, heads, row bytes) uint8) under those weights."""
    pieces = np.ascontiguousarray(rows).view(np.uint32).reshape(len(tokens), *heads.shape)
    words = pieces.astype(np.uint64)
    with np.errstate(over="ignore"):
        per_token = (words * heads).sum(axis=(1, 2), dtype=np.uint64)
        return int((per_token * tokens).sum(dtype=np.uint64))


def add(a: int, b: int) -> int:
    return (a + b) & MASK
