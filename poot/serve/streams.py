"""The thread that writes every streamed response's events.

A step gives each of its streams a token at once. Waking a handler thread per stream per token
to encode and write it costs a thread hand-off of the interpreter's lock for each, and with
many streams the engine's thread waits behind them between its steps. So the engine hands a
stream's outputs (RequestHandle.listen) to one writer thread, which encodes them and sends
what each socket takes without blocking; a slow reader keeps its bytes until its socket
takes them and holds up no one else. The handler thread only waits for its stream's end,
looking meanwhile whether the client left.
"""
import json
import logging
import select
import threading
from collections import deque

from poot.serve.errors import APIError

log = logging.getLogger("poot.serve")

POLL_BLOCKED_S = 0.01       # how long the writer waits on sockets whose buffers are full


def event(obj):
    """One server-sent event as one HTTP chunk (chunked transfer encoding)."""
    payload = b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) \
        + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(payload), payload)


END = event(b"[DONE]") + b"0\r\n\r\n"


def time_token(metrics, started, output):
    """Times an Output's token: a request's first is its time to first token, the others the
    gaps between tokens; a later choice's first (timed from the request too) is neither.
    `started`: the choices (Output.index) that have given a token."""
    if output.token_ids and output.elapsed is not None:
        if output.index in started or not started:
            metrics.observe_token(not started, output.elapsed)
        started.add(output.index)


class Stream:
    """One streamed response: the outputs of `handle` (one request, each of its choices)
    encoded by `request` into the socket `sock`, then the usage where asked and [DONE].
    `done` is set once all is sent, or the client is gone (`gone`)."""

    def __init__(self, sock, request, handle, metrics):
        self.sock, self.request, self.handle, self.metrics = sock, request, handle, metrics
        self.out = bytearray()
        self.open = len(handle.seq_ids)     # choices whose last output is not encoded yet
        self.ended = False                  # every output encoded
        self.started = set()
        self.gone = False
        self.done = threading.Event()
        self.lock = threading.Lock()        # held while the socket is written or given up

    def add(self, item):
        """Encodes one output of the request (or the error that ended it)."""
        if self.ended:
            return
        try:
            if isinstance(item, BaseException):
                self.out += event(APIError(500, str(item), "server_error", None,
                                           "engine_failed").body())
                self.ended = True
            else:
                time_token(self.metrics, self.started, item)
                for chunk in self.request.chunks(item):
                    self.out += event(chunk)
                self.open -= item.finish_reason is not None
                if self.open == 0:          # (the handle may be ahead: it is the engine's)
                    if self.request.include_usage:
                        self.out += event(self.request.usage_chunk(self.handle.usage))
                    self.ended = True
        except Exception as exc:            # a bug shaping one response ends it alone
            log.error("a stream's output could not be written", exc_info=exc)
            self.out += event(APIError(500, f"{type(exc).__name__}: {exc}", "server_error",
                                       None, "server_error").body())
            self.ended = True
        if self.ended:
            self.out += END
            self.handle.cancel()            # the choices left of a failed request

    def send(self):
        """Sends what the socket takes now; False while bytes wait for a full buffer."""
        with self.lock:
            if self.gone:
                return True
            try:
                while self.out:
                    del self.out[:self.sock.send(self.out)]
            except BlockingIOError:
                return False
            except OSError:
                self.give_up()
                return True
            if self.ended:
                self.done.set()
            return True

    def give_up(self):
        """The client is gone: nothing more is written and the request ends (call with
        `lock` held, so the writer is not writing the socket meanwhile)."""
        self.gone = True
        self.handle.cancel()
        self.done.set()


class Writer:
    """One thread writing every Stream attached to it."""

    def __init__(self):
        self._wake = threading.Condition()
        self._ready = deque()               # (stream, output or error), as the engine gave them
        self._blocked = set()               # streams whose sockets took not all their bytes
        self._thread = None

    def attach(self, stream):
        """Starts writing a stream's handles' outputs (the socket must be non-blocking)."""
        with self._wake:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="poot-writer",
                                                daemon=True)
                self._thread.start()
        stream.handle.listen(lambda _, item: self._push(stream, item))

    def _push(self, stream, item):
        """On the engine's thread: queue an output for the writer."""
        with self._wake:
            self._ready.append((stream, item))
            self._wake.notify()

    def _run(self):
        while True:
            with self._wake:
                while not self._ready and not self._blocked:
                    self._wake.wait()
                ready, self._ready = self._ready, deque()
            touched = set(self._blocked)
            for stream, item in ready:
                if not stream.gone:
                    stream.add(item)
                    touched.add(stream)
            self._blocked = {stream for stream in touched if not stream.send()}
            if self._blocked and not ready:
                try:
                    select.select([], [s.sock for s in self._blocked], [], POLL_BLOCKED_S)
                except (OSError, ValueError):       # a socket closed meanwhile: send() says
                    pass

