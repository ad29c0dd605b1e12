"""Helpers for the deployment tests: a small Dockerfile reader, compose runner, S3 server.

The Dockerfile reader follows the Dockerfile reference's line rules that the project's files use:
``#`` comment lines (also inside continued instructions) are dropped, a trailing ``\\`` joins the
next line, and the first word is the instruction (case-insensitive).
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Instruction:
    """One Dockerfile instruction: upper-cased keyword and its raw argument text."""

    keyword: str
    args: str

    def exec_form(self) -> list[str] | None:
        """The JSON-array ("exec") form of the arguments, or ``None`` if they are shell form."""
        text = self.args.strip()
        if not text.startswith("["):
            return None
        value = json.loads(text)
        return [str(v) for v in value]


def parse_dockerfile(path: Path) -> list[Instruction]:
    """Instructions of the Dockerfile at ``path``, in order."""
    out: list[Instruction] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = pending + line
        pending = ""
        keyword, _, args = full.partition(" ")
        out.append(Instruction(keyword.upper(), args.strip()))
    if pending:
        raise ValueError(f"{path}: the last instruction ends with a line continuation")
    return out


def final_stage(instructions: list[Instruction]) -> list[Instruction]:
    """The instructions of the last build stage (from its ``FROM`` on)."""
    starts = [i for i, ins in enumerate(instructions) if ins.keyword == "FROM"]
    if not starts:
        raise ValueError("no FROM instruction")
    return instructions[starts[-1] :]


def env_names(instructions: list[Instruction]) -> dict[str, str]:
    """Variables set by ``ENV`` instructions (``NAME=value`` form), last one wins."""
    env: dict[str, str] = {}
    for ins in instructions:
        if ins.keyword == "ENV":
            for item in shlex.split(ins.args):
                name, sep, value = item.partition("=")
                if not sep:
                    raise ValueError(f"ENV without '=' (legacy form) is not used here: {ins.args}")
                env[name] = value
    return env


def compose_binary() -> str | None:
    """Path of ``docker-compose`` (v1), or ``None`` if it is not installed."""
    return shutil.which("docker-compose")


def compose_config(*args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """``docker-compose [args] config`` run in the repository root, parsed as YAML."""
    binary = compose_binary()
    if binary is None:
        raise FileNotFoundError("docker-compose is not installed")
    proc = subprocess.run(
        [binary, *args, "config"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"docker-compose {' '.join(args)} config failed:\n{proc.stderr}")
    return yaml.safe_load(proc.stdout)
