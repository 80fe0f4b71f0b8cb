"""No import circles in kvcli/ (and kernels/, installed as kvcli_kernels): neither between modules nor
between kvcli's top-level parts (each subpackage such as engine/ or runner/, and each module directly
in kvcli/, such as step.py).

Every import counts, wherever it is written: at module level, inside a function (a deferred import is
still a dependency), under `if TYPE_CHECKING:`. The graph is read from the source with `ast`; nothing
is imported. Known circles that another change is removing are listed in KNOWN_CYCLE_EDGES: their
edges are left out of the graph. Shrink the list as they go (an entry that no longer matches an
import is reported by test_known_cycle_edges_still_exist, which only warns).
"""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"kvcli": ROOT / "kvcli", "kvcli_kernels": ROOT / "kernels"}

# (importer, imported) module pairs left out of the graph. Each closes a circle that is known and
# scheduled to go; remove the line when the import is gone.
KNOWN_CYCLE_EDGES: frozenset[tuple[str, str]] = frozenset()
# (The model/ <-> bench/, attention/ <-> model/, llama.py <-> native_decode.py, kvcache/ <-> kernels/ and
# config.py <-> kvcache/ circles listed here at first are gone: the native/planner refactor, the KV-format
# table, and kvcache/kv_cache.py reading a KVShape protocol instead of ModelConfig.)


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join((pkg, *parts))] = path
    return mods


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of PACKAGES it imports (a `from pkg import name` counts as pkg.name
    when that is a module, else as pkg)."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from the module's package, one level up per extra dot
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    stem = ".".join(base + ([node.module] if node.module else []))
                else:
                    stem = node.module or ""
                targets = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in mods else stem for a in node.names]
            for t in targets:
                while t and t not in mods:  # `import a.b.c` of a name inside a module: the module
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    graph[mod].add(t)
    return graph


def part(module: str) -> str:
    """kvcli's top-level part a module belongs to: kvcli.engine.scheduler -> kvcli.engine,
    kvcli.step -> kvcli.step; kvcli_kernels is one part."""
    names = module.split(".")
    return ".".join(names[:2]) if names[0] == "kvcli" else names[0]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan, iterative), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return sorted(out)


def _describe(graph: dict[str, set[str]], comp: list[str]) -> str:
    members = set(comp)
    edges = [f"  {a} -> {b}" for a in comp for b in sorted(graph[a]) if b in members]
    return "\n".join([", ".join(comp), *edges])


def _without_known(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    return {a: {b for b in bs if (a, b) not in KNOWN_CYCLE_EDGES} for a, bs in graph.items()}


def test_no_module_cycles() -> None:
    graph = _without_known(import_graph())
    found = cycles(graph)
    assert not found, "import circles between modules:\n" + "\n".join(_describe(graph, c) for c in found)


def test_no_cycles_between_top_level_parts() -> None:
    graph = _without_known(import_graph())
    parts: dict[str, set[str]] = {}
    why: dict[tuple[str, str], str] = {}
    for a, bs in graph.items():
        pa = part(a)
        parts.setdefault(pa, set())
        for b in bs:
            pb = part(b)
            if pa != pb:
                parts[pa].add(pb)
                why.setdefault((pa, pb), f"{a} -> {b}")
    found = cycles(parts)
    lines = []
    for comp in found:
        members = set(comp)
        lines.append(", ".join(comp))
        lines += [f"  {a} -> {b} ({why[a, b]})" for a in comp for b in sorted(parts[a]) if b in members]
    assert not found, "import circles between kvcli's top-level parts:\n" + "\n".join(lines)


def test_known_cycle_edges_still_exist() -> None:
    graph = import_graph()
    stale = sorted(e for e in KNOWN_CYCLE_EDGES if e[1] not in graph.get(e[0], ()))
    if stale:
        warnings.warn(f"KNOWN_CYCLE_EDGES entries no longer imported (remove them): {stale}", stacklevel=1)


def test_the_reader_counts_every_kind_of_import(tmp_path, monkeypatch) -> None:
    """Imports inside functions, under TYPE_CHECKING and relative ones are edges; so is a module
    named in `from package import module`."""
    pkg = tmp_path / "p"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import c\n")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.b import X\n")
    (pkg / "b.py").write_text("def f():\n    import p.sub.c\n")
    (pkg / "sub" / "c.py").write_text("from ..a import Y\nfrom p.sub import d\n")
    (pkg / "sub" / "d.py").write_text("")
    monkeypatch.setitem(PACKAGES, "p", pkg)
    for other in [k for k in PACKAGES if k != "p"]:
        monkeypatch.delitem(PACKAGES, other)
    g = import_graph()
    assert g["p.a"] == {"p.b"} and g["p.b"] == {"p.sub.c"} and g["p.sub.c"] == {"p.a", "p.sub.d"}
    assert g["p.sub"] == {"p.sub.c"}
    assert cycles(g) == [["p.a", "p.b", "p.sub.c"]]
