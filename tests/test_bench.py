"""scripts/bench end to end on whatever Vulkan device this machine has (lavapipe in CI): the
table it prints must have a row per backend, model and batch, with finite figures."""
import subprocess
import sys
from pathlib import Path

import pytest

from poot.backends.select import open_device
from poot.errors import BackendUnavailable

ROOT = Path(__file__).resolve().parent.parent


def test_bench_prints_a_row_per_backend_and_batch(tmp_path):
    backends = []
    for name in ("vulkan", "wgpu"):
        try:
            open_device(name)
            backends.append(name)
        except BackendUnavailable:
            pass
    if not backends:
        pytest.skip("no Vulkan or wgpu device opens here")
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench"), "--backend", ",".join(backends),
         "--models", "tiny:Q4_K", "--batches", "1,2", "--steps", "2", "--prefill", "16",
         "--cache", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines()
            if line.split()[:1] and line.split()[0] in backends and "tiny:Q4_K" in line]
    assert sorted((r[0], r[3]) for r in rows) == sorted((b, n) for b in backends for n in "12")
    for row in rows:
        assert float(row[4].replace(",", "")) > 0 and float(row[5].replace(",", "")) > 0
