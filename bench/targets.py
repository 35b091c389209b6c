"""The one line per target every bench script ends with, in the form anyone
can grep: ``target NAME: MEASURED (goal OP VALUE) met|missed``."""

from __future__ import annotations

import math

OPS = {">=": lambda m, g: m >= g, "<=": lambda m, g: m <= g, "<": lambda m, g: m < g, "==": lambda m, g: m == g}


def target_line(name: str, measured: float, op: str, goal: float, fmt: str = ".2f") -> str:
    """A NaN (nothing measured) is missed, never met."""
    if op not in OPS:
        raise ValueError(f"op must be one of {sorted(OPS)}, not {op!r}")
    met = not (isinstance(measured, float) and math.isnan(measured)) and OPS[op](measured, goal)
    return f"target {name}: {measured:{fmt}} (goal {op} {goal:{fmt}}) {'met' if met else 'missed'}"


def print_target(name: str, measured: float, op: str, goal: float, fmt: str = ".2f") -> bool:
    line = target_line(name, measured, op, goal, fmt)
    print(line, flush=True)
    return line.endswith(" met")
