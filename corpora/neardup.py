"""Near-duplicate text: word n-gram Jaccard similarity, estimated with MinHash and found with LSH bands.

Used where a copy on the wrong side would flatter a number: the held-out split (ShareGPT repeats many
conversations), MT-bench decontamination, and de-duplicating synthesised prompts. Everything here is
deterministic across processes (crc32, fixed permutations), never Python's salted `hash`.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Sequence

import numpy as np

SHINGLE_WORDS = 3  # word 3-grams: short enough for one-line prompts, long enough to ignore common words
NUM_PERM = 64  # 16 bands of 4 rows: a pair at Jaccard 0.5 shares a band with probability ~0.65,
BANDS = 16  # at 0.7 with ~0.99; candidates are then checked with the exact Jaccard
THRESHOLD = 0.7  # word 3-gram Jaccard at or above which two texts count as near-duplicates
_PRIME = (1 << 61) - 1
_rng = np.random.default_rng(0x5E1FD2AF)
_A = _rng.integers(1, _PRIME, NUM_PERM, dtype=np.uint64)
_B = _rng.integers(0, _PRIME, NUM_PERM, dtype=np.uint64)
_WORD = re.compile(r"\w+")
MAX_BUCKET_CHECKS = 8  # unlinked earlier members of a bucket one text is compared with
MAX_CHARS = 4000  # a pasted document is compared by its beginning: enough to tell copies apart


def normalize(text: str) -> list[str]:
    """Lower-cased word tokens: case, punctuation and whitespace do not make a prompt new."""
    return _WORD.findall(text[:MAX_CHARS].lower())


def shingles(text: str, n: int = SHINGLE_WORDS) -> np.ndarray:
    """Sorted unique uint64 hashes of the word n-grams (the whole text as one when it has fewer than
    n words; empty for a text with no words). Words are hashed once (crc32) and combined per n-gram."""
    words = normalize(text)
    if not words:
        return np.empty(0, dtype=np.uint64)
    if len(words) < n:
        return np.array([zlib.crc32(" ".join(words).encode())], dtype=np.uint64)
    ids = np.fromiter((zlib.crc32(w.encode()) for w in words), dtype=np.uint64, count=len(words))
    with np.errstate(over="ignore"):
        h = np.zeros(len(words) - n + 1, dtype=np.uint64)
        for i in range(n):  # an order-sensitive mix of the n word hashes, modulo 2^64
            h = h * np.uint64(0x9E3779B97F4A7C15) + ids[i : len(words) - n + 1 + i]
    return np.unique(h)


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """|a & b| / |a | b| of two `shingles` arrays; two empty texts are not duplicates (0.0)."""
    if not len(a) or not len(b):
        return 0.0
    common = len(np.intersect1d(a, b, assume_unique=True))
    return common / (len(a) + len(b) - common)


def signature(shingle_set: np.ndarray) -> np.ndarray:
    """MinHash signature [NUM_PERM] (uint64): per permutation, the minimum of (a*x + b) mod p.

    Products are reduced modulo 2^64 before the prime; that keeps each row a fixed hash of x, which is
    all MinHash needs."""
    with np.errstate(over="ignore"):
        values = (np.outer(_A, shingle_set) + _B[:, None]) % np.uint64(_PRIME)
    return values.min(axis=1)


class _UnionFind:
    def __init__(self, n: int) -> None:
        self.parent = list(range(n))

    def find(self, i: int) -> int:
        while self.parent[i] != i:
            self.parent[i] = self.parent[self.parent[i]]
            i = self.parent[i]
        return i

    def union(self, i: int, j: int) -> None:
        a, b = self.find(i), self.find(j)
        if a != b:
            self.parent[max(a, b)] = min(a, b)


def groups(texts: Sequence[str], threshold: float = THRESHOLD) -> list[int]:
    """Group id per text (the smallest index in its group): texts linked by a chain of near-duplicate
    pairs (Jaccard >= threshold) share a group. Pairs are proposed by LSH bands and confirmed exactly,
    so a reported pair is always a true near-duplicate; a pair may rarely be missed (see BANDS)."""
    sets = [shingles(t) for t in texts]
    uf = _UnionFind(len(texts))
    rows = NUM_PERM // BANDS
    buckets: dict[tuple[int, bytes], list[int]] = {}
    for i, s in enumerate(sets):
        if not len(s):
            continue
        sig = signature(s)
        for band in range(BANDS):
            buckets.setdefault((band, sig[band * rows : (band + 1) * rows].tobytes()), []).append(i)
    for members in buckets.values():
        for pos, j in enumerate(members[1:], start=1):
            # a band is 4 equal minhashes, so members are nearly always similar: compare with a few
            # earlier members of other groups (a bucket of thousands of copies costs one check each)
            for k in members[:pos][:MAX_BUCKET_CHECKS]:
                if uf.find(k) == uf.find(j):
                    break
                if jaccard(sets[k], sets[j]) >= threshold:
                    uf.union(k, j)
                    break
    return [uf.find(i) for i in range(len(texts))]


def near_duplicates_of(queries: Sequence[str], corpus: Sequence[str], threshold: float = THRESHOLD) -> list[int]:
    """For each query, the index of a corpus text it near-duplicates (Jaccard >= threshold), else -1."""
    rows = NUM_PERM // BANDS
    corpus_sets = [shingles(t) for t in corpus]
    buckets: dict[tuple[int, bytes], list[int]] = {}
    for i, s in enumerate(corpus_sets):
        if len(s):
            sig = signature(s)
            for band in range(BANDS):
                buckets.setdefault((band, sig[band * rows : (band + 1) * rows].tobytes()), []).append(i)
    out = []
    for query in queries:
        s = shingles(query)
        found = -1
        if len(s):
            sig = signature(s)
            seen: set[int] = set()
            for band in range(BANDS):
                for i in buckets.get((band, sig[band * rows : (band + 1) * rows].tobytes()), ()):
                    if i not in seen:
                        seen.add(i)
                        if jaccard(s, corpus_sets[i]) >= threshold:
                            found = i
                            break
                if found >= 0:
                    break
        out.append(found)
    return out
