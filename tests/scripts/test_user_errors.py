"""Bad inputs and awkward settings: each gets a clear UserError (one CLI line, exit 2) or just works."""

import json
import logging
from pathlib import Path

import pytest
import torch

from selfdraft.bench import report as bench_report
from selfdraft.bench.tune import score_trees
from selfdraft.destinations import staged_file, staged_folder
from selfdraft.errors import UserError
from selfdraft.heads import HeadsConfig, build_heads, save_heads
from selfdraft.inference import SelfDraftModel
from selfdraft.inference.model import prompt_text
from selfdraft.scripts import cli
from selfdraft.tree import TreeSpec
from selfdraft.tree_syntax import read_tree_file, resolve_tree
from selfdraft.typed_config import ConfigError, build_dataclass

from tiny_models import greedy_reference, random_heads, tiny_target


def medusa(target, heads: int):
    torch.manual_seed(0)
    config = HeadsConfig.for_target(target.config, head_kind="medusa", medusa_num_heads=heads)
    module = build_heads(config)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.02)
    return module


def test_default_tree_fits_medusa_heads_fewer_than_its_depth():
    target = tiny_target("llama")
    model = SelfDraftModel(target, None, medusa(target, 3))  # the default tree is 4 deep
    assert model.tree.max_depth == 3
    prompt = torch.tensor([[4, 8, 15, 16, 23]])
    assert model.generate(prompt, 12, stop_token_ids=[]).tokens == greedy_reference(target, prompt, 12)
    with pytest.raises(UserError, match="at most 3 levels"):
        SelfDraftModel(target, None, medusa(target, 3), tree="chain-4")
    with pytest.raises(UserError, match="at most 3 levels"):
        model.generate(prompt, 4, tree="dynamic:depth=5")


def test_medusa_lookup_tree_near_the_context_end():
    """The shorter chain used near the context end never asks the heads for more levels than they have."""
    target = tiny_target("llama")
    model = SelfDraftModel(target, None, medusa(target, 2), tree="chain-2+lookup=6")
    prompt = torch.randint(0, 96, (1, 245), generator=torch.Generator().manual_seed(1))
    out = model.generate(prompt, 40, stop_token_ids=[])
    assert out.stats.finish_reason == "context"
    assert out.tokens == greedy_reference(target, prompt, len(out.tokens))


def test_prompt_of_exactly_the_context_yields_one_token():
    target = tiny_target("llama")
    model = SelfDraftModel(target, None, medusa(target, 4))
    prompt = torch.randint(0, 96, (1, 256), generator=torch.Generator().manual_seed(2))
    out = model.generate(prompt, 5, stop_token_ids=[])
    assert out.tokens == [int(target(prompt).logits[0, -1].argmax())]
    assert out.stats.finish_reason == "context"


def test_bad_prompt_ids_and_text():
    target = tiny_target("llama")
    model = SelfDraftModel(target, None, medusa(target, 4))
    with pytest.raises(UserError, match="outside the target's vocabulary"):
        model.generate(torch.tensor([[1, 2, 96]]), 2)
    with pytest.raises(UserError, match="token ids, not text"):
        model.generate("hello", 2)
    assert prompt_text(b"caf\xc3\xa9") == "café"
    with pytest.raises(UserError, match="not valid UTF-8"):
        prompt_text(b"caf\xe9")
    with pytest.raises(UserError, match="not valid UTF-8"):
        prompt_text("caf\udce9")  # how argv carries undecodable bytes


def test_stop_ids_are_the_targets_own():
    target = tiny_target("llama")
    target.generation_config.eos_token_id = [5, 7]
    model = SelfDraftModel(target, None, medusa(target, 4))
    assert model.default_stop_ids() == [5, 7]


def test_unapplied_generation_config_is_named(caplog):
    target = tiny_target("llama")
    target.generation_config.repetition_penalty = 1.3
    with caplog.at_level(logging.WARNING, logger="selfdraft.inference.model"):
        SelfDraftModel(target, None, medusa(target, 4))
    (line,) = [r.getMessage() for r in caplog.records]
    assert "repetition_penalty=1.3" in line and "1.0" in line and "\n" not in line


def test_malformed_tree_file_names_the_file(tmp_path):
    bad = tmp_path / "tree.yaml"
    bad.write_text("paths: [[0, 1], [0, -1]]\n")
    with pytest.raises(UserError, match=str(bad)):
        read_tree_file(bad)
    bad.write_text("paths: [[0, 1]\n")  # not YAML
    with pytest.raises(UserError, match=str(bad)):
        read_tree_file(bad)
    with pytest.raises(UserError, match="unknown tree"):
        resolve_tree("tiny")


def test_config_numbers():
    from dataclasses import dataclass

    @dataclass
    class Train:
        lr: float = 1.0

    assert build_dataclass(Train, {"lr": "1e-3"}).lr == 1e-3  # YAML 1.1 reads 1e-3 as a string
    with pytest.raises(ConfigError, match="expected a number"):
        build_dataclass(Train, {"lr": "fast"})
    for bad in (float("inf"), float("nan")):
        with pytest.raises(ConfigError, match="not a finite number"):
            build_dataclass(Train, {"lr": bad})


def test_cli_user_error_and_interrupt_are_one_line(tmp_path, capsys, monkeypatch):
    bad = tmp_path / "tree.yaml"
    bad.write_text("dynamic: {depth: 0}\n")
    code = cli.main(["generate", "--prompt", "hi", "--tree", str(bad)])  # refused before the target loads
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("selfdraft generate: ")

    from selfdraft.scripts import generate

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(generate, "run", interrupted)
    assert cli.main(["generate", "--prompt", "hi"]) == 130
    assert capsys.readouterr().err.strip() == "selfdraft generate: interrupted"


def test_bench_report_without_matplotlib(tmp_path, monkeypatch):
    def no_matplotlib(report, out_dir):
        raise ImportError("No module named 'matplotlib'")

    monkeypatch.setattr(bench_report, "plot", no_matplotlib)
    report = {"config": {}, "machine": {}, "summary": [], "runs": [], "verify_cost_seconds": {"1": 1.0}}
    paths = bench_report.write_report(report, tmp_path)
    assert paths["json"].is_file() and paths["markdown"].is_file() and set(paths) == {"json", "markdown"}


def test_tune_skips_trees_deeper_than_the_heads():
    target = tiny_target("llama")
    model = SelfDraftModel(target, None, medusa(target, 2), tree=TreeSpec.chain(1))
    prompts = [torch.tensor([[3, 1, 4, 1, 5]])]
    scores = score_trees(model, prompts, ["chain-2", "chain-4", "small"], 6, curve={1: 1.0, 64: 2.0})
    assert [s.tree for s in scores] == ["chain-2"]
    with pytest.raises(UserError, match="no candidate tree fits"):
        score_trees(model, prompts, ["chain-4"], 6, curve={1: 1.0, 64: 2.0})


# ---- the matrix: bad command lines, each refused in one line (exit 2) with nothing destroyed ----------


def _snapshot(root: Path) -> dict[str, bytes | None]:
    """Every name under root with its bytes (None for a folder): what "nothing destroyed" compares."""
    return {
        str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))
    }


def _fake_run(root: Path, target_name: str = "smollm2-135m-instruct") -> tuple[Path, Path]:
    """A finished training run (heads, log, run.json, a checkpoint) and its config."""
    heads = random_heads(tiny_target("llama"), "eagle", 0)
    run = root / "run"
    save_heads(heads, run / "heads")
    (run / "run.json").write_text(json.dumps({"fingerprint": "x", "world_size": 1}))
    log = [{"step": 0, "event": "start", "examples": 4}, {"step": 2, "event": "done", "train_seconds": 1.0}]
    (run / "log.jsonl").write_text("\n".join(json.dumps(r) for r in log))
    (run / "checkpoints" / "step-2").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step-2")
    config = root / "run.yaml"
    config.write_text(f"target: {target_name}\nheads:\n  layout: selfdraft\n")  # the heads' layout: no target read
    return run, config


def _publish(run: Path, config: Path, dest: Path, *extra: str) -> list[str]:
    return ["publish", "--run", str(run), "--config", str(config), "--dest", str(dest), *extra]


def _prompts(root: Path, text: str = '{"prompt": "hi"}\n') -> Path:
    path = root / "prompts.jsonl"
    path.write_text(text)
    return path


def _user_folder(path: Path) -> Path:
    (path / "src").mkdir(parents=True)
    (path / "notes.txt").write_text("mine")
    (path / "src" / "main.py").write_text("print('mine')\n")
    return path


def case_publish_into_the_run(tmp_path):
    run, config = _fake_run(tmp_path)
    return _publish(run, config, run), ["--dest", "is the input", "outside the inputs"]


def case_publish_inside_the_run(tmp_path):
    run, config = _fake_run(tmp_path)
    return _publish(run, config, run / "published"), ["lies inside the input", "outside the inputs"]


def case_publish_into_a_users_folder(tmp_path):
    run, config = _fake_run(tmp_path)
    return _publish(run, config, _user_folder(tmp_path / "mine")), ["is not empty", "--overwrite"]


def case_publish_for_another_target(tmp_path):
    run, config = _fake_run(tmp_path)
    argv = _publish(run, config, tmp_path / "card", "--target", "qwen2.5-coder-0.5b-instruct")
    return argv, ["not the target the run trained on", "drop --target"]


def case_publish_a_local_target_without_its_hub_id(tmp_path):
    run, config = _fake_run(tmp_path, target_name=str(tmp_path))
    return _publish(run, config, tmp_path / "card"), ["local folder", "--target HUB_ID"]


def case_generate_out_is_the_prompts_file(tmp_path):
    prompts = _prompts(tmp_path)
    argv = ["generate", "--prompts-file", str(prompts), "--out", str(prompts)]
    return argv, ["--out", "is the input"]


def case_generate_out_exists(tmp_path):
    (tmp_path / "answers.jsonl").write_text('{"id": 0}\n')
    argv = ["generate", "--prompts-file", str(_prompts(tmp_path)), "--out", str(tmp_path / "answers.jsonl")]
    return argv, ["exists", "--overwrite"]


def case_generate_out_in_a_missing_folder(tmp_path):
    argv = ["generate", "--prompts-file", str(_prompts(tmp_path)), "--out", str(tmp_path / "no" / "a.jsonl")]
    return argv, ["does not exist", "create it"]


def case_export_onto_its_source(tmp_path):
    heads = tmp_path / "heads"
    save_heads(random_heads(tiny_target("llama"), "eagle", 0), heads)
    return ["export", "--to", "vllm", str(heads), str(heads)], ["dst", "is the input"]


def case_export_into_another_models_folder(tmp_path):
    heads = tmp_path / "heads"
    save_heads(random_heads(tiny_target("llama"), "eagle", 0), heads)
    other = tmp_path / "model"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "llama"}')
    return ["export", "--to", "vllm", str(heads), str(other)], ["is not empty", "--overwrite"]


def case_convert_into_a_published_folder(tmp_path):
    src = tmp_path / "medusa"
    src.mkdir()
    published = tmp_path / "published"
    save_heads(random_heads(tiny_target("llama"), "eagle", 0), published)
    (published / "README.md").write_text("card")
    (published / "stages.json").write_text("[]")
    return ["convert", str(src), str(published)], ["is not empty", "--overwrite"]


def _tiny_model_folder(path: Path, weights: bool, tokenizer: bool) -> Path:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    config = LlamaConfig(
        vocab_size=96,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    if weights:
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
    else:
        config.save_pretrained(path)
    if tokenizer:
        PreTrainedTokenizerFast(
            tokenizer_object=Tokenizer(WordLevel({"a": 0}, unk_token="a"))
        ).save_pretrained(path)
    return path


def case_target_folder_without_weights(tmp_path):
    target = _tiny_model_folder(tmp_path / "model", weights=False, tokenizer=True)
    return ["generate", "--target", str(target), "--prompt", "hi"], ["no weights", "save_pretrained"]


def case_target_folder_without_tokenizer(tmp_path):
    target = _tiny_model_folder(tmp_path / "model", weights=True, tokenizer=False)
    return ["generate", "--target", str(target), "--prompt", "hi"], ["no tokenizer", "save_pretrained"]


def case_target_is_a_heads_folder(tmp_path):
    heads = tmp_path / "heads"
    save_heads(random_heads(tiny_target("llama"), "eagle", 0), heads)
    return ["generate", "--target", str(heads), "--prompt", "hi"], ["draft heads, not a model", "--heads"]


def case_selfdraft_cache_is_a_file(tmp_path, monkeypatch):
    (tmp_path / "cache").write_text("not a folder")
    monkeypatch.setenv("SELFDRAFT_CACHE", str(tmp_path / "cache"))
    return ["generate", "--prompt", "hi"], ["is a file", "$SELFDRAFT_CACHE"]


def case_prompts_file_not_utf8(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    argv = ["generate", "--prompts-file", str(prompts), "--out", str(tmp_path / "o.jsonl")]
    return argv, ["p.jsonl:2", "0xe9", "save the file as UTF-8"]


def case_prompts_file_is_a_folder(tmp_path):
    argv = ["generate", "--prompts-file", str(tmp_path), "--out", str(tmp_path / "o.jsonl")]
    return argv, ["is a folder", "JSONL file"]


def case_prompts_row_chat_is_not_a_boolean(tmp_path):
    prompts = _prompts(tmp_path, '{"prompt": "hi", "chat": "no"}\n')
    argv = ["generate", "--prompts-file", str(prompts), "--out", str(tmp_path / "o.jsonl")]
    return argv, [":1:", '"chat" must be true or false', "'no'"]


def case_bench_unknown_prompt_set(tmp_path):
    return ["bench", "--prompts", "nope:3", "--methods", "baseline"], [
        "unknown prompt set 'nope:3'",
        "sharegpt:N",
    ]


def case_bench_skip_is_not_a_number(tmp_path):
    argv = ["bench", "--prompts", "sharegpt:3:skip=x", "--methods", "baseline"]
    return argv, ["skip 'x' is not a whole number", "sharegpt:N"]


def case_bench_empty_prompts_file(tmp_path):
    empty = _prompts(tmp_path, "\n")
    return ["bench", "--prompts", str(empty), "--methods", "baseline"], ["holds no prompts", "at least one"]


def case_distill_out_is_its_source(tmp_path):
    chats = _prompts(tmp_path, '{"id": "c0", "messages": [{"role": "user", "content": "hi"}]}\n')
    return ["distill", "--source", str(chats), "--out", str(chats)], ["--out", "is the input"]


def case_tune_unknown_prompt_set(tmp_path):
    return ["tune", "--heads", str(tmp_path), "--prompts", "nope"], [
        "unknown prompt set 'nope'",
        "sharegpt:N",
    ]


CLI_CASES = [value for name, value in sorted(globals().items()) if name.startswith("case_")]


@pytest.mark.parametrize("case", CLI_CASES, ids=[c.__name__.removeprefix("case_") for c in CLI_CASES])
def test_cli_refuses_in_one_line_and_destroys_nothing(case, tmp_path, capsys, monkeypatch):
    """Each case is refused before any model loads (so in well under a second past imports)."""
    import inspect

    extra = {"monkeypatch": monkeypatch} if "monkeypatch" in inspect.signature(case).parameters else {}
    argv, words = case(tmp_path, **extra)
    before = _snapshot(tmp_path)
    capsys.readouterr()  # what building the case printed
    from transformers import AutoModelForCausalLM

    def no_model(*args, **kwargs):
        raise AssertionError("a model loaded before the bad input was refused")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_model)
    code = cli.main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"selfdraft {argv[0]}: ") and "Traceback" not in err
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert _snapshot(tmp_path) == before  # nothing written, nothing removed, no temporary left


def test_publish_overwrite_replaces_only_the_heads_folder_files(tmp_path, capsys):
    """--overwrite onto a user's folder that once held a published card: the heads-folder names are
    replaced (a stale stage config is removed), the user's own files stay; files are 0644; the card's
    base_model is the run config's target (no --target)."""
    run, config = _fake_run(tmp_path, target_name="some-org/some-model")
    dest = _user_folder(tmp_path / "mine")
    (dest / "training_config.stage1.yaml").write_text("old stage")
    (dest / "README.md").write_text("old card")
    assert cli.main(_publish(run, config, dest, "--overwrite")) == 0, capsys.readouterr().err
    assert (dest / "notes.txt").read_text() == "mine" and (dest / "src" / "main.py").is_file()
    assert not (dest / "training_config.stage1.yaml").exists() and not (dest / "stages.json").exists()
    card = (dest / "README.md").read_text()
    assert "base_model: some-org/some-model" in card and "SmolLM2" not in card
    for name in ("config.json", "model.safetensors", "README.md", "training_config.yaml"):
        assert (dest / name).stat().st_mode & 0o777 == 0o644, name
    assert dest.stat().st_mode & 0o777 != 0o700 and not list(tmp_path.glob(".*tmp"))
    assert (run / "checkpoints" / "latest").is_file()
    # a run trained on a local folder names its hub id with --target
    run2, config2 = _fake_run(tmp_path / "local", target_name=str(tmp_path))
    card2 = tmp_path / "card2"
    assert cli.main(_publish(run2, config2, card2, "--target", "org/hub-id")) == 0
    assert (card2 / "config.json").stat().st_mode & 0o777 == 0o644
    assert "base_model: org/hub-id" in (card2 / "README.md").read_text()


def test_staged_folder_is_all_or_nothing(tmp_path):
    dest = _user_folder(tmp_path / "dest")
    (dest / "config.json").write_text("old")
    (dest / "stages.json").write_text("old")
    before = _snapshot(tmp_path)
    with pytest.raises(KeyboardInterrupt), staged_folder(dest) as tmp:
        (tmp / "config.json").write_text("new")
        raise KeyboardInterrupt  # Ctrl-C half-way: dest as it was, no temporary left
    assert _snapshot(tmp_path) == before
    with staged_folder(dest) as tmp:
        (tmp / "config.json").write_text("new")
        (tmp / "studies").mkdir()
    assert (dest / "config.json").read_text() == "new" and (dest / "studies").is_dir()
    assert not (dest / "stages.json").exists()  # owned and not rewritten: not left stale beside new weights
    assert (dest / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dest"]


def test_staged_file_never_truncates_what_it_replaces(tmp_path):
    out = tmp_path / "answers.jsonl"
    out.write_text("earlier answers\n")
    with pytest.raises(KeyboardInterrupt), staged_file(out) as fh:
        fh.write("half")
        raise KeyboardInterrupt
    assert out.read_text() == "earlier answers\n" and sorted(tmp_path.iterdir()) == [out]
    with staged_file(out) as fh:
        fh.write("new\n")
    assert out.read_text() == "new\n" and out.stat().st_mode & 0o777 == 0o644


@pytest.fixture
def read_only_folder(tmp_path):
    """A folder this process cannot create files in: mode 0555, or for root (whom modes do not stop)
    the immutable attribute."""
    import os
    import shutil
    import subprocess

    folder = tmp_path / "read-only"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)
        return
    if not shutil.which("chattr") or subprocess.run(["chattr", "+i", str(folder)]).returncode:
        pytest.skip("root without chattr +i: no way to make a read-only folder here")
    try:
        yield folder
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)


def _run_config(root: Path, output_dir: Path) -> Path:
    path = root / "train.yaml"
    path.write_text(f"target: smollm2-135m-instruct\noutput_dir: {output_dir}\nheads:\n  layout: selfdraft\n")
    return path


def test_read_only_destinations_are_named_before_any_work(tmp_path, read_only_folder, capsys):
    run, config = _fake_run(tmp_path)
    prompts = _prompts(tmp_path)
    for argv in (
        _publish(run, config, read_only_folder / "card"),
        ["export", "--to", "vllm", str(run / "heads"), str(read_only_folder / "vllm")],
        ["generate", "--prompts-file", str(prompts), "--out", str(read_only_folder / "a.jsonl")],
        ["distill", "--source", str(prompts), "--out", str(read_only_folder / "new" / "d.jsonl")],
        ["bench", "--prompts", str(prompts), "--output-dir", str(read_only_folder / "bench")],
        ["train", "--config", str(_run_config(tmp_path, read_only_folder / "run"))],
        ["tune", "--heads", str(run / "heads"), "--out", str(read_only_folder / "tree.yaml")],
        ["compare", str(config), "--out", str(read_only_folder / "cmp")],
    ):
        code = cli.main(argv)
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and "cannot write into" in err, err
        assert "writable folder" in err and not list(read_only_folder.iterdir())


def test_publish_onto_a_full_disk_leaves_nothing_behind(tmp_path):
    """A real full disk: a 24 kB tmpfs (the heads take 47 kB) in a private mount namespace (root with unshare only)."""
    import shutil
    import subprocess
    import sys

    if not shutil.which("unshare") or subprocess.run(["unshare", "-m", "true"]).returncode:
        pytest.skip("needs unshare -m (root) for a private small file system")
    run, config = _fake_run(tmp_path)
    disk = tmp_path / "disk"
    disk.mkdir()
    script = (
        f"mount -t tmpfs -o size=24k tmpfs {disk} && "
        f"{sys.executable} -m selfdraft.scripts.cli publish --run {run} --config {config} "
        f"--dest {disk}/card --dtype float32; echo rc=$?; ls -A {disk}"
    )
    done = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=300)
    err = done.stderr.strip().splitlines()
    assert len(err) == 1 and "no space left" in err[0] and "free some space" in err[0], done.stderr
    assert done.stdout.split() == ["rc=2"]  # exit 2 and the small disk is empty: no card, no *.tmp


def test_read_only_selfdraft_cache_is_named(read_only_folder, monkeypatch, capsys):
    monkeypatch.setenv("SELFDRAFT_CACHE", str(read_only_folder / "cache"))
    code = cli.main(["generate", "--prompt", "hi"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "cannot write the target cache" in err, err
    assert "$SELFDRAFT_CACHE" in err and not list(read_only_folder.iterdir())


def test_api_arguments_of_the_wrong_type_are_refused_not_guessed():
    """Each of these raised a TypeError, or silently did something else (2.5 -> 3 tokens, True -> 1,
    float ids truncated, out-of-vocabulary stop ids never matching, None generating for "None")."""
    target = tiny_target("llama")
    model = SelfDraftModel(target, None, medusa(target, 4))
    prompt = torch.tensor([[4, 8, 15]])
    cases = [
        ({"max_new_tokens": "8"}, "max_new_tokens must be a whole number"),
        ({"max_new_tokens": 2.5}, "max_new_tokens must be a whole number"),
        ({"max_new_tokens": True}, "max_new_tokens must be a whole number"),
        ({"max_new_tokens": torch.tensor(2.5)}, "max_new_tokens must be a whole number"),
        ({"temperature": "0.7"}, "temperature must be a number"),
        ({"top_p": "0.9", "temperature": 1.0}, "top_p must be a number"),
        ({"stop_token_ids": 2}, "stop_token_ids must be a list"),
        ({"stop_token_ids": [2.0]}, "not a token id of this target"),
        ({"stop_token_ids": [-1]}, "not a token id of this target"),
        ({"stop_token_ids": [96]}, "not a token id of this target (0..95)"),
    ]
    for kwargs, message in cases:
        with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
            model.generate(prompt, **{"max_new_tokens": 4, **kwargs})
    with pytest.raises(UserError, match="not integer token ids"):
        model.generate(torch.tensor([[4.0, 8.5]]), 4)
    with pytest.raises(UserError, match="not integer token ids"):
        model.generate([[4.0, 8.5], [1, 2]], 4)  # a batch row
    with pytest.raises(UserError, match="must be text"):
        model.chat_ids(None)
    # what is right still works: numpy-like integer scalars, a tuple of stop ids
    assert len(model.generate(prompt, torch.tensor(3), stop_token_ids=(95,)).tokens) <= 3
    assert len(model.generate(prompt, 3, stop_token_ids=torch.tensor([95])).tokens) <= 3


def test_heads_path_that_is_a_file_is_named_as_such(tmp_path):
    from selfdraft.heads import load_heads

    heads = tmp_path / "heads"
    save_heads(random_heads(tiny_target("llama"), "eagle", 0), heads)
    with pytest.raises(UserError, match="is a file; pass the folder that holds it"):
        load_heads(heads / "model.safetensors")


def test_prompt_rows_read_chat_flags_exactly(tmp_path):
    from selfdraft.bench.prompts import read_prompt_rows

    path = _prompts(tmp_path, '{"prompt": "a", "chat": false}\n{"prompt": "b"}\n')
    assert [r["chat"] for r in read_prompt_rows(path)] == [False, True]
    for bad in ('"no"', "0", "null"):
        path.write_text(f'{{"prompt": "a", "chat": {bad}}}\n')
        with pytest.raises(UserError, match='"chat" must be true or false'):
            read_prompt_rows(path)


@pytest.mark.slow  # the second command loads the embedded real target
def test_ctrl_c_is_one_line_and_leaves_the_prompts(tmp_path):
    """A real SIGINT: while the command's imports run, and during generation (prompts file and --out
    untouched, no temporary left)."""
    import signal
    import subprocess
    import sys
    import time

    command = [sys.executable, "-m", "selfdraft.scripts.cli"]
    # SIGINT at its default in the child: a background job (nohup make test &) inherits it ignored
    interruptible = {"preexec_fn": lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)}
    early = subprocess.Popen(
        [*command, "generate", "--prompt", "hi"], stderr=subprocess.PIPE, text=True, **interruptible
    )
    time.sleep(0.5)
    early.send_signal(signal.SIGINT)
    _, err = early.communicate(timeout=120)
    assert early.returncode == 130 and "Traceback" not in err and err.strip().endswith("interrupted"), err

    prompts = _prompts(tmp_path, "".join(f'{{"prompt": "Count to {i}00."}}\n' for i in range(40)))
    out = tmp_path / "answers.jsonl"
    out.write_text("earlier\n")
    argv = ["generate", "--prompts-file", str(prompts), "--out", str(out), "--overwrite", "--batch-size", "1"]
    late = subprocess.Popen([*command, *argv], stderr=subprocess.PIPE, text=True, **interruptible)
    deadline = time.time() + 120
    while time.time() < deadline and not list(tmp_path.glob(".answers.jsonl.*")):
        time.sleep(0.2)  # generation has started once the temporary output exists
    late.send_signal(signal.SIGINT)
    _, err = late.communicate(timeout=120)
    assert late.returncode == 130 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == "selfdraft generate: interrupted"
    assert out.read_text() == "earlier\n" and sorted(p.name for p in tmp_path.iterdir()) == [
        "answers.jsonl",
        "prompts.jsonl",
    ]


def test_demo_shows_each_timing_run(capsys):
    """compare() announces every run; the demo's progress prints all but the streamed one."""
    import io

    from selfdraft.bench.timing import compare
    from selfdraft.scripts.demo import TimingProgress

    target = tiny_target("llama")
    model = SelfDraftModel(target, None, medusa(target, 4))
    calls = []
    compare(model, torch.tensor([[4, 8, 15]]), 3, repeats=2, progress=lambda r, m: calls.append((r, m)))
    assert calls == [(0, "baseline"), (0, "speculative"), (1, "baseline"), (1, "speculative")]
    log = io.StringIO()  # not a terminal: one line per run
    progress = TimingProgress(2, log)
    for r, method in calls:
        progress(r, method)
    assert log.getvalue().splitlines() == [
        "[timing 1/2: target's own generate...]",
        "[timing 2/2: target's own generate...]",
        "[timing 2/2: speculative decoding...]",
    ]


def test_demo_import_path_keeps_deepspeed_out(tmp_path):
    """save_plain (the embedded target's cache) writes what save_pretrained would, without importing
    DeepSpeed (whose import prints "Setting accelerator to CPU")."""
    import subprocess
    import sys

    code = f"""
import sys, torch
from pathlib import Path
from transformers import AutoModelForCausalLM, LlamaConfig
from selfdraft.target import save_plain
import selfdraft.scripts.demo, selfdraft.scripts.cli
selfdraft.scripts.cli.build_parser()
torch.manual_seed(0)
config = LlamaConfig(vocab_size=96, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
model = AutoModelForCausalLM.from_config(config)
save_plain(model, Path({str(tmp_path / "plain")!r}))
assert not [m for m in sys.modules if m.startswith("deepspeed")], "deepspeed imported"
back = AutoModelForCausalLM.from_pretrained({str(tmp_path / "plain")!r})
ids = torch.tensor([[1, 2, 3]])
assert torch.equal(back(ids).logits, model(ids).logits)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Setting accelerator" not in done.stderr


def test_splitting_data_shows_only_its_render_and_rows_bars(tmp_path, capfd, caplog):
    """Filters, index flattening and saving are quick: no bars of their own; bars stay on after. A
    conversation whose first exchange alone is held out is skipped with a reason a user can act on."""
    import datasets
    from transformers import AutoTokenizer

    from selfdraft.corpora.splits import is_heldout, opens_heldout
    from selfdraft.target import resolve_target_path
    from selfdraft.training.data.dataset import build_dataset, without_bars

    tok = AutoTokenizer.from_pretrained(resolve_target_path("smollm2-135m-instruct"))
    turns = [["q", "a"], ["more", "b"]]
    records = [
        {
            "id": f"c{i}",
            "messages": [
                {"role": r, "content": f"{t} {i}"}
                for pair in turns
                for r, t in zip(("user", "assistant"), pair, strict=True)
            ],
        }
        for i in range(80)
    ]
    opening = [r for r in records if opens_heldout(r, 0.2) and not is_heldout(r, 0.2)]
    assert opening
    datasets.enable_progress_bars()
    capfd.readouterr()
    with caplog.at_level(logging.WARNING, logger="selfdraft.training.data.dataset"):
        train, held = build_dataset([records], tok, 64, 0, 0.2, tmp_path / "run", work_dir=tmp_path / "w")
        with without_bars():
            train.save_to_disk(str(tmp_path / "train"))
    bars = capfd.readouterr().err
    assert "render" in bars and "Filter" not in bars and "Flattening" not in bars and "Saving" not in bars
    assert datasets.is_progress_bar_enabled()
    (line,) = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert line == (
        f"skipped {len(opening)} records: their first exchange alone is in the held-out split; "
        "training on it would leak held-out text"
    )
