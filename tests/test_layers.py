"""The import contract: the package's folders are the pipeline's layers, and no module imports upward.

Every import counts, including those inside functions (they hide dependencies as well as cycles).
A layer may import only layers listed before it. The graph is read from the source with ``ast``,
so the test fails on a new upward edge without importing anything.
"""
from __future__ import annotations

import ast
from pathlib import Path

import moetailor

# lowest first: a module may import modules of its own layer or of an earlier one
LAYERS = ["tables", "outputs", "memory", "device", "kernels", "data", "models", "runtime", "routing", "calibration",
          "plans", "transforms", "serving", "integrations", "bench", "eval", "training", "tuning", "cli"]
ROOT = Path(moetailor.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, module: str | None = None) -> set[str]:
    """Absolute names of the moetailor modules ``path`` imports (any depth in the file); ``module``: the
    name it would have in the package (default: from where it lies under src/)."""
    module = module or _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("moetailor")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name.startswith("moetailor"):
                found.add(name)
                found |= {f"{name}.{a.name}" for a in node.names if (ROOT.parent / f"{name}.{a.name}".replace(".", "/")).exists()
                          or (ROOT.parent / (f"{name}.{a.name}".replace(".", "/") + ".py")).exists()}
    return found


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in ROOT.rglob("*.py")}


def test_every_top_level_folder_is_a_layer():
    folders = {p.name for p in ROOT.iterdir() if (p.is_dir() and (p / "__init__.py").exists()) or p.suffix == ".py"}
    folders = {f.removesuffix(".py") for f in folders} - {"__init__"}
    assert folders <= set(LAYERS), f"add these to LAYERS in the right place: {sorted(folders - set(LAYERS))}"


def test_no_layer_imports_a_later_layer():
    upward = sorted(f"{src} -> {dst}" for src, dsts in _graph().items() for dst in dsts
                    if _layer(src) in LAYERS and _layer(dst) in LAYERS and LAYERS.index(_layer(dst)) > LAYERS.index(_layer(src)))
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_no_import_cycles_between_modules():
    graph = _graph()
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph or nxt == node or nxt.startswith(node + "."):
                continue   # a package importing its own submodules is not a cycle
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]) if nxt in stack else f"{node} -> {nxt}")
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_contract_sees_function_level_imports(tmp_path):
    """The checker must not be blind: an import inside a function is an edge."""
    probe = tmp_path / "_contract_probe.py"     # read as if it lay in moetailor/plans/; src/ is not written
    probe.write_text("def f():\n    from ..serving import LLM\n")
    assert "moetailor.serving" in _imports(probe, "moetailor.plans._contract_probe")
