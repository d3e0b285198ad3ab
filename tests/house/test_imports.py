"""The house's rules, read from the code's own imports (every import statement, at module top or inside a function):
no import circle between modules, and each room imports only the rooms below it (WORKSPACE.md, "Who may import
whom"). A new module in a room that breaks a rule fails here with the import that breaks it."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# Installed names of the two top-level folders (pyproject's package-dir; strata_jax/__init__ maps them from here)
FOLDERS = {"strata_jax": "strata_jax", "host_pool": "strata_jax.host_pool", "pallas_kernels": "strata_jax.pallas_kernels"}


def module_files() -> dict[str, Path]:
    out = {}
    for folder, name in FOLDERS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = path.relative_to(REPO / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([name, *parts])] = path
    return out


MODULES = module_files()


def imports_of(name: str, path: Path) -> list[tuple[str, int]]:
    """The project modules `name` imports: (module, line), relative imports resolved."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            # `from pkg import mod` names a module when pkg.mod is one
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in MODULES:  # strata_jax.model.weights.Weights -> strata_jax.model.weights
                t = t.rsplit(".", 1)[0] if "." in t else ""
            if t and t != name:
                found.append((t, node.lineno))
    return found


GRAPH = {name: imports_of(name, path) for name, path in MODULES.items()}


ROOMS = {"model", "offload", "speculative", "engine", "io", "host_pool", "pallas_kernels"}


def room(module: str) -> str:
    """strata_jax.offload.slots -> 'offload'; strata_jax.errors (a module at the package's top) -> 'top'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ROOMS else "top"


def test_the_walk_sees_the_house():
    assert "strata_jax.engine.api" in MODULES and "strata_jax.host_pool.pool" in MODULES
    assert any(t == "strata_jax.engine.graphs" for t, _ in GRAPH["strata_jax.engine.api"])
    assert room("strata_jax.offload.slots") == "offload" and room("strata_jax.errors") == "top"


def test_no_import_circle():
    """Depth-first search over every import: a back edge is a circle, printed module by module."""
    state: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t, _ in GRAPH[m]:
            if state.get(t) == 1:
                circles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2
    for m in sorted(GRAPH):
        if m not in state:
            visit(m)
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


# room -> the rooms it may import (besides itself); "top" is strata_jax's own modules: errors, options, sampling,
# grammar (the leaves everyone may use) and the two programs decode and serve (above everything).
LEAVES = {"strata_jax.errors", "strata_jax.options", "strata_jax.sampling", "strata_jax.grammar"}
MAY_IMPORT = {
    "pallas_kernels": set(),
    "host_pool": set(),
    "model": {"pallas_kernels"},
    "offload": {"model", "pallas_kernels", "host_pool"},
    "speculative": {"model"},
    "io": {"model", "speculative"},  # the loaders walk the weight declaration (and the MTP module's)
    "engine": {"model", "offload", "speculative", "io", "pallas_kernels", "host_pool"},
}


@pytest.mark.parametrize("area", sorted(MAY_IMPORT))
def test_each_room_imports_only_the_rooms_below_it(area):
    bad = []
    for m, targets in GRAPH.items():
        if room(m) != area:
            continue
        for t, line in targets:
            r = room(t)
            if r == area or t in LEAVES or r in MAY_IMPORT[area] or (r == "top" and t == "strata_jax"):
                continue
            bad.append(f"{MODULES[m].relative_to(REPO)}:{line} imports {t}")
    assert not bad, "\n".join(bad)


def test_no_module_below_the_engine_imports_the_engine_or_the_programs():
    programs = {"strata_jax.decode", "strata_jax.serve"}
    for m, targets in GRAPH.items():
        if room(m) in ("engine",) or m in programs:
            continue
        assert not [t for t, _ in targets if room(t) == "engine" or t in programs], m


def test_moved_modules_still_import_as_the_same_module_with_a_warning():
    """The names of before the rooms (strata_jax.graphs, strata_jax.experts.slots, ...) give the new module object,
    not a second copy, with one DeprecationWarning naming the new place; every new place exists."""
    import importlib
    import subprocess
    import sys
    from strata_jax import MOVED
    assert set(MOVED.values()) <= set(MODULES), set(MOVED.values()) - set(MODULES)
    code = ("import importlib, warnings, strata_jax\n"
            "warnings.simplefilter('error', DeprecationWarning)\n"
            "for old, new in strata_jax.MOVED.items():\n"
            "    try:\n"
            "        importlib.import_module(old)\n"
            "        raise SystemExit(f'no warning for {old}')\n"
            "    except DeprecationWarning as e:\n"
            "        assert str(e).startswith(old.rsplit('.', 1)[0]) and ' is now strata_jax.' in str(e), e\n"
            "warnings.simplefilter('ignore', DeprecationWarning)\n"
            "for old, new in strata_jax.MOVED.items():\n"
            "    assert importlib.import_module(old) is importlib.import_module(new), old\n"
            "from strata_jax.experts.slots import OffloadedExperts\n"
            "from strata_jax.offload.slots import OffloadedExperts as now\n"
            "assert OffloadedExperts is now\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
    assert importlib.import_module("strata_jax.engine.graphs").__name__ == "strata_jax.engine.graphs"
