"""Distributed batch scoring on a local Ray cluster (2 CPUs, 127.0.0.1) with the tiny teacher.

The single-worker reference is :func:`run_distributed` with one replica; the distributed run is
the CLI (``python -m logitcache.server.batch.distributed --replicas 2``) in a subprocess, connected
to this module's cluster: two vLLM engines, one per Ray actor. Their caches must be equal array for
array, key for key, in the same order; bad input must write nothing; a re-run must score nothing.
Sampled targets (issue #12): two replicas give the cache the service's one-process job gives
for the same input and seed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from deploy_support import s3_bucket_fixture, s3_keys  # noqa: F401
from logitcache.cache_format import CacheReader, Manifest, validate
from logitcache.server.errors import InvalidInputError
from logitcache.server.settings import ServerSettings
from server_support import VLLM_ENV

pytestmark = pytest.mark.vllm

K = 20  # ENGINE_MAX_K; float32, the model's own length: the settings of the shared vllm_engine
SHARD = 5
LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1"}


@pytest.fixture(scope="module")
def ray_env():
    """The vLLM environment for the Ray replicas (their workers inherit this process's)."""
    old = {k: os.environ.get(k) for k in VLLM_ENV}
    os.environ.update(VLLM_ENV)
    yield dict(VLLM_ENV)
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _texts(tiny, n: int) -> list[str]:
    docs = tiny.docs("heldout")
    out = []
    for d in docs:
        text = d.text
        for start in range(0, len(text), 180):
            piece = text[start : start + 180]
            if len(piece) > 40:
                out.append(piece)
            if len(out) == n:
                return out
    return out


@pytest.fixture(scope="module")
def dataset(tiny, tmp_path_factory) -> tuple[Path, list[dict]]:
    """A JSONL input of 21 records: explicit ids, texts, a token-id record, and a duplicated text
    (no id) that must be scored once, in its first position. Returns (path, the records)."""
    texts = _texts(tiny, 18)
    records: list[dict] = [{"id": f"doc-{i:02d}", "text": t} for i, t in enumerate(texts)]
    records.insert(3, {"text": texts[0] + " (copy without id)"})
    records.insert(12, {"text": texts[0] + " (copy without id)"})  # duplicate content: dropped
    records.append({"id": "ids-0", "input_ids": [1, 5, 9, 200, 7, 33, 2]})
    path = tmp_path_factory.mktemp("ray-input") / "corpus.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path, records


# One job batch in the engine at a time: vLLM merges the batches in flight into one step as they
# arrive, and the CPU kernels' rounding depends on the step's batch; with one in flight every
# step holds one input batch, so runs over different replicas give comparable bytes.
def _settings_kw(tiny) -> dict:
    """The settings of :func:`_server_flags` as ``ServerSettings`` keywords (dtype ``auto``: the
    early checks compare the dtype only once the weights load)."""
    return dict(model=str(tiny.teacher_dir), k=K, job_batch_sequences=3, job_inflight_batches=1,
                logprob_dtype="float16", backend="vllm")  # fmt: skip


def _server_flags(tiny) -> list[str]:
    return [
        "--model", str(tiny.teacher_dir), "-k", str(K), "--job-batch-sequences", "3",
        "--job-inflight-batches", "1", "--logprob-dtype", "float16", "--backend", "vllm",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def ray_cluster(tiny, ray_env):
    """This process's local Ray cluster (2 CPUs, loopback only); after the tiny models exist, so
    their first build does not compete with Ray for the cores."""
    from logitcache.server.batch.distributed import init_local_ray

    init_local_ray(num_cpus=2)
    import ray

    yield ray
    ray.shutdown()


def _cli(*args: str, timeout: float = 480) -> subprocess.CompletedProcess:
    """``python -m logitcache.server.batch.distributed ARGS`` in a subprocess."""
    argv = [sys.executable, "-m", "logitcache.server.batch.distributed", *args]
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, env=dict(os.environ)
    )


@pytest.fixture(scope="module")
def settings(tiny, ray_env) -> ServerSettings:
    return ServerSettings(
        _env_file=None,
        **_settings_kw(tiny),
        dtype="float32",  # the shared engine's: its rows are the replicas' byte for byte
        job_write_fill_s=0,  # commit per batch group: a killed replica's shard resumes mid-way
    )


@pytest.fixture(scope="module")
def replicas(ray_cluster, settings):
    """Two started teacher replicas (vLLM engines in Ray actors), shared by this module's runs."""
    from logitcache.server.batch.distributed import Plan, Replicas

    with Replicas(settings, 2, Plan(shard_size=SHARD)) as started:
        yield started


@pytest.fixture(scope="module")
def reference(replicas, dataset, settings, tmp_path_factory):
    """The single-worker run: one replica, into a local directory."""
    from logitcache.server.batch.distributed import read_input

    path, _ = dataset
    cache = tmp_path_factory.mktemp("ray-ref") / "single"
    report = _run(read_input(path), cache, settings, 1, replicas, dataset=path.name)
    assert report.replicas == 1 and report.shards == 5 and len(report.workers) == 1
    assert not Path(f"{cache}.staging").exists()
    return cache, report


def assert_same_cache(a: CacheReader, b: CacheReader) -> None:
    """Same keys in the same order, byte-equal arrays per key."""
    assert a.keys == b.keys
    assert a.manifest.identity() == b.manifest.identity()
    differing = []
    for i in range(a.num_sequences):
        x, y = a.sequence(i), b.sequence(i)
        for name in ("input_ids", "topk_ids", "topk_logprobs", "tail_mass"):
            if (
                np.ascontiguousarray(getattr(x, name)).tobytes()
                != np.ascontiguousarray(getattr(y, name)).tobytes()
            ):
                differing.append((x.key, name))
    assert not differing, f"{len(differing)} arrays differ, e.g. {differing[:3]}"


def _run(raws, cache: Path | str, settings: ServerSettings, n: int, pool, **kw):
    from logitcache.server.batch.distributed import Plan, run_distributed

    plan = Plan(replicas=n, shard_size=SHARD)
    return run_distributed(raws, str(cache), settings, plan, replicas=pool, **kw)


def _ray_listeners() -> dict[str, set[str]]:
    """Listening TCP addresses of this process's Ray subprocesses (gcs_server, raylet, workers)."""
    out: dict[str, set[str]] = {}
    for child in psutil.Process().children(recursive=True):
        try:
            conns = child.net_connections(kind="tcp")
            name = child.name()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for c in conns:
            if c.status == psutil.CONN_LISTEN:
                out.setdefault(name, set()).add(c.laddr.ip)
    return out


def test_local_cluster_binds_loopback_only(ray_cluster):
    ray = ray_cluster
    assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}
    assert ray.get_runtime_context().gcs_address.startswith("127.0.0.1:")
    listeners = _ray_listeners()
    assert any("gcs_server" in n for n in listeners) and any("raylet" in n for n in listeners)
    wide = {n: ips for n, ips in listeners.items() if ips - LOOPBACK}
    assert not wide, f"Ray processes listening beyond loopback: {wide}"


def test_more_replicas_than_the_cluster_holds_fail_fast(ray_cluster, settings):
    """Ray would queue such actors forever; the run refuses them before starting any."""
    from logitcache.server.batch.distributed import DistributedError, Plan, Replicas

    with pytest.raises(DistributedError, match="exceed the cluster's 2 CPU"):
        Replicas(settings, 3, Plan(cpus_per_replica=1.0))


def test_two_replicas_on_s3_equal_a_single_worker_run(replicas, reference, dataset, settings,
                                                      s3_bucket):  # fmt: skip
    """Distributed: 2 replicas into a bucket (per-shard staging caches on S3, one commit); the
    reference is the single-worker run into a local directory. Same engines (loaded once)."""
    from logitcache.server.batch.distributed import read_input

    endpoint, bucket, options = s3_bucket
    s3_settings = settings.model_copy(update={"storage_options": options})
    path, records = dataset
    ref_cache, ref = reference

    cache = f"s3://{bucket}/kd"
    report = _run(read_input(path), cache, s3_settings, 2, replicas, dataset=path.name)
    assert report.replicas == 2 and report.shards == 5
    assert len(report.workers) == 2, f"both replicas should score shards: {report.workers}"
    assert report.sequences == len(records) - 1 == report.committed == ref.committed
    assert s3_keys(endpoint, bucket, "kd/"), "the cache is in the bucket"
    assert not s3_keys(endpoint, bucket, "kd.staging/"), "staging is removed after the commit"

    a, b = CacheReader(cache, storage_options=options), CacheReader(ref_cache)
    assert_same_cache(a, b)
    # input order; the text without an id is keyed by content, its later copy dropped
    expected = [r.get("id") for r in records]
    del expected[12]
    assert len(a.keys) == len(expected) == len(records) - 1
    assert a.keys[3].startswith("sha256:") and expected[3] is None
    assert [k for k in a.keys if not k.startswith("sha256:")] == [e for e in expected if e]
    ma, mb = a.manifest, b.manifest
    assert ma.identity() == mb.identity()
    assert ma.k == K and ma.logprob_dtype == "float16"
    assert (ma.num_sequences, ma.num_rows, ma.num_tokens) == (
        mb.num_sequences, mb.num_rows, mb.num_tokens,
    )  # fmt: skip
    assert validate(cache, options).ok
    # the cache holds real teacher rows: aligned, sorted, a valid tail
    rec = a.get("ids-0")
    assert np.array_equal(rec.input_ids, [1, 5, 9, 200, 7, 33, 2])
    assert rec.topk_ids.shape == (6, K)
    assert np.all(np.diff(rec.topk_logprobs, axis=1) <= 0)
    assert np.all((rec.tail_mass >= 0) & (rec.tail_mass <= 1))

    # a re-run scores nothing and changes nothing
    again = _run(read_input(path), cache, s3_settings, 2, replicas, dataset=path.name)
    assert again.committed == 0 and again.scored_sequences == 0
    assert CacheReader(cache, storage_options=options).keys == a.keys


def test_bad_input_is_refused_before_anything_is_written(replicas, dataset, settings, s3_bucket,
                                                         tmp_path):  # fmt: skip
    from logitcache.server.batch.distributed import read_input

    endpoint, bucket, options = s3_bucket
    path, _ = dataset
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        path.read_text()
        + json.dumps({"id": "oov", "input_ids": [1, 2, 10**6]}) + "\n"
        + json.dumps({"id": "doc-01", "text": "an id used twice"}) + "\n"
    )  # fmt: skip
    s3_settings = settings.model_copy(update={"storage_options": options})
    with pytest.raises(InvalidInputError) as err:
        _run(read_input(bad), f"s3://{bucket}/never", s3_settings, 2, replicas)
    problems = " ".join(err.value.detail)
    assert "outside the teacher's vocabulary" in problems and "'doc-01'" in problems
    assert s3_keys(endpoint, bucket) == set(), "nothing may be written for a bad input"


def test_cli_refuses_a_missing_input_before_starting_ray(tmp_path, tiny):
    """Exit status 2 and a typed JSON error; settings flags are parsed like the server's. (The
    model must exist: a missing --model is refused first, as ``invalid_model``.)"""
    proc = _cli(
        "--input", str(tmp_path / "missing.jsonl"), "--cache", str(tmp_path / "c"),
        "--model", str(tiny.teacher_dir), "-k", "4", "--storage-options", '{"anon": true}',
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    error = json.loads(proc.stderr.strip().splitlines()[-1])
    assert error["error"] == "invalid_path" and "missing.jsonl" in error["message"]
    assert not (tmp_path / "c").exists()


def test_cli_refuses_a_cache_of_another_k_or_teacher_before_any_engine_loads(
    tmp_path, tiny, dataset, capsys, monkeypatch
):
    """An existing cache made at another k and temperature: exit 2 with one JSON line naming both
    fields, before Ray or an engine starts (both are patched to fail); the cache is untouched."""
    from format_support import make_records
    from logitcache.cache_format import CacheWriter
    from logitcache.server.batch import distributed
    from logitcache.server.engine import engine_config
    from logitcache.server.engine.config import planned_info
    from logitcache.server.serving.caches import expected_manifest

    other = {**_settings_kw(tiny), "k": K + 1, "temperature": 2.0}
    cfg = engine_config(ServerSettings(_env_file=None, **other))
    manifest = expected_manifest(planned_info(cfg), k=cfg.max_k, logprob_dtype="float16")
    cache = tmp_path / "made-otherwise"
    with CacheWriter.open(cache, manifest) as w:
        w.append(make_records(2, k=manifest.k, vocab=manifest.vocab_size))
    before = sorted(p.name for p in cache.rglob("*"))

    def never(*a, **kw):
        raise AssertionError("Ray or an engine started")

    monkeypatch.setattr(distributed, "init_local_ray", never)
    monkeypatch.setattr(distributed, "Replicas", never)
    path, _ = dataset
    code = distributed.main(["--input", str(path), "--cache", str(cache), *_server_flags(tiny)])
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    (line,) = [x for x in err.splitlines() if x.startswith('{"error"')]  # Ray actors log here too
    error = json.loads(line)
    assert error["error"] == "conflict" and error["detail"] == ["k", "temperature"], error
    assert f"k: cache {K + 1}, this run {K}" in error["message"]
    assert "Traceback" not in err
    assert sorted(p.name for p in cache.rglob("*")) == before
    assert not Path(f"{cache}.staging").exists()


def test_planned_identity_is_the_loaded_engines(replicas, tiny, settings) -> None:
    """The early check's identity (model files + tokenizer only) equals what the loaded vLLM
    replicas report, so a cache made by this configuration is never refused early."""
    from logitcache.server.engine import engine_config
    from logitcache.server.engine.config import planned_info
    from logitcache.server.engine.identity import teacher_identity

    planned = planned_info(engine_config(settings))
    want, have = teacher_identity(planned), teacher_identity(replicas.info)
    assert want == have and have["dtype"] == settings.dtype == "float32"
    assert planned.max_k == replicas.info.max_k == K
    # dtype auto is resolved only when the weights load (the early check leaves it out); the
    # rest of the planned identity is the same
    auto = teacher_identity(
        planned_info(engine_config(settings.model_copy(update={"dtype": "auto"})))
    )
    assert auto.pop("dtype") == "auto"
    assert auto == {f: v for f, v in have.items() if f != "dtype"}


def test_an_interrupted_commit_is_finished_by_a_rerun_without_scoring(
    replicas, reference, dataset, settings, tmp_path
):
    """State after a driver crash in the middle of the commit: every shard staged, the final
    cache holding only the first shards. Running the same command again scores nothing, commits
    the rest, and leaves the single-worker cache."""
    import shutil

    from logitcache.server.batch import shards
    from logitcache.server.batch.distributed import Plan, read_input, run_distributed

    path, _ = dataset
    cache = tmp_path / "interrupted"
    plan = Plan(replicas=2, shard_size=SHARD, keep_staging=True)
    first = run_distributed(read_input(path), str(cache), settings, plan, replicas=replicas)
    staged = sorted(Path(f"{cache}.staging").glob("shard-*"))
    assert len(staged) == first.shards == 5
    shutil.rmtree(cache)
    manifest = Manifest(**CacheReader(reference[0]).manifest.identity())
    partial = []
    for index, url in enumerate(staged[:2]):
        keys = tuple(CacheReader(url).keys)
        partial.append(shards.ShardResult(index, str(url), len(keys), keys, 0, 0, 0.0))
    done = shards.commit(partial, str(cache), manifest)
    assert 0 < done < first.committed

    again = run_distributed(read_input(path), str(cache), settings, plan, replicas=replicas)
    assert again.scored_sequences == 0, "everything was staged: nothing is scored again"
    assert again.committed == first.committed - done
    assert_same_cache(CacheReader(cache), CacheReader(reference[0]))


@pytest.mark.slow  # rebuilds one vLLM engine (~10 s idle; minutes on a loaded 2-core box)
def test_a_replica_killed_mid_run_is_restarted_and_the_cache_is_unchanged(
    replicas, reference, dataset, settings, tmp_path
):
    """SIGKILL one replica once scoring has begun: Ray restarts it (the engine is rebuilt inside
    the retried call), its shard is re-run from what its staging cache committed, and the final
    cache still equals the single-worker run."""
    import ray
    from logitcache.server.batch.distributed import read_input

    path, _ = dataset
    pids = ray.get([a.pid.remote() for a in replicas.actors])
    cache = tmp_path / "crash"
    staging = Path(f"{cache}.staging")
    killed: list[int] = []

    def kill_when_scoring_starts() -> None:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not killed:
            if any(staging.glob("shard-*/zarr.json")):
                os.kill(pids[1], signal.SIGKILL)
                killed.append(pids[1])
            time.sleep(0.005)

    killer = threading.Thread(target=kill_when_scoring_starts, daemon=True)
    killer.start()
    report = _run(read_input(path), cache, settings, 2, replicas, dataset=path.name)
    killer.join(timeout=5)
    assert killed, "the replica was never killed"
    new_pids = ray.get([a.pid.remote() for a in replicas.actors])
    assert new_pids[0] == pids[0] and new_pids[1] != pids[1], "Ray restarts the dead replica"
    assert report.committed == reference[1].committed
    assert_same_cache(CacheReader(cache), CacheReader(reference[0]))


@pytest.mark.slow  # starts its own vLLM engine
def test_cli_on_the_cluster_equals_the_library_run(ray_cluster, tiny, dataset, reference,
                                                   tmp_path):  # fmt: skip
    """The CLI (its own engine, on this module's cluster) writes the single-worker cache."""
    path, _ = dataset
    out, report = tmp_path / "cli", tmp_path / "report.json"
    proc = _cli(
        "--input", str(path), "--cache", str(out), "--replicas", "1", "--shard-size", str(SHARD),
        "--ray-address", ray_cluster.get_runtime_context().gcs_address, "--report", str(report),
        "--cpus-per-replica", "0",  # the module's two replicas hold both CPUs of the cluster
        *_server_flags(tiny), "--dtype", "float32",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(report.read_text())["committed"] == reference[1].committed
    assert_same_cache(CacheReader(out), CacheReader(reference[0]))
    # progress bars (tqdm on stderr) for both phases, over the 5 shards
    assert "check: 100%" in proc.stderr and "score: 100%" in proc.stderr, proc.stderr[-2000:]
    assert "5/5" in proc.stderr


def test_sampled_targets_on_two_replicas_equal_the_one_process_job(
    replicas, dataset, settings, vllm_engine, tmp_path
):
    """``targets`` = sampled (tau 1.5, seed 9) on two replicas: the final cache equals, array for
    array in the same order, the cache the service's own job (``POST /v1/jobs``, one process, the
    suite's shared vLLM engine, of the replicas' settings) writes from the same file with the
    same sampling; the draws depend on (seed, key, teacher row) only, not on shards or replicas.
    A re-run with ``"sampled"`` (the cache's own parameters) scores nothing; a top-k run into it
    is refused before anything is written."""
    from logitcache.cache_format import ManifestMismatchError
    from logitcache.cache_format.sampling import sampling_manifest
    from logitcache.server.batch.distributed import read_input
    from logitcache.server.engine import SampledTargets
    from server_support import ThreadedServer, wait_job

    path, records = dataset
    draws = min(16, replicas.info.vocab_size)
    chosen = SampledTargets(draws=draws, proposal_temperature=1.5, seed=9)
    cache = tmp_path / "sampled"
    report = _run(read_input(path), cache, settings, 2, replicas, dataset=path.name,
                  targets=chosen)  # fmt: skip
    assert report.targets == "sampled" and report.committed == len(records) - 1
    assert len(report.workers) == 2, f"both replicas should score shards: {report.workers}"
    got = CacheReader(cache)
    assert got.manifest.sampling == sampling_manifest(draws, 1.5, 9) and got.manifest.k == draws
    assert validate(cache).ok

    work = tmp_path / "service"
    (work / "data").mkdir(parents=True)
    (work / "data" / path.name).write_text(path.read_text())
    job_settings = settings.model_copy(update={
        "store_root": str(work / "caches"), "data_dir": work / "data", "state_dir": work / "state",
    })  # fmt: skip
    with ThreadedServer(job_settings, vllm_engine) as srv, srv.client() as c:
        body = {"cache": "job", "file": {"path": path.name}, "dataset": path.name,
                "targets": "sampled", "sampling": {"draws": draws,
                "proposal_temperature": 1.5, "seed": 9}}  # fmt: skip
        r = c.post("/v1/jobs", json=body)
        assert r.status_code == 201, r.text
        assert wait_job(c, r.json()["id"], timeout=240)["state"] == "succeeded"
    assert_same_cache(got, CacheReader(work / "caches" / "job"))

    again = _run(read_input(path), cache, settings, 2, replicas, targets="sampled")
    assert again.scored_sequences == 0 and again.committed == 0
    before = sorted(p.name for p in cache.rglob("*"))
    with pytest.raises(ManifestMismatchError, match="targets"):
        _run(read_input(path), cache, settings, 2, replicas)  # top-k into a sampled cache
    with pytest.raises(InvalidInputError, match="draws"):
        _run(read_input(path), tmp_path / "never", settings, 2, replicas,
             targets=SampledTargets(draws=replicas.info.vocab_size + 1))  # fmt: skip
    assert sorted(p.name for p in cache.rglob("*")) == before
    assert not (tmp_path / "never").exists() and not (tmp_path / "never.staging").exists()


def test_cli_sampled_flags_are_checked_before_any_engine_loads(
    tmp_path, tiny, dataset, capsys, monkeypatch
):
    """``--draws`` without ``--targets sampled`` is a settings error; ``--targets sampled`` into
    an existing top-k cache is a conflict naming ``targets``, ``sampling`` and ``k``: exit 2,
    one JSON line, before Ray or an engine starts (both patched to fail); nothing written."""
    from format_support import make_records
    from logitcache.cache_format import CacheWriter
    from logitcache.server.batch import distributed
    from logitcache.server.engine import engine_config
    from logitcache.server.engine.config import planned_info
    from logitcache.server.serving.caches import expected_manifest

    cfg = engine_config(ServerSettings(_env_file=None, **_settings_kw(tiny)))
    manifest = expected_manifest(planned_info(cfg), k=cfg.max_k, logprob_dtype="float16")
    cache = tmp_path / "topk"
    with CacheWriter.open(cache, manifest) as w:
        w.append(make_records(2, k=manifest.k, vocab=manifest.vocab_size))
    before = sorted(p.name for p in cache.rglob("*"))

    def never(*a, **kw):
        raise AssertionError("Ray or an engine started")

    monkeypatch.setattr(distributed, "init_local_ray", never)
    monkeypatch.setattr(distributed, "Replicas", never)
    path, _ = dataset
    base = ["--input", str(path), "--cache", str(cache), *_server_flags(tiny)]
    for extra, code, fields in (
        (["--draws", "4"], "invalid_settings", None),
        (["--targets", "sampled", "--draws", "4", "--sampling-seed", "3"], "conflict",
         ["k", "sampling", "targets"]),
        (["--targets", "sampled", "--proposal-temperature", "0"], "invalid_settings", None),
        (["--head", "2"], "invalid_settings", None),
        (["--targets", "sampled", "--draws", "4", "--head", "2"], "conflict",
         ["k", "sampling", "targets"]),
        (["--targets", "sampled", "--head", "-1"], "invalid_settings", None),
    ):  # fmt: skip
        assert distributed.main([*base, *extra]) == 2
        err = capsys.readouterr().err
        (line,) = [x for x in err.splitlines() if x.startswith('{"error"')]
        error = json.loads(line)
        assert error["error"] == code, error
        if fields is not None:
            assert error["detail"] == fields, error
        else:
            assert any(w in error["message"] for w in ("targets", "proposal", "head")), error
    assert sorted(p.name for p in cache.rglob("*")) == before
    assert not Path(f"{cache}.staging").exists()
