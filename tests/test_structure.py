"""Layout rules for the code base: no import cycle among the project's own modules, no hand-written module
over 600 lines, and the shared package `specdec` never reaching up into a service, the benchmark or the chaos
suite. Computed from the source (AST), so a lazy import inside a function counts as much as a top-level one."""

from __future__ import annotations

import ast
import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parent.parent
MAX_LINES = 600
SERVICE_PACKAGES = ("draft_service", "target_service", "orchestrator", "bench", "chaos")


def _generated(rel: str) -> bool:
    # protoc output (specdec/v1/*_pb2.py, *_pb2_grpc.py): regenerated, never edited by hand
    return rel.endswith(("_pb2.py", "_pb2_grpc.py"))


def _sources() -> dict[str, pathlib.Path]:
    """Module name -> file, for every tracked .py outside tests (and outside generated stubs)."""
    out = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    mods = {}
    for rel in out.split():
        if rel.startswith("tests/") or _generated(rel) or not (ROOT / rel).exists():
            continue
        parts = rel[:-3].split("/")
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:
            mods[".".join(parts)] = ROOT / rel
    return mods


def _imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The project modules `name` imports anywhere in its body (lazy imports included).

    Importing a.b.c runs a/__init__ and a/b/__init__ first, so those count too, except packages that contain
    `name` itself: they are initialised before `name` is. `from pkg import name` counts as importing
    pkg.name where that is a module, else as needing pkg's own namespace (an ancestor's too: importing from a
    package whose __init__ is still running is the cycle this catches)."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    found: set[str] = set()

    def ancestor(mod: str) -> bool:
        return name.startswith(mod + ".")

    def add(mod: str, *, itself: bool = True) -> None:
        parts = mod.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix in known and not ancestor(prefix) and (itself or i < len(parts)):
                found.add(prefix)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            add(mod, itself=False)
            for alias in node.names:
                sub = f"{mod}.{alias.name}"
                if sub in known:
                    found.add(sub)
                elif mod in known:
                    found.add(mod)
    found.discard(name)
    return found


def import_graph() -> dict[str, set[str]]:
    mods = _sources()
    known = set(mods)
    return {name: _imports(name, path, known) for name, path in mods.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        work = [(v, iter(sorted(graph[v])))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        while work:
            node, children = work[-1]
            for w in children:
                if w not in graph:
                    continue
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == node:
                            break
                    if len(comp) > 1:
                        components.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_one_cycle(graph, set(comp)) for comp in components]


def _one_cycle(graph: dict[str, set[str]], comp: set[str]) -> list[str]:
    """A concrete cycle inside a strongly connected component, as a path that returns to its start."""
    start = min(comp)
    # breadth-first from start back to start, within the component
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & comp):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [start] + path[::-1][1:] + [start] if len(path) > 1 else [start, start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return sorted(comp)


def test_cycle_finder_reports_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_imports_resolve_relative_lazy_and_submodule_forms(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from . import b\n    from .c import thing\nimport pkg.sub.d\n")
    known = {"pkg", "pkg.a", "pkg.b", "pkg.c", "pkg.sub", "pkg.sub.d"}
    # pkg itself is initialised before pkg.a: importing its submodules is no edge to it
    assert _imports("pkg.a", pkg / "a.py", known) == {"pkg.b", "pkg.c", "pkg.sub", "pkg.sub.d"}
    (pkg / "e.py").write_text("from pkg import thing\n")  # needs pkg/__init__'s own namespace
    assert _imports("pkg.e", pkg / "e.py", known) == {"pkg"}


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_module_over_the_line_limit():
    too_long = {}
    for name, path in _sources().items():
        n = len(path.read_text().splitlines())
        if n > MAX_LINES:
            too_long[str(path.relative_to(ROOT))] = n
    assert not too_long, f"modules over {MAX_LINES} lines (split them by role): {too_long}"


def test_shared_package_does_not_import_services():
    graph = import_graph()
    upward = {
        name: sorted(d for d in deps if d.split(".")[0] in SERVICE_PACKAGES)
        for name, deps in graph.items()
        if name.split(".")[0] == "specdec"
    }
    upward = {k: v for k, v in upward.items() if v}
    assert not upward, f"specdec imports services/bench/chaos: {upward}"


MAX_ORCHESTRATOR_TOP = 10  # modules directly in orchestrator/ (its __init__ included); the rest live in rooms


def test_orchestrator_lives_in_rooms():
    top = sorted(p.name for p in (ROOT / "orchestrator").glob("*.py"))
    assert len(top) <= MAX_ORCHESTRATOR_TOP, f"{len(top)} modules at the top of orchestrator/ (give them a room): {top}"


def test_every_room_has_a_map():
    """Each package of the orchestrator and the target's engines names its modules in its __init__ docstring."""
    for room in [*(ROOT / "orchestrator").glob("*/__init__.py"), ROOT / "target_service/engines/__init__.py"]:
        doc = ast.get_docstring(ast.parse(room.read_text())) or ""
        modules = sorted(p.name for p in room.parent.glob("*.py") if p.name != "__init__.py")
        unnamed = [m for m in modules if m not in doc]
        assert not unnamed, f"{room.relative_to(ROOT)}'s map does not name {unnamed}"


def _layer_violations(graph: dict[str, set[str]], importer: str, forbidden) -> dict[str, list[str]]:
    out = {name: sorted(d for d in deps if forbidden(d))
           for name, deps in graph.items() if name == importer or name.startswith(importer + ".")}
    return {k: v for k, v in out.items() if v}


def test_offline_tools_do_not_import_the_benchmark():
    """offline/ runs before serving, the benchmark after: what both need (the prompt set) lives in specdec/."""
    bad = _layer_violations(import_graph(), "offline", lambda d: d == "bench" or d.startswith("bench."))
    assert not bad, f"offline/ imports bench/: {bad}"


def test_orchestrator_does_not_import_a_service_server():
    """A service's server module is its process (flags, serve()); the orchestrator's in-process drafter takes the
    draft's servicer and proposer builder (draft_service/servicer.py, build.py), never its server."""
    servers = {f"{pkg}.server" for pkg in ("draft_service", "target_service")}
    bad = _layer_violations(import_graph(), "orchestrator", lambda d: d in servers)
    assert not bad, f"orchestrator/ imports a service's server module: {bad}"


def _reexported(init: pathlib.Path) -> set[str]:
    """The names a package's __init__ binds by importing them (its re-exports)."""
    tree = ast.parse(init.read_text(), str(init))
    return {(a.asname or a.name).split(".")[0] for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))
            for a in node.names}


def _names_through_own_package(name: str, path: pathlib.Path, mods: dict[str, pathlib.Path]) -> list[str]:
    """`from pkg import x` inside pkg (or below it) where pkg's __init__ imports (re-exports) its submodules: the
    __init__ is still being initialised when they load (a cycle through it), so a sibling is imported by its own
    path (`from pkg.sibling import x`)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module and name.startswith(node.module + "."):
            again = _reexported(mods[node.module]) if node.module in mods else set()
            found += [f"{node.module}.{a.name}" for a in node.names] if again else []
    return found


def test_submodules_import_their_siblings_directly():
    mods = _sources()
    bad = {name: found for name, path in mods.items() if (found := _names_through_own_package(name, path, mods))}
    assert not bad, f"names taken from the package's own __init__ (import the sibling module instead): {bad}"


MAX_FUNCTION_LINES = 80
MAX_PARAMETERS = 8  # self and cls not counted; *args and **kwargs count one each


def function_sizes() -> dict[str, tuple[int, int]]:
    """'path:Class.function' -> (lines, parameters) for every function outside tests."""
    out = {}
    for name, path in _sources().items():
        rel = str(path.relative_to(ROOT))

        def visit(node, prefix: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    a = child.args
                    params = [p for p in a.posonlyargs + a.args + a.kwonlyargs if p.arg not in ("self", "cls")]
                    count = len(params) + bool(a.vararg) + bool(a.kwarg)
                    out[f"{rel}:{prefix}{child.name}"] = (child.end_lineno - child.lineno + 1, count)
                    visit(child, f"{prefix}{child.name}.")
                elif isinstance(child, ast.ClassDef):
                    visit(child, f"{prefix}{child.name}.")

        visit(ast.parse(path.read_text(), str(path)), "")
    return out


def test_no_function_over_the_length_limit():
    sizes = function_sizes()
    over = {k: lines for k, (lines, _) in sizes.items() if lines > MAX_FUNCTION_LINES}
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines (split them): {over}"


def test_no_function_over_the_parameter_limit():
    sizes = function_sizes()
    over = {k: n for k, (_, n) in sizes.items() if n > MAX_PARAMETERS}
    assert not over, f"functions over {MAX_PARAMETERS} parameters (pass a typed object): {over}"
