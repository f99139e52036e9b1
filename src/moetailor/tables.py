"""Text every layer shows users, written once: result tables (rich on a terminal, markdown in files) and
the error for a value that is not one of its choices."""
from __future__ import annotations

import sys


def print_table(title: str, columns: list[str], rows: list[tuple], file=None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(*[str(c) for c in row])
    Console(file=file or sys.stdout, width=160).print(table)


def markdown_table(columns: list[str], rows: list[tuple]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def unknown_choice(what: str, value, choices) -> str:
    """The one wording of a bad choice: ``unknown phase 'x'; choose from: decode, prefill, both``."""
    return f"unknown {what} {value!r}; choose from: {', '.join(map(str, choices))}"
