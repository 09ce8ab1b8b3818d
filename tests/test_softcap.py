"""Gemma's kernel parts (kernels/softcap.py) on every device, against the numpy reference:
soft-capped logits, scaled embeddings, and each attention kernel with a sliding window and
soft-capped scores — one pass, its untiled share beside the tensor-core tiles, split along the
context and combined, and the tiles themselves (ptx only). Inputs fresh and random, outputs
poisoned, as in test_kernels.py, whose helpers these tests use.
"""
import numpy as np
import pytest

from poot.ir import reference as ref
from poot.kernels import ops, softcap
from poot.kernels.quant import DEVICE_DTYPES
from poot.engine.kernel_choice import PROMPT_TILES
from tests.test_kernels import (cuda_device, prompt_attention_case, prompt_tiles,  # noqa: F401
                                rel_err, run, weight)

rng = np.random.default_rng()

# (window, softcap): a window over block edges, a cap that bends scores of unit scale, both
MODS = [(24, 0.0), (0, 2.0), (24, 2.0)]


def test_softcap_logits(device):
    cap = 3.0
    x = (rng.standard_normal((3, 1000)) * 4).astype(np.float32)
    got = run(device, softcap.softcap(cap), (-(-x.size // ops.WG),), x, np.zeros_like(x),
              x.size)["out"]
    assert np.max(np.abs(got - ref.capped(x, cap))) < 2e-6 * cap


@pytest.mark.parametrize("dtype", ["F32", "F16", "Q4_0", "Q6_K"])
def test_scaled_embedding(device, dtype):
    vocab, cols, scale = 300, 256, float(np.sqrt(256.0) + 0.25)
    w_planes, dense = weight(dtype, vocab, cols)
    ids = rng.integers(0, vocab, 9).astype(np.int32)
    got = run(device, ops.embedding(dtype, scaled=True), (len(ids),), *w_planes, ids,
              np.zeros((len(ids), cols), np.float32), cols, scale)["out"]
    assert rel_err(got, ref.embedding(dense, ids, scale)) < 1e-6


def test_every_embedding_dtype_has_a_scaled_kernel():
    assert all(ops.embedding(d, scaled=True).name.endswith("_scaled") for d in DEVICE_DTYPES)


def step_case(head_dim, n_heads, n_kv, window, cap):
    """test_kernels.prompt_attention_case at a window and cap: (tiled, q, numpy's attention,
    the kernels' arguments after q and out, the step's token count left off)."""
    tiled, q, want, cache = prompt_attention_case(head_dim, n_heads, n_kv, window, cap)
    return tiled, q, want, cache[:-1]


def kwargs(window, cap):
    return {k: v for k, v in (("window", window), ("softcap", cap)) if v}


@pytest.mark.parametrize("window,cap", MODS)
@pytest.mark.parametrize("head_dim,n_heads,n_kv", [(64, 4, 2), (128, 2, 1)])
def test_attention_with_window_and_cap(device, window, cap, head_dim, n_heads, n_kv):
    _, q, want, cache = step_case(head_dim, n_heads, n_kv, window, cap)
    for shared in sorted({1, ops.attention_heads(n_heads, n_kv, head_dim, device.subgroup_size)}):
        kernel = ops.attention(device.subgroup_size, head_dim, shared, **kwargs(window, cap))
        got = run(device, kernel, (len(q) * n_heads // shared,), q, np.zeros_like(q),
                  *cache)["out"]
        assert rel_err(got, want) < 1e-5, kernel.name


@pytest.mark.parametrize("window,cap", MODS)
def test_untiled_attention_with_window_and_cap(device, window, cap):
    tiled, q, want, cache = step_case(64, 4, 2, window, cap)
    kernel = ops.attention(device.subgroup_size, 64, 2, untiled=True, **kwargs(window, cap))
    got = run(device, kernel, (len(q) * 4 // 2,), q, np.zeros_like(q), *cache, len(q))["out"]
    assert np.all(np.isnan(got[tiled]))
    assert rel_err(got[~tiled], want[~tiled]) < 1e-5


@pytest.mark.parametrize("window,cap", MODS)
@pytest.mark.parametrize("split_tokens,n_splits", [(16, 22), (40, 8)])
def test_split_attention_with_window_and_cap(device, window, cap, split_tokens, n_splits):
    """Splits wholly before a token's window write neutral partials; the combined result is
    the attention's."""
    _, q, want, cache = step_case(64, 4, 2, window, cap)
    T, D = q.shape[0], 64
    partials = run(device, ops.attention_split(device.subgroup_size, D, 2, **kwargs(window, cap)),
                   (T * 4 // 2, n_splits), q, np.zeros((T, 4, n_splits, D + 2), np.float32),
                   *cache, split_tokens)["partials"]
    got = run(device, ops.attention_combine(D), (T * 4,), partials, np.zeros_like(q),
              n_splits)["out"]
    assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("kind", PROMPT_TILES)
@pytest.mark.parametrize("window,cap", MODS)
@pytest.mark.parametrize("head_dim,n_heads,n_kv", [(64, 4, 2), (256, 8, 4)])
def test_attention_tiles_with_window_and_cap(cuda_device, kind, window, cap, head_dim, n_heads,
                                             n_kv):
    """On the tensor cores (attention_tiles and attention_flash): within the f16 rounding of
    q * scale and of the probabilities of numpy's attention; the tokens left to
    attention(untiled=True) unwritten."""
    tiled, q, want, cache = step_case(head_dim, n_heads, n_kv, window, cap)
    kernel, grid = prompt_tiles(kind, head_dim, n_heads, n_kv, len(q), **kwargs(window, cap))
    got = run(cuda_device, kernel, grid, q, np.zeros_like(q), *cache, len(q))["out"]
    assert np.all(np.isnan(got[~tiled]))
    assert rel_err(got[tiled], want[tiled]) < 2e-3


def test_kernel_names_say_their_window_and_cap():
    assert softcap.suffix() == ""
    assert softcap.suffix(4096, 50.0) == "_w4096_cap50"
    assert softcap.suffix(0, 30.5) == "_cap30p5"
    plain = ops.attention(32, 64, 1)
    assert ops.attention(32, 64, 1, window=8).name == plain.name + "_w8"
