"""vt's layers import one way. Every module under vt/ is parsed with `ast` and every import is
read, at any depth: module level, inside functions (lazy imports) and under TYPE_CHECKING, since
a lazy or type-only import couples two modules as much as any other.

The rules, settled from the tree and DESIGN.md:

1. Layers, top to bottom: vt.http -> vt.engine -> (vt.sched, vt.runner) -> vt.model -> vt.kernels.
   A layer imports its own modules and the layers below it, never one above.
2. Beside each other, vt.runner reads the scheduler's hand-off record, vt.sched.output, and
   nothing else of vt.sched; vt.sched imports nothing of vt.runner. vt.sched and vt.kernels never
   import each other: the scheduler speaks of requests, tokens and blocks, the kernels of arrays.
3. vt.http sees the engine through vt.engine.outputs, vt.engine.admission and vt.engine.stats
   only, and never reaches the layers the engine drives (vt.sched, vt.runner, vt.kernels).
4. Shared modules, which any module may import: vt (the version), vt.config, vt.sampling_params,
   vt.text.*, vt.structured.*. A shared module imports only shared modules, so vt.structured
   never imports the engine, the runner or http.
5. Entry points import anything: vt.launch.*, vt.llm (the blocking facade), vt.__main__. No layer
   or shared module imports them; vt.bench may use vt.launch.subprocesses.
6. vt.bench (`vt bench`, a client of a running server) imports only vt.bench.*,
   vt.launch.subprocesses, vt.model.make_model, vt.model.locate and vt.text.*.
7. No import cycle between modules, lazy or not.

A failure names each offending import as FILE:LINE: importer -> imported, and the rule it breaks.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VT = ROOT / "vt"

LAYERS = (("vt.http",), ("vt.engine",), ("vt.sched", "vt.runner"), ("vt.model",), ("vt.kernels",))
SHARED = ("vt", "vt.config", "vt.sampling_params", "vt.text", "vt.structured")
ENTRY_POINTS = ("vt.launch", "vt.llm", "vt.__main__")
HTTP_SEES_OF_ENGINE = ("vt.engine.outputs", "vt.engine.admission", "vt.engine.stats")
RUNNER_SEES_OF_SCHED = ("vt.sched.output",)
BENCH_MAY_IMPORT = ("vt.bench", "vt.launch.subprocesses", "vt.model.make_model", "vt.model.locate", "vt.text")


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    path: Path
    line: int

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}: {self.importer} -> {self.imported}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(source: str, name: str, path: Path, is_package: bool, modules: set[str]) -> list[Import]:
    """Every vt import in `source`, wherever it sits. `from pkg import x` is an import of the
    module pkg.x when x is one, else of pkg."""
    found = []
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importer's package, one level up per extra dot
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join([*package, base] if base else package)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        found += [Import(name, t, path, node.lineno) for t in targets if t == "vt" or t.startswith("vt.")]
    return found


def collect() -> tuple[set[str], list[Import]]:
    paths = sorted(VT.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    edges = []
    for p in paths:
        edges += imports_of(p.read_text(), module_name(p), p, p.name == "__init__.py", modules)
    return modules, sorted(set(edges), key=lambda e: (str(e.path), e.line, e.imported))


MODULES, IMPORTS = collect()


def within(module: str, prefixes: tuple[str, ...]) -> bool:
    """module is one of prefixes or inside one ("vt" stands for the package's own __init__ only)."""
    return any(module == p or (p != "vt" and module.startswith(p + ".")) for p in prefixes)


def tier(module: str) -> int | None:
    for i, layer in enumerate(LAYERS):
        if within(module, layer):
            return i
    return None


def layer_of(module: str) -> str | None:
    return next((p for layer in LAYERS for p in layer if within(module, (p,))), None)


def fail_on(bad: list[tuple[Import, str]]) -> None:
    if bad:
        pytest.fail("imports that break vt's layering:\n" + "\n".join(f"  {e}  ({why})" for e, why in bad),
                    pytrace=False)


def test_the_parser_reads_lazy_and_type_checking_imports() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "import vt.config\n"
        "if TYPE_CHECKING:\n"
        "    from vt.sched.output import ScheduledBatch\n"
        "def f():\n"
        "    from vt.kernels import get_backend\n"
        "    from . import sibling\n"
        "    from ..model import loader\n"
    )
    path = VT / "runner" / "example.py"
    mods = {"vt.config", "vt.sched.output", "vt.kernels", "vt.runner.sibling", "vt.model.loader"}
    got = [(e.imported, e.line) for e in imports_of(source, "vt.runner.example", path, False, mods)]
    assert got == [("vt.config", 2), ("vt.sched.output", 4), ("vt.kernels", 6), ("vt.runner.sibling", 7),
                   ("vt.model.loader", 8)]
    # and on the tree: a lazy import the CLI makes inside a function is seen
    assert any(e.importer == "vt.launch.cli" and e.imported.startswith("vt.bench") for e in IMPORTS)
    assert {"vt.http.server", "vt.engine.engine", "vt.runner.runner", "vt.kernels.base"} <= MODULES


def test_layers_import_only_downward() -> None:
    bad = []
    for e in IMPORTS:
        src, dst = tier(e.importer), tier(e.imported)
        if src is None or dst is None or layer_of(e.importer) == layer_of(e.imported):
            continue
        if dst < src:
            bad.append((e, f"{layer_of(e.importer)} is below {layer_of(e.imported)}"))
        elif dst == src:  # vt.sched and vt.runner, side by side
            if not (within(e.importer, ("vt.runner",)) and e.imported in RUNNER_SEES_OF_SCHED):
                bad.append((e, "vt.runner reads only vt.sched.output of the scheduler; vt.sched never "
                               "imports vt.runner"))
        elif within(e.importer, ("vt.sched",)) and within(e.imported, ("vt.kernels",)):
            bad.append((e, "vt.sched and vt.kernels never import each other"))
    fail_on(bad)


def test_http_sees_the_engine_through_its_boundary_modules_only() -> None:
    bad = []
    for e in IMPORTS:
        if not within(e.importer, ("vt.http",)):
            continue
        if within(e.imported, ("vt.engine",)) and e.imported not in HTTP_SEES_OF_ENGINE:
            bad.append((e, f"vt.http imports from vt.engine only {', '.join(HTTP_SEES_OF_ENGINE)}"))
        elif within(e.imported, ("vt.sched", "vt.runner", "vt.kernels")):
            bad.append((e, "vt.http reaches the scheduler, runner and kernels only through the engine"))
    fail_on(bad)


def test_shared_modules_import_only_shared_modules() -> None:
    bad = [(e, "a shared module imports only shared modules (vt, vt.config, vt.sampling_params, "
               "vt.text, vt.structured)")
           for e in IMPORTS if within(e.importer, SHARED) and not within(e.imported, SHARED)]
    fail_on(bad)


def test_entry_points_are_imported_by_no_layer() -> None:
    bad = [(e, "only entry points import vt.launch, vt.llm and vt.__main__ (vt.bench: launch.subprocesses)")
           for e in IMPORTS
           if within(e.imported, ENTRY_POINTS) and not within(e.importer, ENTRY_POINTS)
           and not (within(e.importer, ("vt.bench",)) and e.imported == "vt.launch.subprocesses")]
    fail_on(bad)


def test_bench_is_a_client_of_the_server_only() -> None:
    bad = [(e, f"vt.bench imports only {', '.join(BENCH_MAY_IMPORT)}")
           for e in IMPORTS if within(e.importer, ("vt.bench",)) and not within(e.imported, BENCH_MAY_IMPORT)]
    bad += [(e, "only vt.launch.cli starts vt bench") for e in IMPORTS
            if within(e.imported, ("vt.bench",)) and e.importer != "vt.launch.cli"
            and not within(e.importer, ("vt.bench",))]
    fail_on(bad)


def cycles(edges: list[Import]) -> list[list[str]]:
    """Strongly connected components of more than one module (or a module importing itself)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for e in edges:
        graph[e.importer].add(e.imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:  # Tarjan's algorithm; it recurses at most as deep as vt has modules
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph[v]:
                found.append(sorted(comp))

    for v in sorted(set(graph) | {w for ws in graph.values() for w in ws}):
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_finds_circles_and_only_circles() -> None:
    a, b, c = VT / "a.py", VT / "b.py", VT / "c.py"
    edges = [Import("vt.a", "vt.b", a, 1), Import("vt.b", "vt.c", b, 2), Import("vt.c", "vt.a", c, 30),
             Import("vt.c", "vt.d", c, 3)]
    assert cycles(edges) == [["vt.a", "vt.b", "vt.c"]]
    assert cycles(edges[:2] + edges[3:]) == []
    assert cycles([Import("vt.a", "vt.a", a, 1)]) == [["vt.a"]]


def test_no_import_cycles_between_modules() -> None:
    found = cycles(IMPORTS)
    lines = []
    for comp in found:
        members = set(comp)
        lines.append("  circle: " + ", ".join(comp))
        lines += [f"    {e}" for e in IMPORTS if e.importer in members and e.imported in members]
    if found:
        pytest.fail("import cycles (lazy imports included):\n" + "\n".join(lines), pytrace=False)


def test_every_module_has_a_place_in_the_rules() -> None:
    """A new folder or root module under vt/ is given a place above before its imports mean anything."""
    placed = (*SHARED, *ENTRY_POINTS, "vt.bench")
    unplaced = sorted(m for m in MODULES if tier(m) is None and not within(m, placed))
    assert not unplaced, f"no rule places these (add them to the layers, shared or entry points): {unplaced}"
