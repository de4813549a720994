"""Turn a training run into a publishable heads folder with a Hugging Face model card.

The folder holds what a Hub user expects and nothing else: `config.json`, `model.safetensors` (fp16
by default), `tree.yaml` when a tree was tuned, the run config as `training_config.yaml`, and a
`README.md` card (standard YAML front matter, a body of at most `CARD_LIMIT` bytes) whose numbers all
come from files the run and the benchmark wrote (log.jsonl, bench.json): nothing in it is typed by
hand. Stage histories and studies belong in the project's docs, not in the folder.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from selfdraft.bench.divergence import NEAR_TIE_NOTE
from selfdraft.bench.report import dtypes_lines, identical_cell, trees_lines
from selfdraft.corpora.mtbench import refuse_for_selection
from selfdraft.destinations import check_destination, staged_folder
from selfdraft.errors import UserError
from selfdraft.heads import load_heads, save_heads
from selfdraft.heads.registry import HEAD_TYPES
from selfdraft.inference.model import shipped_heads_path
from selfdraft.target import EMBEDDED
from selfdraft.training.checkpoint import RUN_FILE, changed_settings
from selfdraft.tree_syntax import check_tree_file

# embedded name -> the hub id a model card names as its base_model
BASE_MODELS = {name: model.hub_id for name, model in EMBEDDED.items()}
DATASETS = {"sharegpt": "anon8231489123/ShareGPT_Vicuna_unfiltered"}
# the files of a published folder (tree.yaml only when a tree was tuned)
FOLDER_FILES = ("config.json", "model.safetensors", "tree.yaml", "training_config.yaml", "README.md")
RUN_CONFIG_NAME = "training_config.yaml"
CARD_LIMIT = 8 * 1024  # bytes of card: what a reader takes in on a Hub page; depth goes to docs


def _session_seconds(session: list[dict], heads_file: Path) -> float:
    """Wall time of one session of a run's log: its own total when it ended ("done"); else, for a
    session stopped early, from its start to its last timed row, or to the heads it last exported."""
    done = [r for r in session if r.get("event") == "done"]
    if done:
        return done[-1].get("train_seconds", 0.0)
    start = session[0].get("time")
    last = max((r["time"] for r in session[1:] if "time" in r), default=None)
    if last is None and heads_file.is_file():
        last = heads_file.stat().st_mtime
    return max(0.0, last - start) if start is not None and last is not None else 0.0


def tokens_trained(
    run_dir: Path, steps: int, world: int, micro_batch: int, accumulation: int, seed: int, grouping: int = 0
) -> tuple[int, int] | None:
    """(tokens the first `steps` steps fed the heads, tokens in the training split), replayed from the
    run's split and its sample order (`SampleStream`); None when the run folder no longer holds it."""
    import datasets

    from selfdraft.training.batches import SampleStream, split_lengths

    split = run_dir / "data" / "train"
    if not split.is_dir():
        return None
    lengths = split_lengths(datasets.load_from_disk(str(split)))
    total = 0
    for rank in range(world):
        stream = SampleStream(len(lengths), seed, world, rank, micro_batch, lengths, grouping)
        for m in range(steps * accumulation):
            total += sum(lengths[i] for i in stream.micro_batch(m))
    return total, sum(lengths)


def run_summary(run_dir: Path, sequences_per_step: int = 0) -> dict:
    """Steps, wall time, world size, precision and the last held-out evaluation, from log.jsonl.

    A run stopped before its last step counts up to its last checkpoint: the heads it exported there
    are what gets published."""
    log = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    meta = json.loads((run_dir / RUN_FILE).read_text())
    starts = [i for i, r in enumerate(log) if r.get("event") in ("start", "resume")]
    sessions = [log[a:b] for a, b in zip(starts, [*starts[1:], len(log)], strict=True)]
    complete = any(r.get("event") == "done" for r in log)
    saved = [r["step"] for r in log if r.get("event") == "checkpoint"]
    steps = max((r["step"] for r in log), default=0) if complete or not saved else max(saved)
    evals = [r for r in log if "eval_top1_by_depth" in r and r["step"] <= steps]
    examples = log[starts[0]].get("examples") if starts else None
    seen = steps * sequences_per_step * meta["world_size"]
    return {
        "steps": steps,
        "complete": complete,
        "sequences_seen": seen,
        "epochs": seen / examples if examples else 0.0,
        "train_seconds": sum(_session_seconds(s, run_dir / "heads" / "model.safetensors") for s in sessions),
        "sessions": len(starts),
        "world_size": meta["world_size"],
        "precision": meta.get("precision", "float32"),  # runs before train.precision were float32
        "device": log[starts[0]].get("device", "cpu") if starts else "cpu",
        # counted by the run itself at the published step (logs since tokens_fed was kept); else replayed
        "tokens_fed": next((r["tokens_fed"] for r in log if "tokens_fed" in r and r["step"] == steps), None),
        "examples": examples,
        "last_eval": evals[-1] if evals else None,
        "throughput_tokens_per_s_per_rank": next(
            (r["tokens_per_s_rank"] for r in reversed(log) if "tokens_per_s_rank" in r), None
        ),
    }


@dataclass(frozen=True)
class Stage:
    """One training run of a checkpoint's history (a later stage starts from an earlier one's heads)."""

    config_path: str
    config_text: str
    summary: dict
    command: str


def read_stage(run_dir: str | Path, config_path: str | Path, train_command: str = "") -> Stage:
    from selfdraft.training.config import load_run_config

    train = load_run_config(config_path).train
    run_dir = Path(run_dir)
    summary = run_summary(run_dir, train.micro_batch_size * train.gradient_accumulation_steps)
    summary["planned_steps"] = train.max_steps
    replayed = tokens_trained(
        run_dir,
        summary["steps"],
        summary["world_size"],
        train.micro_batch_size,
        train.gradient_accumulation_steps,
        train.seed,
        train.length_grouping,
    )
    summary["tokens_trained"], summary["split_tokens"] = replayed or (None, None)
    if summary["tokens_fed"] is not None:
        summary["tokens_trained"] = summary["tokens_fed"]
    return Stage(
        config_path=str(config_path),
        config_text=Path(config_path).read_text(),
        summary=summary,
        command=train_command or f"selfdraft train --config {config_path} --nproc {summary['world_size']}",
    )


def _sources_line(stage: Stage) -> str:
    """The stage's `data.sources` as the card names them (a config that cannot be read: its sources unnamed)."""
    try:
        sources = (yaml.safe_load(stage.config_text) or {}).get("data", {}).get("sources") or []
    except yaml.YAMLError:
        sources = []
    return "sources " + ", ".join(f"`{s}`" for s in sources) if sources else "the run's sources"


def _hardware(summary: dict) -> str:
    """Where a stage trained, from its log's start event (this project's CPU runs: 2 cores)."""
    device = summary.get("device", "cpu")
    return "CUDA GPU" if device.startswith("cuda") else "2-core CPU"


def _training_lines(stages: Sequence[Stage], tokens: int | None) -> list[str]:
    last = stages[-1].summary
    tokens = tokens if tokens is not None else last.get("split_tokens")
    data = (
        f"{last['examples']} sequences"
        if tokens is None
        else f"{tokens} tokens in {last['examples']} sequences"
    )
    lines = [
        f"- Data: {_sources_line(stages[-1])} (held-out split excluded), rendered with the target's chat template; "
        f"labels are the target's own next-token distribution. Last stage's training split: {data}.",
    ]
    for i, stage in enumerate(stages, 1):
        s = stage.summary
        name = f"Stage {i} of {len(stages)}" if len(stages) > 1 else "Training"
        planned = s.get("planned_steps")
        partial = (
            "" if s.get("complete", True) or not planned else f" (stopped at a checkpoint; {planned} planned)"
        )
        fed = f", {s['tokens_trained']} tokens" if s.get("tokens_trained") else ""
        lines.append(
            f"- {name}: `{stage.command}`: {s['steps']} steps{partial}, world size {s['world_size']}, "
            f"{s['sequences_seen']} sequences ({s['epochs']:.1f} passes over its {s['examples']}){fed}, "
            f"wall time {s['train_seconds'] / 60:.1f} min over {s['sessions']} session(s) "
            f"({_hardware(s)}, {s.get('precision', 'float32')})."
        )
    if len(stages) > 1:
        lines.append(
            f"- In all: {sum(st.summary['steps'] for st in stages)} steps, "
            f"{sum(st.summary['sequences_seen'] for st in stages)} sequences, "
            f"{sum(st.summary['train_seconds'] for st in stages) / 60:.1f} min of training."
        )
    if last["last_eval"]:
        e = last["last_eval"]
        acc = ", ".join(f"{a:.3f}" for a in e["eval_top1_by_depth"])
        lines.append(
            f"- Held-out top-1 agreement with the target by depth: {acc}; simulated chain tau "
            f"{e['eval_simulated_tau_chain']:.2f}."
        )
    lines.append(f"- Run config{' of the last stage' if len(stages) > 1 else ''}: `{RUN_CONFIG_NAME}` here.")
    return lines


TAU_NOTE = "tau counts the bonus/correction token (tokens per target forward)."
SELECTION_NOTE = (
    "These prompts chose the heads (or their tree), so the card quotes only their tau and greedy "
    "identity: a speedup measured on the prompts that chose is not evidence of one elsewhere."
)


def _bench_lines(bench: dict, command: str, number: int, selection: bool = False) -> list[str]:
    """One benchmark report as card lines: a numbered heading (several can share a dtype), command,
    dtypes, the table, trees, verify cost, verdict. selection: the prompts chose the heads or tree,
    so tok/s, speedups and the verdict are left out."""
    rows = list(bench.get("summary", []))
    dtypes = bench.get("dtypes", {})
    temperatures = ", ".join(f"{t:g}" for t in bench.get("config", {}).get("temperatures", []))
    heading = f"### {number}. " + (f"Target in {dtypes['target']}" if "target" in dtypes else "Benchmark")
    heading += f", T = {temperatures}" if temperatures else ""
    lines = ["", heading + (" (selection prompts)" if selection else "")]
    lines += ["", f"Command: `{command}`" if command else "Benchmark:"]
    lines += dtypes_lines(bench)
    if selection:
        rows = [r for r in rows if r.get("tau") is not None]
        lines += ["", "| prompts | method | T | tau | identical (T=0) |", "|---|---|---|---|---|"]
        lines += [
            f"| {r['prompts']} | {r['method']} | {r['temperature']:g} | {r['tau']:.2f} | {identical_cell(r)} |"
            for r in rows
        ]
        lines += ["", f"{TAU_NOTE} {SELECTION_NOTE}"]
    else:
        lines += [
            "",
            "| prompts | method | T | tau | tok/s | speedup vs target generate | identical (T=0) |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            tau = f"{r['tau']:.2f}" if r.get("tau") is not None else "-"
            lines.append(
                f"| {r['prompts']} | {r['method']} | {r['temperature']:g} | {tau} | "
                f"{r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | {identical_cell(r)} |"
            )
        lines += [
            "",
            f"{TAU_NOTE} Speedups are ratios measured in the same run with methods interleaved per "
            "prompt, on a shared 2-core CPU.",
        ]
    if any(r.get("near_tie_prompts") for r in rows):
        lines += ["", NEAR_TIE_NOTE]
    lines += trees_lines(bench)
    curve = bench.get("verify_cost_seconds", {})
    if curve:
        one = curve.get("1") or next(iter(curve.values()))
        lines += [
            "",
            "Verify cost on the same machine (one target pass over b tokens, relative to b = 1): "
            + ", ".join(f"{b}: {t / one:.2f}x" for b, t in curve.items())
            + ".",
        ]
    verdict = "" if selection else _verdict(rows)
    return lines + (["", verdict] if verdict else [])


def _verdict(rows: list[dict]) -> str:
    """Derived from the measured rows, per selfdraft method: faster than plain greedy decoding here?"""
    ours: dict[str, list[float]] = {}
    for r in rows:
        if r.get("tau") is not None and r["temperature"] == 0.0 and r["speedup"] is not None:
            ours.setdefault(r["method"], []).append(r["speedup"])
    if not ours:
        return ""
    parts = [f"`{m}` {min(v):.2f}x-{max(v):.2f}x" for m, v in ours.items()]
    text = "Greedy (T=0) speedup on this machine across prompt sets: " + "; ".join(parts) + "."
    if all(max(v) < 1.0 for v in ours.values()):
        text += (
            " **These heads are slower than the target's own greedy decoding here**: their acceptance "
            "length does not yet pay for drafting and for verifying a block."
        )
    return text


def _mtbench_row(row: dict) -> bool:
    return str(row.get("prompts", "")).startswith("mtbench")


def _on_mtbench(bench: dict) -> bool:
    return any(_mtbench_row(r) for r in bench.get("summary", []))


def mtbench_headline(benches: Sequence[tuple[dict, str]]) -> list[str]:
    """The card's first numbers: tau and speedup of every selfdraft row measured on MT-bench (the field's
    report set) in the report benches, by target dtype and temperature; [] when none was."""
    parts = []
    for bench, _ in benches:
        dtype = bench.get("dtypes", {}).get("target", "target dtype unknown")
        for r in bench.get("summary", []):
            if _mtbench_row(r) and r.get("tau") is not None:
                parts.append(f"{dtype} T={r['temperature']:g} tau {r['tau']:.2f}, **{r['speedup']:.2f}x**")
    if not parts:
        return []
    return [
        "",
        "**MT-bench** (a report set: nothing here was chosen on it; speedup over the target's own "
        "`generate`, same run, bench under Measured): " + "; ".join(parts) + ".",
    ]


def model_card(
    *,
    target: str,
    kind: str,
    stages: Sequence[Stage],
    tokens: int | None,
    benches: Sequence[tuple[dict, str]],
    repo_path: str,
    selection_benches: Sequence[tuple[dict, str]] = (),
    shipped: bool = True,
    layout: str = "selfdraft",
) -> str:
    """shipped: the folder is the one selfdraft loads by default for this target. layout: the EAGLE
    heads' layout (`eagle3` ones export to vLLM / SGLang)."""
    base = BASE_MODELS.get(target, target)
    servable = layout in HEAD_TYPES and HEAD_TYPES[layout].servable
    tags = ["speculative-decoding", kind, "draft-model"] + ([layout] if servable else [])
    lines = [
        "---",
        f"base_model: {base}",
        "library_name: selfdraft",
        "license: apache-2.0",
        "datasets:",
        f"- {DATASETS['sharegpt']}",
        f"tags: [{', '.join(tags)}]",
        "---",
        "",
        f"# selfdraft {kind} heads for {target}",
        "",
        f"Draft heads for lossless speculative decoding of **{base}** with "
        "selfdraft. The heads only change speed: greedy output is "
        "token-identical to the target's own decoding (float32; in bfloat16 up to the target's own "
        "near-ties, see Measured) and sampled output follows the target's distribution.",
        *mtbench_headline(benches),
        "",
        "## Load",
        "",
        "```python",
        "from selfdraft.inference import SelfDraftModel",
        f'm = SelfDraftModel.from_pretrained("{target}", heads="{repo_path}")',
        f'# shipped with selfdraft: SelfDraftModel.from_pretrained("{target}") loads these heads by default'
        if shipped
        else "# not the shipped default: kept for a later stage to continue from (heads.init_from)",
        'out = m.generate(m.chat_ids("Hello!"), max_new_tokens=64)',
        "```",
        "",
        "## Training",
        "",
        f"- Target: `{target}` ({base}), frozen; heads kind: {kind}.",
    ]
    lines += _training_lines(stages, tokens)
    lines += ["", "## Measured"]
    # MT-bench reports first: the numbers the field compares
    reports = sorted(benches, key=lambda bench_command: not _on_mtbench(bench_command[0]))
    numbered = [(b, c, True) for b, c in selection_benches] + [(b, c, False) for b, c in reports]
    for number, (bench, command, chose) in enumerate(numbered, 1):
        lines += _bench_lines(bench, command, number, selection=chose)
    if not numbered:
        lines += ["", "No benchmark was recorded for this checkpoint."]
    return "\n".join(lines) + "\n"


def check_card_size(card: str) -> None:
    """A card over `CARD_LIMIT` bytes is refused before anything is written."""
    size = len(card.encode())
    if size > CARD_LIMIT:
        raise UserError(
            f"the model card would be {size:,} bytes, over the {CARD_LIMIT:,} a card should stay within; "
            "pass fewer --bench / --selection-bench reports (each bench.md keeps its full tables)"
        )


def card_target(config_path: str | Path, target: str | None) -> str:
    """The target the card names: the run config's own `target` (what the heads were trained on).
    `target` may only name it differently when the run trained on a local folder (a card's base_model
    is a hub id, which a path is not); any other disagreement is refused."""
    from selfdraft.target import EMBEDDED
    from selfdraft.training.config import load_run_config

    trained = load_run_config(config_path).target
    local = trained.lower() not in EMBEDDED and Path(trained).exists()
    if target is None or target == trained:
        if local:
            raise UserError(
                f"the run trained on the local folder {trained!r} ({config_path}), which a model card "
                "cannot name as base_model; pass --target HUB_ID, the hub id of that model"
            )
        return trained
    if not local:
        raise UserError(
            f"--target {target!r} is not the target the run trained on ({trained!r} in {config_path}); "
            "drop --target, the card names the run's own target"
        )
    return target


def check_run(run_dir: Path, config_path: str | Path, option: str) -> None:
    """`run_dir` is a training run folder trained with `config_path` (the settings its run.json keeps,
    budget aside), or a UserError naming the fix."""
    from selfdraft.training.config import load_run_config

    meta_path = run_dir / RUN_FILE
    if not meta_path.is_file() or not (run_dir / "log.jsonl").is_file():
        raise UserError(
            f"{option} {run_dir} is not a training run (no {RUN_FILE} or log.jsonl); pass a run's output_dir"
        )
    meta = json.loads(meta_path.read_text())
    if "settings" not in meta:
        return  # a run from before selfdraft kept its settings: nothing to compare the config with
    changed = changed_settings(meta["settings"], load_run_config(config_path).settings())
    if changed:
        raise UserError(
            f"{option} {run_dir} was not trained with {config_path} ({'; '.join(changed)}); pass the config "
            "that run used"
        )


def read_bench(path: str | Path, option: str) -> dict:
    """A bench.json, or one UserError naming the file."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"{option} {path} does not exist; pass the bench.json `selfdraft bench` wrote") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(
            f"{option} {path} is not a bench report ({err}); pass the bench.json `selfdraft bench` wrote"
        ) from None
    if not isinstance(data, dict) or not {"summary", "prompt_sets"} & set(data):
        raise UserError(f"{option} {path} is not a bench report (no summary or prompt sets); pass a bench.json")
    return data


def publish(
    run_dir: str | Path,
    dest: str | Path,
    *,
    config_path: str | Path,
    target: str | None = None,
    benches: Sequence[tuple[str | Path, str]] = (),
    selection_benches: Sequence[tuple[str | Path, str]] = (),
    tree_file: str | Path | None = None,
    dtype: torch.dtype = torch.float16,
    train_command: str = "",
    tokens: int | None = None,
    repo_path: str | None = None,
    earlier: Sequence[tuple[str | Path, str | Path]] = (),
    overwrite: bool = False,
) -> Path:
    """Write `dest` (the files of `FOLDER_FILES`) from the run `run_dir` trained with `config_path`.

    target: None (the run config's target) or, for a run on a local folder, the hub id the card names.
    earlier: (run_dir, config_path) of the stages the run continued from (`heads.init_from`), oldest
    first; the card sums them with this run, and the folder keeps only this run's config.
    benches: (bench.json, the command that wrote it) for each benchmark the card reports.
    selection_benches: the same for benchmarks whose prompts chose these heads or their tree; the card
    gives their tau and identity, never their speedups, ahead of the report benches.
    A card over `CARD_LIMIT` bytes is refused before anything is written.
    overwrite: replace a non-empty `dest`'s heads-folder files (refused without it; see
    `selfdraft.destinations`). `dest` may be the init_from folder (re-publishing a checkpoint), never
    a source such as the run folder.
    """
    run_dir, dest = Path(run_dir), Path(dest)
    report = {path: read_bench(path, "--bench") for path, _ in benches}
    chosen = {path: read_bench(path, "--selection-bench") for path, _ in selection_benches}
    for path, bench in chosen.items():  # a choice made on MT-bench would overstate its reported numbers
        for spec in bench.get("prompt_sets", {}):
            refuse_for_selection(spec, f"--selection-bench {path}")
    check_run(run_dir, config_path, "--run")
    for earlier_run, earlier_config in earlier:
        check_run(Path(earlier_run), earlier_config, "--earlier")
    sources = [run_dir, config_path, *(p for p, _ in benches), *(p for p, _ in selection_benches)]
    sources += [*(r for r, _ in earlier), *(c for _, c in earlier)]
    sources += [tree_file] if tree_file else []
    check_destination(dest, sources, overwrite=overwrite)
    if tree_file:
        check_tree_file(Path(tree_file))  # a binary or invalid file would make generate fail later
    target = card_target(config_path, target)
    heads = load_heads(run_dir / "heads")
    stages = [read_stage(r, c) for r, c in earlier]
    stages.append(read_stage(run_dir, config_path, train_command))
    card = model_card(
        target=target,
        kind=heads.config.head_kind,
        stages=stages,
        tokens=tokens,
        benches=[(report[path], command) for path, command in benches],
        selection_benches=[(chosen[path], command) for path, command in selection_benches],
        repo_path=repo_path or str(dest),
        shipped=dest.resolve() == shipped_heads_path(target, heads.config.head_kind).resolve(),
        layout=heads.config.eagle_layout,
    )
    check_card_size(card)
    with staged_folder(dest) as tmp:
        save_heads(heads, tmp, dtype=dtype)
        (tmp / RUN_CONFIG_NAME).write_text(stages[-1].config_text)
        if tree_file:
            shutil.copy(tree_file, tmp / "tree.yaml")
        (tmp / "README.md").write_text(card)
    return dest


def upload(folder: str | Path, repo_id: str) -> str:
    """Push a published folder to the Hugging Face Hub (needs network and a token)."""
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        api.create_repo(repo_id, exist_ok=True)
        info = api.upload_folder(folder_path=str(folder), repo_id=repo_id)
    except Exception as err:  # noqa: BLE001 - the hub's errors are many; each is the user's to fix
        raise UserError(
            f"--push-to {repo_id}: the upload failed ({type(err).__name__}: {str(err).splitlines()[0][:200]}); "
            f"{folder} is written: push it later with `huggingface-cli upload {repo_id} {folder}`"
        ) from err
    return str(info)
