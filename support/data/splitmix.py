"""splitmix64 (Steele, Lea and Flood 2014): integers that depend on (seed, stream) only.

The keys of 01_data.py's shuffle and the hash parameters of 01b_cleaning.py's MinHash come
from here. Integer arithmetic mod 2^64 written out (NumPy arrays wrap), not a NumPy
Generator's stream, which may change between versions: a resume after an upgrade would
then repeat or skip windows of the epoch it resumes in, and a rerun of the cleaning would
remove other documents.
"""

import numpy as np

# splitmix64's increment: 2^64 / φ, odd.
GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: each output bit depends on every input bit (uint64)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def splitmix64(seed: int, stream: int, n: int) -> np.ndarray:
    """(n,) uint64: splitmix64's step (add GOLDEN, then `mix`) chained over seed,
    stream and the index i < n, so every version of every library gives these numbers."""
    state = np.full(n, seed % 2**64, np.uint64)
    state = mix(state + GOLDEN) ^ np.uint64(stream % 2**64)
    state = mix(state + GOLDEN) ^ np.arange(n, dtype=np.uint64)
    return mix(state + GOLDEN)
