"""The no-network guarantee (docs/air-gapped.md): at run time poot opens no network connection
but its listening socket, looks up no name, and imports nothing beyond the standard library but
numpy and cffi. Each test runs poot where no network exists but loopback (tests/offline.py) and
reads the interpreter's audit of what it did."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from poot.backends.select import open_device
from poot.errors import BackendUnavailable
from tests import offline
from tests.models import default_model, tiny_model

ROOT = Path(__file__).resolve().parent.parent
PORT = 8080        # the namespace is the server's own: nothing else listens there


def test_the_server_serves_with_loopback_alone_and_binds_its_port_only():
    default_model()
    command = offline.isolated([sys.executable, ROOT / "tests" / "offline.py", PORT,
                                sys.executable, "-m", "poot", "serve", "--backend", "reference",
                                "--port", PORT])
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["health"][0] == 200, result["log"]
    status, body = result["completion"]
    assert status == 200 and body["choices"][0]["text"], body
    assert result["status"] == 0, result["log"]
    sockets, imports = offline.read_audit(result["audit"])
    assert sockets == [f"socket.bind ('127.0.0.1', {PORT})"]
    assert imports <= offline.RUN_TIME_IMPORTS, imports - offline.RUN_TIME_IMPORTS


def test_generating_on_wgpu_imports_no_wgpu_package_and_opens_no_socket(tmp_path):
    """wgpu-native comes inside the `wgpu` wheel, which poot loads the library from and never
    imports (its Python dependencies are not even installed by scripts/setup)."""
    try:
        open_device("wgpu")
    except BackendUnavailable as e:
        pytest.skip(f"no wgpu device here: {e}")
    model = tiny_model(tmp_path)
    audit = tmp_path / "audit"
    command = offline.isolated([sys.executable, "-m", "poot", "generate", "--backend", "wgpu",
                                "--model", model, "--prompt", "hello", "--max-tokens", "4",
                                "--temperature", "0", "--json"])
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=offline.audited(os.environ, audit))
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["token_ids"]) == 4
    sockets, imports = offline.read_audit(audit.read_text().splitlines())
    assert sockets == []
    assert "wgpu" not in imports
    assert imports <= offline.RUN_TIME_IMPORTS, imports - offline.RUN_TIME_IMPORTS
