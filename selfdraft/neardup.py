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
MAX_CHARS = 20_000  # a pasted document is compared by its beginning: enough to tell copies apart


def normalize(text: str) -> list[str]:
    """Lower-cased word tokens: case, punctuation and whitespace do not make a prompt new."""
    return _WORD.findall(text[:MAX_CHARS].lower())


def shingles(text: str, n: int = SHINGLE_WORDS) -> set[int]:
    """crc32 of each word n-gram (the whole text as one shingle when it has fewer than n words)."""
    words = normalize(text)
    if len(words) < n:
        return {zlib.crc32(" ".join(words).encode())} if words else set()
    return {zlib.crc32(" ".join(words[i : i + n]).encode()) for i in range(len(words) - n + 1)}


def jaccard(a: set[int], b: set[int]) -> float:
    """|a & b| / |a | b|; two empty texts are not duplicates of each other (0.0)."""
    if not a or not b:
        return 0.0
    return len(a & b) / len(a | b)


def signature(shingle_set: set[int]) -> np.ndarray:
    """MinHash signature [NUM_PERM] (uint64): per permutation, the minimum of (a*x + b) mod p.

    Products are reduced modulo 2^64 before the prime; that keeps each row a fixed hash of x, which is
    all MinHash needs. An empty set gets the all-max signature (it matches nothing in `groups`)."""
    if not shingle_set:
        return np.full(NUM_PERM, np.iinfo(np.uint64).max, dtype=np.uint64)
    x = np.fromiter(shingle_set, dtype=np.uint64, count=len(shingle_set))
    with np.errstate(over="ignore"):
        values = (np.outer(_A, x) + _B[:, None]) % np.uint64(_PRIME)
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
        if not s:
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
        if s:
            sig = signature(s)
            for band in range(BANDS):
                buckets.setdefault((band, sig[band * rows : (band + 1) * rows].tobytes()), []).append(i)
    out = []
    for query in queries:
        s = shingles(query)
        found = -1
        if s:
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
