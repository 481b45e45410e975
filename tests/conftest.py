"""Shared pytest setup. The repo root is on sys.path through pyproject.toml (`pythonpath = ["."]`),
so tests import the numbered files with `importlib.import_module("01_data")`."""

import importlib

import pytest


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
