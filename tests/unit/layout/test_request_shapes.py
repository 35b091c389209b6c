"""One shape for a request's streamed pieces (issue 39): a replica's engine output and a prefill
replica's first token become a ``TokenDelta`` in one place each (services/messages.py), not by hand
in every pool.  Checked on the source (no imports run)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
MESSAGES = REPO / "pdcluster" / "services" / "messages.py"


def _constructor_calls(name: str) -> list[str]:
    """``name(...)`` calls in the product's source, as "path:line"."""
    found = []
    for path in sorted((REPO / "pdcluster").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name:
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    return found


def test_token_deltas_are_built_only_by_their_own_constructors():
    assert _constructor_calls("TokenDelta") == [], "use TokenDelta.of_output / of_prefill (services/messages.py)"


def test_the_two_constructors_exist_and_are_used():
    tree = ast.parse(MESSAGES.read_text())
    [delta] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TokenDelta"]
    assert {f.name for f in delta.body if isinstance(f, ast.FunctionDef)} >= {"of_output", "of_prefill"}
    uses = [p for p in (REPO / "pdcluster").rglob("*.py") if "TokenDelta.of_" in p.read_text()]
    assert len(uses) >= 3, uses  # the colocated/decode-local stream, the hand-off's decode side, the gateway
