"""Training data: truncated ShareGPT recovery, assistant loss masks from the template, splits, loaders,
self-distillation resume."""

from __future__ import annotations

import copy
import json
import os

import datasets
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from selfdraft.corpora import sources
from selfdraft.corpora.sources import (
    iter_json_array,
    load_python_source,
    load_sharegpt,
    load_user_dataset,
    read_sharegpt_records,
    sharegpt_path,
    sharegpt_to_messages,
)
from selfdraft.corpora.splits import first_exchange, is_heldout, opens_heldout
from selfdraft.errors import UserError
from selfdraft.training.data import dataset
from selfdraft.training.data import rendering as data
from selfdraft.training.data.dataset import HELDOUT_FILE, build_dataset
from selfdraft.training.data.distill import regenerate_assistant_turns, stop_ids
from selfdraft.training.data.rendering import render_chat

RECORD_START = '\n  {\n    "id": '  # how the shipped file (json.dumps indent=2) starts each record


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from selfdraft.target import resolve_target_path

    return AutoTokenizer.from_pretrained(resolve_target_path("smollm2-135m-instruct"))


# ---------------------------------------------------------------------------------------------- ShareGPT


def test_truncated_sharegpt_gives_every_complete_record_and_nothing_else():
    text = sharegpt_path().read_text(encoding="utf-8")
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)  # the file really is truncated
    records = read_sharegpt_records()
    starts = []
    pos = text.find(RECORD_START)
    while pos >= 0:
        starts.append(pos)
        pos = text.find(RECORD_START, pos + 1)
    # every record start but the last one begins a complete record
    assert len(records) == len(starts) - 1 == 17_671
    last_complete = json.loads(text[starts[-2] : starts[-1]].rstrip().rstrip(","))
    assert records[-1] == last_complete
    assert records[0] == json.loads(text[starts[0] : starts[1]].rstrip().rstrip(","))
    assert all(isinstance(r["id"], str) and isinstance(r["conversations"], list) for r in records)


def test_synthetic_truncated_array_gives_exactly_the_complete_prefix(tmp_path):
    # values that look like JSON structure must not confuse the record boundaries
    records = [
        {"id": f"r{i}", "conversations": [{"from": "human", "value": "x" * i + ', "]}'}]} for i in range(4)
    ]
    text = json.dumps(records, indent=2)
    ends = []  # character offset just past each record
    for record in records:
        chunk = json.dumps(record, indent=2).replace("\n", "\n  ")
        ends.append(text.index(chunk) + len(chunk))
    for cut in range(1, len(text) + 1):
        expected = records[: sum(end <= cut for end in ends)]
        assert list(iter_json_array(text[:cut])) == expected, cut
    path = tmp_path / "cut.json"
    path.write_text(text[: ends[2] + 7])  # mid-way into the fourth record
    assert read_sharegpt_records(path) == records[:3]
    assert read_sharegpt_records(path, limit=2) == records[:2]


def test_sharegpt_roles_are_mapped_and_odd_records_skipped():
    turns = [
        {"from": "gpt", "value": "continuation of an earlier answer"},
        {"from": "human", "value": "q"},
        {"from": "gpt", "value": "a"},
    ]
    assert sharegpt_to_messages(turns) == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
    ]
    system = [{"from": "system", "value": "s"}] + turns[1:]
    assert sharegpt_to_messages(system)[0] == {"role": "system", "content": "s"}
    assert sharegpt_to_messages([]) is None
    assert sharegpt_to_messages([{"from": "human", "value": "q"}]) is None  # nothing to learn
    assert sharegpt_to_messages(turns + [{"from": "bard", "value": "?"}]) is None

    chats = load_sharegpt(limit=300)
    assert 150 < len(chats) <= 300
    for chat in chats:
        roles = [m["role"] for m in chat["messages"]]
        assert set(roles) <= {"system", "user", "assistant"} and "assistant" in roles
        assert roles[0] in ("system", "user") and chat["id"].startswith("sharegpt:")


# ------------------------------------------------------------------------------------------ loss masks


def _masked_runs(tokenizer, row) -> list[str]:
    runs, current = [], []
    for token, keep in zip(row["input_ids"], row["loss_mask"], strict=True):
        if keep:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    return runs


def _unmasked_text(tokenizer, row) -> str:
    return tokenizer.decode([t for t, k in zip(row["input_ids"], row["loss_mask"], strict=True) if not k])


MULTI_TURN = [
    {"role": "system", "content": "Answer in one line."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "2+2 is 4."},
    {"role": "user", "content": "And in Python?"},
    {"role": "assistant", "content": "```python\nprint(2 + 2)\n```"},
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "content": "You're welcome!"},
]


@pytest.mark.parametrize("messages", [MULTI_TURN[1:3], MULTI_TURN], ids=["single-turn", "multi-turn+system"])
def test_loss_mask_is_exactly_the_assistant_turns(tok, messages):
    row = render_chat(tok, messages, max_length=4096)
    expected_ids = tok.apply_chat_template(messages, tokenize=True)
    # transformers 4.x returns a list, 5.x a BatchEncoding
    expected_ids = expected_ids if isinstance(expected_ids, list) else expected_ids["input_ids"]
    assert row["input_ids"] == list(expected_ids)
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    assert _masked_runs(tok, row) == [a + tok.eos_token for a in answers]
    unmasked = _unmasked_text(tok, row)
    for m in messages:
        if m["role"] != "assistant":
            assert m["content"] in unmasked
    if messages[0]["role"] != "system":  # the template's default system prompt is never a label
        assert "SmolLM" in unmasked


def test_loss_mask_follows_any_template_not_a_hard_coded_one(tok):
    other = copy.deepcopy(tok)
    other.chat_template = (
        "{{ bos_token }}{% for m in messages %}"
        "{% if m['role'] == 'user' %}### Question:\n{{ m['content'] }}\n"
        "{% else %}### Answer:\n{{ m['content'] | trim }}{{ eos_token }}\n\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}### Answer:\n{% endif %}"
    )
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "  hello there  "},
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "see you"},
    ]
    row = render_chat(other, messages, max_length=512)
    assert _masked_runs(other, row) == ["hello there" + other.eos_token, "see you" + other.eos_token]
    assert "### Answer" in _unmasked_text(other, row)


def test_truncation_and_early_cut_keep_the_full_rendering_prefix(tok, monkeypatch):
    long_chat = []
    for i in range(12):
        long_chat += [
            {"role": "user", "content": f"question {i} " * 30},
            # whitespace runs make ~40-character tokens: the cut text holds too few tokens, so the
            # conversation must be re-rendered in full
            {"role": "assistant", "content": (" " * 200 + "x") * 20 if i % 2 else f"answer {i} " * 40},
        ]
    text, spans = data.assistant_char_spans(tok, long_chat)
    full = data._tokenize_chats(tok, [(text, spans)], max_length=10**9)[0]
    budgets = []
    real = data.assistant_char_spans
    monkeypatch.setattr(
        data,
        "assistant_char_spans",
        lambda t, m, max_chars=None: budgets.append(max_chars) or real(t, m, max_chars),
    )
    for max_length in (1, 37, 128, 600, 5000):
        row = render_chat(tok, long_chat, max_length=max_length)
        assert row["input_ids"] == full["input_ids"][:max_length]
        assert row["loss_mask"] == full["loss_mask"][:max_length]
    assert None in budgets and budgets[0] is not None  # both the cut and the fallback ran


def test_assistant_first_or_unrenderable_conversation_is_rejected(tok):
    with pytest.raises(ValueError, match="start with an assistant"):
        render_chat(tok, [{"role": "assistant", "content": "a"}], 64)
    rows = data.render_records(tok, [{"id": "x", "messages": [{"role": "assistant", "content": "a"}]}], 64)
    assert isinstance(rows[0], str)


def test_plain_text_windows_cover_every_token(tok):
    text = "def f(x):\n    return x + 1\n" * 50
    windows = data.render_records(tok, [{"id": "t", "text": text}], max_length=64)[0]
    ids = tok(text)["input_ids"]
    assert [t for w in windows for t in w["input_ids"]] == ids
    assert all(len(w["input_ids"]) <= 64 and all(w["loss_mask"]) for w in windows)


# ---------------------------------------------------------------------------------------- splits, loaders


def _synthetic_records(n: int) -> list[dict]:
    out = []
    for i in range(n):
        out.append(
            {
                "id": f"c{i}",
                "messages": [
                    {"role": "user", "content": f"prompt number {i}"},
                    {"role": "assistant", "content": f"answer {i}"},
                ],
            }
        )
    out.append({"id": "doc", "text": "import os\nprint(os.sep)\n"})
    return out


def test_heldout_split_is_deterministic_disjoint_and_written(tok, tmp_path):
    records = _synthetic_records(200)
    # same prompts under another id with another answer: must land with the original
    records.append(
        {
            **records[7],
            "id": "dup7",
            "messages": [records[7]["messages"][0], {**records[7]["messages"][1], "content": "regenerated"}],
        }
    )
    train_a, held_a = build_dataset([records], tok, 64, seed=1, heldout_fraction=0.25, run_dir=tmp_path / "a")
    train_b, held_b = build_dataset([records], tok, 64, seed=2, heldout_fraction=0.25, run_dir=tmp_path / "b")
    assert set(held_a["id"]) == set(held_b["id"]) and held_a["id"] == held_b["id"]
    assert sorted(train_a["id"]) == sorted(train_b["id"]) and train_a["id"] != train_b["id"]  # seed shuffles
    assert not set(train_a["id"]) & set(held_a["id"])
    assert len(train_a) + len(held_a) == len(records)
    assert 0.12 < len(held_a) / len(records) < 0.4
    written = json.loads((tmp_path / "a" / HELDOUT_FILE).read_text())
    assert written["ids"] == sorted(held_a["id"]) and written["heldout_fraction"] == 0.25
    assert ("dup7" in held_a["id"]) == ("c7" in held_a["id"])
    assert is_heldout(records[3], 0.0) is False
    clashing = [*records, {**records[0], "id": next(iter(held_a["id"]))}]
    with pytest.raises(ValueError, match="unique"):
        build_dataset([clashing], tok, 64, seed=1, heldout_fraction=0.25, run_dir=tmp_path / "d")
    again, _ = build_dataset([records], tok, 64, seed=1, heldout_fraction=0.25, run_dir=tmp_path / "c")
    assert again["input_ids"] == train_a["input_ids"]


def test_conversation_opening_with_a_heldout_exchange_trains_nowhere(tok, tmp_path):
    records = _synthetic_records(60)
    turn = {"role": "assistant", "content": "and more"}
    follow = {"role": "user", "content": "go on"}
    conversations = [
        {"id": f"c{i}", "messages": [*r["messages"], follow, turn]} for i, r in enumerate(records[:60])
    ]
    # first exchanges as self-distillation writes them (same id, another answer; held-out conversations,
    # the benchmarks' prompts, are never distilled)
    copies = [
        {"id": c["id"], "messages": [c["messages"][0], {"role": "assistant", "content": "distilled"}]}
        for c in conversations
        if not is_heldout(c, 0.25)
    ]
    opening = [c["id"] for c in conversations if opens_heldout(c, 0.25) and not is_heldout(c, 0.25)]
    assert opening  # the fixture has conversations whose first exchange alone is held out
    train, held = build_dataset([conversations, copies], tok, 64, seed=1, heldout_fraction=0.25, run_dir=tmp_path)
    assert not set(train["id"]) & set(opening) and set(opening) <= set(held["id"])
    assert sum(i in opening for i in held["id"]) == len(opening)  # only the copies are held out
    assert not set(train["id"]) & set(held["id"])
    assert first_exchange(copies[0]) is None and first_exchange({"id": "t", "text": "x"}) is None


def test_rendering_in_two_processes_gives_the_same_splits(tok, tmp_path, monkeypatch):
    records = _synthetic_records(150)
    records += [{"id": f"doc{i}", "text": f"def f{i}(x):\n    return x * {i}\n" * 12} for i in range(20)]
    records.append({"id": "bad", "messages": [{"role": "assistant", "content": "no question"}]})
    long_prompt = [{"role": "user", "content": "words " * 80}, {"role": "assistant", "content": "cut away"}]
    records.append({"id": "no-label", "messages": long_prompt})  # its answer lies past max_length
    monkeypatch.setattr(dataset, "RENDER_BATCH", 16)  # several batches per process, shards mid-batch
    one = build_dataset(
        [records], tok, 48, seed=5, heldout_fraction=0.2, run_dir=tmp_path / "one", num_proc=1
    )
    two = build_dataset(
        [records], tok, 48, seed=5, heldout_fraction=0.2, run_dir=tmp_path / "two", num_proc=2,
        work_dir=tmp_path / "work",
    )  # fmt: skip
    assert any(p.suffix == ".arrow" for p in (tmp_path / "work").iterdir())  # rendered on disk
    for a, b in zip(one, two, strict=True):
        assert a.features == b.features
        assert a["id"] == b["id"] and a["input_ids"] == b["input_ids"] and a["loss_mask"] == b["loss_mask"]
    ids = list(one[0]["id"]) + list(one[1]["id"])
    assert len(one[1]) > 0 and "bad" not in ids and "no-label" not in ids
    assert ids.count("doc3") > 1  # a text record yields several windows
    written = [json.loads((tmp_path / run / HELDOUT_FILE).read_text()) for run in ("one", "two")]
    assert written[0] == written[1] and set(one[1]["id"]) <= set(written[0]["ids"])


def test_render_processes_default_and_override(monkeypatch):
    monkeypatch.delenv(dataset.NUM_PROC_ENV, raising=False)
    assert dataset.resolve_num_proc(None, 10) == 1  # a small corpus is not worth a process pool
    assert dataset.resolve_num_proc(None, 10**7) == min(len(os.sched_getaffinity(0)), dataset.MAX_AUTO_PROCS)
    assert dataset.resolve_num_proc(4, 3) == 3
    monkeypatch.setenv(dataset.NUM_PROC_ENV, "3")
    assert dataset.resolve_num_proc(None, 100) == 3 and dataset.resolve_num_proc(2, 100) == 2
    monkeypatch.setenv(dataset.NUM_PROC_ENV, "many")
    with pytest.raises(UserError, match=dataset.NUM_PROC_ENV):
        dataset.resolve_num_proc(None, 100)
    with pytest.raises(UserError, match="at least 1"):
        dataset.resolve_num_proc(0, 100)


def test_python_source_skips_tests_caches_and_installed_packages(tmp_path):
    for rel in ("b.py", "a/x.py", "test/t.py", "site-packages/p.py", "__pycache__/c.py", "a/empty.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("" if "empty" in rel else f"# {rel}\n")
    assert [r["id"] for r in load_python_source(root=tmp_path)] == ["stdlib:a/x.py", "stdlib:b.py"]
    with_tests = load_python_source(root=tmp_path, include_tests=True)
    assert [r["id"] for r in with_tests] == ["stdlib:a/x.py", "stdlib:b.py", "stdlib:test/t.py"]


def test_python_source_is_deterministic():
    first = load_python_source(limit_files=5)
    assert first == load_python_source(limit_files=5)
    assert [r["id"] for r in first] == sorted(r["id"] for r in first)
    assert all(r["id"].startswith("stdlib:") and r["text"] for r in first)


def test_user_jsonl_both_shapes_and_bad_rows(tmp_path):
    path = tmp_path / "mine.jsonl"
    rows = [
        {"id": 5, "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
        {"text": "plain words", "source": "extra fields are ignored"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    loaded = load_user_dataset(path)
    assert loaded[0] == {"id": "5", "messages": rows[0]["messages"]}
    assert loaded[1]["text"] == "plain words" and loaded[1]["id"].startswith("sha256:")
    assert load_user_dataset(path)[1]["id"] == loaded[1]["id"]  # content ids are stable

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x", "completion": "y"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1.*`messages`.*`text`"):
        load_user_dataset(bad)
    bad.write_text(json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n")
    with pytest.raises(ValueError, match="role"):
        load_user_dataset(bad)
    bad.write_text("{not json\n")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_user_dataset(bad)


def test_user_dataset_folder_via_datasets(tmp_path):
    datasets.Dataset.from_list([{"text": "a b c"}, {"text": "d e"}]).save_to_disk(str(tmp_path / "ds"))
    assert [r["text"] for r in load_user_dataset(tmp_path / "ds")] == ["a b c", "d e"]
    datasets.Dataset.from_list([{"question": "?"}]).save_to_disk(str(tmp_path / "wrong"))
    with pytest.raises(ValueError, match=r"question.*`messages`"):
        load_user_dataset(tmp_path / "wrong")


def test_load_source_specs(monkeypatch):
    seen = []
    monkeypatch.setattr(sources, "load_sharegpt", lambda limit=None: seen.append(("sg", limit)) or [])
    monkeypatch.setattr(
        sources, "load_python_source", lambda limit_files=None: seen.append(("py", limit_files)) or []
    )
    monkeypatch.setattr(sources, "load_user_dataset", lambda spec: seen.append(("user", spec)) or [])
    for spec in ("sharegpt", "sharegpt:10", "python-stdlib:3", "org/name"):
        sources.load_source(spec)
    assert seen == [("sg", None), ("sg", 10), ("py", 3), ("user", "org/name")]
    for spec in ("sharegpt:x", "sharegpt:0", "python-stdlib:-1"):  # a built-in's count that is none
        with pytest.raises(UserError, match="takes a count of records"):
            sources.load_source(spec)


# ------------------------------------------------------------------------------------- self-distillation


def _tiny_chat_model(vocab_size: int):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(config).eval()


def test_self_distillation_regenerates_and_resumes(tok, tmp_path):
    model = _tiny_chat_model(len(tok))
    convs = [
        {"id": "a", "messages": MULTI_TURN},
        {"id": "b", "messages": MULTI_TURN[1:3]},
        {"id": "b", "messages": MULTI_TURN[1:3]},  # duplicate id: done once
        {
            "id": "c",
            "messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "x"}],
        },
    ]
    out = tmp_path / "distill.jsonl"
    regenerate_assistant_turns(model, tok, convs[:1], out, max_new_tokens=4, batch_size=2)
    with out.open("a") as fh:
        fh.write('{"id": "b", "messa')  # a run killed mid-write
    regenerate_assistant_turns(model, tok, convs, out, max_new_tokens=4, batch_size=2)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["a", "c", "b"]  # each id once; a batch runs shortest prompts first
    rows = [rows[0], rows[2], rows[1]]

    # each assistant turn is the target's greedy answer given the regenerated history
    history = []
    for message in MULTI_TURN:
        if message["role"] != "assistant":
            history.append(message)
            continue
        prompt = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
        new = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
        history.append(
            {
                "role": "assistant",
                "content": tok.decode(new[0, ids.shape[1] :], skip_special_tokens=True).strip(),
            }
        )
    assert rows[0]["messages"] == history
    assert [m["role"] for m in rows[1]["messages"]] == ["user", "assistant"]

    def fail(*args, **kwargs):
        raise AssertionError("finished conversations must not be regenerated")

    model.generate = fail
    regenerate_assistant_turns(model, tok, convs, out, max_new_tokens=4)
    assert load_user_dataset(out)[0]["messages"] == history


def test_self_distillation_through_selfdraft_batches_writes_the_targets_answers(tok, tmp_path):
    """Distilling through selfdraft's batched speculative generation (fp32, fresh heads) writes exactly
    what the target's own batched generate writes, also when one row meets a stop token early."""
    from selfdraft.inference import SelfDraftModel

    model = _tiny_chat_model(len(tok))
    convs = [
        {"id": f"q{i}", "messages": [{"role": "user", "content": text}, MULTI_TURN[2]]}
        for i, text in enumerate(["hello", "what is two plus two", "name a prime", "write a loop in python"])
    ]
    convs.append({"id": "multi", "messages": MULTI_TURN})
    prompt = tok.apply_chat_template(convs[0]["messages"][:1], tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
    greedy = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    model.generation_config.eos_token_id = int(greedy[0, ids.shape[1] + 3])  # row "q0" stops at its 4th token
    plain, drafted = tmp_path / "plain.jsonl", tmp_path / "drafted.jsonl"
    regenerate_assistant_turns(model, tok, convs, plain, max_new_tokens=10, batch_size=3)
    drafter = SelfDraftModel.with_heads(model, tok, heads=None, tree="chain-2", draft_dtype=torch.float32)
    regenerate_assistant_turns(drafter, tok, convs, drafted, max_new_tokens=10, batch_size=3)
    assert drafted.read_text() == plain.read_text()
    rows = {r["id"]: r for r in map(json.loads, plain.read_text().splitlines())}
    lengths = {rid: len(tok(r["messages"][1]["content"])["input_ids"]) for rid, r in rows.items()}
    assert lengths["q0"] < max(lengths.values())  # the early stop really happened in a longer batch


def test_sampled_self_distillation_is_the_targets_sampling_and_reproducible(tok, tmp_path):
    """At temperature > 0 every answer is the target's own sample with the seed `answer_seed` gives
    its record and turn: the same for any batch size (so a resumed build draws what it would have),
    different from the greedy answers and from another base seed's."""
    from selfdraft.inference import SelfDraftModel
    from selfdraft.training.data.distill import answer_seed

    model = _tiny_chat_model(len(tok))
    drafter = SelfDraftModel.with_heads(model, tok, heads=None, tree="chain-2", draft_dtype=torch.float32)
    convs = [
        {"id": f"q{i}", "messages": [{"role": "user", "content": text}, MULTI_TURN[2]]}
        for i, text in enumerate(["hello", "what is two plus two", "name a prime", "write a loop in python"])
    ]

    def build(name: str, batch_size: int, temperature: float, seed: int = 5) -> dict:
        out = tmp_path / f"{name}.jsonl"
        regenerate_assistant_turns(
            drafter,
            tok,
            convs,
            out,
            max_new_tokens=8,
            batch_size=batch_size,
            temperature=temperature,
            seed=seed,
        )
        return {r["id"]: r["messages"][1]["content"] for r in map(json.loads, out.read_text().splitlines())}

    sampled = build("a", 3, 1.0)
    assert build("b", 1, 1.0) == sampled
    assert build("greedy", 3, 0.0) != sampled and build("c", 3, 1.0, seed=6) != sampled
    prompt = tok.apply_chat_template(convs[1]["messages"][:1], tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
    alone = drafter.generate(
        ids, 8, temperature=1.0, seed=answer_seed(5, "q1", 1), stop_token_ids=stop_ids(model, tok)
    )
    assert sampled["q1"] == tok.decode(alone.tokens, skip_special_tokens=True).strip()


def test_self_distillation_skips_heldout_and_keeps_first_turns(tok, tmp_path):
    """The benchmarks' held-out prompts are never distilled; first_turns cuts each conversation after
    its first answer; a prompt over max_prompt_tokens, or an empty question, is written as skipped
    (not retried on resume)."""
    model = _tiny_chat_model(len(tok))
    convs = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"question {i}"}, *MULTI_TURN[2:]]}
             for i in range(40)]  # fmt: skip
    convs.append({"id": "long", "messages": [{"role": "user", "content": "word " * 300}, MULTI_TURN[2]]})
    convs.append({"id": "blank", "messages": [{"role": "user", "content": " \t\n"}, MULTI_TURN[2]]})
    heldout = {c["id"] for c in convs if is_heldout(c, 0.3)}
    assert 0 < len(heldout) < len(convs) and not {"long", "blank"} & heldout
    out = tmp_path / "first.jsonl"
    regenerate_assistant_turns(
        model, tok, convs, out, max_new_tokens=3, batch_size=8, heldout_fraction=0.3,
        first_turns=True, max_prompt_tokens=64,
    )  # fmt: skip
    rows = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == {c["id"] for c in convs} - heldout
    for rid, row in rows.items():
        if rid in ("long", "blank"):  # an empty question is not answered either
            assert "skipped" in row and [m["role"] for m in row["messages"]] == ["user"]
        else:
            assert [m["role"] for m in row["messages"]] == ["user", "assistant"]
