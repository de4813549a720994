"""Generated loops are cut out of answers before training: exactly where a phrase recurs too often,
only in assistant turns, and through the run config."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from selfdraft.errors import UserError
from selfdraft.training.config import ConfigError, load_run_config
from selfdraft.training.data import prepare
from selfdraft.training.data.repetition import cut_record_repeats, cut_repeats

LOOP = "Dharma is the one who is not bound by the limits. "


def test_a_loop_is_cut_before_the_phrase_starts_again():
    text = "Intro line here. " + LOOP * 6
    assert cut_repeats(text, 2) == ("Intro line here. " + LOOP * 2).rstrip()
    assert cut_repeats(text, 1) == ("Intro line here. " + LOOP).rstrip()
    # a period shorter than the phrase is still a loop: its 8-word windows recur
    assert cut_repeats("a b c d e f g. " * 5, 2) == "a b c d e f g. a b c d e f g."
    # a phrase said twice, or three times in 7 words, is no loop
    assert cut_repeats("x " + LOOP * 2, 2) == "x " + LOOP * 2
    assert cut_repeats("to be or not to be, said to be so", 2) == "to be or not to be, said to be so"
    # a one-word loop: the window of 8 equal words starts a third time at word 3
    assert cut_repeats("ok " * 20, 2) == "ok ok"
    with pytest.raises(ValueError):
        cut_repeats(text, 0)


def test_only_assistant_turns_are_cut():
    record = {
        "id": "r",
        "messages": [
            {"role": "user", "content": LOOP * 4},
            {"role": "assistant", "content": LOOP * 4},
        ],
    }
    cut = cut_record_repeats(record, 2)
    assert cut["messages"][0] == record["messages"][0]
    assert cut["messages"][1]["content"] == (LOOP * 2).rstrip()
    assert record["messages"][1]["content"] == LOOP * 4  # the input is not modified
    plain = {"id": "t", "text": LOOP * 4}
    assert cut_record_repeats(plain, 2) is plain


def test_run_config_cuts_loops_and_its_fingerprint_names_it(tmp_path, tiny_target_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    source = tmp_path / "chats.jsonl"
    rows = [
        {"id": str(i), "messages": [{"role": "user", "content": f"Question {i}?"},
                                    {"role": "assistant", "content": f"Answer {i}. " + LOOP * 8}]}
        for i in range(12)
    ]  # fmt: skip
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def write(run: str, extra: str) -> object:
        path = tmp_path / f"{run}.yaml"
        path.write_text(
            "target: x\nheads:\n  layout: selfdraft\n"
            f"output_dir: {tmp_path / run}\ndata:\n  sources: [{source}]\n  heldout_fraction: 0.0\n"
            + extra
        )
        return path

    whole, _ = prepare.prepare_splits(load_run_config(write("whole", "")), tokenizer)
    cut, _ = prepare.prepare_splits(load_run_config(write("cut", "  cut_repeats: 2\n")), tokenizer)
    lengths = lambda split: sorted(len(ids) for ids in split["input_ids"])  # noqa: E731
    assert all(c < w for c, w in zip(lengths(cut), lengths(whole), strict=True))
    kept = tokenizer.decode(cut[0]["input_ids"])
    assert kept.count("Dharma is the one") == 2
    # the same output_dir with the other setting is another data config: refused, never reused
    with pytest.raises(UserError, match="cut_repeats"):
        prepare.prepare_splits(load_run_config(write("cut", "")), tokenizer)
    with pytest.raises(ConfigError, match="cut_repeats"):
        load_run_config(write("bad", "  cut_repeats: 0\n"))
