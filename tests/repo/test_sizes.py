"""Size rules of the library (GUIDE.md): no file over 600 lines, no function over 120 lines of
code (docstrings, comments and blank lines excluded) outside numba kernels."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ("cache_format", "client", "server", "protocol", "fixtures")
MAX_FILE_LINES = 600
MAX_FUNCTION_CODE_LINES = 120


def _library_files() -> list[Path]:
    return sorted(p for top in LIBRARY for p in (ROOT / top).rglob("*.py"))


def _is_numba_kernel(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Decorated with numba's ``njit``/``jit`` (or a module-level alias named so)."""
    for dec in fn.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
        if name in ("jit", "njit"):
            return True
    return False


def _docstring_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            if isinstance(node.value.value, str):
                lines.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return lines


def code_lines(source: str, fn: ast.FunctionDef | ast.AsyncFunctionDef, docs: set[int]) -> int:
    """Lines of ``fn`` that hold code: not blank, not a comment, not in a docstring."""
    lines = source.splitlines()[fn.lineno - 1 : fn.end_lineno]
    return sum(
        1
        for n, line in enumerate(lines, fn.lineno)
        if line.strip() and not line.strip().startswith("#") and n not in docs
    )


def test_code_lines_counts_only_code() -> None:
    src = 'def f():\n    """Doc.\n\n    More."""\n    # note\n\n    x = 1\n    return x\n'
    fn = ast.parse(src).body[0]
    assert isinstance(fn, ast.FunctionDef)
    assert code_lines(src, fn, _docstring_lines(ast.parse(src))) == 3


def test_no_library_file_over_the_limit() -> None:
    long = {
        p.relative_to(ROOT).as_posix(): n
        for p in _library_files()
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert long == {}, f"files over {MAX_FILE_LINES} lines: {long}"


def test_no_function_over_the_limit_outside_numba_kernels() -> None:
    long = {}
    for path in _library_files():
        source = path.read_text()
        tree = ast.parse(source)
        docs = _docstring_lines(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if _is_numba_kernel(node):
                    continue
                n = code_lines(source, node, docs)
                if n > MAX_FUNCTION_CODE_LINES:
                    long[f"{path.relative_to(ROOT).as_posix()}:{node.lineno} {node.name}"] = n
    assert long == {}, f"functions over {MAX_FUNCTION_CODE_LINES} lines of code: {long}"
