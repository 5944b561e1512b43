"""The package's shape, held where a review found it hard to change (issue 27): no module over
:data:`FILE_LINES` lines, no function over :data:`FUNCTION_LINES`, no cycle among the
package's imports, and which room of the package may import which (:data:`ROOMS`, issue 33): the
rank's side never imports the notebook's.

The modules and functions over the limits would be listed with their size (both lists are empty
since the rank's kernel was split, issue 27): the lists may only shrink. A listed one that grows fails (split it instead), one that is now within the limit
fails until it is taken off the list (so the list never hides the next offender), and a new one
over the limit fails. Imports made inside functions (to keep a module's load light, or the
notebook free of torch until it is needed) count too: a deferred import hides a loop between two
modules, it does not remove it. Only imports under ``if TYPE_CHECKING:`` are left out (they never
run).
"""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "clorch_repl"
FILE_LINES = 450
FUNCTION_LINES = 80

#: module (relative to clorch_repl/) -> its lines when this list was last cut down
LONG_FILES: dict[str, int] = {}
#: "module:function" -> its lines (nested functions and methods by their own name)
LONG_FUNCTIONS: dict[str, int] = {}


def _modules() -> dict[str, pathlib.Path]:
    return {path.relative_to(PACKAGE).as_posix(): path for path in sorted(PACKAGE.rglob("*.py"))}


def _over(sizes: dict[str, int], known: dict[str, int], limit: int, what: str) -> list[str]:
    problems = []
    for name, size in sorted(sizes.items()):
        if size > limit and name not in known:
            problems.append(f"{what} {name} has {size} lines (limit {limit}): split it")
        elif name in known and size > known[name]:
            problems.append(f"{what} {name} grew to {size} lines (listed at {known[name]}, limit {limit}): split it")
        elif name in known and size <= limit:
            problems.append(f"{what} {name} is within the limit now ({size} lines): take it off the list")
    problems += [f"{what} {name} is listed but no longer exists" for name in sorted(set(known) - set(sizes))]
    return problems


def test_no_new_module_is_over_the_line_limit() -> None:
    sizes = {name: len(path.read_text().splitlines()) for name, path in _modules().items()}
    assert _over(sizes, LONG_FILES, FILE_LINES, "module") == []


def test_no_new_function_is_over_the_line_limit() -> None:
    sizes = {}
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                key = f"{name}:{node.name}"
                sizes[key] = max(sizes.get(key, 0), node.end_lineno - node.lineno + 1)
    assert _over(sizes, LONG_FUNCTIONS, FUNCTION_LINES, "function") == []


def _module_name(relative: str) -> str:
    parts = ["clorch_repl", *relative[:-3].split("/")]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and (
        (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
        or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING"))


def _import_nodes(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, at any depth, except those under ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif _is_type_checking(node):
            stack.extend(node.orelse)  # type: ignore[attr-defined]
        else:
            stack.extend(ast.iter_child_nodes(node))
    return found


def _imports(relative: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The package's modules that this one imports, when loaded or later in a function."""
    name = _module_name(relative)
    package = name if relative.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()
    for node in _import_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
        else:
            found.update(alias.name for alias in node.names)
    # Importing a module runs its packages' __init__ first: ``from ..magics.arguments import x``
    # also imports clorch_repl.magics, and whatever that package's __init__ imports.
    found |= {parent for m in found for parent in _parents(m)}
    return {m for m in found if m in known and m != name and not name.startswith(m + ".")}


def _parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts))]  # below clorch_repl itself


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    """Every import loop found by a depth-first walk, as "a -> b -> a"."""
    cycles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(graph[module]):
            if state.get(dep) == 1:
                loop = path + [module]
                cycles.append(" -> ".join(loop[loop.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, path + [module])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
    return cycles


def test_no_module_imports_itself_through_others() -> None:
    modules = _modules()
    known = {_module_name(r) for r in modules}
    assert _cycles({_module_name(r): _imports(r, p, known) for r, p in modules.items()}) == []


def test_the_guards_catch_what_they_guard() -> None:
    """The checks themselves, on made-up sizes: a new offender, growth, a stale entry."""
    assert _over({"a.py": 500}, {}, 450, "module") == ["module a.py has 500 lines (limit 450): split it"]
    assert "grew to 600" in _over({"a.py": 600}, {"a.py": 500}, 450, "module")[0]
    assert "take it off the list" in _over({"a.py": 400}, {"a.py": 500}, 450, "module")[0]
    assert "no longer exists" in _over({}, {"a.py": 500}, 450, "module")[0]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a -> b -> c -> a"]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    deferred = ast.parse("def f():\n    from . import b\nif TYPE_CHECKING:\n    from . import c\n")
    assert [n.names[0].name for n in _import_nodes(deferred)] == ["b"]
    assert _parents("clorch_repl.magics.arguments") == ["clorch_repl.magics"]


# ------------------------------------------------------------------------------ rooms (issue 33)
#: Each room of the package (a subpackage, or a module at the top level; "" is the package's own
#: __init__) -> the rooms it may import, deferred imports included. A new import between rooms
#: that is not here fails: add it only if it belongs (the rank's side stays off the notebook's, see
#: RANK_SIDE), and take out what is no longer imported (a stale entry fails too).
ROOMS: dict[str, set[str]] = {
    "": {"magics"},  # %load_ext clorch_repl
    # the rank's side: the rank's kernel process, what runs beside it on its host, the contract
    "kernel": {"wire", "diagnosis", "distributed", "common", "errors"},
    "host": {"kernel", "wire", "placement", "common", "cuda", "errors"},
    "wire": {"placement", "common", "errors"},
    "rank": {"host"},  # python -m clorch_repl.rank: the nanny's documented name
    # the notebook's side: the magics over the notebook layer (IPython's hooks) over the engine (session)
    "magics": {"notebook", "session", "launchers", "jobs", "host", "wire", "common", "cuda", "errors"},
    "notebook": {"session", "diagnosis", "wire", "common", "errors"},
    "session": {"launchers", "host", "diagnosis", "wire", "common", "cuda", "errors"},
    "launchers": {"kernel", "host", "placement", "wire", "common", "cuda", "errors"},
    # the rank-side library, batch jobs, diagnosis (rank's answers, notebook's analysis), training
    "distributed": {"jobs", "wire", "common", "cuda", "errors"},  # jobs: launch and Job keep API.md's names
    # launchers: only its registry, to find a launcher's JobRanks by name (its srun and teardown are placement's)
    "jobs": {"distributed", "kernel", "host", "launchers", "placement", "diagnosis", "wire", "common", "errors"},
    "diagnosis": {"host", "wire", "common", "errors"},
    "training": {"distributed", "common", "errors"},
    "amp": {"training"}, "data": {"training"}, "parallel": {"training"},
    "examples": {"amp", "cuda", "data", "distributed", "errors", "parallel"},
    # the commands (clorch-notebook, clorch-release-check), and the release check's documented module name
    "tools": {"session", "host", "distributed", "amp", "data", "parallel", "common", "cuda", "errors"},
    "release_check": {"tools"},
    # leaves and near-leaves every side may use; placement: where ranks run and how they end, written once
    # for sessions (launchers) and batch jobs (jobs): srun, Slurm's task variables, supervised teardown
    "placement": {"common", "errors"},
    "errors": {"common", "host", "session"},  # see NOTEBOOK_ONLY_IMPORTS
    "common": {"cuda", "errors"},
    "cuda": set(),
}
#: Rooms that run in a rank's process or beside it on its host, and rooms that run only in the
#: notebook's: no module of the first imports a module of the second, directly or through any other.
RANK_SIDE = {"kernel", "host", "wire", "placement"}
NOTEBOOK_SIDE = {"session", "notebook", "magics"}
#: Imports of notebook-side modules made inside functions that only the notebook calls, which the
#: rank's side may reach without ever running them: the rendering of a failed cell
#: (errors.DistributedCellError). The list may only shrink.
NOTEBOOK_ONLY_IMPORTS: dict[str, set[str]] = {
    "clorch_repl.errors": {"clorch_repl.session", "clorch_repl.session.protocol"},
}


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = {_module_name(r) for r in modules}
    return {_module_name(r): _imports(r, p, known) for r, p in modules.items()}


def _room_problems(graph: dict[str, set[str]], rooms: dict[str, set[str]]) -> list[str]:
    """Imports between rooms that the table does not allow, and entries no import uses."""
    problems, used = [], set()
    for module, deps in sorted(graph.items()):
        room = _room(module)
        if room not in rooms:
            problems.append(f"{module}: its room {room!r} is not in ROOMS; say which rooms it may import")
            continue
        for dep in sorted(deps):
            other = _room(dep)
            if other == room:
                continue
            used.add((room, other))
            if other not in rooms[room]:
                problems.append(f"{module} imports {dep}: room {room!r} may not import {other!r} (ROOMS)")
    problems += [f"ROOMS lets {room!r} import {other!r}, which it no longer does: take it out"
                 for room, others in sorted(rooms.items()) for other in sorted(others) if (room, other) not in used]
    return problems


def _side_problems(graph: dict[str, set[str]], rooms: dict[str, set[str]]) -> list[str]:
    """Notebook-side modules a rank-side module reaches, with the chain of imports that reaches them."""
    problems = [f"ROOMS lets rank-side {room!r} import notebook-side {other!r}"
                for room in sorted(RANK_SIDE) for other in sorted(rooms.get(room, set()) & NOTEBOOK_SIDE)]
    for start in sorted(m for m in graph if _room(m) in RANK_SIDE):
        seen, stack = {start: [start]}, [start]
        while stack:
            module = stack.pop()
            for dep in sorted(graph.get(module, set()) - NOTEBOOK_ONLY_IMPORTS.get(module, set())):
                if dep in seen:
                    continue
                seen[dep] = seen[module] + [dep]
                if _room(dep) in NOTEBOOK_SIDE:
                    problems.append("rank side imports notebook side: " + " -> ".join(seen[dep]))
                    continue
                stack.append(dep)
    return problems


def test_each_room_imports_only_what_the_table_allows() -> None:
    assert _room_problems(_graph(), ROOMS) == []


def test_the_rank_side_never_imports_the_notebook_side() -> None:
    graph = _graph()
    assert _side_problems(graph, ROOMS) == []
    for module, lazy in NOTEBOOK_ONLY_IMPORTS.items():
        assert lazy <= graph[module], f"{module} no longer imports {sorted(lazy - graph[module])}: shrink the list"


def test_the_room_guards_catch_what_they_guard() -> None:
    """The checks themselves, on made-up graphs: an import the table lacks, a stale entry, a rank-side
    module reaching the notebook's side through a third room, a table that lets it."""
    graph = {"clorch_repl.kernel.a": {"clorch_repl.wire.b"}, "clorch_repl.wire.b": {"clorch_repl.errors"},
             "clorch_repl.errors": {"clorch_repl.session.c"}, "clorch_repl.session.c": set()}
    rooms = {"kernel": {"wire"}, "wire": {"errors"}, "errors": {"session"}, "session": {"magics"}}
    assert _room_problems(graph, rooms) == ["ROOMS lets 'session' import 'magics', which it no longer does: take it out"]
    assert _room_problems(graph, {**rooms, "wire": set()})[0] == (
        "clorch_repl.wire.b imports clorch_repl.errors: room 'wire' may not import 'errors' (ROOMS)")
    assert _side_problems(graph, rooms) == [
        "rank side imports notebook side: clorch_repl.kernel.a -> clorch_repl.wire.b -> clorch_repl.errors -> "
        "clorch_repl.session.c",
        "rank side imports notebook side: clorch_repl.wire.b -> clorch_repl.errors -> clorch_repl.session.c"]
    assert _side_problems({}, {"kernel": {"session"}}) == ["ROOMS lets rank-side 'kernel' import notebook-side 'session'"]


# ------------------------------------------------------------------------------ the top level (issue 33)
#: The most modules (``__init__.py`` included) the package's top level may hold: its public face, the
#: names API.md and README.md give users (``from clorch_repl import cuda, distributed as dist,
#: parallel as ddp, data, amp``, ``clorch_repl.errors``, ``python -m clorch_repl.rank`` and
#: ``python -m clorch_repl.release_check``). Everything else lives in the package of the process
#: that runs it.
TOP_LEVEL_MODULES = 8


def _top_level_problems(names: list[str], limit: int) -> list[str]:
    if len(names) <= limit:
        return []
    return [f"clorch_repl/ holds {len(names)} modules ({', '.join(names)}), at most {limit}: put the new one "
            "in the package of the process that runs it (see ROOMS)"]


def test_the_top_level_holds_only_the_public_face() -> None:
    names = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert _top_level_problems(names, TOP_LEVEL_MODULES) == []
    assert _top_level_problems(["a.py", "b.py", "c.py"], 2) == [
        "clorch_repl/ holds 3 modules (a.py, b.py, c.py), at most 2: put the new one in the package of the "
        "process that runs it (see ROOMS)"]


# ------------------------------------------------------------------------------ IPython (issue 33)
#: The packages of a notebook's front end: only the notebook layer imports them, so that the engine
#: (clorch_repl.session: start, run a cell with hooks, interrupt, status, stop) runs in a script,
#: the release check or an agent without IPython (tests/integration/test_engine.py checks the
#: process too).
FRONT_END_PACKAGES = ("IPython", "ipywidgets")
#: The rooms whose modules may import them: the notebook layer (``notebook/``: IPython's hooks;
#: ``magics/``: the magics over them), and the rank's kernel, which is an IPython kernel in a
#: process of its own.
FRONT_END_ROOMS = {"notebook", "magics", "kernel"}
#: Modules of other rooms that may, and why; the list may only shrink.
FRONT_END_MODULES: dict[str, str] = {
    "clorch_repl.diagnosis.probe": "its cell_frames runs in the rank's kernel, answering a probe",
}


def _front_end_imports(source: str) -> set[str]:
    """The front-end packages (:data:`FRONT_END_PACKAGES`) a module imports, deferred imports included."""
    found = set()
    for node in _import_nodes(ast.parse(source)):
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
        if isinstance(node, ast.ImportFrom) and node.level:
            continue  # the package's own modules: the room table's business
        found |= {name.split(".")[0] for name in names if name.split(".")[0] in FRONT_END_PACKAGES}
    return found


def _front_end_problems(imports: dict[str, set[str]], rooms: set[str], allowed: dict[str, str]) -> list[str]:
    problems = []
    for module, packages in sorted(imports.items()):
        if packages and _room(module) not in rooms and module not in allowed:
            problems.append(f"{module} imports {', '.join(sorted(packages))}, which only the notebook layer may "
                            "(notebook/, magics/): take it through a hook of clorch_repl.session.hooks")
    problems += [f"{module} is listed in FRONT_END_MODULES but imports no IPython now: take it off the list"
                 for module in sorted(allowed) if not imports.get(module)]
    return problems


def test_only_the_notebook_layer_imports_ipython() -> None:
    imports = {_module_name(r): _front_end_imports(p.read_text()) for r, p in _modules().items()}
    assert _front_end_problems(imports, FRONT_END_ROOMS, FRONT_END_MODULES) == []


def test_the_ipython_guard_catches_what_it_guards() -> None:
    """On made-up modules: a deferred import in the engine, an import in the notebook layer, a stale entry."""
    source = "def show():\n    from IPython.display import display\nimport ipywidgets.widgets\nfrom . import x\n"
    assert _front_end_imports(source) == {"IPython", "ipywidgets"}
    imports = {"clorch_repl.session.x": {"IPython"}, "clorch_repl.notebook.y": {"IPython"},
               "clorch_repl.common.z": set()}
    assert _front_end_problems(imports, {"notebook"}, {"clorch_repl.common.z": "why"}) == [
        "clorch_repl.session.x imports IPython, which only the notebook layer may (notebook/, magics/): take it "
        "through a hook of clorch_repl.session.hooks",
        "clorch_repl.common.z is listed in FRONT_END_MODULES but imports no IPython now: take it off the list"]


def test_no_two_test_modules_share_a_name() -> None:
    """pytest imports the test folders without packages, by each file's name: two files of one name
    (tests/unit/test_x.py and tests/integration/test_x.py) stop the whole suite at collection, which
    running either folder alone never shows (it happened: CI's one run of everything caught it)."""
    tests = PACKAGE.parent / "tests"
    seen: dict[str, list[str]] = {}
    for path in sorted(tests.rglob("test_*.py")):
        seen.setdefault(path.name, []).append(path.relative_to(tests).as_posix())
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}
