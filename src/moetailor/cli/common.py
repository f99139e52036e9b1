"""Helpers shared by CLI verbs: result tables (rich when a terminal, plain otherwise)."""
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


def add_dtype_argument(parser, what: str) -> None:
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"),
                        help=f"working dtype for {what} (default auto: the checkpoint's stored dtype, bf16 for "
                             "hub MoE checkpoints; float32 only when asked: twice the memory)")
