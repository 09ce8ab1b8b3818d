"""What the no-network tests share: a network namespace with loopback alone, the audit of what a
process did with sockets and imports (tests/audit/sitecustomize.py), and a server asked once.

`isolated(command)` runs a command where no network exists but loopback (`unshare -n`); the test
skips, saying why, where this user may not make such a namespace. Run as a program inside one,
`python tests/offline.py PORT COMMAND...` starts COMMAND (a server that listens on
127.0.0.1:PORT) under the audit, waits until /health says serving, asks it for one completion,
stops it, and prints one JSON object: /health's answer, the completion, the server's exit status
and log, and the audit's lines.
"""
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

AUDIT = Path(__file__).resolve().parent / "audit"
# beyond the standard library, what poot may import at run time: itself, numpy, and cffi with its
# extension module and its parser
RUN_TIME_IMPORTS = {"poot", "drivers", "numpy", "cffi", "_cffi_backend", "pycparser"}
UP_LOOPBACK = 'ip link set lo up && exec "$@"'


def isolated(command):
    """`command` (a list) as run in a new network namespace whose only interface, loopback, is
    up. As root `unshare -n` makes one; another user may through a user namespace
    (`unshare -rn`); where neither is permitted (or `ip` is missing) the test skips."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("a network namespace needs unshare (util-linux) and ip (iproute2)")
    reasons = []
    for flags in (["-n"], ["-r", "-n"]):
        probe = subprocess.run(["unshare", *flags, "sh", "-c", UP_LOOPBACK, "sh", "true"],
                               capture_output=True, text=True)
        if probe.returncode == 0:
            return ["unshare", *flags, "sh", "-c", UP_LOOPBACK, "sh", *map(str, command)]
        reasons.append(f"unshare {' '.join(flags)}: {probe.stderr.strip()}")
    pytest.skip("no network namespace can be made here (root can): " + "; ".join(reasons))


def audited(env, log):
    """`env` with the audit on: events appended to `log`."""
    path = os.pathsep.join(filter(None, [str(AUDIT), env.get("PYTHONPATH")]))
    return dict(env, PYTHONPATH=path, POOT_TEST_AUDIT=str(log))


def read_audit(lines):
    """(the socket events, in order; the top-level modules imported beyond the standard
    library) of the audit's lines."""
    sockets = [line for line in lines if line.startswith("socket.")]
    imports = {line.split()[1] for line in lines if line.startswith("import ")}
    return sockets, imports


def ask(port, method, path, body=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    conn.request(method, path, body=json.dumps(body) if body is not None else None,
                 headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    answer = (response.status, json.loads(response.read()))
    conn.close()
    return answer


def serve_and_ask(port, command, env=None, seconds=600):
    """Starts `command` (in `env`, under the audit), which serves on 127.0.0.1:`port`, asks for
    one completion once /health says serving, stops it (SIGTERM); returns what the module's
    docstring says the program prints."""
    with tempfile.TemporaryDirectory() as tmp:
        log, audit = Path(tmp) / "server.log", Path(tmp) / "audit"
        with open(log, "w") as err:
            server = subprocess.Popen(list(map(str, command)), stderr=err,
                                      env=audited(env or os.environ, audit))
        health = completion = None
        try:
            deadline = time.monotonic() + seconds
            while server.poll() is None and time.monotonic() < deadline:
                try:
                    health = ask(port, "GET", "/health")
                except OSError:
                    health = None
                if health and health[0] == 200:
                    completion = ask(port, "POST", "/v1/completions", {
                        "model": health[1]["model"], "prompt": "The capital of France is",
                        "max_tokens": 8, "temperature": 0})
                    break
                time.sleep(0.2)
        finally:
            if server.poll() is None:
                server.send_signal(signal.SIGTERM)
            try:
                status = server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
                status = server.wait()
        return {"health": health, "completion": completion, "status": status,
                "log": log.read_text(), "audit": audit.read_text().splitlines()
                if audit.exists() else []}


if __name__ == "__main__":
    print(json.dumps(serve_and_ask(int(sys.argv[1]), sys.argv[2:])))
