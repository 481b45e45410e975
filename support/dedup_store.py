"""What deduplication remembers of the documents it has seen: hashes, never the text.

Plumbing for 01_data.py, which teaches the decisions (what a key is, when a candidate
is a duplicate). MinHash's memory per document is fixed, whatever its length: the
signature (112 uint32: 448 bytes) in a growing array, and one entry per band key in a
dict (~100 bytes each: 1.4 KB for 14 bands). About 1.9 KB a document: 0.6 GB for the
305K documents of 1 GB of prose.
"""

import numpy as np


class SignatureStore:
    """MinHash signatures by document number, and which documents hold each band key.

    A key maps to the first document that had it; the rare later ones (near copies, or
    two bands that collide by chance) go to a side list, so no candidate is ever lost.
    """

    def __init__(self, n_hashes: int):
        self.sigs = np.zeros((1024, n_hashes), np.uint32)
        self.n = 0  # Documents stored: rows 0..n-1 of sigs.
        self.first = {}  # A band key -> the first document that had it.
        self.more = {}  # A band key -> the later documents that had it too.

    def candidates(self, keys) -> list[int]:
        """The documents that share at least one band key with `keys`, in order."""
        docs = set()
        for key in keys:
            if key in self.first:
                docs.add(self.first[key])
                docs.update(self.more.get(key, ()))
        return sorted(docs)

    def add(self, sig: np.ndarray, keys) -> None:
        """Store one document's signature and band keys."""
        if self.n == len(self.sigs):  # Grow by doubling: amortised O(1) a document.
            self.sigs = np.concatenate([self.sigs, np.zeros_like(self.sigs)])
        self.sigs[self.n] = sig
        for key in keys:
            if key in self.first:
                self.more.setdefault(key, []).append(self.n)
            else:
                self.first[key] = self.n
        self.n += 1
