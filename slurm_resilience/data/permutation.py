"""A keyed bijection on [0, n) computed per position: shuffling in O(1) memory.

Each epoch's sample order is a pseudo-random permutation of [0, n) chosen by the
key (seed, epoch). It is never stored: the dataset index at any offset of the epoch
is computed from the offset alone, so memory is O(batch), not O(n), for any n.

How: a balanced Feistel network over the smallest power of four 4**k >= n (two
halves of k bits each; 6 rounds whose round function is the splitmix64 finaliser of
(half, round key)), made a bijection on [0, n) by *cycle walking*: an output >= n is
encrypted again until it lands below n. Every Feistel network is a bijection of its
domain, and cycle walking restricts a bijection of a superset to one of the subset
(the walk starting at x < n follows x's cycle, which returns below n). Since
4**k < 4n, a walk takes fewer than 4 steps on average.

Pure: numpy in, numpy out; vectorised over a batch of offsets. ``reference`` is the
same function written plainly on Python ints, for tests.
"""

from __future__ import annotations

import numpy as np


__all__ = ["ROUNDS", "MAX_N", "half_bits", "round_keys", "permute", "reference"]


ROUNDS = 6
MAX_N = 1 << 62  # 4**31: both halves and every product stay inside uint64
_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB


def half_bits(n: int) -> int:
    """k such that 4**k is the smallest power of four >= n (k >= 1)."""
    k = 1
    while (1 << (2 * k)) < n:
        k += 1
    return k


def _mix_int(z: int) -> int:
    """splitmix64 finaliser on a Python int (the reference of ``_mix``)."""
    z &= _M64
    z = ((z ^ (z >> 30)) * _MUL1) & _M64
    z = ((z ^ (z >> 27)) * _MUL2) & _M64
    return z ^ (z >> 31)


def round_keys(seed: int, epoch: int) -> tuple[int, ...]:
    """The Feistel round keys of (seed, epoch): distinct seeds or epochs give unrelated keys."""
    base = _mix_int(_mix_int(seed & _M64) ^ ((epoch * _GOLDEN) & _M64) ^ (seed >> 64))
    return tuple(_mix_int(base + (i + 1) * _GOLDEN) for i in range(ROUNDS))


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on a uint64 array (wrapping multiplication)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_MUL1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_MUL2)
    return z ^ (z >> np.uint64(31))


def _feistel(x: np.ndarray, k: int, keys: tuple[int, ...]) -> np.ndarray:
    shift, mask = np.uint64(k), np.uint64((1 << k) - 1)
    left, right = x >> shift, x & mask
    for key in keys:
        left, right = right, left ^ (_mix(right ^ np.uint64(key)) & mask)
    return (left << shift) | right


def permute(offsets, n: int, seed: int, epoch: int) -> np.ndarray:
    """Images of ``offsets`` (ints in [0, n)) under the (seed, epoch) permutation of [0, n).

    Returns an int64 array of the same shape. Memory and time are O(len(offsets)),
    independent of n. Raises ValueError for n outside [1, 2**62] or an offset outside
    [0, n).
    """
    if not 1 <= n <= MAX_N:
        raise ValueError(f"n={n} must be in [1, 2**62]")
    x = np.asarray(offsets, dtype=np.int64)
    if x.size and (x.min() < 0 or x.max() >= n):
        raise ValueError(f"offsets must be in [0, {n})")
    if n == 1:
        return np.zeros_like(x)
    k, keys = half_bits(n), round_keys(seed, epoch)
    out = _feistel(x.astype(np.uint64), k, keys)
    walking = out >= np.uint64(n)
    while walking.any():  # cycle walking: re-encrypt what fell outside [0, n)
        out[walking] = _feistel(out[walking], k, keys)
        walking = out >= np.uint64(n)
    return out.astype(np.int64)


def reference(offset: int, n: int, seed: int, epoch: int) -> int:
    """``permute`` for one offset, on plain Python ints (for tests and readers)."""
    if n == 1:
        return 0
    k, keys = half_bits(n), round_keys(seed, epoch)
    mask = (1 << k) - 1

    def encrypt(x: int) -> int:
        left, right = x >> k, x & mask
        for key in keys:
            left, right = right, left ^ (_mix_int(right ^ key) & mask)
        return (left << k) | right

    y = encrypt(offset)
    while y >= n:
        y = encrypt(y)
    return y
