"""The layout a ZeRO shard was saved under: its shards fit no other (07_zero.py)."""


def check_layout(saved: dict | None, here: dict) -> None:
    """Raise a ValueError naming every key whose saved value differs from here's."""
    saved = saved or {}
    diff = [k for k, v in here.items() if saved.get(k) != v]
    if diff:
        pairs = [f"{k} {saved.get(k)!s:.24}, here {here[k]!s:.24}" for k in diff]
        raise ValueError(f"this ZeroOptimizer shard was saved with {'; '.join(pairs)}")
