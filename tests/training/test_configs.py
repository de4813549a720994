"""Every run config in configs/train runs: it loads with the project's own loader, the files it names
exist, and the heads it continues from (`heads.init_from`) are of its kind, layout and layers."""

import json
import subprocess
from pathlib import Path

import pytest

from selfdraft.heads.config import HeadsConfig
from selfdraft.heads.folder import read_heads_config
from selfdraft.training.config import RunConfig, load_run_config

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "configs" / "train"
CONFIGS = sorted(TRAIN.rglob("*.yaml"))
BUILTIN_SOURCES = ("sharegpt", "python-stdlib")  # `selfdraft.corpora.sources.load_source`: NAME[:N]


def missing_files(config: RunConfig) -> list[str]:
    """The DeepSpeed file and local data sources a config names that are not in the tree."""
    missing = [] if (ROOT / config.deepspeed).is_file() else [f"deepspeed {config.deepspeed}"]
    for source in config.data.sources:
        name, _, count = source.partition(":")
        if name in BUILTIN_SOURCES and (count == "" or count.isdigit()):
            continue
        if not (ROOT / source).exists():
            missing.append(f"data.sources {source}")
    return missing


def built_by_the_recipe(path: Path, missing: str) -> bool:
    """A distilled source a recipe builds itself (its target's answers, too big for one session to
    commit) may be absent when the recipe states the `selfdraft distill ... --out` step that writes it
    (a GPU variant's steps are in its CPU recipe)."""
    source = missing.removeprefix("data.sources ")
    if not source.startswith("data/distill/") or not source.endswith(".jsonl.gz"):
        return False
    recipe = TRAIN / path.name if path.parent.name == "gpu" else path
    return f"--out {source.removesuffix('.gz')}" in recipe.read_text()


def restore_command(path: Path, init_from: str) -> str | None:
    """The `git checkout COMMIT -- FOLDER` line a config states for heads that left the tree, or None."""
    for line in path.read_text().splitlines():
        words = line.lstrip("# ").split()
        if words[:2] == ["git", "checkout"] and words[3:] == ["--", init_from]:
            return words[2]
    return None


def heads_in_git(commit: str, folder: str) -> HeadsConfig:
    """The config of the heads `folder` held at `commit` (git must have it, as a full clone of main does)."""
    shallow = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--is-shallow-repository"], capture_output=True, text=True
    )
    if shallow.stdout.strip() != "false":
        pytest.skip(f"heads at {commit} need the git history, which this checkout lacks (shallow or no git)")
    show = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{commit}:{folder}/config.json"], capture_output=True, text=True
    )
    assert show.returncode == 0, f"{commit} holds no {folder}/config.json: {show.stderr.strip()}"
    weights = subprocess.run(
        ["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}:{folder}/model.safetensors"]
    )
    assert weights.returncode == 0, f"{commit} holds no {folder}/model.safetensors"
    return HeadsConfig.from_dict(json.loads(show.stdout))


def init_from_heads(path: Path, config: RunConfig) -> HeadsConfig:
    """The heads a config continues: in the tree, or at the commit its header names."""
    folder = ROOT / config.heads.init_from
    if (folder / "model.safetensors").is_file():
        return read_heads_config(folder)
    commit = restore_command(path, config.heads.init_from)
    assert commit, (
        f"{path.name}: no heads in {folder}, and no `git checkout COMMIT -- {config.heads.init_from}`"
    )
    return heads_in_git(commit, config.heads.init_from)


def _layer_numbers(layers: list[int], depth: int) -> list[int]:
    """output_hidden_states indices with negatives counted from the end (-1 = depth)."""
    return [layer % (depth + 1) for layer in layers]


def init_from_problem(config: RunConfig, heads: HeadsConfig) -> str | None:
    """Why `selfdraft train` could not continue `heads` under `config` (None: it can).

    The same kind; for EAGLE the same layout, and the same feature layers, or one layer that the
    config's several include (`EagleHead.widened` starts the fusion on it)."""
    h = config.heads
    if heads.head_kind != h.kind:
        return f"holds {heads.head_kind} heads, the config trains {h.kind}"
    if h.kind != "eagle":
        return None
    if heads.eagle_layout != h.layout:
        return f"holds {heads.eagle_layout}-layout heads, the config trains layout {h.layout}"
    depth = heads.target_num_layers
    theirs = _layer_numbers(list(heads.feature_layers), depth)
    ours = _layer_numbers(list(h.feature_layers or []), depth)
    if theirs != ours and not (len(theirs) == 1 and theirs[0] in ours):
        return f"reads target layers {heads.feature_layers}, the config fuses {h.feature_layers}"
    if h.layout == "eagle3" and h.draft_vocab_size not in (None, heads.draft_vocab_size):
        return f"has a draft vocabulary of {heads.draft_vocab_size}, the config asks {h.draft_vocab_size}"
    return None


def test_there_is_one_recipe_per_target_and_a_gpu_variant():
    """The top of configs/train holds the recipes (one per target); gpu/ their GPU variants; the
    studies live in ablations/."""
    top = sorted(p.name for p in TRAIN.glob("*.yaml"))
    assert top == ["qwen2.5-coder-0.5b.yaml", "smollm2-135m.yaml"]
    targets = [load_run_config(TRAIN / name).target for name in top]
    assert len(set(targets)) == len(targets), f"two recipes for one target: {targets}"
    assert sorted(p.name for p in (TRAIN / "gpu").glob("*.yaml")) == top
    for name in top:
        cpu, gpu = load_run_config(TRAIN / name), load_run_config(TRAIN / "gpu" / name)
        assert (cpu.target, cpu.heads, cpu.data.sources) == (gpu.target, gpu.heads, gpu.data.sources)
        assert cpu.train.ttt_steps == gpu.train.ttt_steps
    assert all(p.parent.name in ("train", "gpu") or "ablations" in p.parts for p in CONFIGS)


def test_the_recipe_trains_exportable_heads_from_scratch():
    config = load_run_config(TRAIN / "smollm2-135m.yaml")
    assert config.heads.layout == "eagle3" and config.heads.init_from is None
    assert config.heads.fc_bias is False and config.train.feature_weight == 0


def test_the_recipe_names_the_heads_a_cpu_session_continues():
    """The recipe's header tells the next CPU session which heads to continue (`heads.init_from: X`):
    X is in the tree and the recipe can continue it (kind, layout, layers, draft vocabulary)."""
    path = TRAIN / "smollm2-135m.yaml"
    named = [
        line.split("heads.init_from:", 1)[1].split()[0]
        for line in path.read_text().splitlines()
        if line.startswith("#") and "heads.init_from: data/heads/" in line
    ]
    assert named, "the header names no heads to continue"
    config = load_run_config(path)
    for folder in named:
        assert (ROOT / folder / "model.safetensors").is_file(), f"{folder} is not in the tree"
        config.heads.init_from = folder
        assert init_from_problem(config, read_heads_config(ROOT / folder)) is None


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(TRAIN)))
def test_every_config_loads_and_names_files_that_exist(path):
    config = load_run_config(path)
    assert not [m for m in missing_files(config) if not built_by_the_recipe(path, m)], missing_files(config)
    if config.heads.init_from:
        heads = init_from_heads(path, config)
        assert init_from_problem(config, heads) is None, (path.name, init_from_problem(config, heads))


def test_the_shipped_recipe_continues_heads_that_git_holds():
    """The exact recipe of the shipped heads is kept runnable: it states their layout, and the heads it
    continues, which left the tree, are restored by the git command its header states."""
    config = load_run_config(TRAIN / "ablations" / "smollm2-selfdraft-stage18.yaml")
    assert config.heads.layout == "selfdraft" and config.heads.init_from
    shipped = ROOT / "checkpoints" / "smollm2-135m-instruct-eagle"
    assert (shipped / "training_config.yaml").read_text() == (
        TRAIN / "ablations" / "smollm2-selfdraft-stage18.yaml"
    ).read_text()
    assert read_heads_config(shipped).eagle_layout == "selfdraft"
    assert not (ROOT / config.heads.init_from).exists()
    assert restore_command(TRAIN / "ablations" / "smollm2-selfdraft-stage18.yaml", config.heads.init_from)


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        ({"kind": "medusa"}, "holds eagle heads"),
        ({"layout": "eagle3", "fc_bias": False, "feature_layers": [2, 15, 27]}, "selfdraft-layout"),
        ({"feature_layers": [5]}, "reads target layers"),
        ({"feature_layers": [2, 15, 27]}, "reads target layers"),  # -1 is 30, not 27
    ],
)
def test_incompatible_init_from_is_caught(tmp_path, edit, problem):
    """The check above fails a config whose kind, layout or layers do not match the heads it names;
    the shipped recipe's own heads serve as the folder."""
    path = TRAIN / "ablations" / "smollm2-selfdraft-stage18.yaml"
    config = load_run_config(path)
    heads = init_from_heads(path, config)
    assert init_from_problem(config, heads) is None
    for key, value in edit.items():
        setattr(config.heads, key, value)
    assert problem in (init_from_problem(config, heads) or "")


def test_widening_one_layer_into_several_is_compatible():
    path = TRAIN / "ablations" / "smollm2-selfdraft-stage18.yaml"
    config = load_run_config(path)
    heads = init_from_heads(path, config)
    heads.feature_layers = [-1]  # heads that read the last layer alone, continued on a fused run
    assert init_from_problem(config, heads) is None


def test_missing_files_are_named(tmp_path):
    config = load_run_config(TRAIN / "smollm2-135m.yaml")
    config.data.sources = [*config.data.sources, "data/distill/no-such-part.jsonl.gz", "sharegpt:10"]
    config.deepspeed = "configs/deepspeed/zero9.json"
    assert missing_files(config) == [
        "deepspeed configs/deepspeed/zero9.json",
        "data.sources data/distill/no-such-part.jsonl.gz",
    ]
