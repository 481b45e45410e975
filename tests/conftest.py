"""Shared pytest setup. The repo root is on sys.path through pyproject.toml (`pythonpath = ["."]`),
so tests import the numbered files with `importlib.import_module("01_data")`."""

import importlib
import os
from pathlib import Path

import pytest

# One torch thread in this process and in every process it starts (train.py jobs, the
# zygotes' ranks, the demos), unless the caller sets another count. The suite's models are
# tiny: a second thread has almost nothing to share, and on CI's 2 cores it spins while the
# ranks and subprocesses wait for a core (tests/test_train.py's first two tests measured
# 27.7 s of CPU at 2 threads, 13.5 s at 1, on this loaded 2-core VM). Set here, before any
# test module imports torch, which reads it once. README's `OMP_NUM_THREADS=2` run still
# checks the quoted numbers at 2 threads.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def gpt2_encoding():
    """tiktoken's GPT-2 encoding, or a skip that says why it could not be loaded."""
    tiktoken = importlib.import_module("tiktoken")
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as e:  # noqa: BLE001 - any failure to fetch/read the files means "skip"
        pytest.skip(
            "GPT-2's tokenizer files are unavailable (no network and no TIKTOKEN_CACHE_DIR with "
            f"them): {type(e).__name__}: {e}"
        )


@pytest.fixture(scope="session", autouse=True)
def tiktoken_cache_untouched():
    """CI points TIKTOKEN_CACHE_DIR at ../shared/, which must stay as shipped: the suite (and the
    scripts it launches) may read that cache but never add or change a file in it."""
    cache = os.environ.get("TIKTOKEN_CACHE_DIR")
    listing = lambda: {p.name: p.stat().st_mtime_ns for p in Path(cache).iterdir()}  # noqa: E731
    before = listing() if cache and Path(cache).is_dir() else None
    yield
    if before is not None:
        assert listing() == before, f"the test suite wrote into TIKTOKEN_CACHE_DIR={cache}"
