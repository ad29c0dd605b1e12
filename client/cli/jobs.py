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

``submit`` sends ``POST /v1/jobs``: ``PATH`` is relative to the server's ``--data-dir``
(JSONL, .jsonl.gz, Parquet, Arrow, or a directory of them); ``--records`` reads a local JSONL
file (one ``{"text"|"input_ids"|"messages", "id"}`` object per line) and sends its records in the
request (at most the server's ``max_inline_records``). It prints the job's line (``--json``: its
status), and with ``--watch`` then draws the progress bar until the job ends. ``list`` follows
``GET /v1/jobs``'s pages (``next_offset``) to the end.

``--targets sampled`` asks for sampled targets instead of top-k rows (random-sampling KD,
FORMAT.md 4.4): ``--draws`` per row, ``--proposal-temperature``, ``--seed`` and ``--head M``
(keep the teacher's top ``M`` ids exactly and draw from the rest: ``M + draws`` slots a row)
(each optional; without any of them the server takes an existing sampled cache's own
parameters, else 64 draws, temperature 1, seed 0, head 0; a missing one takes that default). A
sampling flag without ``--targets sampled``, or ``--k`` with it, is refused before anything is
sent.

The server is ``--url`` (default ``$LOGITCACHE_URL``, else ``http://127.0.0.1:8000``); the key is
``--api-key`` (default ``$LOGITCACHE_API_KEY``). Progress is in tokens (``tokens_done`` of
``tokens_total``, what the job status reports); throughput and ETA are the server's.

Exit status: 0 on success (``watch``: the job succeeded), 1 when a watched job ended failed or
cancelled, 2 on a usage, connection or HTTP error, printed as one line
``logitcache jobs: error: ...`` (no traceback). Only ``httpx`` (and ``tqdm`` for the bar) are
needed: this is client-side code, like :class:`~logitcache.client.TeacherClient`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, TextIO

from logitcache.protocol import TERMINAL_JOB_STATES

PROG = "logitcache jobs"
DEFAULT_URL = "http://127.0.0.1:8000"


class CliError(Exception):
    """A one-line error for the user (exit status 2)."""


class JobsClient:
    """The few job routes of the service over httpx (``GET/DELETE /v1/jobs[/{id}]``)."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 30.0):
        import httpx

        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, **kw: Any) -> Any:
        import httpx

        try:
            r = self._http.request(method, path, **kw)
        except httpx.HTTPError as e:
            raise CliError(f"cannot reach {self.url}: {e}") from None
        if r.status_code >= 400:
            try:
                msg = r.json()["error"]["message"]
            except Exception:
                msg = r.text.strip()[:200] or r.reason_phrase
            raise CliError(f"{method} {path}: HTTP {r.status_code}: {msg}")
        return r.json()

    def list(self) -> list[dict[str, Any]]:
        """Every job, oldest first: the pages of ``GET /v1/jobs`` followed to the end."""
        jobs: list[dict[str, Any]] = []
        offset: int | None = 0
        while offset is not None:
            page = self._call("GET", "/v1/jobs", params={"offset": offset} if offset else None)
            jobs += page["jobs"]
            nxt = page.get("next_offset")
            offset = nxt if isinstance(nxt, int) and nxt > offset else None
        return jobs

    def submit(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", "/v1/jobs", json=body)

    def get(self, job_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/jobs/{job_id}")

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self._call("DELETE", f"/v1/jobs/{job_id}")


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


def cmd_list(client: JobsClient, args: argparse.Namespace, out: TextIO) -> int:
    jobs = client.list()
    if args.json:
        print(json.dumps(jobs, indent=2), file=out)
    elif not jobs:
        print("no jobs", file=out)
    for job in [] if args.json else jobs:
        print(summary_line(job), file=out)
    return 0


def cmd_show(client: JobsClient, args: argparse.Namespace, out: TextIO) -> int:
    print(json.dumps(client.get(args.job_id), indent=2), file=out)
    return 0


def cmd_cancel(client: JobsClient, args: argparse.Namespace, out: TextIO) -> int:
    job = client.cancel(args.job_id)
    print(f"cancel requested: {summary_line(job)}", file=out)
    return 0


def read_records(path: str) -> list[dict[str, Any]]:
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


def job_body(args: argparse.Namespace) -> dict[str, Any]:
    """The ``POST /v1/jobs`` body of ``jobs submit``'s arguments (only what was given)."""
    if (args.path is None) == (args.records is None):
        raise CliError("give exactly one of PATH (on the server) or --records FILE (local)")
    body: dict[str, Any] = {"cache": args.cache, "on_long": args.on_long}
    if args.records is not None:
        body["records"] = read_records(args.records)
    else:
        file: dict[str, Any] = {"path": args.path}
        for field in ("format", "text_field", "ids_field", "id_field"):
            if getattr(args, field) is not None:
                file[field] = getattr(args, field)
        body["file"] = file
    body.update(target_fields(args))
    if args.dataset is not None:
        body["dataset"] = args.dataset
    if args.layout is not None:
        body["layout"] = args.layout
    return body


#: ``jobs submit`` flags of sampled targets -> the job's ``sampling`` fields.
SAMPLING_FLAGS = {
    "draws": "draws",
    "proposal_temperature": "proposal_temperature",
    "seed": "seed",
    "head": "head",
}


def target_fields(args: argparse.Namespace) -> dict[str, Any]:
    """``k`` (top-k) or ``targets``/``sampling`` (sampled) of ``jobs submit``'s arguments;
    :class:`CliError` for a contradiction (the server would answer 422)."""
    sampling = {
        field: getattr(args, flag)
        for flag, field in SAMPLING_FLAGS.items()
        if getattr(args, flag) is not None
    }
    out: dict[str, Any] = {}
    if args.targets == "sampled":
        if args.k is not None:
            raise CliError("--k does not apply to --targets sampled (a row holds --draws slots)")
        out["targets"] = "sampled"
        if sampling:
            out["sampling"] = sampling
        return out
    if sampling:
        given = ", ".join("--" + f.replace("_", "-") for f in SAMPLING_FLAGS if f in sampling)
        raise CliError(f"{given} only apply with --targets sampled")
    if args.targets is not None:
        out["targets"] = args.targets
    if args.k is not None:
        out["k"] = args.k
    return out


def cmd_submit(client: JobsClient, args: argparse.Namespace, out: TextIO) -> int:
    """Queue a job; print its line (or JSON status); with ``--watch`` follow it to the end."""
    job = client.submit(job_body(args))
    if args.json:
        print(json.dumps(job, indent=2), file=out)
    else:
        print(f"submitted: {summary_line(job)}", file=out)
    if not args.watch:
        return 0
    args.job_id = job["id"]
    return cmd_watch(client, args, out)


def cmd_watch(client: JobsClient, args: argparse.Namespace, out: TextIO) -> int:
    """Poll every ``--interval`` seconds and draw a tqdm bar (tokens) until a terminal state."""
    from tqdm import tqdm

    if args.job_id is None:
        jobs = client.list()
        if not jobs:
            raise CliError("no jobs to watch")
        args.job_id = max(jobs, key=lambda j: j["created_at"])["id"]
    job = client.get(args.job_id)
    bar = tqdm(
        total=job["tokens_total"],
        unit="tok",
        unit_scale=True,
        desc=f"{job['id']} -> {job['cache']}",
        file=out,
        dynamic_ncols=True,
        mininterval=0,
    )
    try:
        while True:
            bar.n = job["tokens_done"]
            rate = job.get("tokens_per_s")
            bar.set_postfix_str(
                f"{job['state']}, {job['sequences_done']}/{job['sequences_total']} seqs, "
                f"{rate or 0:,.0f} tok/s, ETA {_eta(job.get('eta_s'))}",
                refresh=True,
            )
            if job["state"] in TERMINAL_JOB_STATES:
                break
            time.sleep(args.interval)
            job = client.get(args.job_id)
    finally:
        bar.close()
    print(summary_line(job), file=out)
    return 0 if job["state"] == "succeeded" else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--url", default=os.environ.get("LOGITCACHE_URL", DEFAULT_URL))
    p.add_argument("--api-key", default=os.environ.get("LOGITCACHE_API_KEY"))
    sub = p.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("list", help="one line per job", allow_abbrev=False)
    ls.add_argument("--json", action="store_true", help="print the statuses as JSON")
    for name, helptext in (("show", "full status (JSON)"), ("cancel", "cancel a job")):
        sp = sub.add_parser(name, help=helptext, allow_abbrev=False)
        sp.add_argument("job_id")
    w = sub.add_parser("watch", help="progress bar until the job ends", allow_abbrev=False)
    w.add_argument("job_id", nargs="?", help="default: the newest job")
    w.add_argument("--interval", type=float, default=1.0, help="seconds between polls")
    sm = sub.add_parser("submit", help="queue a job (POST /v1/jobs)", allow_abbrev=False)
    sm.add_argument("cache", help="cache to write (created if absent)")
    sm.add_argument(
        "path", nargs="?", help="input file or folder, relative to the server's data dir"
    )
    sm.add_argument("--records", metavar="FILE", help="a local JSONL file, sent inline instead")
    sm.add_argument("--k", type=int, help="default: the cache's k, else the server's")
    sm.add_argument(
        "--targets",
        choices=("topk", "sampled"),
        help="top-k rows (default) or sampled targets (ids with importance weights)",
    )
    sm.add_argument(
        "--draws", type=int, help="sampled: draws per row (default: the cache's, else 64)"
    )
    sm.add_argument(
        "--proposal-temperature",
        type=float,
        help="sampled: tau of the proposal q ~ p^(1/tau) (default: the cache's, else 1)",
    )
    sm.add_argument(
        "--seed",
        type=int,
        help="sampled: seed of every sequence's draws (default: the cache's, else 0)",
    )
    sm.add_argument(
        "--head",
        type=int,
        help="sampled: keep the teacher's top HEAD ids exactly and draw from the rest "
        "(a row holds head + draws slots; default: the cache's, else 0)",
    )
    sm.add_argument(
        "--layout",
        choices=("default", "random_access", "random_access_raw"),
        help="layout preset of a new cache (FORMAT.md 4.7; random_access: cheaper sequence(i) "
        "reads, ~25%% larger; random_access_raw: no compression, cheapest sequence(i) reads, "
        "~2.3x larger); an existing cache keeps its own (another is refused)",
    )
    sm.add_argument("--format", choices=("jsonl", "parquet", "arrow"), help="default: by suffix")
    sm.add_argument("--text-field", help="default: text")
    sm.add_argument("--ids-field", help="default: input_ids")
    sm.add_argument("--id-field", help="default: id")
    sm.add_argument(
        "--on-long",
        choices=("reject", "truncate", "split", "skip"),
        default="reject",
        help="a sequence over the server's max length (default: reject the job)",
    )
    sm.add_argument("--dataset", help="dataset description for a new cache's manifest")
    sm.add_argument("--json", action="store_true", help="print the job's status as JSON")
    sm.add_argument("--watch", action="store_true", help="then draw its progress bar")
    sm.add_argument("--interval", type=float, default=1.0, help="seconds between polls")
    return p


COMMANDS = {
    "submit": cmd_submit,
    "list": cmd_list,
    "show": cmd_show,
    "cancel": cmd_cancel,
    "watch": cmd_watch,
}


def main(argv: list[str] | None = None, out: TextIO | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    out = out or sys.stdout
    try:
        client = JobsClient(args.url, args.api_key)
    except ImportError as e:
        print(f"{PROG}: error: needs the client extra ({e})", file=sys.stderr)
        return 2
    try:
        return COMMANDS[args.command](client, args, out)
    except CliError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main())
