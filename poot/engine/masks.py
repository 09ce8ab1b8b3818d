"""The constrained sequences' masks that are not kept yet, computed beside the steps.

A grammar's mask for a place it has not been before takes milliseconds to read over the
vocabulary; computed on the engine's thread it would hold up every sequence of the step. So a
threaded engine asks `MaskThread.ready(seq)` before a constrained sequence decodes: where the
constraint's `ready()` says its mask is not kept, the mask is computed on this thread and the
sequence sits out the steps until it is (its own answer waits, no other does); the engine is
woken when it is done.
"""
import logging
import threading
from collections import deque

log = logging.getLogger("poot.engine")


class MaskThread:
    def __init__(self, wake):
        self._wake = wake               # the engine's Condition, notified when a mask is kept
        self._todo = deque()
        self._pending = set()
        self._lock = threading.Condition()
        self._thread = None

    def ready(self, seq):
        """Whether seq's next mask is kept (or it has no constraint to compute); if not, its
        computation is queued."""
        constraint = seq.constraint
        ready = getattr(constraint, "ready", None)
        if constraint is None or ready is None or ready():
            return True
        with self._lock:
            if seq.seq_id not in self._pending:
                self._pending.add(seq.seq_id)
                self._todo.append((seq.seq_id, constraint))
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="poot-masks",
                                                    daemon=True)
                    self._thread.start()
                self._lock.notify()
        return False

    def _run(self):
        while True:
            with self._lock:
                while not self._todo:
                    self._lock.wait()
                seq_id, constraint = self._todo.popleft()
            try:
                constraint.allowed()        # kept by the grammar's cache from now on
            except Exception:               # kept as its failure: the step's advance() raises it
                log.debug("request %d: its constraint failed on the mask thread", seq_id)
            with self._lock:
                self._pending.discard(seq_id)
            with self._wake:
                self._wake.notify()
