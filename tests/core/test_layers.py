"""The layout: imports run one way (core <- corpora <- heads <- inference <- bench <- training <-
scripts), the inference path needs no training extras, and one generate step crosses few files."""

import ast
import re
import subprocess
import sys
import threading
from pathlib import Path

import torch

from selfdraft.heads.int8 import has_int8_weights, int8_weights
from selfdraft.inference import SelfDraftModel

from tiny_models import random_heads, tiny_target

ROOT = Path(__file__).resolve().parents[2]
# layer rank by package; the core is every module directly in selfdraft/
# corpora (prompt sources, MT-bench, near-duplicates, the split rule) sits just above the core: bench and
# training both read it, and it needs nothing but the core
LAYERS = {"core": 0, "corpora": 1, "heads": 2, "inference": 3, "bench": 4, "training": 5, "scripts": 6}
FOLDERS = {"selfdraft": "core", "corpora": "corpora", "heads": "heads", "inference": "inference", "bench": "bench",
           "training": "training", "scripts": "scripts"}


def layer_of_module(name: str) -> str | None:
    """`selfdraft.heads.published` -> heads; `selfdraft.kv` -> core; other packages -> None."""
    parts = name.split(".")
    if parts[0] != "selfdraft":
        return None
    if len(parts) == 1 or parts[1] not in LAYERS or parts[1] == "core":
        return "core" if len(parts) == 1 or parts[1] not in ("configs", "checkpoints") else None
    return parts[1]


def imported_modules(path: Path, package: str) -> list[tuple[int, str]]:
    """Every module `path` imports, at any depth (function-level imports included), absolute names."""
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import: resolve against this file's package
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            out.append((node.lineno, module))
            # `from selfdraft import kv` imports the module selfdraft.kv
            out += [(node.lineno, f"{module}.{alias.name}") for alias in node.names if module == "selfdraft"]
    return out


def upward_imports(root: Path) -> list[str]:
    """'file:line imports X (layer A -> higher layer B)' for every import against the direction."""
    problems = []
    for folder, layer in FOLDERS.items():
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root / folder).with_suffix("")
            package = ".".join(["selfdraft"] + ([] if layer == "core" else [layer]) + list(rel.parts[:-1]))
            for line, module in imported_modules(path, package):
                target = layer_of_module(module)
                if target is not None and LAYERS[target] > LAYERS[layer]:
                    problems.append(f"{path.relative_to(root)}:{line} imports {module} ({layer} -> {target})")
    return problems


def test_imports_run_one_way():
    assert upward_imports(ROOT) == []


def test_an_upward_import_is_caught(tmp_path):
    """The check is not vacuous: a copy of the tree with one reintroduced cycle fails it."""
    for folder in FOLDERS:
        (tmp_path / folder).mkdir()
        for path in (ROOT / folder).rglob("*.py"):
            dest = tmp_path / folder / path.relative_to(ROOT / folder)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(path.read_text())
    eagle = tmp_path / "heads" / "eagle" / "module.py"
    eagle.write_text(eagle.read_text() + "\nfrom selfdraft.inference import kv_helpers  # noqa\n")
    prompts = tmp_path / "bench" / "prompts.py"
    prompts.write_text(prompts.read_text() + "\ndef f():\n    from selfdraft.training.data import x  # noqa\n")
    found = upward_imports(tmp_path)
    assert len(found) == 2
    assert any("heads/eagle/module.py" in p and "(heads -> inference)" in p for p in found)
    assert any("bench/prompts.py" in p and "(bench -> training)" in p for p in found)


def test_no_lazy_module_getattr():
    """Import cycles are not hidden behind a module-level __getattr__."""
    for folder in FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            names = [n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)]
            assert "__getattr__" not in names, path


def test_inference_and_bench_need_no_training_extras():
    code = (  # heads, inference and bench each import on their own, without the training extras
        "import sys, selfdraft.heads, selfdraft.inference, selfdraft.bench.run, selfdraft.bench.report, "
        "selfdraft.scripts.generate, selfdraft.scripts.bench; "
        "print(sorted(m for m in ('datasets', 'deepspeed', 'peft', 'selfdraft.training') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_one_generate_step_crosses_at_most_eight_files():
    """Trace one speculative step (draft -> verify -> accept -> commit -> retire) in the shipped
    configuration: EAGLE heads with a reduced draft vocabulary and int8 weights (what bf16 CPUs draft
    with), a dynamic tree and a prompt-lookup branch; the project files it executes. Eight: the loop
    with the target's passes (inference/decoding), drafting, acceptance, the trees (selfdraft/tree),
    the KV cache (selfdraft/kv), the EAGLE head (heads/eagle), its view of the vocabulary (borrowed
    embeddings and the draft-vocabulary maps, heads/vocab) and the int8 linears (heads/int8). One
    prompt and a batch run the same loop, so a batch crosses the same files."""
    target = tiny_target("llama")
    heads = int8_weights(random_heads(target, "eagle", 0, draft_vocab_size=48), torch.float32)
    assert has_int8_weights(heads) and heads.draft_vocab is not None
    model = SelfDraftModel(target, None, heads, tree="dynamic+lookup=4")
    prompt = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6]])
    model.generate(prompt, 3)  # warm caches so the traced call is a plain step
    files: set[str] = set()
    in_step = False

    def inside_loop(frame) -> bool:
        while frame is not None:
            if frame.f_code.co_name == "speculative_generate":
                return True
            frame = frame.f_back
        return False

    def tracer(frame, event, arg):
        name = frame.f_code.co_filename
        ours = name.startswith(str(ROOT)) and not name.startswith((str(ROOT / "tests"), str(ROOT / ".venv")))
        if in_step and ours and inside_loop(frame):
            files.add(str(Path(name).relative_to(ROOT)))
        return None

    # everything from the first draft of the traced call on: draft, verify, accept, compact, repeat
    real_start = type(model.tree).start

    def traced_start(self, *args, **kwargs):
        nonlocal in_step
        in_step = True
        return real_start(self, *args, **kwargs)

    type(model.tree).start = traced_start
    sys.setprofile(tracer)
    threading.setprofile(tracer)
    try:
        model.generate(prompt, 3)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        type(model.tree).start = real_start
    assert files, "the tracer saw nothing"
    assert {"heads/vocab.py", "heads/int8.py"} <= files, sorted(files)
    assert len(files) <= FILES_PER_STEP, "\n".join(sorted(files))


FILES_PER_STEP = 8  # project files one shipped generate step may cross
LOOP_LINES = 60  # the decode loop, signature and docstring included


def test_the_design_page_states_what_the_tests_check():
    """docs/design.md cannot drift: its limits are these tests' constants, and every project path it
    names exists."""
    from selfdraft.training.release.publish import CARD_LIMIT

    text = (ROOT / "docs" / "design.md").read_text()
    flat = " ".join(text.split())
    assert f"at most {LOOP_LINES} lines" in flat
    assert f"at most {FILES_PER_STEP} project files" in flat
    assert f"at most {CARD_LIMIT // 1024} KB" in flat
    named = set(re.findall(r"`((?:[a-z_0-9]+/)+[a-z_0-9]+\.(?:py|md|yaml|json))(?::[A-Za-z_]+)?`", text))
    named |= {f"{a}/{b}" for a, b in re.findall(r"(heads|inference|training|selfdraft)/([a-z_0-9/]+\.py)", text)}
    assert named, "the page names no file"
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, missing


def test_the_decode_loop_reads_in_one_screen():
    """`speculative_generate` is one straight function: at most LOOP_LINES lines, no timing code (the
    opt-in `PhaseTimer` measures phases), and no coroutine anywhere in the decoding path."""
    source = (ROOT / "inference" / "decoding.py").read_text()
    loop = next(
        n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "speculative_generate"
    )
    assert loop.end_lineno - loop.lineno + 1 <= LOOP_LINES
    names = {n.id for n in ast.walk(loop) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(loop) if isinstance(n, ast.Attribute)}
    assert not names & {"time", "perf_counter", "monotonic"}, names & {"time", "perf_counter", "monotonic"}
    for path in ("inference/decoding.py", "inference/drafting.py", "selfdraft/tree.py", "heads/eagle/drafter.py"):
        tree = ast.parse((ROOT / path).read_text())
        assert not [n for n in ast.walk(tree) if isinstance(n, ast.Yield | ast.YieldFrom)
                    and not _in_contextmanager(tree, n)], f"{path} drives a tree with a generator"


def _in_contextmanager(tree: ast.Module, node: ast.AST) -> bool:
    """Whether `node` sits in a function decorated @contextmanager (a timer's phase, not a protocol)."""
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef) and any(
            getattr(d, "id", getattr(d, "attr", None)) == "contextmanager" for d in fn.decorator_list
        ) and any(n is node for n in ast.walk(fn)):
            return True
    return False
