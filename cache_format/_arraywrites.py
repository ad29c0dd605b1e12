"""Step 4 of an append (FORMAT.md W3): growing every array and writing its new rows past the
commit, for :class:`~._writer.CacheWriter` (a mixin: its state lives on the writer). Arrays with
a known layout are encoded by :mod:`._shardwrite` and written in one batch
(:func:`.store.put_objects`); the others through zarr, opened all at once on its loop."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import numpy as np
import zarr
import zarr.api.asynchronous
from zarr.storage import StorePath

from . import _shardwrite as shardwrite
from . import _templates as templates
from . import spec
from ._seal import seal_written, sealed
from ._zarr_adapter import default_buffer_prototype, sync
from .layout import array_defs
from .store import put_objects

if TYPE_CHECKING:
    from ._encode import Batch
    from ._manifest import Manifest
    from .store import StoreHandle


class ArrayWrites:
    """The array writes of :class:`~._writer.CacheWriter` (see the module docstring)."""

    _handle: StoreHandle
    _store: Any
    _manifest: Manifest
    _layout: spec.Layout
    _direct: dict[str, templates.DirectArray]
    _opened: dict[str, Any]

    def _columns(self, m: Manifest, fresh: Batch) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def _keep_direct(self, name: str, direct: templates.DirectArray) -> None:
        raise NotImplementedError

    def _write(self, m: Manifest, fresh: Batch) -> None:
        """Step 4 of the transaction: grow every array and write the new rows past the commit
        (direct arrays encoded here and written in one batch, the others opened through zarr first);
        the commit starts only after every write has returned."""
        cols = self._columns(m, fresh)
        base = {
            spec.INPUT_IDS: m.num_tokens,
            spec.ID_ORDER: 0,
            spec.HEAD_WEIGHT: 0,
            spec.HEAD_BIAS: 0,
            spec.SEQ_KEY_BYTES: m.num_key_bytes,
            **{n: m.num_sequences for n in (*spec.SEQ_ARRAYS, spec.SEQ_KEY_END)},
        }
        jobs = [
            (d.name, base.get(d.name, m.num_rows), cols[d.name])
            for d in array_defs(m, self._layout)
            if d.name in cols
        ]
        ready: list[tuple[str, int, np.ndarray, templates.DirectArray, bool]] = []
        later = []
        for name, start, data in jobs:
            direct = self._direct.pop(name, None)
            if direct is not None and direct.length == start:  # ours as we left it: no zarr
                ready.append((name, start, data, direct, False))
            else:
                later.append((name, start, data))
        if later:

            async def open_all() -> list[Any]:
                return await asyncio.gather(*(self._open_array(*job) for job in later))

            for (name, start, data), got in zip(later, sync(open_all()), strict=True):
                if got is not None:
                    ready.append((name, start, data, *got))
        objects: list[tuple[str, Any]] = []
        done = []
        for name, start, data, direct, new in ready:
            objs, written = direct.objects(start, data)
            objects += objs
            done.append((name, direct, new, written))
        self._put(objects)
        for name, direct, new, written in done:
            written()
            if new:
                self._keep_direct(name, direct)
            else:
                self._direct[name] = direct

    def _put(self, objects: list[tuple[str, Any]]) -> None:
        """Write an append's array objects in one batch (:func:`.store.put_objects`), all durable on
        return."""
        put_objects(self._store, objects)

    async def _open_array(
        self, name: str, start: int, data: np.ndarray
    ) -> tuple[templates.DirectArray, bool] | None:
        """Array ``name``, not left by this writer at length ``start``, ready for
        :mod:`._shardwrite`: from this process's template (:meth:`_from_template`) or opened through
        zarr and resized; with ``True`` when it is new to the templates. ``None``: written through
        zarr's ``setitem`` (a layout :mod:`._shardwrite` does not write, a version-1 store). Every
        chunk is stored, also one equal to the fill value, so an absent object in the committed
        range is a lost one (FORMAT.md R9)."""
        direct = await self._from_template(name, start)
        if direct is not None:
            return direct, False
        arr = self._opened.get(name)
        if arr is None or arr.shape[0] != start:  # not ours as we left it: read it again
            arr = await zarr.api.asynchronous.open_array(store=self._store, path=name, mode="r+")
            if self._manifest.format_version >= 2:  # version 1 stored no all-fill chunk
                arr = arr.with_config({"write_empty_chunks": True})
        self._opened.pop(name, None)
        stop = start + data.shape[0]
        # when growing, no chunk lies outside the new shape: skip zarr's scan of every chunk key
        # (it grows with the store); shrinking (past a dead writer's rows) deletes as before
        shrink = stop < arr.shape[0]
        await arr.resize((stop, *arr.shape[1:]), delete_outside_chunks=shrink)
        lay = templates.direct_layout_of(arr, name, self._manifest.format_version)
        direct = (
            None
            if lay is None
            else templates.DirectArray.of(arr, lay, start, shardwrite.LastShard())
        )
        if direct is not None:
            return direct, True
        await arr.setitem(slice(start, stop), data)
        if sealed(self._manifest.format_version):  # zarr writes no seal (FORMAT.md 4.8)
            await seal_written(arr, name, start, stop)
        self._opened[name] = arr  # reused if the array still ends where this append left it
        return None

    async def _from_template(self, name: str, start: int) -> templates.DirectArray | None:
        """Array ``name`` as a :class:`templates.DirectArray` of length ``start`` without zarr, when
        this process wrote the same store's array before and its stored ``zarr.json`` is, byte for
        byte, that template at length ``start``; with the last shard that writer left when its file
        is still the one written (:func:`._templates.shard_sig`). ``None``: open it through zarr."""
        tpl = templates.TEMPLATES.get((self._handle.url, name))
        if tpl is None or self._manifest.format_version < 2:
            return None
        old, head, tail = tpl
        path = StorePath(self._store, name)
        got = await (path / "zarr.json").get(prototype=default_buffer_prototype())
        if got is None or got.to_bytes() != head + str(start).encode() + tail:
            return None
        lay = templates.rebased(old, path, start)
        last = shardwrite.LastShard()
        with templates.LAST_LOCK:
            saved = templates.LAST.get(self._handle.url, {}).pop(name, None)
        if saved is not None and saved[1] == templates.shard_sig(lay, saved[0]):
            last = saved[0]  # its shard file is the one it describes
        return templates.DirectArray(lay, path / "zarr.json", head, tail, start, last)
