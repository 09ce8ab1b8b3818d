"""scripts/bench end to end on whatever Vulkan device this machine has (lavapipe in CI): the
table it prints must have a row per backend, model and batch, with finite figures, and --host
its split of the step's time and --in-step each kernel's time wherever steps are recorded."""
import itertools
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
         "--cache", str(tmp_path), "--host", "--in-step"], capture_output=True, text=True,
        timeout=600)
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines()
            if line.split()[:1] and line.split()[0] in backends and "tiny:Q4_K" in line]
    assert sorted((r[0], r[3]) for r in rows) == sorted((b, n) for b in backends for n in "12")
    for row in rows:
        assert float(row[4].replace(",", "")) > 0 and float(row[5].replace(",", "")) > 0
    # --host: a backend that records its steps (vulkan) splits each batch's step time
    splits = [line for line in result.stdout.splitlines()
              if line.startswith("# tiny:Q4_K batch") and "replays back to back" in line]
    assert len(splits) == (2 if "vulkan" in backends else 0), result.stdout
    # --in-step: a line per kernel of each recorded step, their launches all the step's
    lines = result.stdout.splitlines()
    steps = [i for i, line in enumerate(lines) if " in the step: " in line]
    assert len(steps) == (2 if "vulkan" in backends else 0), result.stdout
    for i in steps:
        launches = int(lines[i].split(" in the step: ")[1].split()[0])
        kernels = list(itertools.takewhile(lambda k: k[0] == "#" and len(k) == 5,
                                           (line.split() for line in lines[i + 2:])))
        assert launches > 0 and sum(int(k[2]) for k in kernels) == launches, result.stdout


def test_pooled_random_models_draw_their_rows_from_the_pool(tmp_path):
    """write_random_llama(pool_rows=N), as scripts/bench writes its 1B and 8B models: each matrix
    holds at most N distinct rows, the file loads and the reference runs it to finite logits."""
    import numpy as np

    import poot
    from poot.engine.batch import SamplingRows, StepBatch
    from poot.models.random_weights import write_random_llama
    path = write_random_llama(tmp_path / "pooled.gguf", "tiny-k", dtype="Q4_0", pool_rows=16)
    model = poot.load(path)
    for name in ("blk.0.ffn_up.weight", "token_embd.weight", "output.weight"):
        raw = np.asarray(model.file.raw(name)).reshape(model.file.tensors[name].shape[0], -1)
        assert 1 < len(np.unique(raw, axis=0)) <= 16, name
    logits = model.runner(None, num_blocks=4).logits(StepBatch(
        np.array([5, 80, 9], np.int32), np.arange(3, dtype=np.int32), np.zeros(3, np.int32),
        np.array([[0, 1, 2, 3]], np.int32), np.array([2], np.int32), SamplingRows.greedy(1)))
    assert np.all(np.isfinite(logits)) and logits.std() > 0


def test_compare_reference_reports_agreement_per_model(tmp_path):
    """scripts/compare-reference on the Vulkan device: a line per model with its count of equal
    greedy tokens, status 0 when all agree."""
    try:
        open_device("vulkan")
    except BackendUnavailable as e:
        pytest.skip(str(e))
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "compare-reference"), "--backend", "vulkan",
         "--models", "tiny:Q4_0:6,tiny:F16:4", "--cache", str(tmp_path)],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("tiny:")]
    assert [line.split(":", 3)[-1].split(",")[0].strip() for line in lines] == \
        ["6/6 greedy tokens equal", "4/4 greedy tokens equal"], result.stdout


def test_bench_counts_the_active_weights_of_a_mixture_of_experts(tmp_path):
    """A random Qwen3-MoE-shaped model (as 30b-a3b is written, pooled rows, at a tiny size):
    its rows, and the active weight bytes a token, which leave out the experts not chosen."""
    try:
        open_device("vulkan")
    except BackendUnavailable as e:
        pytest.skip(str(e))
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench"), "--backend", "vulkan", "--models",
         "tiny-moe:Q4_0", "--batches", "1,4", "--steps", "2", "--prefill", "16", "--cache",
         str(tmp_path), "--mixed", "2:40:24", "--profile"], capture_output=True, text=True,
        timeout=600)
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines()
            if "tiny-moe:Q4_0" in line and not line.startswith("#")]
    assert [(r[2], r[3]) for r in rows] == [("Q4_0", "1"), ("Q4_0", "4")]
    active = [line for line in result.stderr.splitlines() if "active weights a token" in line]
    assert len(active) == 1 and "(2 of 6 experts)" in active[0], result.stderr
    words = active[0].split()
    active_bytes, total_bytes = (int(words[i - 1].replace(",", "")) for i, w in enumerate(words)
                                 if w == "bytes")
    assert 0 < active_bytes < total_bytes
    # --mixed 2:40:24: 2 decode rows, then 12 tokens ending a prompt, a whole one, 4 of the next:
    # of the 16-token tiles from the step's start only the second holds one sequence alone
    mixed = [line for line in result.stdout.splitlines() if "tiny-moe:Q4_0 mixed" in line]
    assert len(mixed) == 2, result.stdout
    assert "2 decoding at 16 tokens + 40 prompt tokens of 24-token prompts (16 of them" in \
        mixed[0]
    assert "launches" in mixed[1] and float(mixed[0].split()[-2]) > 0


def test_a_run_past_the_models_context_is_refused_before_it_starts(tmp_path):
    """tiny holds 512 tokens a sequence: the default 512-token prefill and its decode steps do
    not fit, which the bench says in words rather than failing inside a step."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench"), "--backend", "reference", "--models",
         "tiny:F16", "--batches", "1", "--steps", "2", "--cache", str(tmp_path)],
        capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "holds 512 tokens a sequence; the run needs 544" in result.stderr, result.stderr
