"""Every kernel on every device poot can open here, against the numpy reference.

Fresh random inputs each run (never zeros), outputs poisoned with 0xFF bytes (NaN as f32) before
each launch, relative error bounds by what the kernel computes. Devices that cannot open here
skip with their reason; on a CUDA machine `python -m pytest tests/test_kernels.py` runs them all.
"""
import numpy as np
import pytest

from poot.errors import BackendUnavailable
from poot.formats.quants import dequantize, quantize
from poot.ir import reference as ref
from poot.kernels import matmul, ops
from poot.kernels.quant import DEVICE_DTYPES, planes, reader

rng = np.random.default_rng()


def open_device(backend):
    try:
        if backend == "ptx":
            from poot.backends.ptx import PtxDevice
            return PtxDevice(0)
        if backend == "rocm":
            from poot.backends.rocm import RocmDevice
            return RocmDevice(0)
        if backend == "vulkan":
            from poot.backends.vulkan import VulkanDevice
            return VulkanDevice(0)
        if backend == "wgpu":
            from poot.backends.wgpu import WgpuDevice
            return WgpuDevice(0)
    except BackendUnavailable as e:
        pytest.skip(str(e))
    pytest.skip(f"{backend}: no device backend of that name is built")


@pytest.fixture(scope="module", params=["ptx", "rocm", "vulkan", "wgpu"])
def device(request):
    return open_device(request.param)


def run(device, kernel, grid, *args):
    """Launches kernel with args (numpy arrays are uploaded, outputs poisoned first); returns
    the arrays of its "w"/"rw" buffer parameters after the launch, by name."""
    bufs, call, outs = [], [], {}
    for param, arg in zip(kernel.params, args, strict=True):
        if param.kind == "buffer":
            arr = np.ascontiguousarray(arg)
            buf = device.alloc(arr.nbytes)
            if param.access == "w":
                device.write(buf, np.full(arr.nbytes, 0xFF, np.uint8))
            else:
                device.write(buf, arr)
            if param.access in ("w", "rw"):
                outs[param.name] = (buf, arr)
            bufs.append(buf)
            call.append(buf)
        else:
            call.append(arg)
    device.launch(device.program(kernel), kernel, grid, call)
    device.synchronize()
    result = {name: np.frombuffer(device.read(buf), arr.dtype).reshape(arr.shape)
              for name, (buf, arr) in outs.items()}
    for buf in bufs:
        device.free(buf)
    return result


def rel_err(got, want):
    assert np.all(np.isfinite(got)), "unwritten (poisoned) or non-finite outputs"
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def weight(dtype, rows, cols):
    """Random weights in `dtype`: (device planes in kernel param order, dequantised values)."""
    values = rng.standard_normal((rows, cols)).astype(np.float32)
    raw = quantize(dtype, values).reshape(rows, -1)
    dense = dequantize(dtype, raw, (rows, cols))
    p = planes(dtype, raw, (rows, cols))
    return [p[name] for name in reader(dtype).plane_names], dense


@pytest.mark.parametrize("dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("n_tokens", [1, 3, 8, 11])
def test_matvec(device, dtype, n_tokens):
    rows, cols = 200, 512
    w_planes, dense = weight(dtype, rows, cols)
    x = rng.standard_normal((n_tokens, cols)).astype(np.float32)
    group = next((g for g in (1, 2, 4, 8) if g >= n_tokens), 8)
    k = matmul.matvec(dtype, device.subgroup_size, group)
    per_wg = matmul.WORKGROUP // device.subgroup_size
    got = run(device, k, (-(-rows // per_wg), -(-n_tokens // group)), *w_planes, x,
              np.zeros((n_tokens, rows), np.float32), rows, cols, n_tokens)["y"]
    assert rel_err(got, ref.matmul(x, dense)) < 1e-5


@pytest.mark.parametrize("dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("norm,outputs,n_tokens", [(True, 1, 1), (True, 3, 11), (False, 3, 5)])
def test_matvec_with_rms_norm_and_split_outputs(device, dtype, n_tokens, norm, outputs):
    """The norm folded into the product (as attn_norm into q, k, v), and stacked matrices
    (q, k, v concatenated) written to one buffer each."""
    sizes = (136, 40, 40)[:outputs] if outputs > 1 else (200,)
    rows, cols, eps = sum(sizes), 512, 1e-5
    w_planes, dense = weight(dtype, rows, cols)
    x = rng.standard_normal((n_tokens, cols)).astype(np.float32) * 3
    g = rng.standard_normal(cols).astype(np.float32)
    group = next((g_ for g_ in (1, 2, 4, 8) if g_ >= n_tokens), 8)
    k = matmul.matvec(dtype, device.subgroup_size, group, norm=norm, outputs=outputs)
    per_wg = matmul.WORKGROUP // device.subgroup_size
    ys = [np.zeros((n_tokens, n), np.float32) for n in sizes]
    splits = list(np.cumsum(sizes)[:-1])
    got = run(device, k, (-(-rows // per_wg), -(-n_tokens // group)), *w_planes, x,
              *([g] if norm else []), *ys, rows, cols, n_tokens, *splits,
              *([eps] if norm else []))
    want = ref.matmul(ref.rms_norm(x, g, eps) if norm else x, dense)
    names = ["y"] if outputs == 1 else [f"y{i}" for i in range(outputs)]
    for name, part in zip(names, np.split(want, splits, axis=1)):
        assert rel_err(got[name], part) < 1e-5, name


@pytest.mark.parametrize("dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("norm,n_tokens", [(True, 1), (False, 11)])
def test_matvec_swiglu(device, dtype, n_tokens, norm):
    """silu(gate . x) * (up . x) in one pass over x: the feed-forward's first half."""
    rows, cols, eps = 200, 512, 1e-6
    gate_planes, gate = weight(dtype, rows, cols)
    up_planes, up = weight(dtype, rows, cols)
    x = rng.standard_normal((n_tokens, cols)).astype(np.float32) * 3
    g = rng.standard_normal(cols).astype(np.float32)
    group = next((g_ for g_ in (1, 2, 4, 8) if g_ >= n_tokens), 8)
    k = matmul.matvec(dtype, device.subgroup_size, group, norm=norm, swiglu=True)
    per_wg = matmul.WORKGROUP // device.subgroup_size
    got = run(device, k, (-(-rows // per_wg), -(-n_tokens // group)), *gate_planes, *up_planes,
              x, *([g] if norm else []), np.zeros((n_tokens, rows), np.float32), rows, cols,
              n_tokens, *([eps] if norm else []))["y"]
    h = ref.rms_norm(x, g, eps) if norm else x
    assert rel_err(got, ref.swiglu(ref.matmul(h, gate), ref.matmul(h, up))) < 1e-5


@pytest.mark.parametrize("dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("n_tokens", [5, 64, 130])
def test_tiled_matmul(device, dtype, n_tokens):
    rows, cols = 200, 512
    w_planes, dense = weight(dtype, rows, cols)
    x = rng.standard_normal((n_tokens, cols)).astype(np.float32)
    r = rng.standard_normal((n_tokens, rows)).astype(np.float32)
    k = matmul.tiled(dtype, residual=True)
    got = run(device, k, (-(-rows // matmul.TILE), -(-n_tokens // matmul.TILE)), *w_planes, x,
              np.zeros((n_tokens, rows), np.float32), r, rows, cols, n_tokens)["y"]
    assert rel_err(got, ref.matmul(x, dense) + r) < 1e-5


@pytest.mark.parametrize("dtype", DEVICE_DTYPES)
def test_embedding(device, dtype):
    vocab, cols = 300, 256
    w_planes, dense = weight(dtype, vocab, cols)
    ids = rng.integers(0, vocab, 9).astype(np.int32)
    got = run(device, ops.embedding(dtype), (len(ids),), *w_planes, ids,
              np.zeros((len(ids), cols), np.float32), cols)["out"]
    assert np.array_equal(got, ref.embedding(dense, ids))


@pytest.mark.parametrize("n", [64, 576, 2048])
def test_rms_norm(device, n):
    x = rng.standard_normal((7, n)).astype(np.float32) * 3
    w = rng.standard_normal(n).astype(np.float32)
    got = run(device, ops.rms_norm(device.subgroup_size), (7,), x, w, np.zeros_like(x), n,
              1e-5)["out"]
    assert rel_err(got, ref.rms_norm(x, w, 1e-5)) < 1e-5


def test_add_and_bias(device):
    a = rng.standard_normal((5, 300)).astype(np.float32)
    for b in (rng.standard_normal((5, 300)).astype(np.float32),
              rng.standard_normal(300).astype(np.float32)):
        got = run(device, ops.elementwise("add"), (-(-a.size // ops.WG),), a, b,
                  np.zeros_like(a), a.size, b.size)["out"]
        assert np.array_equal(got, a + b)


def test_swiglu(device):
    g, u = (rng.standard_normal((5, 700)).astype(np.float32) * 4 for _ in range(2))
    got = run(device, ops.elementwise("swiglu"), (-(-g.size // ops.WG),), g, u,
              np.zeros_like(g), g.size, g.size)["out"]
    assert rel_err(got, ref.swiglu(g, u)) < 1e-5


def test_gather_rows(device):
    x = rng.standard_normal((12, 100)).astype(np.float32)
    index = np.array([11, 0, 5], np.int32)
    got = run(device, ops.gather_rows(), (3,), x, index, np.zeros((3, 100), np.float32),
              100)["out"]
    assert np.array_equal(got, x[index])


@pytest.mark.parametrize("style", ["normal", "neox"])
def test_rope(device, style):
    T, H, D, pairs = 6, 4, 64, 24                      # partial rotary: 48 of 64 dims
    x = rng.standard_normal((T, H, D)).astype(np.float32)
    positions = rng.integers(0, 100000, T).astype(np.int32)
    inv_freq = (1.0 / 10000 ** (np.arange(pairs) / pairs)).astype(np.float32)
    got = run(device, ops.rope(style), (-(-T * H * pairs // ops.WG),), x.copy(), positions,
              inv_freq, T, H, D, pairs)["x"]
    assert rel_err(got, ref.rope(x, positions, inv_freq, style)) < 1e-5


def paged_case(n_kv, head_dim, lengths, block_size=16, num_blocks=64):
    """Random K/V for sequences of `lengths` stored through the store_kv reference into a
    shuffled paged cache, plus one query token per sequence at its last position."""
    tables = np.zeros((len(lengths), -(-max(lengths) // block_size)), np.int32)
    free = list(rng.permutation(num_blocks))
    for s, n in enumerate(lengths):
        for b in range(-(-n // block_size)):
            tables[s, b] = free.pop()
    positions = np.concatenate([np.arange(n) for n in lengths]).astype(np.int32)
    seq_rows = np.concatenate([[s] * n for s, n in enumerate(lengths)]).astype(np.int32)
    k = rng.standard_normal((len(positions), n_kv, head_dim)).astype(np.float32)
    v = rng.standard_normal((len(positions), n_kv, head_dim)).astype(np.float32)
    return tables, positions, seq_rows, k, v


def test_store_kv(device):
    n_kv, D, bs, nb = 2, 64, 16, 64
    tables, positions, seq_rows, k, v = paged_case(n_kv, D, [37, 5, 16], bs, nb)
    words = n_kv * D // 2
    cache = np.zeros((nb, bs, n_kv, D // 2), np.uint32)
    out = run(device, ops.store_kv(), (-(-len(positions) * words // ops.WG),), k, v, cache,
              cache, positions, seq_rows, tables, len(positions), words, tables.shape[1], bs)
    want_k, want_v = (np.full((nb, bs, n_kv, D), np.nan, np.float32) for _ in range(2))
    ref.store_kv(k, v, want_k, want_v, positions, seq_rows, tables)
    for name, want in (("k_cache", want_k), ("v_cache", want_v)):
        got = out[name].view(np.float16).astype(np.float32)
        written = ~np.isnan(want)
        assert np.array_equal(got[written], want[written].astype(np.float16).astype(np.float32))


@pytest.mark.parametrize("style", ["normal", "neox"])
@pytest.mark.parametrize("pairs", [32, 24])                # full and partial rotary
def test_rope_store_kv(device, style, pairs):
    H, n_kv, D, bs, nb = 6, 2, 64, 16, 64
    tables, positions, seq_rows, k, v = paged_case(n_kv, D, [37, 5, 16], bs, nb)
    T = len(positions)
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    inv_freq = (1.0 / 10000 ** (np.arange(pairs) / pairs)).astype(np.float32)
    cache = np.zeros((nb, bs, n_kv, D // 2), np.uint32)
    out = run(device, ops.rope_store_kv(style), (-(-T * (H + n_kv) * D // 2 // ops.WG),),
              q.copy(), k, v, cache, cache, positions, seq_rows, tables, inv_freq, T, H, n_kv,
              D, pairs, tables.shape[1], bs)
    assert rel_err(out["q"], ref.rope(q, positions, inv_freq, style)) < 1e-5
    want_k, want_v = (np.full((nb, bs, n_kv, D), np.nan, np.float32) for _ in range(2))
    ref.store_kv(ref.rope(k, positions, inv_freq, style), v, want_k, want_v, positions,
                 seq_rows, tables)
    written = ~np.isnan(want_k)
    got_k = out["k_cache"].view(np.float16).astype(np.float32)
    got_v = out["v_cache"].view(np.float16).astype(np.float32)
    assert rel_err(got_k[written], want_k[written]) < 1e-3            # f16: 2^-11 per value
    assert np.array_equal(got_v[written], want_v[written].astype(np.float16).astype(np.float32))


@pytest.mark.parametrize("head_dim,n_heads,n_kv", [(64, 9, 3), (128, 8, 8)])
def test_attention(device, head_dim, n_heads, n_kv):
    bs, nb = 16, 128
    lengths = [1, 300, 57, 700]
    tables, positions, seq_rows, k, v = paged_case(n_kv, head_dim, lengths, bs, nb)
    k16, v16 = k.astype(np.float16), v.astype(np.float16)
    cache_k, cache_v = (np.zeros((nb, bs, n_kv, head_dim), np.float32) for _ in range(2))
    ref.store_kv(k16.astype(np.float32), v16.astype(np.float32), cache_k, cache_v, positions,
                 seq_rows, tables)
    # query every token of the second sequence and the last token of the others
    pick = np.concatenate([np.nonzero(seq_rows == 1)[0],
                           [np.nonzero(seq_rows == s)[0][-1] for s in (0, 2, 3)]])
    q = rng.standard_normal((len(pick), n_heads, head_dim)).astype(np.float32)
    qpos, qrows = positions[pick], seq_rows[pick]
    scale = head_dim ** -0.5
    want = ref.attention(q, cache_k, cache_v, qpos, qrows, tables, scale)
    got = run(device, ops.attention(device.subgroup_size, head_dim), (len(pick) * n_heads,), q,
              np.zeros_like(q), cache_k.astype(np.float16).view(np.uint32),
              cache_v.astype(np.float16).view(np.uint32), qpos, qrows, tables, n_heads, n_kv,
              tables.shape[1], bs, scale)["out"]
    assert rel_err(got, want) < 1e-5


def test_argmax(device):
    logits = rng.standard_normal((5, 49152)).astype(np.float32)
    logits[3, 100] = logits[3, 7000] = logits[3].max() + 1     # a tie: the lower index wins
    got = run(device, ops.argmax(device.subgroup_size), (5,), logits, np.zeros(5, np.int32),
              logits.shape[1])["token"]
    assert got.tolist() == [int(np.argmax(r)) for r in logits]
