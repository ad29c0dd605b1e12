"""``logitcache info --versions``: the libraries installed and the optional paths that run."""

from __future__ import annotations

import platform
from importlib import metadata
from importlib.util import find_spec

#: Distributions reported, in order: the base install, then the optional ones.
DISTRIBUTIONS = (
    "logitcache",
    "numpy",
    "zarr",
    "numcodecs",
    "pydantic",
    "typer",
    "numba",
    "httpx",
    "torch",
    "triton",
)


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def loss_kernels() -> str:
    """Which code runs the loss's full-vocabulary passes on CUDA (Triton or torch)."""
    if find_spec("torch") is None:
        return "n/a (torch not installed)"
    from logitcache.client.loss import TRITON_AVAILABLE

    return "triton" if TRITON_AVAILABLE else "torch (triton not installed)"


def versions_report() -> str:
    """One ``name  version`` line per library, then the optional paths chosen at import."""
    rows = [("python", platform.python_version())]
    rows += [(name, _version(name)) for name in DISTRIBUTIONS]
    from logitcache.cache_format import kernels_in_use

    rows += [(f"format {part}", path) for part, path in kernels_in_use().items()]
    rows.append(("loss kernels (CUDA)", loss_kernels()))
    return "\n".join(f"{name:<22} {value}" for name, value in rows)
