"""A background thread that steps buckets while the forward or backward pass goes on.

Fusion makes each bucket's update independent of the rest of the pass: in backward mode no later
node of the backward reads the bucket's parameters (:mod:`paraprop.optim.backward`); in forward
mode a module waits for its own bucket only (:mod:`paraprop.optim.forward`). PyTorch runs its
kernels (and the autograd engine) with the GIL released, so a second thread can run the
optimizer's Python and kernels meanwhile: the parallelism half of Jiang et al. 2021 on a CPU (on
a GPU the kernels of both threads go to the same stream, in the order they are issued). The
thread is started on first use and stopped by ``close()``.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable


class Worker:
    """Runs submitted calls one after another on a daemon thread; ``drain()`` waits for them.

    An exception raised by a call is kept, the calls after it are skipped, and ``drain()``
    raises it in the caller's thread.
    """

    def __init__(self, name: str = "paraprop-optim"):
        self._name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, fn: Callable, *args) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
            self._thread.start()
        self._queue.put((fn, args))

    def drain(self) -> None:
        """Wait until every submitted call has run; re-raise the first error."""
        if self._thread is not None:
            done = threading.Event()
            self._queue.put(done)
            done.wait()
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def raise_error(self) -> None:
        """Re-raise a stored error without waiting."""
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            if self._error is not None:
                continue
            fn, args = item
            try:
                fn(*args)
            except BaseException as e:  # noqa: BLE001 - re-raised by drain()
                self._error = e
