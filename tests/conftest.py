"""Suite-wide settings: kernels run under Triton's CPU interpreter, Ray and
UCX stay on loopback, torch uses one thread per process unless a test says
otherwise."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
