"""``logitcache jobs``: submit, list, show, watch and cancel the service's batch jobs.

From a terminal:

::

    logitcache jobs submit CACHE PATH [--watch]  # score a file of the server's data dir
    logitcache jobs submit CACHE --records FILE  # a local JSONL file, sent inline
    logitcache jobs submit CACHE PATH --targets sampled --draws 32 --seed 7  # sampled targets
    logitcache jobs submit CACHE PATH --layout random_access  # a new cache's layout preset
    logitcache jobs list                    # one line per job (every page): id, state, progress
    logitcache jobs show JOB_ID             # the job's full status (JSON)
    logitcache jobs watch [JOB_ID]          # a progress bar until the job ends (default: newest)
    logitcache jobs cancel JOB_ID

``submit`` sends ``POST /v1/jobs`` (``PATH`` is relative to the server's ``--data-dir``;
``--records`` sends a local JSONL file's records inline) and prints the job's line. A sampling
flag without ``--targets sampled``, or ``--k`` with it, is refused before anything is sent. The
server is ``--url`` (``$LOGITCACHE_URL``), the key ``--api-key`` (``$LOGITCACHE_API_KEY``),
options of ``jobs`` itself (``logitcache jobs --url URL list``); requests go through
:class:`~logitcache.client.TeacherClient` (its retries and typed errors). Progress is in tokens;
throughput and ETA are the server's.

Exit status: 0 on success (``watch``: the job succeeded), 1 when a watched job ended failed or
cancelled, 2 on a usage, connection or HTTP error, printed as one line
``logitcache: error: ...``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from logitcache.protocol import InputFormat, LayoutName, OnLong, TargetKind

from .errors import CliError

if TYPE_CHECKING:
    from logitcache.client.http import TeacherClient
    from logitcache.protocol import JobStatus

DEFAULT_URL = "http://127.0.0.1:8000"

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="Submit, list, watch and cancel batch jobs."
)


@app.callback()
def connect(
    ctx: typer.Context,
    url: Annotated[str, typer.Option(envvar="LOGITCACHE_URL", help="the service")] = DEFAULT_URL,
    api_key: Annotated[
        str | None, typer.Option(envvar="LOGITCACHE_API_KEY", help="bearer key of the service")
    ] = None,
) -> None:
    """Batch jobs of the teacher service (``POST/GET /v1/jobs``)."""
    try:
        from logitcache.client.http import TeacherClient
    except ImportError as exc:
        raise CliError(
            f"jobs need the client extra (pip install 'logitcache[client]'): {exc}"
        ) from None
    client = TeacherClient(url, api_key=api_key, timeout=30.0, max_retries=2, progress=False)
    ctx.obj = ctx.with_resource(client)


def _client(ctx: typer.Context) -> TeacherClient:
    client: TeacherClient = ctx.obj
    return client


def _job(status: JobStatus) -> dict[str, Any]:
    """A ``JobStatus`` as the JSON the server sent."""
    return status.model_dump(mode="json")


def _pct(job: dict[str, Any]) -> float:
    total = job.get("tokens_total") or 0
    return 100.0 * (job.get("tokens_done") or 0) / total if total else 0.0


def _eta(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def targets_label(job: dict[str, Any]) -> str:
    """``top-20`` for a top-k job; ``sampled 64 tau 1 seed 0`` for a sampled one (a server
    that predates the field reports neither: ``k=20``)."""
    kind = job.get("targets")
    if kind == "sampled":
        s = job.get("sampling") or {}
        if not s:
            return f"sampled {job.get('k')}"
        head = f" head {s['head']}" if s.get("head") else ""
        return f"sampled {s['draws']}{head} tau {s['proposal_temperature']:g} seed {s['seed']}"
    if kind == "topk":
        return f"top-{job.get('k')}"
    if kind == "hidden":  # FORMAT.md 4.10
        return "hidden states"
    return f"k={job.get('k')}"


def summary_line(job: dict[str, Any]) -> str:
    """``id  state  cache  done/total seqs  pct  tok/s  ETA  targets  [note]`` for one job
    (``targets``: :func:`targets_label`; last of the fixed columns, so lines keep the order
    that scripts reading the earlier columns expect)."""
    rate = job.get("tokens_per_s")
    note = job.get("error") or ""
    counts = job.get("input") or {}
    kinds = ("duplicates", "skipped", "truncated", "split")
    extra = [f"{counts[k]} {k}" for k in kinds if counts.get(k)]
    parts = [
        job["id"],
        f"{job['state']:<9}",
        job["cache"],
        f"{job['sequences_done']}/{job['sequences_total']} seqs",
        f"{_pct(job):5.1f}%",
        f"{rate:,.0f} tok/s" if rate else "- tok/s",
        f"ETA {_eta(job.get('eta_s'))}",
        targets_label(job),
    ]
    return "  ".join(parts + extra + ([note] if note else []))


@app.command("list")
def list_cmd(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="print the statuses as JSON")] = False,
) -> None:
    """One line per job (every page, oldest first)."""
    jobs = [_job(j) for j in _client(ctx).list_jobs()]
    if as_json:
        typer.echo(json.dumps(jobs, indent=2))
    elif not jobs:
        typer.echo("no jobs")
    for job in [] if as_json else jobs:
        typer.echo(summary_line(job))


@app.command()
def show(ctx: typer.Context, job_id: str) -> None:
    """The job's full status (JSON)."""
    typer.echo(json.dumps(_job(_client(ctx).get_job(job_id)), indent=2))


@app.command()
def cancel(ctx: typer.Context, job_id: str) -> None:
    """Cancel a job (what it committed stays in the cache)."""
    typer.echo(f"cancel requested: {summary_line(_job(_client(ctx).cancel_job(job_id)))}")


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a local JSONL file (one JSON object per non-empty line)."""
    records = []
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise CliError(f"{path}:{n}: not JSON ({e.msg})") from None
                if not isinstance(rec, dict):
                    raise CliError(f"{path}:{n}: a record must be a JSON object")
                records.append(rec)
    except (OSError, UnicodeDecodeError) as e:
        raise CliError(f"cannot read {path}: {e}") from None
    if not records:
        raise CliError(f"{path} holds no records")
    return records


def target_fields(
    targets: str | None, k: int | None, sampling: dict[str, int | float | None]
) -> dict[str, Any]:
    """``k`` (top-k) or ``targets``/``sampling`` (sampled) of ``jobs submit``'s flags
    (``sampling``: draws, proposal_temperature, seed, head); :class:`CliError` for a
    contradiction (the server would answer 422)."""
    given = {name: value for name, value in sampling.items() if value is not None}
    out: dict[str, Any] = {}
    if targets == "hidden" and (k is not None or given):  # FORMAT.md 4.10: rows are states
        raise CliError("--k and the sampling flags do not apply to --targets hidden")
    if targets == "sampled":
        if k is not None:
            raise CliError("--k does not apply to --targets sampled (a row holds --draws slots)")
        out["targets"] = "sampled"
        if given:
            out["sampling"] = given
        return out
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in sampling if name in given)
        raise CliError(f"{flags} only apply with --targets sampled")
    if targets is not None:
        out["targets"] = targets
    if k is not None:
        out["k"] = k
    return out


@app.command()
def submit(
    ctx: typer.Context,
    cache: Annotated[str, typer.Argument(help="cache to write (created if absent)")],
    path: Annotated[
        str | None, typer.Argument(help="input file or folder, relative to the server's data dir")
    ] = None,
    records: Annotated[
        Path | None, typer.Option(metavar="FILE", help="a local JSONL file, sent inline instead")
    ] = None,
    k: Annotated[int | None, typer.Option(help="default: the cache's k, else the server's")] = None,
    targets: Annotated[
        TargetKind | None,
        typer.Option(help="top-k rows (default) or sampled targets (ids with importance weights)"),
    ] = None,
    draws: Annotated[
        int | None, typer.Option(help="sampled: draws per row (default: the cache's, else 64)")
    ] = None,
    proposal_temperature: Annotated[
        float | None,
        typer.Option(
            help="sampled: tau of the proposal q ~ p^(1/tau) (default: the cache's, else 1)"
        ),
    ] = None,
    seed: Annotated[
        int | None,
        typer.Option(help="sampled: seed of every sequence's draws (default: the cache's, else 0)"),
    ] = None,
    head: Annotated[
        int | None,
        typer.Option(
            help="sampled: keep the teacher's top HEAD ids exactly and draw from the rest "
            "(a row holds head + draws slots; default: the cache's, else 0)"
        ),
    ] = None,
    layout: Annotated[
        LayoutName | None,
        typer.Option(
            help="layout preset of a new cache (FORMAT.md 4.7; random_access: cheaper "
            "sequence(i) reads, ~25% larger; random_access_raw: no compression, cheapest "
            "sequence(i) reads, ~2.3x larger); an existing cache keeps its own"
        ),
    ] = None,
    fmt: Annotated[InputFormat | None, typer.Option("--format", help="default: by suffix")] = None,
    text_field: Annotated[str | None, typer.Option(help="default: text")] = None,
    ids_field: Annotated[str | None, typer.Option(help="default: input_ids")] = None,
    id_field: Annotated[str | None, typer.Option(help="default: id")] = None,
    on_long: Annotated[
        OnLong, typer.Option(help="a sequence over the server's max length")
    ] = "reject",
    dataset: Annotated[
        str | None, typer.Option(help="dataset description for a new cache's manifest")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the job's status as JSON")] = False,
    watch_: Annotated[bool, typer.Option("--watch", help="then draw its progress bar")] = False,
    interval: Annotated[float, typer.Option(help="seconds between polls")] = 1.0,
) -> None:
    """Queue a job (``POST /v1/jobs``); print its line (or JSON status); with ``--watch``
    follow it to the end."""
    if (path is None) == (records is None):
        raise CliError("give exactly one of PATH (on the server) or --records FILE (local)")
    sampling = {"draws": draws, "proposal_temperature": proposal_temperature}
    fields = target_fields(targets, k, sampling | {"seed": seed, "head": head})
    file: dict[str, str] | None = None
    if path is not None:
        given = {"format": fmt, "text_field": text_field}
        given |= {"ids_field": ids_field, "id_field": id_field}
        file = {"path": path} | {name: value for name, value in given.items() if value}
    job = _job(
        _client(ctx).submit_job(
            cache,
            records=None if records is None else read_records(records),
            file=file,
            dataset=dataset,
            on_long=on_long,
            layout=layout,
            **fields,
        )
    )
    typer.echo(json.dumps(job, indent=2) if as_json else f"submitted: {summary_line(job)}")
    if watch_:
        watch(ctx, job["id"], interval)


@app.command()
def watch(
    ctx: typer.Context,
    job_id: Annotated[str | None, typer.Argument(help="default: the newest job")] = None,
    interval: Annotated[float, typer.Option(help="seconds between polls")] = 1.0,
) -> None:
    """A progress bar (tokens) until the job ends (:meth:`TeacherClient.wait_job`); exit
    status 1 if it did not succeed."""
    client = _client(ctx)
    if job_id is None:
        jobs = client.list_jobs()
        if not jobs:
            raise CliError("no jobs to watch")
        job_id = max(jobs, key=lambda j: j.created_at).id
    status = client.wait_job(job_id, poll_interval=interval, raise_on_failure=False, progress=True)
    job = _job(status)
    typer.echo(summary_line(job))
    if job["state"] != "succeeded":
        raise typer.Exit(1)
