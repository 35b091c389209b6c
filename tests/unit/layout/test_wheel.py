"""The installed product claims one top-level import name (issue 39): the
wheel holds ``pdcluster`` and its dist-info, and no ``bench``.

The wheel is built offline (setuptools from this interpreter, no build
isolation) from a copy of the sources, so the checkout gains no build/ or
egg-info; bench/ is copied too, to show it is left out, not missing."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
SOURCES = ("pyproject.toml", "README.md", "pdcluster", "bench")


def _build_wheel(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.so", "results"))
        else:
            shutil.copy(path, src / name)
    out = tmp_path / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                    "-w", str(out), str(src)], check=True, capture_output=True, text=True, timeout=300)
    (wheel,) = out.glob("pdcluster-*.whl")
    return wheel


def test_the_wheel_has_one_import_root(tmp_path):
    with zipfile.ZipFile(_build_wheel(tmp_path)) as wheel:
        names = wheel.namelist()
        roots = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
        (top_level,) = [n for n in names if n.endswith(".dist-info/top_level.txt")] or [None]
        declared = set(wheel.read(top_level).decode().split()) if top_level else roots
    assert roots == {"pdcluster"}, sorted(roots)
    assert declared == {"pdcluster"}, declared
    assert "pdcluster/planning/planner.py" in names and "pdcluster/services/cli/checkout.py" in names
    assert any(n.startswith("pdcluster/kernels/csrc/") for n in names)  # package data still ships
