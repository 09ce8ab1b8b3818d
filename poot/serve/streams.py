"""The thread that encodes every streamed response's events, and the process that sends them.

A step gives each of its streams a token at once. Waking a handler thread per stream per token
to encode and write it costs a thread hand-off of the interpreter's lock for each, and so does
each socket send: with many streams the engine's thread waits behind them. So the engine hands
a stream's outputs (RequestHandle.listen) to one writer thread, which encodes them and passes
every stream's bytes of a batch in one message to the sender process (sender.py), which holds
each stream's socket (passed to it when the stream starts) and sends, outside this process's
lock, what each socket takes without blocking; a slow reader keeps its bytes there and holds
up no one else. The writer encodes while the device runs a step: from a step's landing to the
next launch (the engine's `launched` Event clear) it waits, rather than take the interpreter's
lock from the engine's thread while the device idles. The handler thread only waits for its
stream's end (all sent, or the client gone), looking meanwhile whether the client left.
"""
import json
import logging
import socket
import subprocess
import sys
import threading
from collections import deque

import poot.serve.sender as sender
from poot.serve.errors import APIError

log = logging.getLogger("poot.serve")

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
        self.out = bytearray()              # encoded, not yet passed to the sender
        self.open = len(handle.seq_ids)     # choices whose last output is not encoded yet
        self.ended = False                  # every output encoded
        self.started = set()
        self.gone = False
        self.done = threading.Event()
        self.lock = threading.Lock()        # held while the stream is finished or given up
        self.id = None                      # the sender's name for it

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
            self.handle.cancel()            # the choices left where a response could not be shaped

    def sent(self):
        """The sender has sent every byte, the end included."""
        with self.lock:
            self.done.set()

    def give_up(self):
        """The client is gone: nothing more is written and the request ends (call with
        `lock` held)."""
        self.gone = True
        self.handle.cancel()
        self.done.set()


class Writer:
    """One thread encoding every Stream attached to it, one process sending them (sender.py),
    both started with the first stream; a thread reads the sender's reports."""

    def __init__(self):
        self._wake = threading.Condition()
        self._ready = deque()               # (stream, output or error), as the engine gave them
        self._streams = {}                  # id -> Stream, until the sender reports it
        self._next_id = 0
        self._control = None                # this end of the sender's SOCK_SEQPACKET pair
        self._send_lock = threading.Lock()  # one message at a time into it
        self._process = None
        self.launched = None                # the engine's Event: set but while it launches

    def start(self):
        """Starts the sender process (a fresh interpreter, exec'd at once: nothing of a device
        this process holds goes with it) and the threads."""
        with self._wake:
            if self._process is not None:
                return
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            self._process = subprocess.Popen(
                [sys.executable, sender.__file__, str(theirs.fileno())],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
            theirs.close()
            self._control = ours
            for target, name in ((self._run, "poot-writer"), (self._reports, "poot-sent")):
                threading.Thread(target=target, name=name, daemon=True).start()

    def close(self):
        """Ends the sender process (it exits once its end of the pair is closed)."""
        with self._wake:
            process, self._process = self._process, None
        if process is not None:
            self._control.shutdown(socket.SHUT_RDWR)
            process.wait(5)

    def attach(self, stream):
        """Starts writing a stream's handles' outputs into its socket."""
        self.start()
        with self._wake:
            stream.id = self._next_id
            self._next_id = (self._next_id + 1) % 2 ** 32
            self._streams[stream.id] = stream
        with self._send_lock:
            socket.send_fds(self._control, [sender.ATTACH + sender.ID.pack(stream.id)],
                            [stream.sock.fileno()])
        stream.handle.listen(lambda _, item: self._push(stream, item))

    def forget(self, stream):
        """The handler has given the stream up: the sender drops its socket."""
        with self._wake:
            known = self._streams.pop(stream.id, None) is not None
        if known:
            self._send([sender.FORGET + sender.ID.pack(stream.id)])

    def _push(self, stream, item):
        """On the engine's thread: queue an output for the writer."""
        with self._wake:
            self._ready.append((stream, item))
            self._wake.notify()

    def _send(self, messages):
        try:
            with self._send_lock:
                for message in messages:
                    self._control.send(message)
        except OSError:             # the sender has gone: _reports gives every stream up
            pass

    def _run(self):
        while True:
            with self._wake:
                while not self._ready:
                    self._wake.wait()
                ready, self._ready = self._ready, deque()
            touched = {}
            launched = self.launched
            for stream, item in ready:
                if launched is not None:
                    launched.wait()
                if not stream.gone and not stream.done.is_set():
                    stream.add(item)
                    touched[stream.id] = stream
            parts = []
            for stream in touched.values():
                if stream.out:
                    parts.append((stream.id, stream.out, stream.ended))
                    stream.out = bytearray()
            self._send(sender.records(parts))

    def _reports(self):
        """The sender's reports: a stream all sent, or whose client is gone."""
        while True:
            try:
                message = self._control.recv(64)
            except OSError:
                message = b""
            if not message:
                break
            sid, = sender.ID.unpack_from(message, 1)
            with self._wake:
                stream = self._streams.pop(sid, None)
            if stream is None:
                continue
            if message[:1] == sender.SENT:
                stream.sent()
            else:
                with stream.lock:
                    stream.give_up()
        with self._wake:
            left, self._streams = list(self._streams.values()), {}
        if left:
            log.error("the sender process has ended: %d stream(s) given up", len(left))
        for stream in left:
            with stream.lock:
                stream.give_up()
