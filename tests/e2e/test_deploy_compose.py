"""docker-compose.yml and docker/compose.gpu.yml, validated by ``docker-compose config``.

No Docker engine runs on the test machines, so nothing is built or started here: compose (v1,
Debian's ``docker-compose``) resolves the files, profiles, overrides and ``${VAR}`` substitution,
and the resolved model is checked. Skipped (with the reason) only if the binary is absent.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from deploy_support import REPO, compose_binary, compose_config
from logitcache.server.settings import ServerSettings

pytestmark = pytest.mark.skipif(
    compose_binary() is None,
    reason="docker-compose (v1) is not installed: `apt-get install docker-compose` to run these",
)

GPU_OVERRIDE = ("-f", "docker-compose.yml", "-f", "docker/compose.gpu.yml")
TEACHERS = ("teacher", "teacher-s3")
#: LOGITCACHE_* variables a teacher container may carry that are not ServerSettings fields.
NON_SETTINGS = {"LOGITCACHE_FIXTURES"}


@pytest.fixture
def env_file(tmp_path: Path):
    """Write a compose env file (``--env-file``) so a developer's own .env never leaks in."""

    def make(**values: str) -> tuple[str, str]:
        path = tmp_path / "compose.env"
        path.write_text("".join(f"{k}={v}\n" for k, v in values.items()))
        return ("--env-file", str(path))

    return make


def clean_env() -> dict[str, str]:
    """The environment minus LOGITCACHE_/MINIO_/VLLM_/HF_ variables (they would substitute)."""
    return {k: v for k, v in os.environ.items() if not re.match(r"(LOGITCACHE|MINIO|VLLM|HF)_", k)}


def config(*args: str) -> dict:
    return compose_config(*args, env=clean_env())


def volume_targets(service: dict) -> dict[str, str]:
    """Mount target -> source for a resolved service (v1 prints ``source:target:mode``)."""
    out = {}
    for v in service.get("volumes", []):
        if isinstance(v, dict):
            out[v["target"]] = v["source"]
        else:
            parts = v.split(":")
            out[parts[1]] = parts[0]
    return out


def test_default_up_starts_the_cpu_teacher_with_its_store_on_a_volume(env_file):
    cfg = config(*env_file())
    services = cfg["services"]
    default = sorted(n for n, s in services.items() if not s.get("profiles"))
    assert default == ["teacher"], "`docker compose up` must start the teacher alone"
    t = services["teacher"]
    assert t["build"]["dockerfile"] == "docker/cpu.Dockerfile"
    assert Path(t["build"]["context"]).resolve() == REPO
    assert t["environment"]["LOGITCACHE_STORE_ROOT"] == "/data/caches"
    mounts = volume_targets(t)
    assert mounts["/data/caches"] == "caches" and "caches" in cfg["volumes"]
    assert mounts["/data/state"] == "state" and "state" in cfg["volumes"]
    assert t["healthcheck"]["test"] == ["CMD", "python3", "/opt/logitcache/healthcheck.py"]
    assert t["ports"] == ["127.0.0.1:8000:8000/tcp"]
    assert t["environment"]["LOGITCACHE_HOST"] == "0.0.0.0"
    assert t["environment"]["LOGITCACHE_PORT"] == "8000"


def test_s3_profile_adds_minio_a_bucket_job_and_a_teacher_writing_to_s3(env_file):
    cfg = config(*env_file(LOGITCACHE_S3_BUCKET="kd-bucket", MINIO_ROOT_PASSWORD="pw-123456"))
    services = cfg["services"]
    for name in ("minio", "minio-init", "teacher-s3"):
        assert services[name]["profiles"] == ["s3"], name
    minio, init, t = services["minio"], services["minio-init"], services["teacher-s3"]
    assert minio["healthcheck"]["test"][:2] == ["CMD", "mc"]
    assert init["depends_on"] == {"minio": {"condition": "service_healthy"}}
    assert init["environment"]["LOGITCACHE_S3_BUCKET"] == "kd-bucket"
    script = " ".join(init["command"])
    assert "mc mb --ignore-existing" in script and "LOGITCACHE_S3_BUCKET" in script
    assert init["restart"] == "no"
    assert t["depends_on"] == {"minio-init": {"condition": "service_completed_successfully"}}
    env = t["environment"]
    assert env["LOGITCACHE_STORE_ROOT"] == "s3://kd-bucket/caches"
    options = json.loads(env["LOGITCACHE_STORAGE_OPTIONS"])
    assert options["endpoint_url"] == "http://minio:9000"
    assert "region" not in options, "s3fs (cache listing) rejects a top-level region"
    assert options["client_kwargs"] == {"region_name": "us-east-1"}
    assert options["key"] == minio["environment"]["MINIO_ROOT_USER"]
    assert options["secret"] == "pw-123456" == minio["environment"]["MINIO_ROOT_PASSWORD"]
    assert "/data/caches" not in volume_targets(t), "the S3 teacher keeps no local cache volume"
    published = {p.split(":")[1] for p in t["ports"]} | {
        p.split(":")[1] for p in services["teacher"]["ports"]
    }
    assert published == {"8000", "8001"}, "both teachers can run side by side"


def test_gpu_override_uses_the_gpu_image_with_device_reservations(env_file):
    cfg = config(*GPU_OVERRIDE, *env_file(LOGITCACHE_TENSOR_PARALLEL_SIZE="4"))
    for name in TEACHERS:
        t = cfg["services"][name]
        assert t["build"]["dockerfile"] == "docker/gpu.Dockerfile", name
        devices = t["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
        assert t["shm_size"]
        env = t["environment"]
        assert env["LOGITCACHE_TENSOR_PARALLEL_SIZE"] == "4"
        assert env["LOGITCACHE_DTYPE"] == "bfloat16"
        # the override adds to the base environment instead of replacing it
        assert env["LOGITCACHE_STORE_ROOT"] in ("/data/caches", "s3://logitcache/caches")
        assert t["healthcheck"]["test"][-1] == "/opt/logitcache/healthcheck.py"
    assert [n for n, s in cfg["services"].items() if not s.get("profiles")] == ["teacher"]


@pytest.mark.parametrize("variant", ["cpu", "gpu"])
def test_teacher_environment_is_valid_server_settings(variant, env_file, monkeypatch):
    """Every LOGITCACHE_* name a teacher gets is a ServerSettings field, and the values parse."""
    args = GPU_OVERRIDE if variant == "gpu" else ()
    cfg = config(*args, *env_file())
    fields = {f"LOGITCACHE_{name.upper()}" for name in ServerSettings.model_fields}
    for name in TEACHERS:
        env = cfg["services"][name]["environment"]
        ours = {k for k in env if k.startswith("LOGITCACHE_")}
        unknown = ours - fields - NON_SETTINGS
        assert not unknown, f"{name}: not server settings: {sorted(unknown)}"
        for k in list(os.environ):
            if k.startswith("LOGITCACHE_"):
                monkeypatch.delenv(k)
        for k in ours:
            monkeypatch.setenv(k, str(env[k]))
        s = ServerSettings(_env_file=None)  # type: ignore[call-arg]
        assert s.store_root == env["LOGITCACHE_STORE_ROOT"]
        assert s.host == "0.0.0.0" and s.port == 8000
        assert s.api_key is None, "an empty LOGITCACHE_API_KEY means no key"
        if name == "teacher-s3":
            assert s.storage_options["endpoint_url"] == "http://minio:9000"


def test_env_example_is_complete_and_used(env_file):
    """Each .env.example variable is substituted somewhere, and compose accepts the file."""
    example = (REPO / ".env.example").read_text()
    names = re.findall(r"^([A-Z][A-Z0-9_]*)=", example, flags=re.M)
    assert len(names) == len(set(names)), "duplicate names in .env.example"
    sources = "".join(
        (REPO / f).read_text()
        for f in ("docker-compose.yml", "docker/compose.gpu.yml", "docker/compose.api-key-file.yml")
    )
    used = set(re.findall(r"\$\{([A-Z][A-Z0-9_]*)", sources))
    assert set(names) == used, {
        "in .env.example, never substituted": sorted(set(names) - used),
        "substituted, missing from .env.example": sorted(used - set(names)),
    }
    cfg = config("--env-file", str(REPO / ".env.example"), *GPU_OVERRIDE)
    opts = json.loads(cfg["services"]["teacher-s3"]["environment"]["LOGITCACHE_STORAGE_OPTIONS"])
    assert opts["secret"] == "change-me-please"


def test_broken_compose_file_is_rejected(tmp_path):
    """The validation is real: compose refuses an invalid file (unknown key in a service)."""
    bad = tmp_path / "docker-compose.yml"
    text = (REPO / "docker-compose.yml").read_text()
    bad.write_text(text.replace("restart: unless", "restrt: x"))
    with pytest.raises(RuntimeError, match="restrt"):
        compose_config("-f", str(bad), env=clean_env())


@pytest.mark.parametrize("variant", ["cpu", "gpu"])
def test_volume_mount_points_exist_in_the_image_owned_by_the_service_user(variant, env_file):
    """A named volume starts as a copy of its mount point in the image; a mount point the image
    lacks is created root-owned and the non-root service could not write to it."""
    from deploy_support import final_stage, parse_dockerfile

    args = GPU_OVERRIDE if variant == "gpu" else ()
    cfg = config(*args, *env_file())
    stage = final_stage(parse_dockerfile(REPO / "docker" / f"{variant}.Dockerfile"))
    runs = " ".join(i.args for i in stage if i.keyword == "RUN")
    made = {p for group in re.findall(r"mkdir -p ((?:[\w/.-]+\s*)+)", runs) for p in group.split()}
    owned = re.findall(r"chown -R \S+ ((?:/[\w/.-]+\s*)+)", runs)
    owned_roots = {p for group in owned for p in group.split()}
    for name in TEACHERS:
        service = cfg["services"][name]
        for target, source in volume_targets(service).items():
            if source not in cfg["volumes"]:
                continue  # a bind mount (read-only inputs/models)
            assert target in made, f"{name}: {target} is not created in the {variant} image"
            assert any(target == r or target.startswith(r + "/") for r in owned_roots), (
                f"{name}: {target} is not owned by the service user"
            )


def test_api_key_file_override_gives_each_teacher_the_secret_not_the_key(env_file, tmp_path):
    key = tmp_path / "api_key"
    key.write_text("k-123\n")
    args = ("-f", "docker-compose.yml", "-f", "docker/compose.api-key-file.yml", "--profile", "s3")
    cfg = config(*args, *env_file(LOGITCACHE_API_KEY_SECRET=str(key)))
    assert cfg["secrets"]["logitcache_api_key"]["file"] == str(key)
    for name in TEACHERS:
        t = cfg["services"][name]
        env = t["environment"]
        assert env["LOGITCACHE_API_KEY_FILE"] == "/run/secrets/logitcache_api_key"
        assert env["LOGITCACHE_STORE_ROOT"], "the override adds to the base environment"
        secrets = [s if isinstance(s, str) else s["source"] for s in t["secrets"]]
        assert secrets == ["logitcache_api_key"]
        assert "k-123" not in json.dumps(t), "the key itself must not be in the service"
