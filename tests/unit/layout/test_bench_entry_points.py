"""Every bench script answers ``--help`` both ways it is run from a
checkout: as a module (``python -m bench.<room>.<x>``, the documented way)
and as a file (``PYTHONPATH=. python bench/<room>/<x>.py``, its folder first
on sys.path; bench is not installed, issue 39, so the checkout goes on the
path by hand)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
SCRIPTS = sorted(p for p in (REPO / "bench").rglob("*.py") if 'if __name__ == "__main__"' in p.read_text())


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))}
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_there_are_bench_scripts():
    assert len(SCRIPTS) >= 10, SCRIPTS


def test_every_bench_script_runs_as_a_file():
    """As ``python bench/<room>/<x>.py --help`` would: the script's folder
    first on sys.path, run as __main__.  One process for all (a process each
    imported torch 21 times, some 30 CPU seconds of the suite); what one run
    imported from bench/ is forgotten before the next, so a name that its
    folder would shadow is looked up again from the next script's folder."""
    probe = ("import contextlib, io, runpy, sys\n"
             "bench = sys.argv[1]\n"
             "for path in sys.argv[2:]:\n"
             "    sys.path[0] = path.rsplit('/', 1)[0]\n"
             "    sys.argv = [path, '--help']\n"
             "    out = io.StringIO()\n"
             "    try:\n"
             "        with contextlib.redirect_stdout(out):\n"
             "            runpy.run_path(path, run_name='__main__')\n"
             "    except SystemExit as exit:\n"
             "        assert exit.code in (0, None), (path, exit.code)\n"
             "    assert 'usage:' in out.getvalue(), (path, out.getvalue()[-300:])\n"
             "    for name, module in list(sys.modules.items()):\n"
             "        if (getattr(module, '__file__', None) or '').startswith(bench):\n"
             "            del sys.modules[name]\n"
             "    print('ok', path)\n")
    paths = [str(p) for p in SCRIPTS]
    result = _run([sys.executable, "-c", probe, str(REPO / "bench"), *paths])
    assert result.returncode == 0, result.stderr[-2000:]
    assert [line.split()[1] for line in result.stdout.splitlines() if line.startswith("ok ")] == paths


def test_every_bench_script_runs_as_a_module():
    modules = [".".join(p.relative_to(REPO).with_suffix("").parts) for p in SCRIPTS]
    probe = ("import runpy, sys\n"
             "for name in sys.argv[1:]:\n"
             "    sys.argv = [name, '--help']\n"
             "    try:\n"
             "        runpy.run_module(name, run_name='__main__', alter_sys=True)\n"
             "    except SystemExit as exit:\n"
             "        assert exit.code in (0, None), (name, exit.code)\n"
             "        print('ok', name)\n"
             "    else:\n"
             "        raise AssertionError(f'{name} --help did not exit')\n")
    result = _run([sys.executable, "-c", probe, *modules])
    assert result.returncode == 0, result.stderr[-2000:]
    assert [line.split()[1] for line in result.stdout.splitlines() if line.startswith("ok ")] == modules
