"""A shuffle of range(n) computed, never stored: position -> item in O(1) memory.

01_data.py's loader reads window `order[k]` at position k of an epoch. A stored
`np.random.permutation(n)` holds all n windows (8 bytes each: 2.5 GB for 10B tokens at
T = 32, 20 GB at the demo's T = 8), so memory would grow with the corpus. Instead, a
balanced Feistel network (Luby and Rackoff 1988) over 2h bits, 4^h >= n, is a bijection
of range(4^h) whatever its round function:

    x = (L, R), h bits each; a round: (L, R) -> (R, L xor F_k(R)), undone by its mirror

and cycle-walking (apply it again while the value is >= n: the cycle through an x < n
comes back below n) restricts it to a bijection of range(n). Keys from (seed, epoch): a
new order each epoch. 4^h < 4n, so fewer than 4 applications are expected a position.
The keys are splitmix64 of (seed, epoch, round), integer arithmetic mod 2^64 written out
here: a NumPy Generator's stream may change between versions, and a resume after an
upgrade would then repeat or skip windows of the epoch it resumes in.
"""

import numpy as np

# Four rounds already make a pseudo-random permutation (Luby-Rackoff); six mix more.
ROUNDS = 6
# splitmix64's increment: 2^64 / φ, odd (Steele, Lea and Flood 2014).
GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: each output bit depends on every input bit (uint64)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def splitmix64(seed: int, stream: int, n: int) -> np.ndarray:
    """(n,) uint64 that depend on (seed, stream) only: splitmix64's step (add GOLDEN,
    then `_mix`) chained over seed, stream and the index i < n. Integer arithmetic mod
    2^64 (NumPy arrays wrap), so every version of every library gives these numbers."""
    state = np.full(n, seed % 2**64, np.uint64)
    state = _mix(state + GOLDEN) ^ np.uint64(stream % 2**64)
    state = _mix(state + GOLDEN) ^ np.arange(n, dtype=np.uint64)
    return _mix(state + GOLDEN)


def _feistel(x: np.ndarray, keys: np.ndarray, half_bits: int) -> np.ndarray:
    """One pass of the network over uint64 values below 4^half_bits."""
    mask = np.uint64((1 << half_bits) - 1)
    left = x >> np.uint64(half_bits)
    right = x & mask
    for key in keys:
        new_right = left ^ (_mix(right ^ key) & mask)
        left = right
        right = new_right
    return (left << np.uint64(half_bits)) | right


def shuffled(positions, n: int, seed: int, epoch: int) -> np.ndarray:
    """The items at `positions` (each in range(n)) of the order (seed, epoch) picks.

    Over positions 0..n-1 it returns every item of range(n) once: a permutation.
    """
    positions = np.asarray(positions, dtype=np.uint64)
    assert n >= 1 and (positions < n).all(), f"positions outside range({n})"
    half_bits = max(1, (int(n - 1).bit_length() + 1) // 2)  # 4^h >= n
    keys = splitmix64(seed, epoch, ROUNDS)  # The same keys everywhere, any version.
    out = _feistel(positions, keys, half_bits)
    outside = out >= n
    while outside.any():  # Cycle-walking: along each cycle until back in range.
        out[outside] = _feistel(out[outside], keys, half_bits)
        outside = out >= n
    return out.astype(np.int64)
