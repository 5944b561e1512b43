"""The package's shape, held where a review found it hard to change (issue 27): no module over
:data:`FILE_LINES` lines, no function over :data:`FUNCTION_LINES`, and no cycle among the
package's imports.

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
