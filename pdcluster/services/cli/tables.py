"""The CLI's tables: ``rich`` tables rendered to plain lines (no colour, no
wrapping, no markup: a stage named ``router.route [prefill]`` stays as it is),
so a command prints them and a test reads them."""

from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table

_WIDTH = 1000  # wide enough that no row ever wraps; trailing padding is stripped


def plain_table(*columns: str, header: bool = True) -> Table:
    """A borderless table; a column named with a leading ``>`` is right-aligned (numbers)."""
    table = Table(box=None, show_header=header, show_edge=False, pad_edge=False, header_style="", padding=(0, 1))
    for name in columns:
        right = name.startswith(">")
        table.add_column(name.removeprefix(">"), justify="right" if right else "left", no_wrap=True)
    return table


def table_lines(table: Table) -> list[str]:
    console = Console(file=io.StringIO(), width=_WIDTH, color_system=None, markup=False, highlight=False,
                      emoji=False)
    console.print(table)
    return [line.rstrip() for line in console.file.getvalue().splitlines()]
