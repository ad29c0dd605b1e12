"""The layout of server/ (DESIGN.md, "Rooms and arrows"): no import circle (imports under
``TYPE_CHECKING`` and inside functions count), a module map that names every module, routers
that import no other router, no ``LOGITCACHE_*`` variable read outside the settings, and the
size limits of a file and a function."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[2]
SERVER = ROOT / "server"
#: The routers: none imports another.
ROUTERS = {"api.score", "api.jobs", "api.caches", "api.store", "api.openai", "api.ops", "api.ui"}


def _name(path: Path) -> str:
    """``server/api/score.py`` -> ``api.score`` (``__init__`` dropped; the package is ``""``)."""
    parts = list(path.relative_to(SERVER).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Modules of ``logitcache.server`` that ``path`` imports anywhere (``TYPE_CHECKING`` blocks
    and function bodies included), as names relative to the package, each ``from X import y``
    also as ``X.y``."""
    name = _name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".") if package else []
                base = parts[: len(parts) - (node.level - 1)]
                target = ".".join([*base, *(node.module.split(".") if node.module else [])])
            elif (node.module or "").startswith("logitcache.server"):
                target = (node.module or "").removeprefix("logitcache.server").lstrip(".")
            else:
                continue
            out.add(target)
            out.update(f"{target}.{a.name}".lstrip(".") for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(
                a.name.removeprefix("logitcache.server").lstrip(".")
                for a in node.names
                if a.name.startswith("logitcache.server")
            )
    return out


def _graph() -> dict[str, set[str]]:
    files = {_name(p): p for p in SERVER.rglob("*.py")}
    graph = {}
    for mod, path in files.items():
        targets = {t for t in _imports(path) if t in files and t != mod}
        # a package importing its own submodules (its face) is not a circle
        graph[mod] = {t for t in targets if not (mod == "" or t.startswith(mod + "."))}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
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
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_in_server_type_checking_and_deferred_imports_included() -> None:
    graph = _graph()
    assert _circles(graph) == []
    assert "serving.scoring" in graph["serving.cache_hits"]  # the walk sees real imports


def test_the_circle_check_finds_a_circle() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_router_imports_another_router() -> None:
    bad = []
    for path in (SERVER / "api").rglob("*.py"):
        mod = _name(path)
        own = next((r for r in ROUTERS if mod == r or mod.startswith(r + ".")), None)
        if own is None:
            continue
        for t in _imports(path):
            other = next((r for r in ROUTERS if t == r or t.startswith(r + ".")), None)
            if other is not None and other != own:
                bad.append(f"{mod} -> {t}")
    assert bad == []


def test_the_module_map_names_every_module() -> None:
    """``server/__init__.py``'s map names every module, and nothing else; ``engine`` and
    ``api.ui`` stand for their packages, a private ``_module`` is described with its user."""
    import logitcache.server

    doc = logitcache.server.__doc__ or ""
    listed = set(re.findall(r"^``([\w.]+)``\s", doc, flags=re.M))
    whole = {"engine", "api.ui"}  # packages with one line
    rooms = {_name(p) for p in SERVER.rglob("__init__.py")} - whole
    want = {
        mod
        for mod in (_name(p) for p in SERVER.rglob("*.py"))
        if mod not in rooms
        and not mod.startswith(tuple(f"{w}." for w in whole))
        and not re.fullmatch(r"_[a-z]\w*", mod.rpartition(".")[2])  # private: with its user
    }
    assert listed == want


def test_no_logitcache_environment_variable_is_read_in_server_code() -> None:
    """Behaviour is chosen by ``ServerSettings`` (pydantic-settings reads ``LOGITCACHE_*``),
    never by an environment lookup inside the library."""
    bad = []
    for path in SERVER.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call | ast.Subscript):
                continue
            text = ast.unparse(node)
            if ("environ" in text or "getenv" in text) and "LOGITCACHE_" in text:
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert bad == []


def _code_lines(source: str) -> set[int]:
    """Line numbers that hold code (no comments, blank lines or docstrings)."""
    tree = ast.parse(source)
    docs: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Module):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docs.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}
    lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in skip and tok.type != tokenize.ENDMARKER:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return lines - docs


def test_no_server_file_over_600_lines_and_no_function_over_120_lines_of_code() -> None:
    """The engine backends (``server/engine/``) are their own room, checked with it."""
    big, long = [], []
    for path in SERVER.rglob("*.py"):
        if path.relative_to(SERVER).parts[0] == "engine":
            continue
        source = path.read_text()
        if source.count("\n") > 600:
            big.append(str(path.relative_to(ROOT)))
        code = _code_lines(source)
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                span = range(node.lineno, (node.end_lineno or node.lineno) + 1)
                if sum(1 for n in span if n in code) > 120:
                    long.append(f"{path.relative_to(ROOT)}:{node.name}")
    assert big == [] and long == []
