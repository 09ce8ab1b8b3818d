"""scripts/serve-check end to end: poot-serve in its own process, driven over HTTP with a
prompt of three chunks, concurrent mixed clients, clients that hang up, malformed requests and a
load phase, on the Vulkan device this machine has (lavapipe in CI: small sizes) through vulkan
and wgpu, and on reference with faults injected into its steps."""
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import open_or_skip

ROOT = Path(__file__).resolve().parent.parent


def serve_check(tmp_path, *flags):
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "serve-check"), "--cache",
                           str(tmp_path), "--model", "tiny:F16", "--small", *flags],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.parametrize("backend", ["vulkan", "wgpu"])
def test_serve_check_holds_on_the_vulkan_device(tmp_path, backend):
    open_or_skip(backend)
    out = serve_check(tmp_path, "--backend", backend, "--memory-limit", "1GiB",
                      "--prefill-chunk", "128")
    assert "| long | 1 | 1 | 0 | 0 | 384 |" in out and "3 chunks of 128" in out
    assert "every check holds" in out


def test_serve_check_holds_with_faults_injected(tmp_path):
    """Every 40th step fails: the requests in them fail with the injected error, no others do,
    malformed requests still get 4xx, and every block is free at the end."""
    out = serve_check(tmp_path, "--backend", "reference", "--faults", "every=40",
                      "--phases", "long,mixed,alone,load,fuzz", "--fuzz", "500")
    rows = [line.split("|") for line in out.splitlines() if line.startswith("| ")]
    assert sum(int(r[5]) for r in rows[1:]) > 0          # some requests met injected faults
    assert all(r[4].strip() == "0" for r in rows[1:])  # and none failed otherwise
    assert "every check holds" in out


@pytest.mark.parametrize("backend", ["reference", "vulkan", "wgpu"])
def test_the_api_phase_holds_on_every_backend_here(tmp_path, backend):
    """n, several prompts, echo, logit_bias, min_tokens, penalties (against the reference's
    engine), embeddings and json_schema output through HTTP on each backend."""
    if backend != "reference":
        open_or_skip(backend)
    flags = [] if backend == "reference" else ["--memory-limit", "1GiB"]
    out = serve_check(tmp_path, "--backend", backend, "--phases", "api", *flags)
    assert "| api | 13 | 13 | 0 | 0 |" in out and "every check holds" in out


def test_the_load_sent_in_bursts_gives_a_row_a_burst(tmp_path):
    """--load-bursts 2: the load twice, one burst after the other, each complete in its row."""
    out = serve_check(tmp_path, "--backend", "reference", "--phases", "load", "--load-bursts",
                      "2")
    rows = [line.split("|") for line in out.splitlines() if line.startswith("| load")]
    assert [r[1].strip() for r in rows] == ["load 1", "load 2"], out
    assert all(r[2].strip() == r[3].strip() == "16" and r[4].strip() == "0" for r in rows), out
    assert "every check holds" in out
