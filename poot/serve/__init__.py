"""poot-serve: the OpenAI-compatible HTTP server over one engine.

`Server` is the whole life of a server in-process, in the order the program follows: bind the
port (so /health answers "loading"), `load` a model and its runner into an engine, serve, and
`close` (stop accepting, let in-flight requests finish within a bound, cancel the rest). The
program (cli.py) and the tests both use it. HTTP is http.py, the API's shapes openai.py.
"""
import threading
import time

from poot.engine.engine import Engine
from poot.serve.http import IDLE_TIMEOUT_S, MAX_BODY_BYTES, Serving, listen


class Server:
    def __init__(self, host="127.0.0.1", port=8080, api_key=None, max_body=MAX_BODY_BYTES,
                 idle_timeout=IDLE_TIMEOUT_S):
        self.serving = Serving(api_key=api_key, max_body=max_body, idle_timeout=idle_timeout)
        self.httpd = listen(self.serving, host, port)
        self.host = host
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="poot-http",
                                        kwargs={"poll_interval": 0.1}, daemon=True)
        self._thread.start()

    @property
    def port(self):
        return self.httpd.port

    @property
    def url(self):
        return f"http://{self.host}:{self.port}"

    @property
    def engine(self):
        return self.serving.engine

    def load(self, model, runner, *, devices=(), plan=None, max_seqs=16, step_tokens=256,
             max_context=None, on_failure=None, served_names=None, prefix_caching=True,
             ahead=True):
        """Start an engine over `runner` for `model`; /health then reports serving, naming
        `devices` (what the runner runs on, as the program describes them) and `plan` (the
        memory plan and its check, engine/plan.py) beside the shape the engine runs.
        `on_failure` is called once the engine can serve no more (its device lost).
        `served_names`: the names requests may use for the model (default: its file's).
        `prefix_caching`: whether requests reuse the KV blocks of prompts that began alike.
        `ahead`: whether steps are launched on the device's tokens of the step in flight, where
        the runner can (Engine's)."""
        engine = Engine(runner, model.tokenizer, max_seqs=max_seqs, step_tokens=step_tokens,
                        max_context=max_context, prefix_caching=prefix_caching, ahead=ahead)
        engine.on_failure = on_failure
        engine.start()
        # a short request before the first client's: the pre-tokenizer compiled, and every
        # first-time cost of the steps paid (a burst of requests at start waits on it otherwise)
        engine.warm_up(model.tokenizer.encode("Ready."))
        plan = dict(plan or {}, max_seqs=engine.max_seqs, context=engine.context_limit,
                    step_tokens=engine.step_tokens, launch_ahead=engine.ahead,
                    kv_blocks=runner.num_blocks,
                    kv_block_size=runner.block_size)
        names = list(served_names or [model.name])
        self.serving.ready(model, engine, {"model": names[0], "backend": runner.backend,
                                           "devices": list(devices), "plan": plan}, names)
        return engine

    def close(self, grace=10.0):
        """Stop accepting; in-flight requests get `grace` seconds to finish, then are cancelled."""
        self.serving.status = "stopping"
        self.httpd.shutdown()
        self.httpd.server_close()
        engine = self.serving.engine
        if engine is not None:
            deadline = time.monotonic() + grace
            while not engine.idle and engine.error is None and time.monotonic() < deadline:
                time.sleep(0.05)
            engine.stop()
        # Handlers write the last chunks of what just finished or was cancelled.
        self.serving.wait_quiet(2.0)
        self.serving.writer.close()
