"""Helpers shared by CLI verbs: result tables (rich when a terminal, plain otherwise)."""
from __future__ import annotations

import sys


def set_threads(threads: int | None) -> None:
    """``--threads N``: torch intra-op threads (None: torch's default)."""
    if threads is None:
        return
    if threads < 1:
        raise ValueError(f"--threads must be at least 1 (got {threads}); omit it to use every core")
    import torch
    torch.set_num_threads(threads)


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
