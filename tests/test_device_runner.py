"""The device runner against the reference runner: same step graph, same batches, on every
device backend that opens here (skips with the reason elsewhere)."""
import numpy as np
import pytest

import poot
from poot.backends.select import open_device
from poot.engine.batch import SamplingRows, StepBatch
from poot.errors import BackendUnavailable
from poot.kernels.quant import DEVICE_DTYPES
from tests.models import default_model, tiny_model


@pytest.fixture(scope="module", params=["ptx", "rocm", "vulkan", "wgpu"])
def device(request):
    try:
        return open_device(request.param)
    except BackendUnavailable as e:
        pytest.skip(str(e))


def step(tokens, start, row_tables):
    """One sequence's tokens from position `start`, every token's logits sampled."""
    n = len(tokens)
    return StepBatch(np.array(tokens, np.int32), np.arange(start, start + n, dtype=np.int32),
                     np.zeros(n, np.int32), np.array([row_tables], np.int32),
                     np.arange(n, dtype=np.int32), SamplingRows.greedy(n))


def greedy(runner, prompt, n, table):
    ids, logits = list(prompt), []
    out = runner.logits(step(ids, 0, table))[-1:]
    for _ in range(n):
        logits.append(out[0])
        ids.append(int(np.argmax(out[0])))
        out = runner.logits(step(ids[-1:], len(ids) - 1, table))
    return ids[len(prompt):], np.array(logits)


@pytest.mark.parametrize("dtype", DEVICE_DTYPES)
def test_tiny_model_matches_reference(tmp_path, device, dtype):
    model = poot.load(tiny_model(tmp_path, dtype=dtype))
    table = list(np.random.default_rng().permutation(32))
    want_ids, want = greedy(model.runner(None, num_blocks=32), [5, 80, 9, 41], 24, table)
    got_ids, got = greedy(model.runner(device, num_blocks=32), [5, 80, 9, 41], 24, table)
    assert got_ids == want_ids
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-3   # f16 KV cache


def test_default_model_greedy_tokens_match_reference(device):
    model = poot.load(default_model())
    prompt = model.tokenizer.encode("The capital of France is")
    table = list(range(64))
    want_ids, want = greedy(model.runner(None, num_blocks=64), prompt, 32, table)
    got_ids, got = greedy(model.runner(device, num_blocks=64), prompt, 32, table)
    assert got_ids == want_ids
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 5e-3


def test_batched_decode_replays_equal_single_steps(tmp_path, device):
    """Several sequences decoding together (a captured bucket, padded) give each one's logits."""
    model = poot.load(tiny_model(tmp_path, dtype="F16"))
    runner = model.runner(device, num_blocks=64)
    rng = np.random.default_rng()
    prompts = [rng.integers(3, 300, n).tolist() for n in (5, 9, 3)]
    tables = [list(range(i * 16, i * 16 + 16)) for i in range(3)]
    for p, t in zip(prompts, tables):
        runner.logits(step(p, 0, t))
    width = 16
    batch = StepBatch(np.array([p[-1] for p in prompts], np.int32),
                      np.array([len(p) for p in prompts], np.int32), np.arange(3, dtype=np.int32),
                      np.array(tables, np.int32)[:, :width], np.arange(3, dtype=np.int32),
                      SamplingRows.greedy(3))
    together = runner.logits(batch)
    reference = model.runner(None, num_blocks=64)
    for p, t in zip(prompts, tables):
        reference.logits(step(p, 0, t))
    want = reference.logits(batch)
    assert np.linalg.norm(together - want) / np.linalg.norm(want) < 2e-3


@pytest.mark.parametrize("dtype", ["F16", "Q4_K"])
def test_long_prefill_matches_reference(tmp_path, device, dtype):
    """A 70-token step: the matrix kernels run over groups of tokens."""
    model = poot.load(tiny_model(tmp_path, dtype=dtype))
    prompt = np.random.default_rng().integers(3, 300, 70).tolist()
    table = list(range(16))
    batch = StepBatch(np.array(prompt, np.int32), np.arange(70, dtype=np.int32),
                      np.zeros(70, np.int32), np.array([table], np.int32),
                      np.arange(62, 70, dtype=np.int32), SamplingRows.greedy(8))
    want = model.runner(None, num_blocks=16).logits(batch)
    got = model.runner(device, num_blocks=16, max_tokens=128).logits(batch)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-3


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_variants_match_reference(tmp_path, device, arch):
    """q/k/v biases (qwen2) and q/k norms (qwen3) around the fused q/k/v matmul and rope."""
    model = poot.load(tiny_model(tmp_path, dtype="F16", arch=arch))
    table = list(np.random.default_rng().permutation(32))
    want_ids, want = greedy(model.runner(None, num_blocks=32), [5, 80, 9, 41], 12, table)
    got_ids, got = greedy(model.runner(device, num_blocks=32), [5, 80, 9, 41], 12, table)
    assert got_ids == want_ids
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-3


def test_a_llama_layer_is_six_launches(tmp_path, device):
    """attn_norm folded into one q/k/v matmul, rope with store_kv, attention, the output
    projection with its residual, ffn_norm folded into gate/up with SwiGLU, down with its
    residual; the stacked q/k/v weight replaces the three."""
    model = poot.load(tiny_model(tmp_path, dtype="Q8_0"))
    runner = model.runner(device, num_blocks=32)
    launches = [s.kind for s in runner.steps if s.kind != "reshape"]
    layer = ["matmul", "rope_store_kv", "attention", "matmul", "matmul", "matmul"]
    assert launches == ["embedding", *layer * model.config.n_layers, "gather", "matmul"]
    weights = [a.name for a in runner.allocations() if a.kind == "weights"]
    assert "blk.0.attn_q.weight+blk.0.attn_k.weight+blk.0.attn_v.weight:quants" in weights
    assert not any(name.startswith("blk.0.attn_k.weight:") for name in weights)


def test_mixed_dtypes_fuse_what_shares_a_dtype(tmp_path, device):
    """A Q4_K_M-like mix: q and k stack (v in Q6_K stays apart, its own matmul with the norm
    folded in); gate and up differ, so each is a matmul and SwiGLU its own kernel."""
    mixed = (("attn_v", "Q6_K"), ("ffn_up", "Q8_0"))
    model = poot.load(tiny_model(tmp_path, dtype="Q4_K", mixed=mixed))
    runner = model.runner(device, num_blocks=32)
    layer = ["matmul", "matmul", "rope_store_kv", "attention", "matmul", "matmul", "matmul",
             "swiglu", "matmul"]
    assert [s.kind for s in runner.steps if s.kind != "reshape"] == \
        ["embedding", *layer * model.config.n_layers, "gather", "matmul"]
    assert [len(s.outputs) for s in runner.steps if s.kind == "matmul"][:2] == [2, 1]
    table = list(np.random.default_rng().permutation(32))
    want_ids, want = greedy(model.runner(None, num_blocks=32), [5, 80, 9, 41], 12, table)
    got_ids, got = greedy(runner, [5, 80, 9, 41], 12, table)
    assert got_ids == want_ids
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-3
