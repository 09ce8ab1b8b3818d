"""kernels/flash.py's prompt attention, and the kernel it stands in for (ops.attention_tiles),
run in lockstep by numpy (tests/lockstep.py) against numpy's attention: every prompt kernel of
kernel_choice.PROMPT_TILES on steps of several sequences, cached prefixes, many rounds of keys,
grouped heads, a window and a cap, with no GPU. Their runs on the GPU are test_kernels.py's and
test_softcap.py's (ptx).
"""
import numpy as np
import pytest

from poot.engine.kernel_choice import PROMPT_TILES
from poot.ir import reference as ref
from poot.kernels import flash, ops
from tests import lockstep
from tests.test_kernels import paged_case, prompt_attention_case, prompt_tiles, rel_err

rng = np.random.default_rng()


def attention_step(head_dim, n_heads, n_kv, new, window=0, cap=0.0):
    """A step of new tokens after cached ones, (cached, new) per sequence: (tiled, q, numpy's
    attention, the kernels' arguments after q and out)."""
    bs, lengths = 16, [start + n for start, n in new]
    num_blocks = sum(-(-n // bs) for n in lengths)
    tables, positions, seq_rows, k, v = paged_case(n_kv, head_dim, lengths, bs, num_blocks)
    cache_k, cache_v = (np.zeros((num_blocks, bs, n_kv, head_dim), np.float32) for _ in range(2))
    ref.store_kv(k.astype(np.float16).astype(np.float32), v.astype(np.float16).astype(np.float32),
                 cache_k, cache_v, positions, seq_rows, tables)
    qpos = np.concatenate([np.arange(start, start + n) for start, n in new]).astype(np.int32)
    qrows = np.concatenate([[s] * n for s, (_, n) in enumerate(new)]).astype(np.int32)
    q = rng.standard_normal((len(qpos), n_heads, head_dim)).astype(np.float32)
    scale = head_dim ** -0.5
    want = ref.attention(q, cache_k, cache_v, qpos, qrows, tables, scale, window, cap)
    cache = (cache_k.astype(np.float16).view(np.uint32), cache_v.astype(np.float16).view(np.uint32),
             qpos, qrows, tables, n_heads, n_kv, tables.shape[1], bs, scale, len(qpos))
    return np.array(ops.tiled_tokens(qrows)), q, want, cache


def check(kind, case, head_dim, n_heads, n_kv, **mods):
    """The prompt kernel `kind` writes the tiles' tokens within the f16 rounding of q and of
    the probabilities, the others unwritten (poisoned)."""
    tiled, q, want, cache = case
    kernel, grid = prompt_tiles(kind, head_dim, n_heads, n_kv, len(q), **mods)
    out = np.full(q.shape, np.nan, np.float32)
    lockstep.run(kernel, grid, q, out, *cache)
    assert np.all(np.isnan(out[~tiled])), kernel.name
    assert rel_err(out[tiled], want[tiled]) < 2e-3, kernel.name


@pytest.mark.parametrize("kind", PROMPT_TILES)
@pytest.mark.parametrize("head_dim,n_heads,n_kv,window,cap", [
    (128, 8, 2, 0, 0.0), (64, 9, 3, 0, 0.0), (64, 4, 4, 0, 0.0), (64, 4, 2, 24, 2.0),
    (256, 8, 4, 24, 2.0)])
def test_prompt_kernels_in_lockstep(kind, head_dim, n_heads, n_kv, window, cap):
    """test_kernels.prompt_attention_case: tiles of six sequences beside tokens left to the
    untiled kernel, a workgroup of attention_flash holding several of them."""
    mods = {key: v for key, v in (("window", window), ("softcap", cap)) if v}
    check(kind, prompt_attention_case(head_dim, n_heads, n_kv, window, cap), head_dim, n_heads,
          n_kv, **mods)


@pytest.mark.parametrize("kind", PROMPT_TILES)
@pytest.mark.parametrize("head_dim,n_heads,n_kv,new,window,cap", [
    (128, 8, 2, [(70, 120), (0, 5), (30, 40)], 0, 0.0),     # rounds wholly below the diagonal
    (128, 4, 4, [(0, 260)], 100, 0.0),                      # a window many rounds behind
    (64, 4, 1, [(70, 150), (0, 40)], 0, 5.0),
])
def test_long_prompts_in_lockstep(kind, head_dim, n_heads, n_kv, new, window, cap):
    mods = {key: v for key, v in (("window", window), ("softcap", cap)) if v}
    check(kind, attention_step(head_dim, n_heads, n_kv, new, window, cap), head_dim, n_heads,
          n_kv, **mods)


def test_flash_workgroups_take_128_rows_longest_first():
    """Eight subgroups of 16 tokens of one head: 2 blocks of 4 heads, 8 of 1; the grid's
    first workgroup takes the step's last tile, and the head groups go first along it."""
    assert [flash.flash_blocks(h) for h in (1, 2, 4, 8)] == [8, 4, 2, 1]
    assert flash.flash_grid(2048, 32, 4) == (8, 64)
    assert flash.attention_flash(128, 4).workgroup == (256, 1, 1)
    assert flash.attention_flash(128, 4, warps=4).workgroup == (128, 1, 1)
    tiled, q, want, cache = attention_step(64, 2, 1, [(0, 40)])
    kernel = flash.attention_flash(64, 2, warps=2)          # one 16-token block a workgroup
    out = np.full(q.shape, np.nan, np.float32)
    lockstep.run(kernel, flash.flash_grid(40, 2, 2, warps=2), q, out, *cache,
                 only={(0, 0, 0)})
    assert np.all(np.isnan(out[:32])) and rel_err(out[32:], want[32:]) < 2e-3


@pytest.mark.parametrize("head_dim,n_heads,n_kv,lengths", [
    (128, 8, 2, [1, 17, 64, 65, 200]),          # rounds whole, cut, one key
    (64, 12, 3, [130, 5]),
    (128, 32, 2, [40]),                         # sixteen heads a tile
    (256, 8, 4, [100, 3]),
])
def test_decode_on_the_tensor_cores_in_lockstep(head_dim, n_heads, n_kv, lengths):
    """flash.attention_decode: one token of each sequence after the others, every workgroup's
    heads as the rows of a tile, within the f16 rounding of q and the probabilities."""
    tiled, q, want, cache = attention_step(head_dim, n_heads, n_kv, [(n - 1, 1) for n in lengths])
    heads = n_heads // n_kv
    kernel = flash.attention_decode(head_dim, heads)
    out = np.full(q.shape, np.nan, np.float32)
    lockstep.run(kernel, (len(q) * n_heads // heads,), q, out, *cache[:-1])
    assert rel_err(out, want) < 2e-3, kernel.name


def test_decode_on_the_tensor_cores_leaves_the_tiles_in_lockstep():
    """attention_decode(untiled=True) beside the prompt tiles: the tokens the tiles take are
    left unwritten (poisoned), the others within the f16 rounding."""
    tiled, q, want, cache = prompt_attention_case(128, 8, 2)
    kernel = flash.attention_decode(128, 4, untiled=True)
    out = np.full(q.shape, np.nan, np.float32)
    lockstep.run(kernel, (len(q) * 2,), q, out, *cache)
    assert np.all(np.isnan(out[tiled])) and rel_err(out[~tiled], want[~tiled]) < 2e-3
