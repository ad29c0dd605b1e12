"""A restored loader position that every copy of the dataset can mark as read.

``CacheDataset.load_state_dict`` restores a position in an epoch's stream; ``set_epoch`` of that
epoch keeps it *until the restored stream is iterated*. With ``DataLoader(num_workers > 0)`` the
iteration happens in worker processes, on copies of the dataset, so a plain attribute set there
never reaches the trainer's process. :class:`ResumeMark` is one shared byte (``multiprocessing``
shared memory, inherited by forked and spawned workers): a worker that starts iterating the
restored stream clears it, and the trainer process sees that at its next ``set_epoch``.

Outside a worker start (``pickle.dumps`` of the dataset by a user, a copy sent elsewhere) the
mark travels as a plain value: shared memory cannot be pickled outside process creation.
"""

from __future__ import annotations

import multiprocessing
from multiprocessing.context import get_spawning_popen
from typing import Any


class ResumeMark:
    """``pending``: the restored stream of ``epoch`` has not been iterated by any copy yet."""

    def __init__(self, epoch: int) -> None:
        self.epoch = int(epoch)
        self._flag: Any = multiprocessing.RawValue("b", 1)

    @property
    def pending(self) -> bool:
        return bool(self._flag.value)

    def clear(self) -> None:
        """The restored stream is being read (here or in a worker)."""
        self._flag.value = 0

    def __getstate__(self) -> dict[str, Any]:
        if get_spawning_popen() is not None:  # a worker being started: share the byte
            return {"epoch": self.epoch, "flag": self._flag}
        return {"epoch": self.epoch, "flag": None, "pending": self.pending}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.epoch = state["epoch"]
        flag = state["flag"]
        if flag is None:
            flag = multiprocessing.RawValue("b", int(state["pending"]))
        self._flag = flag
