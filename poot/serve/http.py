"""HTTP for poot-serve: the standard library's threaded server, routing, auth, bodies and SSE.

One handler thread per connection (HTTP/1.1 keep-alive). A handler reads and checks the body,
lets openai.py turn it into a request, submits that to the engine and writes what comes back:
one JSON response, or server-sent events per token (chunked transfer encoding), which one
writer thread encodes and one sender process sends for every stream (streams.py). It notices a
client that went away, while waiting as well as while writing, and cancels its request (every
choice of it) so the engine frees its KV blocks. It never touches the engine's internals.
"""
import hmac
import json
import logging
import re
import select
import socket
import socketserver
import sys
import threading
import time
from contextlib import contextmanager
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

from poot.engine.request import EngineFailed, InvalidRequest
from poot.serve import openai, streams
from poot.serve.embeddings import Embeddings
from poot.serve.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE, Metrics
from poot.serve.errors import APIError

log = logging.getLogger("poot.serve")

MAX_BODY_BYTES = 4 * 1024 * 1024
IDLE_TIMEOUT_S = 60.0
DISCONNECT_POLL_S = 0.25
# Requests made (prompt encoded, grammar compiled) at once, at most: a burst's handlers would
# otherwise all take turns under the interpreter's lock, the engine's thread among them while
# the device waits for its launches.
INTAKE_SLOTS = 4
# The longest a request's making waits for the engine's thread to issue a step
# (Engine.host_free): a step's launches take milliseconds, so this bounds only a stuck one.
ENGINE_TURN_S = 1.0
# RFC 9110 5.6.2: a method is a token; what may follow it on the request line's first bytes
METHOD = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]*(?:[ \r\n]|\Z)")


class ClientGone(Exception):
    pass


def _not_json(name):
    """Python's json reads NaN and Infinity, which JSON has not."""
    raise ValueError(f"{name} is not a JSON value")


class Serving:
    """What every handler thread shares: the model and engine once loaded, the status, metrics."""

    def __init__(self, api_key=None, max_body=MAX_BODY_BYTES, idle_timeout=IDLE_TIMEOUT_S):
        self.api_key = api_key
        self.max_body = max_body
        self.idle_timeout = idle_timeout
        self.status = "loading"          # loading -> serving -> stopping
        self.model = None
        self.names = []             # the names the model is served under (the first: default)
        self.engine = None
        self.info = {}
        self.metrics = Metrics()
        self.writer = streams.Writer()      # writes every streamed response's events
        self._active = 0
        self._active_lock = threading.Condition()
        self._intake = threading.BoundedSemaphore(INTAKE_SLOTS)

    def ready(self, model, engine, info, names=None):
        self.model, self.engine, self.info = model, engine, info
        self.writer.launched = engine.launched
        self.names = list(names or [model.name])
        self.status = "serving"

    def failure(self):
        """(status, message) once the engine serves no more, else None."""
        engine = self.engine
        if engine is None or engine.error is None:
            return None
        return ("device lost" if engine.device_lost else "error"), engine.error

    def health(self):
        failed = self.failure()
        if failed is not None:
            return 503, {"status": failed[0], "error": failed[1]}
        if self.status == "serving":
            return 200, dict({"status": "serving"}, **self.info)
        return 503, {"status": self.status}

    def require_engine(self):
        failed = self.failure()
        if failed is not None:
            raise APIError(503, failed[1], "server_error", None,
                           "device_lost" if failed[0] == "device lost" else "engine_failed")
        if self.status != "serving":
            raise APIError(503, f"the server is {self.status}", "server_error", None,
                           f"server_{self.status}")

    @contextmanager
    def intake(self):
        """Where a request is made: one of INTAKE_SLOTS, entered while the engine's thread
        issues no step (Engine.host_free; up to ENGINE_TURN_S), so that the few handlers making
        requests finish what they do and then leave the interpreter's lock to those launches."""
        with self._intake:
            engine = self.engine
            if engine is not None:
                deadline = time.monotonic() + ENGINE_TURN_S
                # (a wait a set wakes may find it clear again: the next step's issue began)
                while not engine.host_free.is_set() and time.monotonic() < deadline:
                    engine.host_free.wait(deadline - time.monotonic())
            yield

    def enter(self):
        with self._active_lock:
            self._active += 1

    def leave(self):
        with self._active_lock:
            self._active -= 1
            self._active_lock.notify_all()

    def wait_quiet(self, timeout):
        """Wait until no completion is being written; False if `timeout` seconds pass first."""
        with self._active_lock:
            return self._active_lock.wait_for(lambda: self._active == 0, timeout)


class HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128

    def __init__(self, address, serving):
        self.serving = serving
        super().__init__(address, Handler)

    @property
    def port(self):
        return self.server_address[1]

    def server_bind(self):
        """http.server's bind, less its reverse lookup of the host's name (socket.getfqdn), which
        can be a DNS query: poot opens no network connection but its port (docs/air-gapped.md).
        `server_name` (only CGI reads it) is the address as bound."""
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]

    def handle_error(self, request, client_address):
        """A connection that broke between requests is the client's business; anything else
        is logged (socketserver would print it to stderr)."""
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            return
        log.error("connection from %s failed", client_address, exc_info=exc)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # every event is one small write: Nagle's algorithm would hold it back for the client's
    # delayed acknowledgement (~40 ms on a kept-alive connection)
    disable_nagle_algorithm = True

    status_sent = None          # the status of the response begun, for /metrics
    body_pending = False        # the request has a body not read yet

    # route -> (allowed methods, handler method name, needs the api key)
    ROUTES = {
        "/health": ({"GET"}, "health", False),
        "/metrics": ({"GET"}, "metrics", True),
        "/v1/models": ({"GET"}, "models", True),
        "/v1/completions": ({"POST"}, "completions", True),
        "/v1/chat/completions": ({"POST"}, "chat_completions", True),
        "/v1/embeddings": ({"POST"}, "embeddings", True),
        "/tokenize": ({"POST"}, "tokenize", True),
        "/detokenize": ({"POST"}, "detokenize", True),
    }

    def do_GET(self):
        self.dispatch()

    def do_POST(self):
        self.dispatch()

    def do_PUT(self):
        self.dispatch()

    def do_DELETE(self):
        self.dispatch()

    def do_PATCH(self):
        self.dispatch()

    def do_OPTIONS(self):
        self.dispatch()

    def do_HEAD(self):
        self.dispatch()

    @property
    def serving(self):
        return self.server.serving

    def setup(self):
        self.timeout = self.serving.idle_timeout   # idle (or a stalled body) this long: closed
        super().setup()

    def handle_one_request(self):
        """http.server's, after a look at the first bytes that came: where they cannot start a
        request line (a method holding a byte no method may: a TLS handshake sent to this
        plain-HTTP port, binary noise), a 400 at once, not after the idle timeout spent waiting
        for a line end that may never come."""
        try:
            head = self.rfile.peek(1)
        except OSError:                 # a timeout included: idle this long, closed
            self.close_connection = True
            return
        if head and not METHOD.match(head):
            self.command, self.request_version, self.requestline = None, "HTTP/1.1", ""
            self.send_error(400, f"not an HTTP request: it starts {head[:8]!r}" + (
                " (a TLS handshake: this port speaks plain HTTP)" if head[:1] == b"\x16" else ""))
            return
        super().handle_one_request()

    def version_string(self):
        return "poot"

    def log_message(self, format, *args):
        log.debug("%s - %s", self.address_string(), format % args)

    # ---- dispatch -------------------------------------------------------------------------

    def _route(self):
        path = urlsplit(self.path).path
        if path in self.ROUTES:
            return path, path, None
        if path.startswith("/v1/models/"):
            return "/v1/models/{id}", "/v1/models", unquote(path[len("/v1/models/"):])
        return None, path, None

    def dispatch(self):
        self.status_sent = None
        # A body this handler does not read would be parsed as the next request: unless its
        # framing is intact and it is read, the connection ends with this response.
        self.body_pending = True
        route, path, model_id = self._route()
        try:
            length = self._body_length()
            self.body_pending = length > 0
            if route is None:
                raise APIError(404, f"no route {self.command} {path}", "invalid_request_error",
                               None, "not_found")
            methods, name, needs_key = self.ROUTES[path]
            self.allowed = methods
            if self.command not in methods:
                raise APIError(405, f"{path} accepts {', '.join(sorted(methods))}, not "
                               f"{self.command}", "invalid_request_error", None,
                               "method_not_allowed")
            if needs_key:
                self._check_key()
            body = self._read_json(length) if self.command == "POST" else None
            if model_id is not None:
                self.model_card(model_id)
            else:
                getattr(self, name)(body)
        except APIError as exc:
            self._send_error(exc)
        except ClientGone:
            self.close_connection = True
            self.status_sent = self.status_sent or 499
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            self.close_connection = True
        except Exception as exc:
            log.exception("%s %s failed", self.command, path)
            self._send_error(APIError(500, f"internal error: {type(exc).__name__}: {exc}",
                                      "server_error"))
        finally:
            self.serving.metrics.count_request(route or "unknown", self.status_sent or 0)

    def _body_length(self):
        """The body's length by the request's framing. Framing that a proxy in front could read
        otherwise (RFC 9112 6.3: Transfer-Encoding beside Content-Length, Content-Lengths that
        disagree, or one that is not plain digits) is refused, as request smuggling starts
        there; a Transfer-Encoding alone is refused too, as bodies come with a length here."""
        values = [v.strip() for header in self.headers.get_all("Content-Length", [])
                  for v in header.split(",")]
        if "Transfer-Encoding" in self.headers:
            if values:
                raise APIError(400, "the request has both Transfer-Encoding and Content-Length",
                               "invalid_request_error", None, "ambiguous_framing")
            raise APIError(411, "send the body with a Content-Length (chunked request bodies "
                           "are not accepted)", "invalid_request_error", None, "length_required")
        if not values:
            return 0
        if len(set(values)) > 1 or not all(re.fullmatch(r"[0-9]+", v) for v in values):
            raise APIError(400, f"Content-Length must be one non-negative integer, got "
                           f"{', '.join(values)!r:.80}", "invalid_request_error", None,
                           "ambiguous_framing")
        digits = values[0].lstrip("0") or "0"
        if len(digits) > len(str(self.serving.max_body)):
            return self.serving.max_body + 1        # refused as too large, unread
        return int(digits)

    def _check_key(self):
        key = self.serving.api_key
        if key is None:
            return
        given = self.headers.get("Authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode("utf-8", "replace"), key.encode("utf-8")):
            raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer "
                           "<key>'", "invalid_request_error", None, "invalid_api_key")

    def _read_json(self, length):
        if length > self.serving.max_body:
            raise APIError(413, f"the body is {length} bytes; the limit is "
                           f"{self.serving.max_body}", "invalid_request_error", None,
                           "request_too_large")
        raw = self.rfile.read(length)
        self.body_pending = False
        if len(raw) < length:
            self.close_connection = True
            raise ClientGone
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise APIError(400, f"the body is not valid UTF-8 (byte {exc.start})",
                           "invalid_request_error") from None
        try:
            body = json.loads(text, parse_constant=_not_json)
        except ValueError as exc:       # JSONDecodeError, or an integer of over 4,300 digits
            raise APIError(400, f"the body is not valid JSON: {exc}",
                           "invalid_request_error") from None
        except RecursionError:
            raise APIError(400, "the body's JSON is nested too deeply",
                           "invalid_request_error") from None
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object", "invalid_request_error")
        return body

    # ---- writing --------------------------------------------------------------------------

    def _send(self, status, data, content_type, headers=()):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for name, value in headers:
            self.send_header(name, value)
        if self.close_connection or self.body_pending or self.serving.status == "stopping":
            self.close_connection = True
            self.send_header("Connection", "close")
        self.end_headers()
        self.status_sent = status
        if self.command != "HEAD":
            self.wfile.write(data)

    def _send_json(self, status, obj, headers=()):
        self._send(status, json.dumps(obj).encode(), "application/json", headers)

    def _send_error(self, exc):
        headers = []
        if exc.status == 405:
            headers.append(("Allow", ", ".join(sorted(self.allowed))))
        if exc.status == 401:            # RFC 6750 3: the scheme the key goes in
            headers.append(("WWW-Authenticate", 'Bearer realm="poot-serve"'))
        if self.status_sent is not None:      # a stream already started: nothing more to say
            self.close_connection = True
            return
        try:
            self._send_json(exc.status, exc.body(), headers)
        except OSError:
            self.close_connection = True

    def send_error(self, code, message=None, explain=None):
        """http.server's own errors (bad request line, huge headers) in the OpenAI shape. Its
        two 5xx answers are the client's mistakes, and 5xx is kept for the server's own
        failures: a method it does not know is 405, an HTTP version it does not speak 400."""
        self.close_connection = True
        self.status_sent = None
        if code == HTTPStatus.NOT_IMPLEMENTED:
            code, message = 405, f"method {self.command!r:.40} is not allowed"
        elif code == HTTPStatus.HTTP_VERSION_NOT_SUPPORTED:
            code = 400
        if self.request_version == "HTTP/0.9":     # the line did not parse: answer as 1.1
            self.request_version = "HTTP/1.1"
        phrase = HTTPStatus(code).phrase if code in HTTPStatus._value2member_map_ else "Error"
        body = APIError(code, message or phrase, "invalid_request_error").body()
        try:
            self._send_json(code, body)
        except OSError:
            pass

    def _client_gone(self):
        """True when the peer closed its side (readable with nothing to read)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    # ---- routes ---------------------------------------------------------------------------

    def health(self, _):
        status, body = self.serving.health()
        self._send_json(status, body)

    def metrics(self, _):
        engine = self.serving.engine
        text = self.serving.metrics.render(engine.stats() if engine is not None else None)
        self._send(200, text.encode(), METRICS_CONTENT_TYPE)

    def models(self, _):
        self.serving.require_engine()
        self._send_json(200, openai.models_list(self.serving.names,
                                                self.serving.engine.context_limit))

    def model_card(self, model_id):
        self.serving.require_engine()
        if model_id not in self.serving.names:
            raise APIError(404, f"The model '{model_id}' does not exist", "invalid_request_error",
                           "model", "model_not_found")
        self._send_json(200, openai.model_card(model_id, self.serving.engine.context_limit))

    def tokenize(self, body):
        self.serving.require_engine()
        with self.serving.intake():
            answer = openai.tokenize(body, self.serving.model, self.serving.names,
                                     self.serving.engine.context_limit)
        self._send_json(200, answer)

    def detokenize(self, body):
        self.serving.require_engine()
        self._send_json(200, openai.detokenize(body, self.serving.model))

    def completions(self, body):
        self.serving.require_engine()
        with self.serving.intake():
            request = openai.Completion.text(body, self.serving.model, self.serving.names)
        self._complete(request)

    def chat_completions(self, body):
        self.serving.require_engine()
        with self.serving.intake():
            request = openai.Completion.chat(body, self.serving.model, self.serving.names)
        self._complete(request)

    def embeddings(self, body):
        self.serving.require_engine()
        with self.serving.intake():
            request = Embeddings(body, self.serving.model, self.serving.names)
        for i, ids in enumerate(request.inputs):   # all checked before any is queued
            try:
                self.serving.engine.check_prompt(ids, request.params)
            except InvalidRequest as exc:
                raise APIError(400, f"input {i}: {exc}", "invalid_request_error",
                               "input") from None
        handles = []
        self.serving.enter()
        try:
            for ids in request.inputs:          # submitted together: they share steps
                try:
                    handles.append(self.serving.engine.submit(ids, request.params))
                except InvalidRequest as exc:
                    raise APIError(400, f"input {len(handles)}: {exc}",
                                   "invalid_request_error", "input") from None
                except EngineFailed as exc:
                    raise APIError(503, str(exc), "server_error", None,
                                   "engine_failed") from None
            outputs = [self._whole(handle)[-1] for handle in handles]
            for output in outputs:
                if isinstance(output, EngineFailed):
                    raise APIError(500, str(output), "server_error", None, "engine_failed")
            self._send_json(200, request.response(outputs))
        finally:
            for handle in handles:
                handle.cancel()
            self.serving.leave()

    def _complete(self, request):
        try:
            handle = self.serving.engine.submit_prompts(request.prompts, request.params,
                                                        request.n)
        except InvalidRequest as exc:
            raise openai.from_invalid_request(exc) from None
        except EngineFailed as exc:
            raise APIError(503, str(exc), "server_error", None, "engine_failed") from None
        self.serving.enter()
        try:
            if request.stream:
                self._stream(request, handle)
            else:
                outputs = self._whole(handle)
                if isinstance(outputs[-1], EngineFailed):
                    raise APIError(500, str(outputs[-1]), "server_error", None,
                                   "engine_failed")
                self._send_json(200, request.response(outputs, handle.usage))
        finally:
            handle.cancel()          # no-op once finished; frees the blocks of a gone client
            self.serving.leave()

    def _whole(self, handle):
        """Every output of a request (of every choice) once it ends, or the error that ended
        it, last: the engine's thread gathers them (RequestHandle.listen) while this one looks
        every DISCONNECT_POLL_S whether the client left (a whole answer is written only at its
        end, so nothing else would notice)."""
        outputs, ended = [], threading.Event()

        def gather(_, item):            # on the engine's thread, which accounts the handle
            outputs.append(item)
            if handle.finished:
                ended.set()
        handle.listen(gather)
        while not ended.wait(DISCONNECT_POLL_S):
            if self._client_gone():
                raise ClientGone
        started = set()
        for output in outputs:
            if not isinstance(output, BaseException):
                streams.time_token(self.serving.metrics, started, output)
        return outputs

    def _stream(self, request, handle):
        """Server-sent events: the first chunks from here, then the writer thread's
        (streams.py) until the request ends, this thread looking every DISCONNECT_POLL_S
        whether the client left."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.status_sent = 200
        try:
            for chunk in request.first_chunks():
                self.wfile.write(streams.event(chunk))
        except OSError:
            self.close_connection = True
            raise ClientGone from None
        stream = streams.Stream(self.connection, request, handle, self.serving.metrics)
        timeout = self.connection.gettimeout()
        self.serving.writer.attach(stream)
        while not stream.done.wait(DISCONNECT_POLL_S):
            if self._client_gone():
                with stream.lock:
                    stream.give_up()
        if stream.gone:
            self.serving.writer.forget(stream)
        self.connection.settimeout(timeout)     # the sender's copy made the socket non-blocking
        if stream.gone:
            self.close_connection = True
            raise ClientGone


def listen(serving, host, port):
    """Bind the port (0: any free one); serve with `serve_forever` on a thread of your own."""
    return HTTPServer((host, port), serving)
