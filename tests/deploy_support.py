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

import pytest
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


@pytest.fixture(name="s3_bucket")
def s3_bucket_fixture(s3_endpoint):
    """``(endpoint, bucket, storage_options)`` of a fresh bucket on the session's
    ``s3_endpoint`` (tests/conftest.py)."""
    import uuid

    import boto3

    bucket = f"deploy-{uuid.uuid4().hex[:10]}"
    boto3.client(
        "s3",
        endpoint_url=s3_endpoint,
        aws_access_key_id="test",
        aws_secret_access_key="test",
        region_name="us-east-1",
    ).create_bucket(Bucket=bucket)
    # s3fs-style options in the form both store backends accept (obstore via cache_format's
    # translation, s3fs as is): a top-level "region" breaks s3fs (AioSession rejects it).
    options = {
        "endpoint_url": s3_endpoint,
        "key": "test",
        "secret": "test",
        "client_kwargs": {"region_name": "us-east-1"},
    }
    return s3_endpoint, bucket, options


def s3_keys(endpoint: str, bucket: str, prefix: str = "") -> set[str]:
    """Every object key under ``prefix`` in ``bucket``."""
    import boto3

    s3 = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="test",
        aws_secret_access_key="test",
        region_name="us-east-1",
    )
    keys: set[str] = set()
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys |= {o["Key"] for o in page.get("Contents", [])}
    return keys
