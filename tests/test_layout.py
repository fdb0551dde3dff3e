"""The house rules the code keeps (docs/design.md, "Layers"): imports in one direction (no cycle
among the project's modules), no module uses another module's private names, the torch-free
layers stay torch-free, and the code cites only documents the repository has."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parent.parent
# folder -> package, as pyproject.toml maps them
PACKAGES = {"planner": "remat", "core": "remat.core", "solvers": "remat.solvers", "solvers/ilp": "remat.solvers.ilp",
            "frontends": "remat.frontends"}


def modules() -> dict[str, Path]:
    out = {}
    for folder, pkg in PACKAGES.items():
        for path in sorted((ROOT / folder).glob("*.py")):
            out[pkg if path.name == "__init__.py" else f"{pkg}.{path.stem}"] = path
    return out


MODULES = modules()


def _type_checking_blocks(tree: ast.AST) -> set[int]:
    """Line numbers inside ``if TYPE_CHECKING:`` blocks (imports for annotations only)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                lines.update(range(sub.lineno, (sub.end_lineno or sub.lineno) + 1))
    return lines


def _resolve(name: str, module: str, level: int, is_package: bool) -> str:
    if not level:
        return name
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def imports(module: str, path: Path) -> tuple[set[str], dict[str, str], set[str], list[tuple[str, str]]]:
    """(project modules it imports, local name -> project module, local names of other modules,
    private names it imports from project modules)."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_blocks(tree)
    is_package = path.name == "__init__.py"
    edges: set[str] = set()
    aliases: dict[str, str] = {}
    external: set[str] = set()
    private: list[tuple[str, str]] = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in MODULES:
                    edges.add(a.name)
                    aliases[a.asname or a.name] = a.name
                elif not a.name.startswith("remat"):
                    external.add((a.asname or a.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node.module or "", module, node.level, is_package)
            for a in node.names:
                full = f"{base}.{a.name}"
                if full in MODULES:
                    edges.add(full)
                    aliases[a.asname or a.name] = full
                elif base in MODULES:
                    edges.add(base)
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        private.append((base, a.name))
                elif not base.startswith("remat"):
                    external.add(a.asname or a.name)
    edges.discard(module)
    return edges, aliases, external, private


def test_the_project_has_the_layout_docs_design_describes():
    for name in ("remat", "remat.core.graph", "remat.core.simulate", "remat.core.analysis", "remat.solvers.registry",
                 "remat.solvers.ilp.mip", "remat.solvers.ilp.scalable", "remat.frontends.tracing", "remat.planning",
                 "remat.cli"):
        assert name in MODULES, name


def test_no_import_cycle_among_the_projects_modules():
    g = nx.DiGraph()
    for module, path in MODULES.items():
        g.add_node(module)
        for dep in imports(module, path)[0]:
            g.add_edge(module, dep)
    cycles = list(nx.simple_cycles(g))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c + [c[0]]) for c in cycles[:5])


def test_lower_layers_import_no_higher_one():
    # core <- solvers <- frontends <- the top (remat: budget, planning, viz, cli); frontends and
    # solvers do not know each other
    layer = {"remat.core": 0, "remat.solvers": 1, "remat.frontends": 1}

    def rank(module: str) -> int:
        for prefix, r in layer.items():
            if module == prefix or module.startswith(prefix + "."):
                return r
        return 2

    bad = []
    for module, path in MODULES.items():
        for dep in imports(module, path)[0]:
            if rank(dep) > rank(module) or (rank(dep) == rank(module) == 1 and dep.split(".")[1] != module.split(".")[1]):
                bad.append(f"{module} -> {dep}")
    assert not bad, bad


def _defined_private_attributes() -> dict[str, set[str]]:
    """module -> private attribute names its classes define (methods, class attributes, self._x)."""
    out: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for item in ast.walk(node):
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name.startswith("_"):
                        names.add(item.name)
                    elif isinstance(item, ast.Attribute) and isinstance(item.value, ast.Name) \
                            and item.value.id == "self" and isinstance(item.ctx, ast.Store):
                        names.add(item.attr)
                    elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                        for t in (item.targets if isinstance(item, ast.Assign) else [item.target]):
                            if isinstance(t, ast.Name):
                                names.add(t.id)
        out[module] = {n for n in names if n.startswith("_") and not n.startswith("__")}
    return out


def test_no_module_uses_another_modules_private_names():
    defined = _defined_private_attributes()
    bad = []
    for module, path in MODULES.items():
        _, aliases, external, private = imports(module, path)
        bad += [f"{module}: from {m} import {n}" for m, n in private]
        own = defined[module]
        foreign = set().union(*(v for k, v in defined.items() if k != module)) - own
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
                continue
            base = node.value
            if isinstance(base, ast.Name) and base.id in aliases:
                bad.append(f"{module}: {base.id}.{node.attr} ({aliases[base.id]})")
            elif isinstance(base, ast.Name) and (base.id in ("self", "cls") or base.id in external):
                continue
            elif node.attr in foreign:
                bad.append(f"{module}:{node.lineno}: {ast.unparse(node)} (a private attribute of another module's class)")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("package", ["remat.core", "remat.solvers"])
def test_the_planner_layers_import_no_torch(package):
    heavy = []
    for module, path in MODULES.items():
        if module == package or module.startswith(package + "."):
            text = path.read_text()
            if re.search(r"^\s*(import torch|from torch)", text, re.M):
                heavy.append(module)
    assert not heavy, heavy


def test_the_code_cites_only_documents_the_repository_has():
    cited = set()
    for path in list(MODULES.values()) + sorted((ROOT / "benchmarks").glob("*.py")) + sorted((ROOT / "tests").glob("*.py")):
        for doc in re.findall(r"\b((?:docs/)?[A-Z][A-Za-z_]*\.md|docs/[a-z_]+\.md)\b", path.read_text()):
            cited.add(doc)
    missing = [d for d in sorted(cited) if not (ROOT / d).exists()]
    assert not missing, f"cited but not in the repository: {missing}"


@pytest.mark.parametrize("old, name, new", [
    ("remat.graph", "Graph", "remat.core.graph"),
    ("remat.simulate", "simulate", "remat.core.simulate"),
    ("remat.plan", "sweep", "remat.planning"),
    ("remat.plan", "load_plan", "remat.core.plan"),
    ("remat.solvers.ilp_scalable", "window_bound", "remat.solvers.ilp.bounds"),
    ("remat.solvers.instant_ip", "split_bound", "remat.solvers.ilp.windows"),
])
def test_old_module_paths_still_import_with_a_deprecation_warning(old, name, new):
    import importlib
    import remat  # noqa: F401  (registers the old paths)
    import remat.solvers  # noqa: F401
    with pytest.warns(DeprecationWarning, match=f"moved to {new}"):
        value = getattr(importlib.import_module(old), name)
    assert value is getattr(importlib.import_module(new), name)
