"""scripts/bundle, and the bundle it writes carried to a host with no network: it checks itself
against its manifest, installs from its own wheels, generates, serves and tests; a changed byte
stops the install.

The bundle is built once, for this machine's Python and architecture, with the default model:
the default targets (CPython 3.10-3.13 on x86_64 and aarch64) are a download too large for every
test run.
"""
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from poot.loader import DEFAULT_MODEL_FILE
from tests import offline
from tests.models import default_model

ROOT = Path(__file__).resolve().parent.parent
PROMPT = ["generate", "--backend", "reference", "--prompt", "The capital of France is",
          "--max-tokens", "8", "--temperature", "0", "--json"]
# the interpreter the bundle's venv is made from: this one's, outside its virtual environment
BASE_PYTHON = os.path.realpath(sys.executable)


@pytest.fixture(scope="module")
def archive(tmp_path_factory):
    """The bundle of HEAD for this Python and machine, with the default model."""
    if subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("scripts/bundle archives a git commit: this is not a git checkout")
    default_model()
    output = tmp_path_factory.mktemp("bundle") / "poot.tar"
    done = subprocess.run([ROOT / "scripts" / "bundle", "--python",
                           "{}.{}".format(*sys.version_info[:2]), "--arch", platform.machine(),
                           "--model", "default", "--output", output],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(output)
    return output


def unpack(archive, into):
    """The bundle's folder, unpacked into the folder `into` (a fresh one: a host's)."""
    subprocess.run(["tar", "-xf", archive, "-C", into], check=True)
    (folder,) = into.iterdir()
    return folder


@pytest.fixture(scope="module")
def installed(archive, tmp_path_factory):
    """The bundle unpacked into a fresh folder and installed there with no network."""
    folder = unpack(archive, tmp_path_factory.mktemp("host"))
    done = subprocess.run(offline.isolated(["./install", BASE_PYTHON]), cwd=folder,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return folder


@pytest.fixture(scope="module")
def expected():
    """What the checkout itself generates for PROMPT (greedy, so every run agrees)."""
    done = subprocess.run([sys.executable, "-m", "poot", *PROMPT], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_bundle_holds_the_commit_the_wheels_the_model_and_a_manifest_of_every_file(
        archive, tmp_path):
    folder = unpack(archive, tmp_path)
    files = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}
    listed = {line.split(maxsplit=1)[1] for line in
              (folder / "MANIFEST.sha256").read_text().splitlines()}
    assert listed == files - {"MANIFEST.sha256"}
    commit = subprocess.run(["git", "-C", ROOT, "ls-tree", "-r", "--name-only", "HEAD"],
                            capture_output=True, text=True, check=True).stdout.split()
    assert set(commit) <= files
    wheels = {name.split("-")[0] for name in os.listdir(folder / "wheels")}
    assert {"numpy", "cffi", "pycparser", "wgpu", "pip", "pytest"} <= wheels
    assert f"models/{DEFAULT_MODEL_FILE}" in files
    assert {"install", "serve", "test", "python", "BUNDLE"} <= files


def test_installed_with_no_network_it_generates_what_the_checkout_does(installed, expected):
    done = subprocess.run(offline.isolated(["./python", "-m", "poot", *PROMPT]), cwd=installed,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == expected
    assert "Paris" in expected["text"]


def test_installed_it_carries_wgpu_native(installed):
    """The venv's wgpu wheel is where poot finds wgpu-native (no wgpu wheel, no wgpu backend)."""
    done = subprocess.run(offline.isolated(["./python", "-m", "poot", "devices"]),
                          cwd=installed, capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if "wgpu-native " in line]
    assert lines and f"{installed}/venv/" in lines[0], done.stdout + done.stderr


def test_installed_with_no_network_it_serves(installed):
    """./serve without --backend: pick-backend's choice (reference on a CPU, auto on a GPU)."""
    port = 8080
    command = [sys.executable, ROOT / "tests" / "offline.py", port, "./serve", "--port", port]
    done = subprocess.run(offline.isolated(command), cwd=installed, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert "serve: --backend " in result["log"]
    assert result["health"][0] == 200, result["log"]
    status, body = result["completion"]
    assert status == 200 and body["choices"][0]["text"], body
    sockets, _ = offline.read_audit(result["audit"])
    assert sockets == [f"socket.bind ('127.0.0.1', {port})"]


def test_installed_with_no_network_its_tests_run(installed):
    done = subprocess.run(offline.isolated(["./test", "tests/test_sampling.py"]), cwd=installed,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert " passed" in done.stdout


def test_from_its_folder_it_runs_without_installing(archive, tmp_path, expected):
    """Where numpy and cffi import already (this test's Python), nothing needs installing."""
    folder = unpack(archive, tmp_path)
    done = subprocess.run(["./python", "-m", "poot", *PROMPT], cwd=folder, capture_output=True,
                          text=True, timeout=600, env=dict(os.environ, POOT_PYTHON=sys.executable))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == expected
    assert not (folder / "venv").exists()


def test_a_changed_byte_stops_the_install_and_names_the_file(archive, tmp_path):
    folder = unpack(archive, tmp_path)
    changed = folder / "poot" / "cli.py"
    data = bytearray(changed.read_bytes())
    data[100] ^= 0x01
    changed.write_bytes(data)
    done = subprocess.run(["./install", BASE_PYTHON], cwd=folder, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 1
    assert "poot/cli.py: FAILED" in done.stderr
    assert "nothing installed" in done.stderr
    assert not (folder / "venv").exists()
