"""The one ``logitcache`` command: ``info --versions`` reports the optional paths, a user error
is one line with exit status 2 (an unreachable service, a bad flag), and the jobs commands
retry through the client's one request core (a real server that starts late)."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest
from logitcache.client.cli import main
from server_support import free_port


def test_info_versions_names_the_loss_kernels(capsys: pytest.CaptureFixture[str]) -> None:
    from logitcache.client.loss import TRITON_AVAILABLE

    out = io.StringIO()
    assert main(["info", "--versions"], out=out) == 0
    assert "numpy" in out.getvalue() and "zarr" in out.getvalue()
    kernels = [line for line in out.getvalue().splitlines() if line.startswith("loss kernels")]
    assert kernels and kernels[0].split()[3] == ("triton" if TRITON_AVAILABLE else "torch")
    from logitcache.cache_format import kernels_in_use

    for part, path in kernels_in_use().items():
        line = next(x for x in out.getvalue().splitlines() if x.startswith(f"format {part} "))
        assert line.split()[-1] == path


def test_info_without_a_store_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "give a store URL" in err


def test_unreachable_service_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["jobs", "--url", url, "list"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("logitcache: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err


def test_bad_flag_is_refused_before_any_request(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["jobs", "--url", url, "submit", "c", "f.jsonl", "--draws", "8"]) == 2
    assert "--draws only apply with --targets sampled" in capsys.readouterr().err


@pytest.mark.subprocess
def test_console_script_runs() -> None:
    exe = subprocess.run(
        [sys.executable, "-c", "import sys; from logitcache.client.cli import main; "
         "sys.exit(main(['info', '--versions']))"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert exe.returncode == 0 and "loss kernels" in exe.stdout, exe.stderr


@pytest.mark.subprocess
def test_the_cli_and_the_client_face_load_no_torch_or_httpx() -> None:
    """The store commands run on the base install: importing the CLI (and the client's face)
    loads neither torch nor httpx until a name that needs them is used."""
    code = (
        "import sys, logitcache.client, logitcache.client.cli\n"
        "print(','.join(m for m in ('torch', 'httpx') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "", out.stderr
