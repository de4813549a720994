"""`pip install .` (a wheel, not the editable tree) ships every subpackage and the shipped heads."""

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_contents(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(ROOT),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = tmp_path.glob("selfdraft-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in (
        "heads/eagle/module.py",
        "heads/eagle3/module.py",
        "heads/medusa/drafter.py",
        "inference/model.py",
        "training/train.py",
        "scripts/cli.py",
    ):
        assert f"selfdraft/{module}" in names, module
    shipped = "selfdraft/checkpoints/smollm2-135m-instruct-eagle/"
    for part in ("config.json", "model.safetensors", "README.md", "tree.yaml"):
        assert shipped + part in names, part
    assert "selfdraft/configs/deepspeed/zero1.json" in names
    assert not any(n.startswith(("selfdraft/tests", "tests/", "selfdraft/.venv")) for n in names)
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "selfdraft = selfdraft.scripts.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()
