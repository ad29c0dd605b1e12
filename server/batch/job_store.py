"""Durable job records: one SQLite table, one row per job, every change committed at once.

State machine (``JobState``)::

    queued -> running -> succeeded | failed | cancelled
    queued -> cancelled
    running -> queued          (server stopped or killed mid-job: resumed at the next start)

Progress counters (``sequences_done``/``tokens_done``) only move after the cache has committed the
batch they count, so after a crash the table never claims more than the cache holds. The cache's
sequence keys, not these counters, decide what a resumed job skips.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import uuid
import zlib
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from logitcache.protocol import JobState

from ..errors import NotFoundError

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    cache TEXT NOT NULL,
    k INTEGER NOT NULL,
    state TEXT NOT NULL,
    spec TEXT NOT NULL,
    input_digest TEXT NOT NULL,
    created_at TEXT NOT NULL,
    started_at TEXT,
    finished_at TEXT,
    sequences_total INTEGER NOT NULL,
    sequences_done INTEGER NOT NULL DEFAULT 0,
    tokens_total INTEGER NOT NULL,
    tokens_done INTEGER NOT NULL DEFAULT 0,
    errors TEXT NOT NULL DEFAULT '[]',
    cancel_requested INTEGER NOT NULL DEFAULT 0
)
"""

#: Columns added after the first release (``ALTER TABLE`` on an older database).
_ADDED_COLUMNS = {"spec_z": "BLOB", "layout": "TEXT"}

#: Every column but the job's input (listing never reads inputs).
_LIST_COLUMNS = (
    "id, cache, k, state, input_digest, created_at, started_at, finished_at, sequences_total,"
    " sequences_done, tokens_total, tokens_done, errors, cancel_requested, layout"
)

_TERMINAL = (JobState.succeeded.value, JobState.failed.value, JobState.cancelled.value)


def _now() -> str:
    return datetime.now(UTC).isoformat()


@dataclass(frozen=True)
class JobRecord:
    """One row of the job table (``spec`` is the submitted ``JobCreate`` as a dict; rows from
    :meth:`JobStore.list` carry no spec: ``spec_json`` is None)."""

    id: str
    cache: str
    k: int
    state: JobState
    spec_json: str | None
    input_digest: str
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    sequences_total: int
    sequences_done: int
    tokens_total: int
    tokens_done: int
    errors: list[str]
    cancel_requested: bool
    layout: str | None = None
    """The layout preset the job asked for its cache (``JobCreate.layout``), else None."""

    @classmethod
    def from_row(cls, row: sqlite3.Row) -> JobRecord:
        def ts(v: str | None) -> datetime | None:
            return datetime.fromisoformat(v) if v else None

        keys = row.keys()
        spec: str | None = None
        if "spec_z" in keys and row["spec_z"] is not None:
            spec = zlib.decompress(row["spec_z"]).decode("utf-8")
        elif "spec" in keys:
            spec = row["spec"]
        return cls(
            id=row["id"],
            cache=row["cache"],
            k=row["k"],
            state=JobState(row["state"]),
            spec_json=spec,
            input_digest=row["input_digest"],
            created_at=datetime.fromisoformat(row["created_at"]),
            started_at=ts(row["started_at"]),
            finished_at=ts(row["finished_at"]),
            sequences_total=row["sequences_total"],
            sequences_done=row["sequences_done"],
            tokens_total=row["tokens_total"],
            tokens_done=row["tokens_done"],
            errors=json.loads(row["errors"]),
            cancel_requested=bool(row["cancel_requested"]),
            layout=row["layout"] if "layout" in keys else None,
        )

    @property
    def spec(self) -> dict[str, Any]:
        """The submitted ``JobCreate`` as a dict (parsed on demand: inline inputs can be large)."""
        if self.spec_json is None:
            raise ValueError("this job record was read without its input (use JobStore.get)")
        return json.loads(self.spec_json)


class JobStore:
    """The job table. Thread-safe (one connection behind a lock); WAL journal, full sync."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute(_SCHEMA)
        cols = {r[1] for r in self._db.execute("PRAGMA table_info(jobs)").fetchall()}
        if "input_counts" not in cols:  # added for job input counts (server/inputs/long.py)
            self._db.execute("ALTER TABLE jobs ADD COLUMN input_counts TEXT")
        have = {r["name"] for r in self._db.execute("PRAGMA table_info(jobs)").fetchall()}
        for column, kind in _ADDED_COLUMNS.items():
            if column not in have:
                self._db.execute(f"ALTER TABLE jobs ADD COLUMN {column} {kind}")
        self._db.execute("CREATE INDEX IF NOT EXISTS jobs_created ON jobs (created_at, id)")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _exec(self, sql: str, args: tuple[Any, ...] = ()) -> sqlite3.Cursor:
        with self._lock:
            return self._db.execute(sql, args)

    # --- create / read ----------------------------------------------------------------------

    def create(
        self,
        *,
        cache: str,
        k: int,
        spec: dict[str, Any],
        input_digest: str,
        sequences_total: int,
        tokens_total: int,
        layout: str | None = None,
    ) -> JobRecord:
        """Insert a queued job and return it (its spec stored once, zlib-compressed)."""
        job_id = uuid.uuid4().hex
        spec_z = zlib.compress(json.dumps(spec, separators=(",", ":")).encode("utf-8"), 6)
        self._exec(
            "INSERT INTO jobs (id, cache, k, state, spec, spec_z, input_digest, created_at,"
            " sequences_total, tokens_total, layout) VALUES (?, ?, ?, ?, '', ?, ?, ?, ?, ?, ?)",
            (
                job_id,
                cache,
                k,
                JobState.queued.value,
                spec_z,
                input_digest,
                _now(),
                sequences_total,
                tokens_total,
                layout,
            ),
        )
        return self.get(job_id)

    def get(self, job_id: str) -> JobRecord:
        row = self._exec("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            raise NotFoundError(f"no job with id {job_id!r}")
        return JobRecord.from_row(row)

    def list(
        self, *, limit: int | None = None, offset: int = 0, state: JobState | None = None
    ) -> list[JobRecord]:
        """Jobs oldest first (optionally one ``state``; ``limit``/``offset`` page), without their
        inputs (``spec_json`` is None): listing costs the same for small and huge jobs."""
        sql = f"SELECT {_LIST_COLUMNS} FROM jobs"
        args: list[Any] = []
        if state is not None:
            sql += " WHERE state = ?"
            args.append(JobState(state).value)
        sql += " ORDER BY created_at, id LIMIT ? OFFSET ?"
        args += [-1 if limit is None else limit, offset]
        rows = self._exec(sql, tuple(args)).fetchall()
        return [JobRecord.from_row(r) for r in rows]

    def count(self, state: JobState | None = None) -> int:
        if state is None:
            return int(self._exec("SELECT COUNT(*) FROM jobs").fetchone()[0])
        row = self._exec("SELECT COUNT(*) FROM jobs WHERE state = ?", (state.value,)).fetchone()
        return int(row[0])

    def pending_tokens(self) -> int:
        """Prompt tokens not yet scored in queued and running jobs (job admission)."""
        row = self._exec(
            "SELECT COALESCE(SUM(MAX(tokens_total - tokens_done, 0)), 0) FROM jobs"
            " WHERE state IN (?, ?)",
            (JobState.queued.value, JobState.running.value),
        ).fetchone()
        return int(row[0])

    def prune(self, older_than_s: float, *, now: datetime | None = None) -> int:
        """Delete terminal jobs that finished more than ``older_than_s`` seconds ago."""
        cutoff = ((now or datetime.now(UTC)) - timedelta(seconds=older_than_s)).isoformat()
        cur = self._exec(
            "DELETE FROM jobs WHERE state IN (?, ?, ?) AND finished_at IS NOT NULL"
            " AND finished_at < ?",
            (*_TERMINAL, cutoff),
        )
        return cur.rowcount

    def count_by_state(self) -> dict[str, int]:
        rows = self._exec("SELECT state, COUNT(*) AS n FROM jobs GROUP BY state").fetchall()
        return {r["state"]: r["n"] for r in rows}

    def next_queued(self) -> JobRecord | None:
        """The oldest queued job."""
        row = self._exec(
            "SELECT * FROM jobs WHERE state = ? ORDER BY created_at, id LIMIT 1",
            (JobState.queued.value,),
        ).fetchone()
        return JobRecord.from_row(row) if row is not None else None

    # --- transitions ------------------------------------------------------------------------

    def requeue_interrupted(self) -> int:
        """Put jobs left ``running`` by a stopped or killed server back in the queue."""
        cur = self._exec(
            "UPDATE jobs SET state = ? WHERE state = ?",
            (JobState.queued.value, JobState.running.value),
        )
        return cur.rowcount

    def start(self, job_id: str) -> bool:
        """``queued -> running``; ``False`` if the job was no longer queued (e.g. cancelled)."""
        cur = self._exec(
            "UPDATE jobs SET state = ?, started_at = COALESCE(started_at, ?) "
            "WHERE id = ? AND state = ? AND cancel_requested = 0",
            (JobState.running.value, _now(), job_id, JobState.queued.value),
        )
        return cur.rowcount == 1

    def set_input_counts(self, job_id: str, counts: dict[str, int]) -> None:
        """Store what the job's input held (``InputCounts`` as a dict), once, at submission."""
        self._exec("UPDATE jobs SET input_counts = ? WHERE id = ?", (json.dumps(counts), job_id))

    def input_counts(self, job_id: str) -> dict[str, int] | None:
        """The job's input counts (None for jobs stored before counts existed)."""
        row = self._exec("SELECT input_counts FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return json.loads(row[0]) if row is not None and row[0] else None

    def progress(self, job_id: str, *, sequences_done: int, tokens_done: int) -> None:
        self._exec(
            "UPDATE jobs SET sequences_done = ?, tokens_done = ? WHERE id = ?",
            (sequences_done, tokens_done, job_id),
        )

    def finish(self, job_id: str, state: JobState, error: str | None = None) -> None:
        """Move to a terminal ``state``; ``error`` is appended to the job's error list."""
        with self._lock:
            row = self._db.execute("SELECT errors FROM jobs WHERE id = ?", (job_id,)).fetchone()
            errors = json.loads(row["errors"]) if row is not None else []
            if error:
                errors.append(error)
            self._db.execute(
                "UPDATE jobs SET state = ?, finished_at = ?, errors = ? WHERE id = ?",
                (state.value, _now(), json.dumps(errors), job_id),
            )

    def request_cancel(self, job_id: str) -> JobRecord:
        """Cancel: a queued job at once; a running one is flagged for the runner; terminal jobs
        stay as they are."""
        self.get(job_id)
        live = (JobState.queued.value, JobState.running.value)
        self._exec(
            "UPDATE jobs SET cancel_requested = 1 WHERE id = ? AND state IN (?, ?)",
            (job_id, *live),
        )
        self._exec(
            "UPDATE jobs SET state = ?, finished_at = ? WHERE id = ? AND state = ?",
            (JobState.cancelled.value, _now(), job_id, JobState.queued.value),
        )
        return self.get(job_id)

    def cancel_requested(self, job_id: str) -> bool:
        row = self._exec("SELECT cancel_requested FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return bool(row is not None and row["cancel_requested"])
