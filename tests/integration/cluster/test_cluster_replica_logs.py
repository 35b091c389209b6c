"""Our log lines in each replica's Serve log (pdcluster/services/replica_logs.py), the file
the Ray dashboard shows for a replica: at INFO, with their level, on the live session
cluster (1 gateway, 2 prefill + 1 decode replicas).  Before, INFO lines were dropped and a
warning came through the redirected stderr without its level."""

from __future__ import annotations

import pytest

from tests.integration.crash_evidence import ray_logs_dir

pytestmark = pytest.mark.integration
FROZEN = "start-up objects frozen out of garbage collection"  # every engine replica, once at start


def log_lines(deployment: str) -> list[str]:
    logs = ray_logs_dir()
    assert logs is not None, "this process is not attached to the test run's Ray"
    return [line for path in sorted((logs / "serve").glob(f"replica_*_{deployment}_*.log"))
            for line in path.read_text(errors="replace").splitlines()]


@pytest.mark.parametrize("deployment, words", [("prefill", FROZEN), ("decode", FROZEN),
                                               ("gateway", "gateway ready: mode=disaggregated")])
def test_a_replicas_own_info_lines_are_in_its_serve_log(base_url, deployment, words):
    ours = [line for line in log_lines(deployment) if words in line]
    assert ours, f"no {words!r} line in the {deployment} replicas' Serve logs"
    assert all(line.startswith("INFO ") for line in ours), ours
