"""``CacheDataset``: a torch ``IterableDataset`` of aligned teacher top-k items.

Per epoch the dataset plans, from the cache lengths alone: the epoch's order
(:func:`~logitcache.client.order.epoch_order`; identity without ``shuffle``), this rank's span of
it (:func:`~logitcache.client.order.rank_partition`), the items of that span
(:func:`~logitcache.client.collate.plan_items`: padding or packing to ``tokens_per_item``), and
the *units* it yields: single items, or batches of ``batch_size`` consecutive items (use
``DataLoader(batch_size=None)`` then). DataLoader worker ``w`` of ``n`` yields units ``w, w+n,
...``, so the loader's round-robin gives the trainer the rank's units in order for any
``num_workers``. Items are documented in :mod:`logitcache.client.collate`.

Resume: ``state_dict()`` is a :class:`~logitcache.client.state.LoaderState` (``epoch`` and
``items_consumed``, the items of this rank's epoch stream *delivered to the trainer*);
``load_state_dict`` makes the next iteration start there, so the rest of the stream is the one
an uninterrupted run would have seen. With DataLoader workers only the loader knows what the
trainer consumed: use :class:`CacheDataLoader`, whose ``state_dict()`` counts its batches.

Reading (:class:`~logitcache.client.config.ReadOptions`): a background thread per iterating
process collates ``prefetch`` units ahead, from records that
:class:`~logitcache.client.readahead.ReadAhead` reads ``read_threads`` store reads at a time.
``StreamConfig(follow=True)``: :meth:`CacheDataset.set_epoch` adopts the sequences committed since
(every rank plans over the smallest count any rank sees; the state's ``num_sequences`` pins it).
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import threading
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from . import selection
from .collate import (
    ItemPlan,
    build_batch,
    cut_rows,
    plan_items,
    trim_padding_columns,
)
from .config import TRAINER_SHUFFLE, ReadOptions, StreamConfig
from .errors import ConfigError, CutSequenceWarning, StateError
from .guards import check_compatible
from .order import epoch_order, lane_item_order, rank_partition, worker_units
from .readahead import ReadAhead, default_read_threads, read_granularity, row_bytes
from .resume_mark import ResumeMark
from .sources import CacheSource, HttpSource, LocalSource, open_source
from .state import LoaderState
from .world import agree_min, current_worker, distributed_world_size, resolve_ranks

if TYPE_CHECKING:
    from logitcache.cache_format import Manifest

__all__ = ["CacheDataset", "CacheDataLoader", "ReadOptions", "StreamConfig", "TRAINER_SHUFFLE"]

_DONE = object()


def _tuned(source: CacheSource, read: ReadOptions) -> CacheSource:
    """``source`` with ``read``'s ``decode_threads``, as a copy (the source itself at the
    default); a LocalSource or an HttpSource only."""
    if read.decode_threads == 1:
        return source
    if type(source) is LocalSource or type(source) is HttpSource:
        config = {name: getattr(source, name) for name in source._CONFIG}
        return type(source)(**config | {"decode_threads": read.decode_threads})
    raise ConfigError(
        "decode_threads applies where this process reads the store: a LocalSource or an "
        f"HttpSource; not to {source!r}"
    )


class CacheDataset(IterableDataset):
    """Stream aligned, fixed-budget items from a teacher cache (see the module docstring).

    ``CacheDataset(source, config=StreamConfig(...), read=ReadOptions(...), tokenizer=...,
    vocab_size=...)``:

    * ``source``: a :class:`~logitcache.client.sources.CacheSource` or a store location (local
      path, ``s3://...``); for a server URL, storage options or HTTP settings build the source
      with :func:`~logitcache.client.sources.open_source` first.
    * ``config``: the stream (:class:`~logitcache.client.config.StreamConfig`).
    * ``read``: read tuning (:class:`~logitcache.client.config.ReadOptions`); the stream does
      not depend on it.
    * ``tokenizer``, ``vocab_size``, ``allow_mismatch``: student guards
      (:func:`~logitcache.client.guards.check_compatible`): the student's tokenizer (or its
      fingerprint) and vocab size (int, config or model). A mismatch raises
      ``IncompatibleCacheError`` unless ``allow_mismatch=True``.

    ``rank``, ``world_size`` (resolved from the config or ``torch.distributed``) and ``k`` (the
    columns per row after ``topk``) are attributes.
    """

    def __init__(
        self,
        source: CacheSource | str | os.PathLike[str],
        config: StreamConfig | None = None,
        read: ReadOptions | None = None,
        *,
        tokenizer: object = None,
        vocab_size: object = None,
        allow_mismatch: bool = False,
    ) -> None:
        super().__init__()
        self.config = config = StreamConfig() if config is None else config
        self.read = read = ReadOptions() if read is None else read
        if not isinstance(config, StreamConfig) or not isinstance(read, ReadOptions):
            raise ConfigError("config must be a StreamConfig and read a ReadOptions")
        self.source = _tuned(open_source(source), read)
        manifest = self.source.manifest
        self.mismatches = check_compatible(
            manifest, tokenizer=tokenizer, vocab_size=vocab_size, allow_mismatch=allow_mismatch
        )
        selection.check_cache(manifest, config.entropy_top_fraction)
        k = int(manifest.k)
        hidden = getattr(manifest, "hidden", None)  # FORMAT.md 4.10: no top-k columns
        self.hidden_dim = None if hidden is None else int(hidden["dim"])
        if hidden and config.topk is not None:
            raise ConfigError('topk does not apply to a targets="hidden" cache (no top-k rows)')
        if config.topk is not None and config.topk > k:
            raise ConfigError(f"topk must be in [1, {k}] (the cache's k), got {config.topk}")
        self.k = k if config.topk is None else config.topk
        self.rank, self.world_size = resolve_ranks(config.rank, config.world_size)
        self._manifest_identity = _identity(manifest)
        self._all_lengths = np.asarray(self.source.lengths, dtype=np.int64)
        self.num_sequences = len(self._all_lengths)
        self.epoch = 0
        self._start = 0
        self._consumed = 0
        # the position load_state_dict restored: set_epoch of its epoch keeps it until a copy of
        # this dataset (here or in a DataLoader worker) iterates it (None: no pending resume)
        self._resume_mark: ResumeMark | None = None
        self._plans: dict[tuple[int, int], ItemPlan] = {}
        # validate budget, mode and policy now rather than in the first worker
        plan_items(
            np.zeros(0, dtype=np.int64),
            self._all_lengths,
            config.tokens_per_item,
            config.mode,
            config.long_sequences,
        )
        if config.long_sequences == "split":
            self._warn_cut()

    def _warn_cut(self) -> None:
        """:class:`CutSequenceWarning` when ``"split"`` cuts sequences (rows trained against
        targets conditioned on a prefix the student does not see)."""
        cut = cut_rows(self._all_lengths, self.config.tokens_per_item)
        if not cut:
            return
        rows = int(np.maximum(self._all_lengths - 1, 0).sum())
        longest = int(self._all_lengths.max())
        warnings.warn(
            f"tokens_per_item={self.config.tokens_per_item} cuts sequences of this cache (longest "
            f"{longest} tokens): {cut:,} of {rows:,} rows ({cut / rows:.1%}) fall in later "
            "pieces that restart at position 0, while their cached targets are the teacher's "
            "given the whole prefix. Train with tokens_per_item >= the longest sequence, score "
            "the corpus in pieces of at most tokens_per_item tokens, or drop those rows with "
            "long_sequences='truncate'",
            CutSequenceWarning,
            stacklevel=3,
        )

    # -- configuration --------------------------------------------------------------------
    @property
    def manifest(self) -> Manifest:
        """The cache manifest."""
        return self.source.manifest

    @property
    def target_kind(self) -> str:
        """``"topk"``, ``"sampled"`` or ``"hidden"`` (the manifest's ``targets``; FORMAT.md
        4.4, 4.10). Units of a sampled or hidden cache carry it as the key ``"target_kind"`` too;
        top-k units keep exactly their tensor keys. Hidden units hold ``hidden [.., T, d]``
        bfloat16 instead of ``topk_*``/``tail_mass`` (:mod:`logitcache.client.hidden`)."""
        return str(getattr(self.source.manifest, "targets", "topk"))

    @property
    def lengths(self) -> np.ndarray:
        """Token lengths of the sequences the current epoch is planned over."""
        return self._all_lengths[: self.num_sequences]

    def config_fingerprint(self, num_sequences: int | None = None) -> str:
        """sha256 of every setting that shapes the item stream, and of the planned lengths."""
        n = self.num_sequences if num_sequences is None else num_sequences
        settings = self.config.fingerprint_fields() | {"cache": self._manifest_identity}
        h = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode())
        h.update(np.ascontiguousarray(self._all_lengths[:n], dtype="<i8").tobytes())
        return h.hexdigest()

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (its order); the next iteration starts at its beginning.

        Right after :meth:`load_state_dict`, until the restored stream is iterated (by this
        object or by a copy in a DataLoader worker: the
        :class:`~logitcache.client.resume_mark.ResumeMark` is shared with them), setting the
        state's own epoch keeps the restored position and sequence count (``follow=True`` does
        not adopt newer sequences then): a trainer that calls ``set_epoch`` at every epoch
        start, the resumed one included, continues the interrupted epoch exactly. Any other
        epoch starts from its beginning (``follow=True``: over the sequences committed now).
        """
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ConfigError(f"epoch must be an int >= 0, got {epoch!r}")
        epoch = int(epoch)
        mark = self._resume_mark
        if mark is not None and mark.pending and epoch == mark.epoch:
            return  # the resumed epoch, not read yet: keep load_state_dict's position and snapshot
        self._resume_mark = None
        if epoch != self.epoch:
            self._plans.clear()
        self.epoch = epoch
        self._start = 0
        self._consumed = 0
        if self.config.follow:
            self._follow()

    def _follow(self) -> None:
        """Adopt the committed sequences (``follow=True``): the count every rank sees."""
        if self.world_size > 1 and distributed_world_size() != self.world_size:
            raise ConfigError(
                "follow=True with world_size > 1 needs torch.distributed initialised with that "
                "world size: the ranks must agree on how many sequences an epoch covers"
            )
        self.source.refresh()
        lengths = np.asarray(self.source.lengths, dtype=np.int64)
        count = agree_min(len(lengths))
        if count != self.num_sequences or len(lengths) != len(self._all_lengths):
            self._plans.clear()
        self._all_lengths = lengths
        self.num_sequences = count

    # -- planning -------------------------------------------------------------------------
    def plan(self, epoch: int | None = None, rank: int | None = None) -> ItemPlan:
        """Item plan of ``rank`` (default this rank) for ``epoch`` (default the current one)."""
        epoch = self.epoch if epoch is None else epoch
        rank = self.rank if rank is None else rank
        key = (epoch, rank)
        if key not in self._plans:
            n = self.num_sequences
            if self.config.shuffle:
                order = epoch_order(
                    n,
                    self.config.seed,
                    epoch,
                    self.config.shuffle_block_size,
                    self.config.shuffle_window,
                )
            else:
                order = np.arange(n, dtype=np.int64)
            span = rank_partition(order, rank, self.world_size)
            parts = np.array_split(span, self.config.lanes) if self.config.lanes > 1 else [span]
            plans = [
                plan_items(
                    p,
                    self.lengths,
                    self.config.tokens_per_item,
                    self.config.mode,
                    self.config.long_sequences,
                )
                for p in parts
            ]
            self._plans[key] = _interleave(plans, self.config.batch_size or 1)
        return self._plans[key]

    def num_items(self, epoch: int | None = None, rank: int | None = None) -> int:
        """Items ``rank`` (default this rank) yields in ``epoch`` (after ``even_ranks``)."""
        if self.config.even_ranks:
            return min(self.plan(epoch, r).num_items for r in range(self.world_size))
        return self.plan(epoch, rank).num_items

    def __len__(self) -> int:
        """Units (items, or batches when ``batch_size`` is set) of this rank's current epoch."""
        return -(-self.num_items() // (self.config.batch_size or 1))

    # -- state ----------------------------------------------------------------------------
    @property
    def resume_point(self) -> int:
        """Item of the epoch stream the next iteration starts at (set by load_state_dict)."""
        return self._start

    def state_dict(self, items_consumed: int | None = None) -> dict[str, Any]:
        """Loader state (see :mod:`logitcache.client.state`); JSON-serialisable.

        ``items_consumed`` defaults to what this object delivered in this process since the
        epoch's resume point; :class:`CacheDataLoader` passes its own count.
        """
        consumed = self._start + self._consumed if items_consumed is None else items_consumed
        return LoaderState(
            epoch=self.epoch,
            items_consumed=int(consumed),
            seed=self.config.seed,
            num_sequences=self.num_sequences,
            rank=self.rank,
            world_size=self.world_size,
            config=self.config_fingerprint(),
        ).to_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next iteration yields the rest of the stream the state was taken from."""
        st = LoaderState.from_dict(state)
        if st.world_size != self.world_size or st.rank != self.rank:
            raise StateError(
                f"state is for rank {st.rank} of {st.world_size}, this dataset is rank "
                f"{self.rank} of {self.world_size} (elastic resume is not supported)"
            )
        if st.seed != self.config.seed:
            raise StateError(f"state has seed {st.seed}, this dataset seed {self.config.seed}")
        if st.num_sequences > len(self._all_lengths):
            raise StateError(
                f"state was planned over {st.num_sequences} sequences, the cache has only "
                f"{len(self._all_lengths)}"
            )
        if st.config != self.config_fingerprint(st.num_sequences):
            raise StateError(
                "state belongs to another configuration (budget, mode, shuffle, cache or "
                "lengths differ)"
            )
        self.num_sequences = st.num_sequences
        self._plans.clear()
        self.epoch = st.epoch
        total = self.num_items()
        if st.items_consumed > total:
            raise StateError(f"state consumed {st.items_consumed} items of an epoch of {total}")
        self._start = st.items_consumed
        self._consumed = 0
        self._resume_mark = ResumeMark(st.epoch)

    # -- iteration ------------------------------------------------------------------------
    def _units(self, worker: int, num_workers: int) -> list[np.ndarray]:
        """Item indices of each unit this worker yields, in order."""
        total = self.num_items()
        step = self.config.batch_size or 1
        starts = np.arange(self._start, total, step, dtype=np.int64)
        mine = worker_units(len(starts), worker, num_workers)
        return [np.arange(s, min(s + step, total)) for s in starts[mine]]

    def _make_unit(
        self, plan: ItemPlan, items: np.ndarray, records: dict, trim: bool = False
    ) -> dict[str, Any]:
        arrays = build_batch(
            plan,
            items,
            selection.select(records, self.config.entropy_top_fraction),
            self.config.tokens_per_item,
            self.k,
            pad_token_id=self.config.pad_token_id,
            ids_dtype=np.int64 if self.config.ids_dtype == torch.int64 else np.int32,
            hidden_dim=self.hidden_dim,
        )
        if trim and self.target_kind == "sampled":
            arrays = trim_padding_columns(arrays)
        unit: dict[str, Any] = {name: torch.from_numpy(v) for name, v in arrays.items()}
        if "hidden" in unit:  # bfloat16 bit patterns, viewed as such (no copy)
            unit["hidden"] = unit["hidden"].view(torch.bfloat16)
        if self.config.batch_size is None:
            unit = {name: value[0] for name, value in unit.items()}
        if self.target_kind != "topk":
            unit["target_kind"] = self.target_kind
        return unit

    def padding_unit(self) -> dict[str, Any]:
        """A unit of one item of padding, full width: no token and no row, so it adds 0 to every
        loss and every count."""
        none = np.zeros(0, dtype=np.int64)
        plan = ItemPlan(none, none, none, none, item_offsets=np.zeros(2, dtype=np.int64))
        return self._make_unit(plan, np.zeros(1, dtype=np.int64), {})

    def _read_threads(self, num_workers: int) -> int:
        if self.read.read_threads is not None:
            return self.read.read_threads
        return default_read_threads(num_workers, os.cpu_count())

    def _produce(
        self,
        units: list[np.ndarray],
        out: queue.Queue,
        stop: threading.Event,
        trim: bool = False,
    ) -> None:
        """Background thread: collate units in order from records read ahead (ReadAhead)."""
        reads: ReadAhead | None = None
        try:
            plan = self.plan()
            worker, num_workers = current_worker()
            block, group = read_granularity(self.config, row_bytes(self.manifest))
            reads = ReadAhead(
                self.source,
                [plan.sequences_of(items) for items in units],
                block=block,
                num_sequences=self.num_sequences,
                threads=self._read_threads(num_workers if get_worker_info() else 0),
                group=group,
            )
            for u, items in enumerate(units):
                unit = self._make_unit(plan, items, reads.records(u), trim)
                while not stop.is_set():
                    try:
                        out.put((len(items), unit), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            out.put(_DONE)
        except BaseException as exc:  # handed to the consumer, re-raised there
            out.put(exc)
        finally:
            if reads is not None:
                reads.close()

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self._iterate(trim=self.config.trim_sampled)

    def _iterate(self, trim: bool) -> Iterator[dict[str, torch.Tensor]]:
        """The units of :meth:`__iter__`; ``trim``: cut sampled units' padding columns."""
        if self._resume_mark is not None:  # the restored stream is being read (maybe in a
            self._resume_mark.clear()  # worker: the mark is shared): set_epoch resets now
        worker, num_workers = current_worker()
        units = self._units(worker, num_workers)
        self._consumed = 0
        out: queue.Queue = queue.Queue(maxsize=self.read.prefetch)
        stop = threading.Event()
        thread = threading.Thread(
            target=self._produce,
            args=(units, out, stop, trim),
            name="logitcache-prefetch",
            daemon=True,
        )
        thread.start()
        try:
            while True:
                got = out.get()
                if got is _DONE:
                    return
                if isinstance(got, BaseException):
                    raise got
                count, unit = got
                self._consumed += count
                yield unit
        finally:
            stop.set()
            while thread.is_alive():
                try:
                    out.get_nowait()
                except queue.Empty:
                    thread.join(timeout=0.05)


def _interleave(plans: list[ItemPlan], unit: int) -> ItemPlan:
    """One plan of the lanes' items in :func:`lane_item_order` (a single plan is returned as is)."""
    if len(plans) == 1:
        return plans[0]
    order = lane_item_order([p.num_items for p in plans], unit)
    piece_base = np.cumsum([0] + [len(p.piece_seq) for p in plans])
    starts = np.concatenate(
        [p.item_offsets[:-1] + b for p, b in zip(plans, piece_base, strict=False)]
    )
    stops = np.concatenate(
        [p.item_offsets[1:] + b for p, b in zip(plans, piece_base, strict=False)]
    )
    starts, stops = starts[order], stops[order]
    sizes = stops - starts
    pieces = np.repeat(starts - np.concatenate([[0], np.cumsum(sizes)[:-1]]), sizes)
    pieces = pieces + np.arange(int(sizes.sum()), dtype=np.int64)
    cat = {
        f: np.concatenate([getattr(p, f) for p in plans])[pieces]
        for f in ("piece_seq", "piece_start", "piece_stop", "piece_rows")
    }
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return ItemPlan(item_offsets=offsets, **cat)


class CacheDataLoader(DataLoader):
    """A ``DataLoader`` over a :class:`CacheDataset` that knows what the trainer consumed.

    ``batch_size`` is the dataset's (the dataset yields whole batches, so the loader is built
    with ``batch_size=None``). ``state_dict()`` / ``load_state_dict()`` delegate to the dataset
    with the number of items this loader has yielded, which is exact with any ``num_workers``.
    ``persistent_workers`` is refused: workers would keep a stale epoch. When the source is not
    fork-safe (obstore-backed object stores, see :class:`~logitcache.client.sources.LocalSource`)
    and no ``multiprocessing_context`` is given, workers are started with ``spawn``.
    """

    def __init__(self, dataset: CacheDataset, **kwargs: Any) -> None:
        if not isinstance(dataset, CacheDataset):
            raise ConfigError("CacheDataLoader needs a CacheDataset")
        if kwargs.get("batch_size") is not None:
            raise ConfigError("set batch_size on the CacheDataset; the loader uses batch_size=None")
        if kwargs.get("persistent_workers"):
            raise ConfigError("persistent_workers would keep a stale epoch/resume point")
        kwargs["batch_size"] = None
        workers, context = kwargs.get("num_workers", 0), kwargs.get("multiprocessing_context")
        kwargs["multiprocessing_context"] = worker_context(dataset.source, workers, context)
        super().__init__(dataset, **kwargs)
        self._epoch = dataset.epoch
        self._base = 0
        self._yielded = 0

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        ds: CacheDataset = self.dataset  # type: ignore[assignment]
        self._epoch, self._base, self._yielded = ds.epoch, ds.resume_point, 0
        if ds._resume_mark is not None:  # at once, not when the first worker starts (the
            ds._resume_mark.clear()  # workers' copies clear the same shared mark then)
        for unit in super().__iter__():
            self._yielded += int(unit["input_ids"].shape[0]) if ds.config.batch_size else 1
            yield unit

    def state_dict(self) -> dict[str, Any]:
        """Loader state after the units yielded so far (see :mod:`logitcache.client.state`)."""
        ds: CacheDataset = self.dataset  # type: ignore[assignment]
        if ds.epoch != self._epoch:  # set_epoch was called since the last iteration
            return ds.state_dict(items_consumed=ds.resume_point)
        return ds.state_dict(items_consumed=self._base + self._yielded)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the dataset; the next iteration yields the rest of the stream."""
        ds: CacheDataset = self.dataset  # type: ignore[assignment]
        ds.load_state_dict(state)
        self._epoch, self._base, self._yielded = ds.epoch, ds.resume_point, 0


def worker_context(source: CacheSource, num_workers: int, context: Any) -> Any:
    """The DataLoader ``multiprocessing_context`` for workers reading ``source``: ``context``,
    or ``"spawn"`` when none is given and the source must not be forked (``fork_safe``)."""
    if num_workers > 0 and context is None and not getattr(source, "fork_safe", True):
        return "spawn"
    return context


def _identity(manifest: Manifest) -> dict[str, object]:
    """The manifest fields that identify the cached distributions (not its counts/timestamps):
    ``cache_format``'s :data:`~logitcache.cache_format.IDENTITY_FIELDS` (the teacher identity,
    ``k``, encodings, target kind), read off any source's manifest."""
    from logitcache.cache_format import IDENTITY_FIELDS

    return {f: getattr(manifest, f, None) for f in IDENTITY_FIELDS}
