"""Honest splits: no held-out prompt has a near-duplicate on the training side."""

import itertools
import random

import pytest

from selfdraft.corpora.neardup import groups, jaccard, near_duplicates_of, shingles
from selfdraft.corpora.splits import heldout_flags, is_heldout, prompt_of
from selfdraft.training.data.dataset import build_dataset

WORDS = [
    *("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota"),
    *("kappa", "lambda", "mu", "nu", "xi", "omicron", "pi", "rho", "sigma"),
]


def chat(record_id: str, prompt: str) -> dict:
    return {
        "id": record_id,
        "messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": "ok " + prompt[:9]}],
    }


def test_groups_match_brute_force_jaccard():
    rng = random.Random(0)
    base = [" ".join(rng.choice(WORDS) for _ in range(40)) for _ in range(12)]
    texts = []
    for b in base:  # each base text, an edited copy (one word changed) and a re-cased, re-spaced copy
        words = b.split()
        words[rng.randrange(40)] = "changed"
        texts += [b, " ".join(words), "  " + b.upper() + " !"]
    g = groups(texts)
    for i, j in itertools.combinations(range(len(texts)), 2):
        sim = jaccard(shingles(texts[i]), shingles(texts[j]))
        if sim >= 0.85:  # well above the threshold: LSH finds these pairs with near certainty
            assert g[i] == g[j], (i, j, sim)
        if g[i] == g[j] and sim < 0.7:  # a group links only through confirmed pairs
            assert any(
                jaccard(shingles(texts[i]), shingles(texts[k])) >= 0.7 for k in range(len(texts)) if g[k] == g[i]
            )
    assert len(set(g)) == 12


def _with_side(held: bool, stem: str, fraction: float) -> dict:
    """A record whose per-record split (is_heldout) is `held`, its prompt starting with `stem`."""
    for n in range(10_000):
        r = chat(f"{stem[:5]}{n}", f"{stem} variant {n}")
        if is_heldout(r, fraction) == held:
            return r
    raise AssertionError("no record found")


def test_heldout_flags_move_groups_with_a_trained_member_to_training():
    f = 0.3
    long = "please explain in detail how the water cycle works on earth for my class"
    held_dup = _with_side(True, long, f)
    trained_dup = _with_side(False, long, f)  # a near-duplicate prompt on the training side
    lonely = _with_side(True, "write a sonnet about the sea and the stars at night", f)
    pair = "give me three tips for learning to play the violin as an adult beginner"
    both = [_with_side(True, pair, f), _with_side(True, pair + " now", f)]  # held-out near-duplicates
    records = [held_dup, trained_dup, lonely, *both]
    assert jaccard(shingles(prompt_of(held_dup)), shingles(prompt_of(trained_dup))) >= 0.7
    assert [is_heldout(r, f) for r in records] == [True, False, True, True, True]
    assert heldout_flags(records, f) == [False, False, True, True, True]
    assert heldout_flags(records, 0.0) == [False] * 5


def test_built_splits_have_no_heldout_near_duplicate_in_training(tmp_path):
    from transformers import AutoTokenizer

    from selfdraft.target import resolve_target_path

    tok = AutoTokenizer.from_pretrained(resolve_target_path("smollm2-135m-instruct"))
    f = 0.3
    rng = random.Random(1)
    records = []
    for n in range(40):  # ShareGPT-like: many prompts asked twice, with a word changed
        prompt = " ".join(rng.choice(WORDS) for _ in range(30))
        records.append(chat(f"a{n}", prompt))
        if n % 2 == 0:
            records.append(chat(f"b{n}", prompt.replace(prompt.split()[3], "changed", 1)))
    before = [r for r in records if is_heldout(r, f)]
    before_train = [prompt_of(r) for r in records if not is_heldout(r, f)]
    assert any(i >= 0 for i in near_duplicates_of([prompt_of(r) for r in before], before_train))
    train, heldout = build_dataset([records], tok, max_length=128, seed=0, heldout_fraction=f, run_dir=tmp_path)
    held_ids, train_ids = set(heldout["id"]), set(train["id"])
    assert held_ids and not held_ids & train_ids
    by_id = {r["id"]: prompt_of(r) for r in records}
    hits = near_duplicates_of([by_id[i] for i in held_ids], [by_id[i] for i in train_ids])
    assert all(i < 0 for i in hits)


@pytest.mark.slow
def test_sharegpt_bench_prompts_have_no_near_duplicate_in_training():
    """The bench's held-out ShareGPT prompts against every trained ShareGPT prompt (checked with the
    query path of `neardup`, not the grouping that built the split)."""
    from selfdraft.bench.prompts import sharegpt_heldout
    from selfdraft.corpora.sources import load_sharegpt
    from selfdraft.corpora.splits import opens_heldout

    f = 0.02
    records = load_sharegpt()
    held = sharegpt_heldout(10**9, f)
    trained = [prompt_of(r) for r in records if not is_heldout(r, f) and not opens_heldout(r, f)]
    assert len(held) > 200
    assert not [p.id for p, i in zip(held, near_duplicates_of([p.text for p in held], trained), strict=False) if i >= 0]
