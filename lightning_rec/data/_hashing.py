"""Counter-based random numbers: a value is a pure function of (key, counter).

Rows are generated from their global index alone, so any slice of rows (a rank's batch, a worker's
share) is the same bytes whatever the batch size, world size or number of workers.
"""

from __future__ import annotations

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S11 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(11)


def mix64(x: np.ndarray | np.uint64) -> np.ndarray:
    """splitmix64's finaliser: a bijection of uint64 that scrambles every bit (wraps on purpose)."""
    x = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = x + _GOLDEN  # a new array; the rest works in place (readers hash millions of ids per second)
        z ^= z >> _S30
        z *= _M1
        z ^= z >> _S27
        z *= _M2
        z ^= z >> _S31
    return z


def key_of(*parts: int) -> np.uint64:
    """Fold a few small ints (seed, split, stream) into one 64-bit key."""
    k: np.uint64 | np.ndarray = np.uint64(0x5EED)
    for p in parts:
        k = mix64(np.uint64(k) ^ np.uint64(p & 0xFFFFFFFFFFFFFFFF))[()]
    return np.uint64(k)


def uniform(key: np.uint64, counter: np.ndarray) -> np.ndarray:
    """Float64 uniforms in [0, 1), one per counter."""
    bits = mix64(np.asarray(counter, dtype=np.uint64) ^ key)
    return (bits >> _S11).astype(np.float64) * (1.0 / (1 << 53))


def hash_into(values: np.ndarray, salt: int, size: int) -> np.ndarray:
    """Map arbitrary uint64 ids to ``[0, size)``, differently per ``salt`` (e.g. the feature index)."""
    return (mix64(np.asarray(values, dtype=np.uint64) ^ key_of(salt)) % np.uint64(size)).astype(np.int64)
