"""`pdcluster status --watch [S]`: redraws every S seconds until Ctrl-C (exit
0); too short an interval is refused with the fix."""

from __future__ import annotations

import argparse

import pytest

from pdcluster.services.cli import status


def test_watch_redraws_until_ctrl_c(monkeypatch, capsys):
    drawn, naps = [], []
    monkeypatch.setattr(status, "status_once", lambda args: drawn.append(args.watch) or 0)

    def sleep(s: float) -> None:
        naps.append(s)
        if len(naps) == 3:
            raise KeyboardInterrupt

    assert status.run_status(argparse.Namespace(json=False, watch=1.5), sleep=sleep) == 0
    assert drawn == [1.5] * 3 and naps == [1.5] * 3
    assert capsys.readouterr().out.count("\033[2J") == 3


def test_watch_interval_and_parsing(monkeypatch):
    with pytest.raises(SystemExit, match="use 0.5 or more"):
        status.run_status(argparse.Namespace(json=False, watch=0.1))
    parser = argparse.ArgumentParser()
    status.register(parser.add_subparsers())
    assert parser.parse_args(["status", "--watch"]).watch == 2.0
    assert parser.parse_args(["status", "--watch", "5"]).watch == 5.0
    assert parser.parse_args(["status"]).watch is None
