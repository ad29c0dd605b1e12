"""Fail-fast start-up checks and the start-up banner of ``logitcache-server``.

:func:`check` runs before the engine loads and reports an operator's mistake in one line
(:class:`PreflightError`; exit status 2): no model, a missing model or tokenizer path or one
without ``config.json``, a hub id under ``HF_HUB_OFFLINE=1``, a store root or state directory
that cannot be written, a port in use. :func:`install_banner` prints, once the engine has
loaded, the URLs, store root, data directory, model, k and the effective max sequence length.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import socket
import sys
import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from fastapi import FastAPI

    from .settings import ServerSettings

#: A hub model id: ``name`` or ``org/name`` (letters, digits, ``-_.``), nothing path-like.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


class PreflightError(Exception):
    """A start-up problem the operator must fix; ``str(e)`` is the one-line message."""


def _is_remote(url: str) -> bool:
    return "://" in url and not url.startswith("file://")


def check_model(model: str, *, what: str = "model", flag: str = "--model") -> None:
    """``model`` is a local model directory (holding ``config.json``) or a plausible hub id."""
    if not model:
        raise PreflightError(
            f"no {what} given: pass {flag} /path/to/model (a Hugging Face model directory) "
            f"or set LOGITCACHE_{flag[2:].upper().replace('-', '_')}"
        )
    path = Path(model).expanduser()
    if path.exists():
        if not path.is_dir():
            raise PreflightError(f"{what} {model!r} is a file, not a model directory")
        if what == "model" and not (path / "config.json").is_file():
            raise PreflightError(
                f"{what} {model!r} is not a model directory (no config.json in {path})"
            )
        return
    looks_like_path = (
        model.startswith(("/", ".", "~")) or model.count("/") > 1 or not _HUB_ID.match(model)
    )
    if looks_like_path:
        raise PreflightError(f"{what} path {model!r} does not exist")
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        raise PreflightError(
            f"{what} {model!r} is not a local directory and HF_HUB_OFFLINE is set, so it cannot "
            "be fetched from the hub: give the path of a local model directory"
        )


def check_writable_dir(directory: str | Path, *, what: str) -> Path:
    """Create ``directory`` if needed, prove it writable (a temporary file); its absolute path."""
    path = Path(directory).expanduser().absolute()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".preflight-"):
            pass
    except FileExistsError as e:
        raise PreflightError(f"{what} {str(directory)!r} is a file, not a directory") from e
    except OSError as e:
        raise PreflightError(
            f"{what} {str(directory)!r} is not writable ({e.strerror or e})"
        ) from e
    return path


def check_port(host: str, port: int) -> None:
    """Bind ``(host, port)`` as uvicorn will (``SO_REUSEADDR``) and release it at once."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise PreflightError(f"cannot resolve the bind address {host!r} ({e.strerror})") from e
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise PreflightError(
                    f"port {port} on {host} is already in use: stop the other server or pass "
                    "--port N (0 picks a free port)"
                ) from e
            raise PreflightError(f"cannot bind {host}:{port} ({e.strerror or e})") from e


def check(settings: ServerSettings) -> None:
    """Every start-up check, cheapest first; raises :class:`PreflightError` on the first failure."""
    for teacher in settings.teacher_list():
        each = settings.for_teacher(teacher)
        check_model(each.model)
        if each.tokenizer:
            check_model(each.tokenizer, what="tokenizer", flag="--tokenizer")
    if not _is_remote(settings.store_root):
        root = settings.store_root.removeprefix("file://")
        check_writable_dir(root, what="store root")
    check_writable_dir(settings.state_dir, what="state directory")
    data = Path(settings.data_dir).expanduser()
    if data.exists() and not data.is_dir():
        raise PreflightError(f"data directory {str(settings.data_dir)!r} is a file")
    check_port(settings.host, settings.port)


def banner_lines(settings: ServerSettings, services: Any) -> list[str]:
    """The banner's lines, from the settings and the loaded services (engine info, limits)."""
    host = settings.host
    shown = f"[{host}]" if ":" in host else host
    if host in ("0.0.0.0", "::"):
        shown = "127.0.0.1" if host == "0.0.0.0" else "[::1]"
    url = (
        f"http://{shown}:{settings.port}"
        if settings.port
        else f"http://{shown}:<port> (port 0: see uvicorn's 'running on' line)"
    )
    info = services.engine.info
    k_eff = services.scoring.default_k
    asked = settings.max_seq_len
    max_len = services.scoring.limits.max_seq_len
    capped = f" (asked {asked}; capped by the model)" if max_len < asked else ""
    data = Path(settings.data_dir).expanduser().absolute()
    data_note = "" if data.is_dir() else "  (does not exist yet: create it for file inputs)"
    store = services.caches.root
    lines = [
        "logitcache teacher service ready",
        f"  URL             {url}   (status page)",
        f"  API docs        {url.split(' ')[0]}/docs",
        f"  store root      {store}",
        f"  data dir        {data}{data_note}",
        f"  model           {info.model_id} ({settings.backend}, vocab {info.vocab_size})",
        f"  k               {k_eff} (requests may ask up to {info.max_k})",
        f"  max seq length  {max_len} tokens{capped}",
        "  API key         "
        + ("required (Authorization: Bearer <key>)" if settings.api_key else "none (open)"),
    ]
    return lines


def install_banner(
    app: FastAPI, settings: ServerSettings, out: Callable[[], TextIO] = lambda: sys.stderr
) -> None:
    """Print :func:`banner_lines` once the app's lifespan has started (the engine is loaded)."""
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a: Any) -> AsyncIterator[Any]:
        async with inner(a) as state:
            services = getattr(a.state, "services", None)
            if services is not None:
                with contextlib.suppress(Exception):  # a banner must never stop the server
                    print("\n".join(banner_lines(settings, services)), file=out(), flush=True)
            yield state

    app.router.lifespan_context = lifespan


def fail(message: str, prog: str = "logitcache-server") -> None:
    """Print ``prog: error: message`` to stderr and exit with status 2 (argparse's convention)."""
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)
