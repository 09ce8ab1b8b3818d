"""scripts/serve, the README's first command: it sets up what is missing (scripts/setup, the wgpu
wheel included) and, without --backend, lets scripts/pick-backend choose auto where auto opens a
GPU and reference otherwise (a CPU behind Vulkan, such as lavapipe, included)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from poot.backends.select import open_device
from poot.errors import BackendUnavailable
from tests import offline
from tests.models import default_model
from tests.test_serve import free_port

ROOT = Path(__file__).resolve().parent.parent
PICK = [sys.executable, ROOT / "scripts" / "pick-backend"]
NO_LIBRARIES = {"POOT_CUDA_LIB": "/nonexistent", "POOT_HSA_LIB": "/nonexistent",
                "POOT_WGPU_LIB": "/nonexistent"}


def auto_device():
    """The device `--backend auto` opens here, or None."""
    try:
        return open_device("auto")
    except BackendUnavailable:
        return None


def pick(*args, env=None):
    done = subprocess.run([*PICK, *args], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, **(env or {})))
    assert done.returncode == 0, done.stderr
    return done.stdout.strip(), done.stderr.strip()


def test_a_backend_the_user_names_is_left_to_the_server():
    assert pick("--port", "9000", "--backend", "ptx") == ("", "")
    assert pick("--backend=reference") == ("", "")


def test_reference_where_auto_opens_no_device():
    chosen, why = pick(env=NO_LIBRARIES)
    assert chosen == "--backend reference"
    assert why.startswith("serve: --backend reference: --backend auto opens no device here")


def test_reference_on_a_cpu_behind_vulkan():
    device = auto_device()
    if device is None or device.backend != "wgpu" or not device.on_cpu:
        pytest.skip(f"auto's device here is no CPU behind Vulkan: {device and device.name}")
    chosen, why = pick()
    assert chosen == "--backend reference"
    assert device.name in why and "a CPU behind Vulkan" in why


def test_auto_on_a_gpu():
    device = auto_device()
    if device is None or (device.backend == "wgpu" and device.on_cpu):
        pytest.skip(f"auto opens no GPU here: {device and device.name}")
    assert pick() == ("--backend auto", f"serve: --backend auto: it opens {device.name}, a GPU")


def test_without_backend_it_says_which_and_serves_on_it():
    if sys.prefix == sys.base_prefix:
        pytest.skip("scripts/serve runs in a virtual environment (POOT_VENV): this is none")
    default_model()
    port = free_port()
    result = offline.serve_and_ask(port, [ROOT / "scripts" / "serve", "--port", port],
                                   env=dict(os.environ, POOT_VENV=sys.prefix))
    assert result["health"][0] == 200, result["log"]
    chosen = "auto" if "serve: --backend auto: " in result["log"] else "reference"
    assert f"serve: --backend {chosen}: " in result["log"]
    if chosen == "reference":
        assert result["health"][1]["backend"] == "reference"
    assert result["completion"][0] == 200 and result["status"] == 0, result["log"]


def test_from_a_fresh_clone_backend_auto_serves_on_wgpu_on_lavapipe(tmp_path):
    """The machine of the issue: no NVIDIA or AMD device, a CPU Vulkan device (lavapipe). The
    clone's scripts/setup makes a new .venv with the wgpu wheel, so auto reaches wgpu; lavapipe
    reports no memory budget, hence --memory-limit."""
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True,
                          text=True)
    if head.returncode:
        pytest.skip("a fresh clone needs a git checkout to clone")
    try:
        vulkan = open_device("vulkan")
    except BackendUnavailable as e:
        pytest.skip(f"no Vulkan device here: {e}")
    for backend in ("ptx", "rocm"):
        try:
            device = open_device(backend)
        except BackendUnavailable:
            continue
        pytest.skip(f"auto takes {device.name} here, before wgpu")
    default_model()         # the clone's scripts/fetch-model finds it in the same cache
    clone = tmp_path / "poot"
    subprocess.run(["git", "clone", "-q", "--no-checkout", ROOT, clone], check=True)
    subprocess.run(["git", "-C", clone, "checkout", "-q", head.stdout.strip()], check=True)
    env = {k: v for k, v in os.environ.items() if k != "POOT_VENV"}
    port = free_port()
    result = offline.serve_and_ask(port, [clone / "scripts" / "serve", "--backend", "auto",
                                          "--memory-limit", "4GiB", "--port", port], env=env)
    assert result["health"][0] == 200, result["log"]
    assert result["health"][1]["backend"] == "wgpu"
    assert result["health"][1]["devices"][0]["name"].split(" (wgpu:")[0] == \
        vulkan.name.split(" (vulkan:")[0]
    status, body = result["completion"]
    assert status == 200 and body["choices"][0]["text"], body
    assert result["status"] == 0, result["log"]
