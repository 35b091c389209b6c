"""The one door from the product into bench/.

bench/ (load generation, workloads, endpoint profiles, accuracy checks) is
not in the wheel: it runs from a checkout of the repository.  A command
that needs it (``pdcluster bench``, ``pdcluster plan --profile`` or
``--workload``) loads it here, by name, when it runs; nothing under
pdcluster/ imports bench at the top or inside a function
(tests/unit/layout/test_layers.py), so the product never depends on it.

    installed from the wheel    bench is not importable -> one line: run from a checkout
    editable install (pip -e)   pdcluster/ sits in the checkout: its parent holds bench/
    python -m ... in the repo   the working directory is on sys.path already"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

BENCH = "bench"
FIX = "bench/ ships with a checkout of the repository, not the wheel: run it from a clone (pip install -e . there)"


class BenchMissing(RuntimeError):
    """bench/ is not importable: the package was installed from the wheel, away from a checkout."""


def _checkout_root() -> Path | None:
    """The checkout pdcluster was imported from, if it was (an editable install): the folder holding bench/."""
    root = Path(__file__).resolve().parents[3]
    return root if (root / BENCH / "__init__.py").is_file() else None


def bench_module(name: str) -> ModuleType:
    """``bench.<...>`` by name; raises BenchMissing (its message names the fix) when bench/ is absent."""
    if name != BENCH and not name.startswith(BENCH + "."):
        raise ValueError(f"{name} is not a bench module")
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != BENCH:
            raise
    root = _checkout_root()
    if root is None:
        raise BenchMissing(FIX)
    sys.path.append(str(root))
    return importlib.import_module(name)


def bench_or_exit(name: str, command: str) -> ModuleType:
    """bench_module, or exit the command with one line naming the fix."""
    try:
        return bench_module(name)
    except BenchMissing as exc:
        raise SystemExit(f"pdcluster {command}: error: {exc}") from None
