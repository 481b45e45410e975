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
"""

import numpy as np

# Four rounds already make a pseudo-random permutation (Luby-Rackoff); six mix more.
ROUNDS = 6


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: each output bit depends on every input bit (uint64)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


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
    rng = np.random.default_rng([seed, epoch])  # The same keys on every machine.
    keys = rng.integers(0, 2**63, ROUNDS, dtype=np.uint64)
    out = _feistel(positions, keys, half_bits)
    outside = out >= n
    while outside.any():  # Cycle-walking: along each cycle until back in range.
        out[outside] = _feistel(out[outside], keys, half_bits)
        outside = out >= n
    return out.astype(np.int64)
