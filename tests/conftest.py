"""Suite-wide settings: kernels run under Triton's CPU interpreter, Ray and
UCX stay on loopback, torch uses one thread per process unless a test says
otherwise."""

import os

from pdcluster.services.cluster_env import cluster_env

os.environ.setdefault("TRITON_INTERPRET", "1")
cluster_env()  # loopback, Serve's throughput mode: what `pdcluster up` runs with
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# PDCLUSTER_TEST_CPU_REPORT=FILE: each test's wall time and machine CPU (tests/cpu_report.py).
from tests.cpu_report import pytest_runtest_protocol, pytest_sessionfinish  # noqa: E402,F401
