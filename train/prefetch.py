"""Training batches made on a background thread, so the host's batch assembly (numpy slicing,
label tables, the per-row steering pick) overlaps the GPU's step instead of idling it.

One producer thread owns the numpy generator, so the batch sequence is the same as drawing the
batches inline with that generator (the tests check it)."""

from __future__ import annotations

import queue
import threading
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Prefetcher(Generic[T]):
    """`next()` returns what `make()` returned, in order, made up to `depth` batches ahead."""

    def __init__(self, make: Callable[[], T], depth: int = 3):
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self._make = make
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="batch-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                item = (True, self._make())
            except BaseException as exc:          # handed to the consumer, raised there
                item = (False, exc)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if not item[0]:
                return

    def next(self) -> T:
        ok, value = self._queue.get()
        if not ok:
            raise value
        return value

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def __enter__(self) -> "Prefetcher[T]":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
