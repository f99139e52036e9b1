"""Writing benchmark results: rich tables on the terminal, markdown + JSON + PNG plots in --out."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..outputs import save_figure, write_json, write_text
from ..tables import markdown_table, print_table


@dataclass
class Report:
    """Sections of one benchmark run, printed as they come and written together at the end."""

    title: str
    out: Path
    command: str = ""
    sections: list[str] = field(default_factory=list)
    data: dict = field(default_factory=dict)
    plots: list[str] = field(default_factory=list)

    def table(self, title: str, columns: list[str], rows: list[tuple]) -> None:
        print_table(title, columns, rows)
        self.sections.append(f"### {title}\n\n{markdown_table(columns, rows)}\n")

    def note(self, text: str) -> None:
        print(text)
        self.sections.append(text + "\n")

    def plot(self, name: str, fig) -> None:
        name = name.replace("/", "_").lstrip("._")  # names built from a checkpoint path stay inside ``out``
        self.out.mkdir(parents=True, exist_ok=True)
        save_figure(fig, self.out / name, dpi=110, bbox_inches="tight")
        self.plots.append(name)

    def write(self) -> Path:
        self.out.mkdir(parents=True, exist_ok=True)
        body = [f"## {self.title}\n"]
        if self.command:
            body.append(f"```\n{self.command}\n```\n")
        body += self.sections
        body += [f"![{p}]({p})\n" for p in self.plots]
        path = self.out / "report.md"
        write_text(path, "\n".join(body))
        write_json(self.out / "results.json", self.data, indent=1, default=str)
        print(f"wrote {path} and results.json" + (f", {len(self.plots)} plots" if self.plots else "") + f" in {self.out}")
        return path


def figure(xlabel: str, ylabel: str, title: str, logx: bool = False):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if logx:
        ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3)
    return fig, ax


def close(fig) -> None:
    import matplotlib.pyplot as plt

    plt.close(fig)
