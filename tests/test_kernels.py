"""Every kernel on every device poot can open here, against the numpy reference.

Fresh random inputs each run (never zeros), outputs poisoned with 0xFF bytes (NaN as f32) before
each launch, relative error bounds by what the kernel computes. Devices that cannot open here
skip with their reason; on a CUDA machine `python -m pytest tests/test_kernels.py` runs them all.
"""
import numpy as np
import pytest

from poot.engine.batch import LogitEdits, SamplingRows
from poot.engine.kernel_choice import FEW_TOKEN_ROUNDS, PROMPT_TILES
from poot.engine import sampling
from poot.engine.sampling import BANNED, edit_logits
from poot.formats.quants import QUANTS, dequantize, quantize
from poot.ir import reference as ref
from poot.kernels import choice, matmul, matvec, mma_vec, ops
from poot.kernels.quant import DEVICE_DTYPES, planes, reader
from tests import lockstep
from tests.conftest import open_or_skip

rng = np.random.default_rng()


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


def run_matvec(device, dtype, rows, n_tokens, args, **variant):
    """A matvec launch over rows x n_tokens, in the smallest token group that holds them (more
    tokens: further launches along grid y), as the runner launches it."""
    group = next((g for g in (1, 2, 4, 8) if g >= n_tokens), 8)
    k = matvec.matvec(dtype, device.subgroup_size, group, **variant)
    grid = matvec.matvec_grid(rows, n_tokens, device.subgroup_size, group,
                              variant.get("rows_per", 1), variant.get("split", 1))
    return run(device, k, grid, *args)


@pytest.mark.parametrize("dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("n_tokens,rows_per,split", [(1, 1, 1), (1, 3, 1), (3, 1, 1), (8, 2, 1),
                                                     (11, 1, 1), (1, 2, 4), (3, 1, 2)])
def test_matvec(device, dtype, n_tokens, rows_per, split):
    """rows_per 3: 200 rows leave the last subgroup part of its rows; split: subgroups share
    a row's columns."""
    if split > matvec.WORKGROUP // device.subgroup_size:
        pytest.skip(f"a workgroup of {device.subgroup_size}-lane subgroups has fewer than "
                    f"{split}")
    rows, cols = 200, 512
    w_planes, dense = weight(dtype, rows, cols)
    x = rng.standard_normal((n_tokens, cols)).astype(np.float32)
    got = run_matvec(device, dtype, rows, n_tokens, (*w_planes, x,
                     np.zeros((n_tokens, rows), np.float32), rows, cols, n_tokens),
                     rows_per=rows_per, split=split)["y"]
    assert rel_err(got, ref.matmul(x, dense)) < 1e-5


@pytest.mark.parametrize("dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("norm,outputs,n_tokens,rows_per,split", [
    (True, 1, 1, 1, 1), (True, 3, 11, 1, 1), (False, 3, 5, 1, 1), (True, 3, 1, 3, 2)])
def test_matvec_with_rms_norm_and_split_outputs(device, dtype, n_tokens, norm, outputs,
                                                rows_per, split):
    """The norm folded into the product (as attn_norm into q, k, v), and stacked matrices
    (q, k, v concatenated) written to one buffer each; rows_per 3 puts a split inside a
    subgroup's rows."""
    sizes = (136, 40, 40)[:outputs] if outputs > 1 else (200,)
    rows, cols, eps = sum(sizes), 512, 1e-5
    w_planes, dense = weight(dtype, rows, cols)
    x = rng.standard_normal((n_tokens, cols)).astype(np.float32) * 3
    g = rng.standard_normal(cols).astype(np.float32)
    ys = [np.zeros((n_tokens, n), np.float32) for n in sizes]
    splits = list(np.cumsum(sizes)[:-1])
    got = run_matvec(device, dtype, rows, n_tokens,
                     (*w_planes, x, *([g] if norm else []), *ys, rows, cols, n_tokens, *splits,
                      *([eps] if norm else [])),
                     norm=norm, outputs=outputs, rows_per=rows_per, split=split)
    want = ref.matmul(ref.rms_norm(x, g, eps) if norm else x, dense)
    names = ["y"] if outputs == 1 else [f"y{i}" for i in range(outputs)]
    for name, part in zip(names, np.split(want, splits, axis=1)):
        assert rel_err(got[name], part) < 1e-5, name


@pytest.mark.parametrize("dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("norm,n_tokens,rows_per,split,activation", [
    (True, 1, 1, 1, "silu"), (False, 11, 1, 1, "silu"), (True, 1, 2, 2, "silu"),
    (True, 3, 1, 1, "gelu_tanh")])
def test_matvec_glu(device, dtype, n_tokens, norm, rows_per, split, activation):
    """activation(gate . x) * (up . x) in one pass over x: the feed-forward's first half."""
    rows, cols, eps = 200, 512, 1e-6
    gate_planes, gate = weight(dtype, rows, cols)
    up_planes, up = weight(dtype, rows, cols)
    x = rng.standard_normal((n_tokens, cols)).astype(np.float32) * 3
    g = rng.standard_normal(cols).astype(np.float32)
    got = run_matvec(device, dtype, rows, n_tokens,
                     (*gate_planes, *up_planes, x, *([g] if norm else []),
                      np.zeros((n_tokens, rows), np.float32), rows, cols, n_tokens,
                      *([eps] if norm else [])),
                     norm=norm, glu=activation, rows_per=rows_per, split=split)["y"]
    h = ref.rms_norm(x, g, eps) if norm else x
    assert rel_err(got, ref.glu(ref.matmul(h, gate), ref.matmul(h, up), activation)) < 1e-5


# -- mma_tiled: the tensor-core matmul (PTX devices only) -----------------------------------------
def emulated_fragment_load(slots, index_of_lane):
    """lang.fragment_load as documented, on shared memory given as its 16-bit slots: word j of
    lane l is elements 2(l % 4), +1 of the row that lane 8j + l // 4 names."""
    return [[(slots[2 * index_of_lane[8 * j + l // 4] + 2 * (l % 4)],
              slots[2 * index_of_lane[8 * j + l // 4] + 2 * (l % 4) + 1]) for j in range(4)]
            for l in range(32)]


@pytest.mark.parametrize("depth", matmul.MMA_DEPTHS)
def test_mma_fragment_indices_give_the_documented_operands(depth):
    """The words mma_tiled names to fragment_load hold, lane by lane, the elements lang.mma
    documents for `a` (x tile) and `b` (W tile), and the 8 rows of each matrix start in 8
    different groups of 4 banks."""
    rw = depth // 2 + 4
    assert depth != matmul.MMA_DEPTH or rw == matmul.ROW_WORDS
    tile = lambda r, c: r * 1000 + c                                   # noqa: E731 (a label)
    slots = np.full(2 * 128 * rw, -1)
    for r in range(128):
        slots[2 * r * rw:2 * r * rw + depth] = [tile(r, c) for c in range(depth)]
    for step in range(depth // 16):
        for first in range(0, 128, 16):
            index = [matmul.a_fragment_index(lane, first, step, rw) for lane in range(32)]
            words = emulated_fragment_load(slots, index)
            for lane in range(32):
                g, q = lane // 4, lane % 4
                for j in range(4):
                    r, c = first + g + 8 * (j % 2), 16 * step + 2 * q + 8 * (j // 2)
                    assert words[lane][j] == (tile(r, c), tile(r, c + 1))
            index = [matmul.b_fragment_index(lane, first, step, rw) for lane in range(32)]
            words = emulated_fragment_load(slots, index)
            for lane in range(32):
                g, q = lane // 4, lane % 4
                for n_tile in range(2):
                    for j in range(2):
                        row, c = first + 8 * n_tile + g, 16 * step + 2 * q + 8 * j
                        assert words[lane][2 * n_tile + j] == (tile(row, c), tile(row, c + 1))
            for matrix in range(4):
                rows = index[8 * matrix:8 * matrix + 8]
                assert len({(i % 32) // 4 for i in rows}) == 8
    cover = {matmul.accumulator_position(lane, j) for lane in range(32) for j in range(4)}
    assert cover == {(t, m) for t in range(16) for m in range(8)}


@pytest.fixture(scope="module")
def cuda_device():
    return open_or_skip("ptx")


# (tokens, rows, cols): token and row counts that are not whole tiles; column counts that are
# not whole 64-column steps for the formats whose blocks allow them.
MMA_SHAPES = [(1, 96, 256), (17, 1000, 512), (64, 96, 4096), (130, 1000, 1024),
              (512, 4096, 4096), (512, 1000, 4096 + 256)]
MMA_SHAPES_FLOAT = [(130, 200, 72), (17, 96, 64)]
MMA_SHAPES_BLOCK32 = [(130, 200, 96)]


def mma_shapes(dtype):
    if dtype in ("F32", "F16", "BF16"):
        return MMA_SHAPES + MMA_SHAPES_FLOAT
    return MMA_SHAPES + (MMA_SHAPES_BLOCK32 if QUANTS[dtype].block_elems == 32 else [])


def check_mma(got, x, dense, r, dtype, where):
    """Operands rounded to f16 (bf16 for BF16 weights) with unit roundoff u, f32 sums (in any
    order): each element within (2u + cols 2^-23) |x_t| |w_m| of the exact product
    (Cauchy-Schwarz), and the whole within a few u/sqrt(3) (the rms of rounding) in relative
    Frobenius norm. r: the residual added, or None."""
    u = 2.0 ** (-8 if dtype == "BF16" else -11)
    rounded = 1 if dtype in ("F16", "BF16") else 2           # x, and W unless already 16-bit
    got = got.astype(np.float64)
    assert np.all(np.isfinite(got)), f"{where}: unwritten outputs"
    product = x.astype(np.float64) @ dense.astype(np.float64).T
    error = np.abs(got - (product if r is None else product + r))
    bound = (rounded * u + x.shape[1] * 2.0 ** -23) * np.outer(np.linalg.norm(x, axis=1),
                                                               np.linalg.norm(dense, axis=1))
    worst = np.unravel_index(np.argmax(error / bound), error.shape)
    assert np.all(error <= bound), f"{where}: worst at {worst}, error {error[worst]}"
    relative = np.linalg.norm(error) / np.linalg.norm(product)
    assert relative < 3 * rounded * u / np.sqrt(3), f"{where}: relative error {relative}"


def mma_variants(dtype):
    """The mma_tiled pipelines (matmul.MMA_VARIANTS) that take `dtype`: the staged ones copy
    F16 and BF16 words as they are."""
    return [name for name, variant in matmul.MMA_VARIANTS.items()
            if dtype in ("F16", "BF16") or not variant.get("stages")]


MMA_DTYPE_VARIANTS = [(d, v) for d in DEVICE_DTYPES for v in mma_variants(d)]


def mma_x(device, dtype, variant, x):
    """What mma_tiled of `variant` reads as x: x itself, or for x16 x rounded to the operand by
    mma_x16 on the device (checked against numpy's rounding)."""
    if not variant.get("x16"):
        return x
    words = run(device, matmul.mma_x16(dtype), (-(-x.size // 4 // matmul.WORKGROUP),), x,
                np.zeros(x.size // 2, np.uint32), x.size)["x16"]
    if dtype == "BF16":
        bits = x.view(np.uint32).astype(np.uint64)
        want = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    else:
        want = x.astype(np.float16).view(np.uint16)
    assert np.array_equal(words.view(np.uint16), want.reshape(-1))
    return words


@pytest.mark.parametrize("dtype", [d for d in DEVICE_DTYPES if d not in ("F16", "BF16")])
def test_dequant_f16(cuda_device, dtype):
    """W decoded to f16 pairs (what long steps on wgmma multiply as F16 weights): each value
    the format's dequantized value rounded to f16, as mma_tiled's own decoding rounds it."""
    rows, cols = 37, split_cols_of(dtype)
    w_planes, dense = weight(dtype, rows, cols)
    units = rows * cols // reader(dtype).block_elems
    got = run(cuda_device, matmul.dequant_f16(dtype), (-(-units // matmul.WORKGROUP),),
              *w_planes, np.zeros(rows * cols // 2, np.uint32), rows, cols)["out"]
    got = got.view(np.float16).reshape(rows, cols)
    # within f16's rounding of the value (the kernel's fma against numpy's product and sum can
    # sit either side of a rounding midpoint), and equal to numpy's rounding nearly everywhere
    assert np.all(np.abs(got.astype(np.float32) - dense) <= np.abs(dense) * 2.0 ** -11 + 2.0 ** -25)
    assert np.mean(got == dense.astype(np.float16)) > 0.999


@pytest.mark.parametrize("dtype", ["F16", "BF16", "Q4_0"])
def test_mma_x16(cuda_device, dtype):
    """x rounded once to the mma operand, two values a word, for mma_tiled's x16 pipelines."""
    x = rng.standard_normal(4 * 1000).astype(np.float32) * 100
    mma_x(cuda_device, dtype, {"x16": True}, x)


@pytest.mark.parametrize("dtype,variant", MMA_DTYPE_VARIANTS)
def test_mma_tiled_matmul(cuda_device, dtype, variant):
    """Each shape in the token tile the runner would pick for it, unsplit."""
    keywords = matmul.MMA_VARIANTS[variant]
    for case, (n_tokens, rows, cols) in enumerate(mma_shapes(dtype)):
        residual = case % 2 == 1
        w_planes, dense = weight(dtype, rows, cols)
        x = rng.standard_normal((n_tokens, cols)).astype(np.float32)
        r = rng.standard_normal((n_tokens, rows)).astype(np.float32)
        tokens = matmul.mma_launch(rows, cols, n_tokens, 1).tokens
        k = matmul.mma_tiled(dtype, residual=residual, tokens=tokens, **keywords)
        grid = matmul.MmaLaunch(tokens, 1, cols).grid(rows, n_tokens)
        args = [*w_planes, mma_x(cuda_device, dtype, keywords, x),
                np.zeros((n_tokens, rows), np.float32), *([r] if residual else []),
                rows, cols, n_tokens]
        got = run(cuda_device, k, grid, *args)["y"]
        where = f"{k.name} T={n_tokens} rows={rows} cols={cols}"
        check_mma(got, x, dense, r if residual else None, dtype, where)


def split_cols_of(dtype):
    """Column counts for split cases: one that ends mid-step where the format's blocks allow."""
    return {1: 1032, 32: 1056}.get(QUANTS[dtype].block_elems, 1280)


def split_mma(device, dtype, launch, w_planes, x, r, rows, cols, variant=None):
    """y of a split launch: mma_tiled's partials, then split_sum (adding r unless None)."""
    n_tokens = len(x)
    keywords = variant or {}
    tile = matmul.mma_tiled(dtype, tokens=launch.tokens, split=True, **keywords)
    partials = run(device, tile, launch.grid(rows, n_tokens), *w_planes,
                   mma_x(device, dtype, keywords, x),
                   np.zeros((launch.splits, n_tokens, rows), np.float32), rows, cols, n_tokens,
                   launch.split_cols)["partials"]
    add = matmul.split_sum(r is not None)
    return run(device, add, (-(-n_tokens * rows // matmul.WORKGROUP),), partials,
               np.zeros((n_tokens, rows), np.float32), *([] if r is None else [r]),
               n_tokens * rows, launch.splits)["y"]


@pytest.mark.parametrize("dtype,variant", MMA_DTYPE_VARIANTS)
@pytest.mark.parametrize("n_tokens", [16, 33, 64, 100])
def test_split_mma_tiled_matmul(cuda_device, dtype, variant, n_tokens):
    """Split along the columns: slices of one step, of several, one whose last slice is short
    or ends mid-step, and the runner's own choice for an H200 (by default and in one wave);
    residual on and off. A second run of the same inputs gives the same bits (the slices add in
    a fixed order)."""
    keywords = matmul.MMA_VARIANTS[variant]
    depth = keywords.get("depth", matmul.MMA_DEPTH)
    rows, cols = 200, split_cols_of(dtype)
    w_planes, dense = weight(dtype, rows, cols)
    x = rng.standard_normal((n_tokens, cols)).astype(np.float32)
    r = rng.standard_normal((n_tokens, rows)).astype(np.float32)
    tokens = matmul.mma_launch(rows, cols, n_tokens, 1).tokens
    chosen = matmul.mma_launch(rows, cols, n_tokens, 132, depth)
    assert chosen.splits > 1
    launches = [matmul.MmaLaunch(tokens, -(-cols // step), step)
                for step in (depth, 2 * depth, 5 * depth)]
    launches += [chosen, matmul.mma_launch(rows, cols, n_tokens, 132, depth, one_wave=True)]
    for case, launch in enumerate(launches):
        residual = r if case % 2 == 0 else None
        got = split_mma(cuda_device, dtype, launch, w_planes, x, residual, rows, cols, keywords)
        check_mma(got, x, dense, residual, dtype, f"{dtype} {variant} T={n_tokens} {launch}")
    runs = [split_mma(cuda_device, dtype, chosen, w_planes, x, None, rows, cols, keywords)
            for _ in range(2)]
    assert np.array_equal(*runs)


def silu_times(gate, up):
    return gate / (1.0 + np.exp(-gate)) * up


@pytest.mark.parametrize("dtype", ["F16", "BF16", "Q4_0", "Q6_K"])
@pytest.mark.parametrize("n_tokens,split", [(5, False), (33, True), (64, True), (130, False),
                                            (300, False)])
def test_mma_tiled_stacked_outputs(cuda_device, dtype, n_tokens, split):
    """q, k and v stacked row-wise (parts of 512, 128 and 128 rows: not whole tiles after the
    first), each part's rows into its own output: stored by mma_tiled's epilogue (outputs=3)
    or, split, by split_sum's; with the runner's pipeline for the format (device_runner's
    mma_choice, the device's: wgmma on the H200), x read as x16 beforehand where it is."""
    from poot.engine.kernel_choice import mma_choice
    parts, cols = (512, 128, 128), 1024
    rows = sum(parts)
    w_planes, dense = weight(dtype, rows, cols)
    x = rng.standard_normal((n_tokens, cols)).astype(np.float32)
    starts = list(np.cumsum(parts)[:-1])
    ys = [np.zeros((n_tokens, p), np.float32) for p in parts]
    launch = matmul.mma_launch(rows, cols, n_tokens, 132 if split else 1,
                               **mma_choice(dtype, cuda_device.caps)[1])
    assert (launch.splits > 1) == split
    keywords = mma_choice(dtype, cuda_device.caps, launch.tokens)[0]
    x_in = mma_x(cuda_device, dtype, keywords, x)
    if split:
        tile = matmul.mma_tiled(dtype, tokens=launch.tokens, split=True, **keywords)
        partials = run(cuda_device, tile, launch.grid(rows, n_tokens), *w_planes, x_in,
                       np.zeros((launch.splits, n_tokens, rows), np.float32), rows, cols,
                       n_tokens, launch.split_cols)["partials"]
        add = matmul.split_sum(outputs=3)
        got = run(cuda_device, add, (-(-n_tokens * rows // matmul.WORKGROUP),), partials, *ys,
                  n_tokens * rows, launch.splits, rows, *starts)
    else:
        tile = matmul.mma_tiled(dtype, tokens=launch.tokens, outputs=3, **keywords)
        got = run(cuda_device, tile, launch.grid(rows, n_tokens), *w_planes, x_in, *ys, rows,
                  cols, n_tokens, *starts)
    got = np.concatenate([got[f"y{i}"] for i in range(3)], axis=1)
    check_mma(got, x, dense, None, dtype, f"{tile.name} T={n_tokens}")


@pytest.mark.parametrize("dtype", ["F16", "Q4_0", "Q4_K"])
@pytest.mark.parametrize("n_tokens,splits", [(3, 1), (40, 1), (40, 4), (130, 2)])
def test_split_sum_swiglu_of_stacked_gate_up(cuda_device, dtype, n_tokens, splits):
    """gate and up stacked row-wise, one mma_tiled launch (split or not) into the partials,
    then split_sum's SwiGLU of each pair of sums: against numpy's silu(x gate^T) * (x up^T),
    within the product's bound carried through silu (|silu'| < 1.1) and the multiplication."""
    from poot.engine.kernel_choice import mma_choice
    half, cols = 200, 512
    w_planes, dense = weight(dtype, 2 * half, cols)
    x = rng.standard_normal((n_tokens, cols)).astype(np.float32) * 0.5
    launch = matmul.MmaLaunch(matmul.mma_launch(2 * half, cols, n_tokens, 1).tokens, splits,
                              -(-cols // (splits * matmul.MMA_DEPTH)) * matmul.MMA_DEPTH)
    keywords = mma_choice(dtype, cuda_device.caps, launch.tokens)[0]
    tile = matmul.mma_tiled(dtype, tokens=launch.tokens, split=True, **keywords)
    partials = run(cuda_device, tile, launch.grid(2 * half, n_tokens), *w_planes,
                   mma_x(cuda_device, dtype, keywords, x),
                   np.zeros((splits, n_tokens, 2 * half), np.float32), 2 * half, cols,
                   n_tokens, launch.split_cols)["partials"]
    got = run(cuda_device, matmul.split_sum(glu="silu"),
              (-(-n_tokens * half // matmul.WORKGROUP),), partials,
              np.zeros((n_tokens, half), np.float32), n_tokens * half, splits, half)["y"]
    product = x.astype(np.float64) @ dense.astype(np.float64).T
    gate, up = product[:, :half], product[:, half:]
    u = 2.0 ** -11
    rounded = 1 if dtype == "F16" else 2
    bound = (rounded * u + cols * 2.0 ** -23) * np.outer(np.linalg.norm(x, axis=1),
                                                        np.linalg.norm(dense, axis=1))
    gb, ub = bound[:, :half], bound[:, half:]
    err = np.abs(got - silu_times(gate, up))
    allowed = 1.1 * gb * (np.abs(up) + ub) + ub * (np.abs(gate) + gb) + 1e-5 * np.abs(gate * up)
    assert np.all(np.isfinite(got)), "unwritten outputs"
    worst = np.unravel_index(np.argmax(err / allowed), err.shape)
    assert np.all(err <= allowed), f"worst at {worst}: {err[worst]} > {allowed[worst]}"
    # the x16 variant (what the down projection's mma_tiled reads): the same values rounded
    words = run(cuda_device, matmul.split_sum(glu="silu", x16=dtype),
                (-(-n_tokens * half // (2 * matmul.WORKGROUP)),), partials,
                np.zeros(n_tokens * half // 2, np.uint32), n_tokens * half, splits, half)["x16"]
    assert np.array_equal(words.view(np.float16).reshape(got.shape), got.astype(np.float16))


@pytest.mark.parametrize("dtype", ["F16", "BF16"])
@pytest.mark.parametrize("n_tokens", [5, 130, 300, 520])
@pytest.mark.parametrize("glu", ["silu", "gelu_tanh"])
def test_gated_unit_stored_by_wgmma_tiles(cuda_device, dtype, n_tokens, glu):
    """A gated unit's tiles on wgmma (mma_tiled's glu: a tile's first warpgroup takes gate's
    rows, its second up's of the same units) store the unit, as f32 and as the x16 words of
    the matmul next: bit for bit what the split tile's sums give through split_sum, whose
    sums are the same products in the same order (half not a whole number of tiles)."""
    from poot.engine.kernel_choice import WGMMA, mma_choice
    if WGMMA not in cuda_device.caps:
        pytest.skip(f"{cuda_device.name} has no wgmma (sm_90a)")
    half, cols = 200, 512
    w_planes, _ = weight(dtype, 2 * half, cols)
    x = rng.standard_normal((n_tokens, cols)).astype(np.float32) * 0.5
    launch = matmul.mma_launch(2 * half, cols, n_tokens, 1, **mma_choice(dtype,
                                                                          cuda_device.caps)[1])
    keywords = mma_choice(dtype, cuda_device.caps, launch.tokens)[0]
    x_in = mma_x(cuda_device, dtype, keywords, x)
    tile = matmul.mma_tiled(dtype, tokens=launch.tokens, split=True, **keywords)
    partials = run(cuda_device, tile, launch.grid(2 * half, n_tokens), *w_planes, x_in,
                   np.zeros((1, n_tokens, 2 * half), np.float32), 2 * half, cols, n_tokens,
                   launch.split_cols)["partials"]
    want = run(cuda_device, matmul.split_sum(glu=glu),
               (-(-n_tokens * half // matmul.WORKGROUP),), partials,
               np.zeros((n_tokens, half), np.float32), n_tokens * half, 1, half)["y"]
    want16 = run(cuda_device, matmul.split_sum(glu=glu, x16=dtype),
                 (-(-n_tokens * half // (2 * matmul.WORKGROUP)),), partials,
                 np.zeros(n_tokens * half // 2, np.uint32), n_tokens * half, 1, half)["x16"]
    grid = launch.unit_grid(2 * half, n_tokens)
    unit = matmul.mma_tiled(dtype, tokens=launch.tokens, glu=glu, **keywords)
    got = run(cuda_device, unit, grid, *w_planes, x_in,
              np.full((n_tokens, half), np.nan, np.float32), 2 * half, cols, n_tokens)["y"]
    assert np.array_equal(got, want), f"{unit.name} T={n_tokens}"
    unit16 = matmul.mma_tiled(dtype, tokens=launch.tokens, glu=glu, glu_x16=dtype, **keywords)
    got16 = run(cuda_device, unit16, grid, *w_planes, x_in,
                np.full(n_tokens * half // 2, 0xFFFFFFFF, np.uint32), 2 * half, cols,
                n_tokens)["y16"]
    assert np.array_equal(got16, want16), f"{unit16.name} T={n_tokens}"


@pytest.mark.parametrize("dtype", ["F16", "BF16", "Q4_0", "Q8_0", "F32"])
def test_tiled_norm_x16_feeds_mma_tiled(cuda_device, dtype):
    """The runner's folded norm on the tensor cores: tiled_norm_x16 (x normed, times the gain,
    rounded in column order), then the x16 mma_tiled: against numpy's product of the normed x,
    whose rounding is one of the operand roundings check_mma allows."""
    from poot.engine.kernel_choice import mma_choice, tiled_norm_x16
    n_tokens, rows, cols = 37, 300, 1024
    launch = matmul.mma_launch(rows, cols, n_tokens, 1)
    keywords = dict(mma_choice(dtype, cuda_device.caps, launch.tokens)[0], x16=True)
    w_planes, dense = weight(dtype, rows, cols)
    x = rng.standard_normal((n_tokens, cols)).astype(np.float32) * 3
    g = rng.standard_normal(cols).astype(np.float32)
    eps = 1e-5
    x16 = run(cuda_device, tiled_norm_x16(dtype), (n_tokens,), x, g,
              np.zeros(n_tokens * cols // 2, np.uint32), cols, eps)["x16"]
    normed = x / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=1, keepdims=True) + eps) * g
    tile = matmul.mma_tiled(dtype, tokens=launch.tokens, **keywords)
    got = run(cuda_device, tile, launch.grid(rows, n_tokens), *w_planes, x16,
              np.zeros((n_tokens, rows), np.float32), rows, cols, n_tokens)["y"]
    check_mma(got, normed.astype(np.float32), dense, None, dtype, tile.name)


# -- mma_vec: the decode matmul on the tensor cores (PTX devices only) -----------------------------
# (variant, n_tokens, rows, cols): tokens past one 8-token launch, rows that are not whole
# 16-row tiles, columns that are not whole 128-column groups (576: SmolLM2's width), pipelined
# rounds (with subgroups that have none: 576 columns split 8 ways), two accumulator chains, x
# normed beforehand (x16: norm_x16, as the runner launches a norm variant)
MMA_VEC_CASES = [({}, 1, 200, 512), ({}, 3, 96, 576), ({"tiles": 2}, 8, 200, 4096),
                 ({"split": 4}, 11, 200, 576), ({"residual": True, "tiles": 2, "split": 2}, 5,
                                                 1000, 1024),
                 ({"x16": True, "outputs": 3}, 1, 216, 576),
                 ({"x16": True, "outputs": 3, "split": 8}, 8, 216, 4096),
                 ({"glu": "silu"}, 2, 200, 512),
                 ({"x16": True, "glu": "silu", "tiles": 2, "split": 2}, 9, 200, 576),
                 ({"pipeline": True, "unroll": 2, "split": 2}, 8, 200, 4096),
                 ({"pipeline": True, "split": 8, "x16": True}, 3, 200, 576),
                 ({"pipeline": True, "tiles": 2, "residual": True}, 1, 1000, 1024),
                 ({"chains": 2, "x16": True, "outputs": 3, "split": 2}, 5, 216, 576),
                 ({"chains": 2, "x16": True, "glu": "silu", "pipeline": True, "unroll": 2}, 8,
                  200, 4096),
                 ({"x16": True, "pipeline": True, "unroll": 2, "split": 2}, 8, 200, 4096),
                 # token tiles: 16 or 32 tokens a launch, a part tile, more launches along y
                 ({"token_tiles": 2, "x16": True, "split": 8}, 13, 216, 576),
                 ({"token_tiles": 4, "x16": True, "glu": "silu", "pipeline": True,
                   "unroll": 2}, 32, 200, 4096),
                 ({"token_tiles": 4, "tiles": 2, "residual": True}, 45, 216, 1024),
                 ({"token_tiles": 2, "chains": 2, "x16": True, "split": 2}, 7, 200, 576),
                 # an output head's shape (mma_vec.shape: one tile, split 2, one group a round)
                 ({"x16": True, "split": 2, "chains": 2}, 1, 1000, 2048),
                 # rows too few to fill the device (mma_vec.shape: one tile, split 8, one
                 # chain, two groups a round from norm_x16's x, one from f32 x)
                 ({"x16": True, "split": 8, "unroll": 2}, 1, 1000, 2048),
                 ({"residual": True, "split": 8, "unroll": 2}, 3, 200, 4096 + 256),
                 ({"residual": True, "split": 8}, 1, 200, 4096 + 256)]


@pytest.mark.parametrize("rows,cols,x16,experts,tiles", [
    (5120, 2048, True, False, 1),       # Qwen3-30B-A3B q/k/v: 160 workgroups of two tiles
    (2048, 4096, False, False, 1),      # its o: one tile's 128 workgroups fit 132
    (768 * 8, 2048, True, True, 1),     # its experts' gate/up at one token
    (2048 * 8, 768, False, True, 2),    # its experts' down: split 4 fills the device
    (6144, 4096, True, False, 1),       # Llama-8B q/k/v
    (4096, 4096, False, False, 2),      # its o: one tile's 256 workgroups overfill it
    (14336, 4096, True, False, 2)])     # its gate/up: split 4 fills the device
def test_mma_vec_shape_takes_one_tile_where_rows_are_few(rows, cols, x16, experts, tiles):
    """mma_vec.shape at one token, Q4_0, 132 multiprocessors: rows that leave the device idle
    even split 8 ways take one tile, one chain, no pipeline where x is norm_x16's or one
    tile's workgroups fit, two groups a round from norm_x16's x, one from f32; the others keep
    two tiles."""
    shape = mma_vec.shape("Q4_0", rows, cols, 132, 1, experts=experts, x16=x16)
    assert shape["tiles"] == tiles
    if tiles == 1:
        assert shape == dict(tiles=1, split=8, unroll=2 if x16 else 1, chains=1,
                             pipeline=False, token_tiles=1)


@pytest.mark.parametrize("dtype", mma_vec.DTYPES)
@pytest.mark.parametrize("variant,n_tokens,rows,cols", MMA_VEC_CASES)
def test_mma_vec(cuda_device, dtype, variant, n_tokens, rows, cols):
    """Every fused variant, as matvec's (the same arguments but a norm's), against numpy with
    mma_tiled's error bounds (check_mma): x (normalised x for x16, normed by norm_x16 on the
    device) and decoded quant weights rounded once to the operand type, f32 sums; swiglu,
    whose silu moves the bounds, in relative norm."""
    if cols % QUANTS[dtype].block_elems:
        pytest.skip(f"{dtype} rows are whole blocks of {QUANTS[dtype].block_elems}")
    eps, x16 = 1e-5, variant.get("x16", False)
    matrices = 2 if variant.get("glu") else 1
    weights = [weight(dtype, rows, cols) for _ in range(matrices)]
    x = rng.standard_normal((n_tokens, cols)).astype(np.float32) * 3
    g = rng.standard_normal(cols).astype(np.float32)
    h = ref.rms_norm(x, g, eps) if x16 else x
    x_in = x
    if x16:
        x_in = run(cuda_device, mma_vec.norm_x16(dtype), (n_tokens,), x, g,
                   np.zeros((n_tokens, cols // 2), np.uint32), cols, eps)["x16"]
    outputs = variant.get("outputs", 1)
    sizes = (rows - 80, 40, 40)[:outputs] if outputs > 1 else (rows,)
    splits = list(np.cumsum(sizes)[:-1])
    r = rng.standard_normal((n_tokens, rows)).astype(np.float32)
    k = mma_vec.mma_vec(dtype, **variant)
    got = run(cuda_device, k, mma_vec.grid(rows, n_tokens, variant.get("tiles", 1),
                                           variant.get("split", 1), variant.get("token_tiles", 1)),
              *[p for planes_, _ in weights for p in planes_], x_in,
              *[np.zeros((n_tokens, n), np.float32) for n in sizes],
              *([r] if variant.get("residual") else []), rows, cols, n_tokens, *splits)
    where = f"{k.name} T={n_tokens} {rows}x{cols}"
    if matrices == 2:
        gate, up = (ref.matmul(h, dense) for _, dense in weights)
        assert rel_err(got["y"], ref.glu(gate, up, "silu")) < (2e-2 if dtype == "BF16" else 3e-3), where
        return
    names = ["y"] if outputs == 1 else [f"y{i}" for i in range(outputs)]
    want_r = r if variant.get("residual") else None
    for name, dense in zip(names, np.split(weights[0][1], splits)):
        check_mma(got[name], h, dense, want_r, dtype, f"{where} {name}")


@pytest.mark.parametrize("dtype", ["Q4_0", "F16", "BF16"])
@pytest.mark.parametrize("n_tokens,cols", [(1, 576), (5, 4096), (16, 2048)])
def test_norm_x16(cuda_device, dtype, n_tokens, cols):
    """norm_x16: each token's RMSNorm times the gain, rounded once to the operand type (within
    its unit roundoff of the f64 norm, plus f32's, or half f16's least subnormal), each 4-value
    run paired as mma_vec's B words take it: (a, c), (b, d) for block quants, (a, b), (c, d)
    for floats."""
    eps = 1e-5
    x = rng.standard_normal((n_tokens, cols)).astype(np.float32) * 3
    g = rng.standard_normal(cols).astype(np.float32)
    got = run(cuda_device, mma_vec.norm_x16(dtype), (n_tokens,), x, g,
              np.zeros((n_tokens, cols // 2), np.uint32), cols, eps)["x16"]
    check_x16(got, x, g, eps, dtype)


@pytest.mark.parametrize("dtype", ["Q4_0", "F16", "BF16"])
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("n_tokens,cols", [(1, 4096), (5, 2048), (3, 576)])
def test_reduce_norm_x16(cuda_device, dtype, world, n_tokens, cols):
    """reduce_norm_x16: out = residual + (the ranks' partials summed in rank order), the same
    bits as all_reduce's, and norm_x16 of it."""
    eps = 1e-5
    parts = [rng.standard_normal((n_tokens, cols)).astype(np.float32) for _ in range(world)]
    residual = rng.standard_normal((n_tokens, cols)).astype(np.float32) * 3
    g = rng.standard_normal(cols).astype(np.float32)
    got = run(cuda_device, mma_vec.reduce_norm_x16(dtype, world), (n_tokens,), *parts, residual,
              np.full((n_tokens, cols), np.nan, np.float32), g,
              np.zeros((n_tokens, cols // 2), np.uint32), cols, eps)
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    want = residual + total
    assert np.array_equal(got["out"], want)
    reduced = run(cuda_device, ops.all_reduce(world, residual=True), (-(-want.size // 1024),),
                  *parts, residual, np.zeros_like(want), 0, want.size)["out"]
    assert np.array_equal(got["out"], reduced)
    check_x16(got["x16"], want, g, eps, dtype)


def check_x16(got, x, g, eps, dtype):
    """x16 words against the f64 RMSNorm of x times g (see test_norm_x16)."""
    n_tokens, cols = x.shape
    halves = np.ascontiguousarray(got).view(np.uint16).reshape(n_tokens, cols // 4, 4)
    if mma_vec.quant_pairs(dtype):
        halves = halves[..., [0, 2, 1, 3]]
    if dtype == "BF16":
        values, u = (halves.astype(np.uint32) << 16).view(np.float32), 2.0 ** -8
    else:
        values, u = halves.view(np.float16).astype(np.float32), 2.0 ** -11
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt(np.mean(x64 * x64, axis=1, keepdims=True) + eps) * g
    error = np.abs(values.reshape(n_tokens, cols) - want)
    assert np.all(error <= (u + 2.0 ** -18) * np.abs(want) + 2.0 ** -25), \
        f"{dtype} T={n_tokens} cols={cols}: worst {np.max(error / np.abs(want))}"


@pytest.mark.parametrize("rows", [1, 96, 512, 2048, 4096, 14336, 128256])
@pytest.mark.parametrize("cols", [64, 72, 128, 1000, 2048, 4096, 14336])
def test_mma_launch_slices_tile_the_columns(rows, cols):
    """On the host, for every step length: the token tile, and slices of whole 64-column steps
    (so of whole quant blocks: a block is 8 to 64 values) that tile the columns exactly, none
    empty; a split only where the tiles alone give fewer workgroups than multiprocessors, and
    then half to one times SPLIT_BLOCKS_PER_SM a multiprocessor (the slices whole steps) unless
    the slices reach their minimum. Asked for one wave (with other depths, workgroups a
    multiprocessor and least steps a slice), never more workgroups than run at once."""
    for sms in (1, 108, 132):
        for n_tokens in range(1, 300):
            for depth, per_sm, least in ((64, 2, 2), (64, 1, 4), (128, 2, 4)):
                launch = matmul.mma_launch(rows, cols, n_tokens, sms, depth, per_sm, least,
                                           one_wave=True)
                assert launch.split_cols % depth == 0
                assert [begin for begin, _ in [matmul.split_columns(
                    p, launch.split_cols, cols) for p in range(launch.splits)]][-1] < cols
                gx, gy, gz = launch.grid(rows, n_tokens)
                assert gz == 1 or (gx * gy * gz <= per_sm * sms
                                   and launch.split_cols >= least * depth)
            launch = matmul.mma_launch(rows, cols, n_tokens, sms)
            assert launch.tokens == (32 if n_tokens <= 32 else 64 if n_tokens <= 64 else 128)
            gx, gy, gz = launch.grid(rows, n_tokens)
            assert (gx, gy, gz) == (-(-n_tokens // launch.tokens), -(-rows // 128), launch.splits)
            assert launch.split_cols % matmul.MMA_DEPTH == 0
            covered = []
            for piece in range(launch.splits):
                begin, end = matmul.split_columns(piece, launch.split_cols, cols)
                assert begin < end, f"slice {piece} of {launch} is empty"
                covered += range(begin, end)
            assert covered == list(range(cols))
            if gx * gy >= sms:
                assert launch.splits == 1
            elif launch.splits > 1:
                assert launch.split_cols >= matmul.MIN_SPLIT_STEPS * matmul.MMA_DEPTH
                assert gx * gy * gz <= matmul.SPLIT_BLOCKS_PER_SM * sms + gx * gy
                if launch.split_cols > matmul.MIN_SPLIT_STEPS * matmul.MMA_DEPTH:
                    assert 2 * gx * gy * gz >= matmul.SPLIT_BLOCKS_PER_SM * sms
            assert launch.partial_floats(rows, n_tokens) == \
                (launch.splits * n_tokens * rows if launch.splits > 1 else 0)


def test_wide_tiles_take_long_steps_whose_tiles_fill_the_device():
    """wgmma's 256-token tiles past 128 tokens, where they alone give every multiprocessor a
    workgroup (never split); else the 128-token tile."""
    for rows, n_tokens, sms, want in ((28672, 2048, 132, 256), (4096, 2048, 132, 256),
                                      (4096, 512, 132, 128), (28672, 512, 132, 256),
                                      (4096, 128, 132, 128), (28672, 129, 132, 256),
                                      (4096, 4096, 132, 256), (128, 4096, 132, 128)):
        launch = matmul.mma_launch(rows, 4096, n_tokens, sms, wide=True, one_wave=True)
        assert launch.tokens == want, (rows, n_tokens)
        assert launch.tokens == 128 or launch.splits == 1
        assert matmul.mma_launch(rows, 4096, n_tokens, sms).tokens == min(want, 128)


@pytest.mark.parametrize("rows,cols", [(256, 512), (2048, 8192), (4096, 14336), (512, 64)])
@pytest.mark.parametrize("least,most", [(16, 16), (16, 63), (16, 256), (1, 1000), (100, 700)])
def test_mma_launches_stand_for_every_length(rows, cols, least, most):
    """The launches the runner compiles and sizes partials for are those of every length."""
    every = {n: matmul.mma_launch(rows, cols, n, 132) for n in range(least, most + 1)}
    standing = matmul.mma_launches(rows, cols, least, most, 132)
    assert set(standing) <= set(every)
    assert set(standing.values()) == set(every.values())
    assert max(launch.partial_floats(rows, n) for n, launch in standing.items()) == \
        max(launch.partial_floats(rows, n) for n, launch in every.items())


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


def test_scale(device):
    x = rng.standard_normal((7, 333)).astype(np.float32)
    got = run(device, ops.scale(), (-(-x.size // ops.WG),), x,
              np.full_like(x, np.nan), x.size, 0.37)["out"]
    assert np.array_equal(got, x * np.float32(0.37))


@pytest.mark.parametrize("n", [64, 1000])
def test_rms_norm_with_residual(device, n):
    """Gemma's norm after attention or the feed-forward, added to the residual stream."""
    x = rng.standard_normal((7, n)).astype(np.float32) * 3
    w, res = rng.standard_normal(n).astype(np.float32), rng.standard_normal((7, n)).astype(
        np.float32)
    got = run(device, ops.rms_norm(device.subgroup_size, residual=True), (7,), x, w, res,
              np.zeros_like(x), n, 1e-6)["out"]
    assert rel_err(got, res + ref.rms_norm(x, w, 1e-6)) < 1e-5


def test_add_and_bias(device):
    a = rng.standard_normal((5, 300)).astype(np.float32)
    for b in (rng.standard_normal((5, 300)).astype(np.float32),
              rng.standard_normal(300).astype(np.float32)):
        got = run(device, ops.elementwise("add"), (-(-a.size // ops.WG),), a, b,
                  np.zeros_like(a), a.size, b.size)["out"]
        assert np.array_equal(got, a + b)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_glu(device, activation):
    g, u = (rng.standard_normal((5, 700)).astype(np.float32) * 4 for _ in range(2))
    got = run(device, ops.elementwise("glu", activation), (-(-g.size // ops.WG),), g, u,
              np.zeros_like(g), g.size, g.size)["out"]
    assert rel_err(got, ref.glu(g, u, activation)) < 1e-5


def test_gather_rows(device):
    x = rng.standard_normal((12, 100)).astype(np.float32)
    index = np.array([11, 0, 5], np.int32)
    got = run(device, ops.gather_rows(), (3,), x, index, np.zeros((3, 100), np.float32),
              100)["out"]
    assert np.array_equal(got, x[index])


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_all_gather(device, world):
    """A device group's slices of the logits (uneven: 1000 columns over `world`) side by side;
    here every slice is in the one device's memory."""
    widths = [len(a) for a in np.array_split(np.arange(1000), world)]
    parts = [rng.standard_normal((3, n)).astype(np.float32) for n in widths]
    got = run(device, ops.all_gather(world), (-(-1000 // ops.WG), 3), *parts,
              np.zeros((3, 1000), np.float32), 1000, *np.cumsum(widths)[:-1].tolist())["out"]
    assert np.array_equal(got, ref.all_gather(parts))


@pytest.mark.parametrize("residual", [False, True])
def test_all_reduce(device, residual):
    parts = [rng.standard_normal(1000).astype(np.float32) for _ in range(3)]
    res = [rng.standard_normal(1000).astype(np.float32)] if residual else []
    got = run(device, ops.all_reduce(3, residual), (-(-1000 // (4 * ops.WG)),), *parts, *res,
              np.zeros(1000, np.float32), 0, 1000)["out"]
    want = ((res[0] if residual else 0) + ((parts[0] + parts[1]) + parts[2])).astype(np.float32)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("style", ["normal", "neox"])
@pytest.mark.parametrize("scale", [1.0, 1.19])             # LongRoPE's attention factor
def test_rope(device, style, scale):
    T, H, D, pairs = 6, 4, 64, 24                      # partial rotary: 48 of 64 dims
    x = rng.standard_normal((T, H, D)).astype(np.float32)
    positions = rng.integers(0, 100000, T).astype(np.int32)
    inv_freq = (1.0 / 10000 ** (np.arange(pairs) / pairs)).astype(np.float32)
    got = run(device, ops.rope(style, scale), (-(-T * H * pairs // ops.WG),), x.copy(),
              positions, inv_freq, T, H, D, pairs)["x"]
    assert rel_err(got, ref.rope(x, positions, inv_freq, style, scale)) < 1e-5


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
@pytest.mark.parametrize("pairs,scale", [(32, 1.0), (24, 1.0), (24, 1.19)])  # partial rotary,
def test_rope_store_kv(device, style, pairs, scale):                       # LongRoPE's factor
    H, n_kv, D, bs, nb = 6, 2, 64, 16, 64
    tables, positions, seq_rows, k, v = paged_case(n_kv, D, [37, 5, 16], bs, nb)
    T = len(positions)
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    inv_freq = (1.0 / 10000 ** (np.arange(pairs) / pairs)).astype(np.float32)
    cache = np.zeros((nb, bs, n_kv, D // 2), np.uint32)
    out = run(device, ops.rope_store_kv(style, scale),
              (-(-T * (H + n_kv) * D // 2 // ops.WG),), q.copy(), k, v, cache, cache,
              positions, seq_rows, tables, inv_freq, T, H, n_kv, D, pairs, tables.shape[1], bs)
    assert rel_err(out["q"], ref.rope(q, positions, inv_freq, style, scale)) < 1e-5
    assert_stored(out, ref.rope(k, positions, inv_freq, style, scale), v, positions, seq_rows,
                  tables, nb)


@pytest.mark.parametrize("style", ["normal", "neox"])
@pytest.mark.parametrize("D,pairs,scale", [(64, 32, 1.0), (128, 48, 1.0), (128, 64, 1.19)])
def test_norm_rope_store_kv(device, style, D, pairs, scale):
    """Each head's RMSNorm (q's weight, k's weight) before the rope and the store, as Qwen3's
    graph has them: the dims past the rotated pairs are scaled too."""
    H, n_kv, bs, nb, eps = 5, 2, 16, 64, 1e-6
    tables, positions, seq_rows, k, v = paged_case(n_kv, D, [37, 5, 16], bs, nb)
    T = len(positions)
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    q_w, k_w = (rng.uniform(0.5, 1.5, D).astype(np.float32) for _ in range(2))
    inv_freq = (1.0 / 10000 ** (np.arange(pairs) / pairs)).astype(np.float32)
    cache = np.zeros((nb, bs, n_kv, D // 2), np.uint32)
    heads_a_group = ops.WG // device.subgroup_size
    out = run(device, ops.norm_rope_store_kv(style, device.subgroup_size, scale),
              (-(-T * (H + n_kv) // heads_a_group),), q.copy(), k, v, cache, cache, positions,
              seq_rows, tables, inv_freq, q_w, k_w, T, H, n_kv, D, pairs, tables.shape[1], bs,
              eps)
    want_q = ref.rope(ref.rms_norm(q, q_w, eps), positions, inv_freq, style, scale)
    assert rel_err(out["q"], want_q) < 1e-5
    assert_stored(out, ref.rope(ref.rms_norm(k, k_w, eps), positions, inv_freq, style, scale),
                  v, positions, seq_rows, tables, nb)


def assert_stored(out, k, v, positions, seq_rows, tables, nb):
    """The paged f16 cache a kernel wrote holds keys k (to 2^-11 a value) and values v (exactly
    as f16) where the reference stores them."""
    want_k, want_v = (np.full((nb,) + out["k_cache"].shape[1:-1] + (k.shape[-1],), np.nan,
                              np.float32) for _ in range(2))
    ref.store_kv(k, v, want_k, want_v, positions, seq_rows, tables)
    written = ~np.isnan(want_k)
    got_k = out["k_cache"].view(np.float16).astype(np.float32)
    got_v = out["v_cache"].view(np.float16).astype(np.float32)
    assert rel_err(got_k[written], want_k[written]) < 1e-3            # f16: 2^-11 per value
    assert np.array_equal(got_v[written], want_v[written].astype(np.float16).astype(np.float32))


@pytest.mark.parametrize("style", ["normal", "neox"])
def test_head_norm_kernels_in_lockstep_at_32_lanes(style):
    """norm_rope_store_kv and the residual rms_norm at NVIDIA's subgroup size, which no device
    here has, run by numpy (tests/lockstep.py) against the reference, every cache word they do
    not write left as it was."""
    H, n_kv, D, pairs, bs, nb, eps = 5, 2, 128, 48, 16, 64, 1e-6
    tables, positions, seq_rows, k, v = paged_case(n_kv, D, [37, 5, 16], bs, nb)
    T = len(positions)
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    q_w, k_w = (rng.uniform(0.5, 1.5, D).astype(np.float32) for _ in range(2))
    inv_freq = (1.0 / 10000 ** (np.arange(pairs) / pairs)).astype(np.float32)
    k_cache, v_cache = (np.full((nb, bs, n_kv, D // 2), 0x7E007E00, np.uint32) for _ in range(2))
    got_q = q.copy()
    lockstep.run(ops.norm_rope_store_kv(style, 32), (-(-T * (H + n_kv) // (ops.WG // 32)),),
                 got_q, k, v, k_cache, v_cache, positions, seq_rows, tables, inv_freq, q_w, k_w,
                 T, H, n_kv, D, pairs, tables.shape[1], bs, eps)
    assert rel_err(got_q, ref.rope(ref.rms_norm(q, q_w, eps), positions, inv_freq, style)) < 1e-5
    want_k, want_v = (np.full((nb, bs, n_kv, D), np.nan, np.float32) for _ in range(2))
    ref.store_kv(ref.rope(ref.rms_norm(k, k_w, eps), positions, inv_freq, style), v, want_k,
                 want_v, positions, seq_rows, tables)
    written = ~np.isnan(want_k)
    got_k, got_v = (c.view(np.float16).astype(np.float32) for c in (k_cache, v_cache))
    assert rel_err(got_k[written], want_k[written]) < 1e-3
    assert np.array_equal(got_v[written], want_v[written].astype(np.float16).astype(np.float32))
    assert np.isnan(got_k[~written]).all() and np.isnan(got_v[~written]).all()
    x = rng.standard_normal((7, 1000)).astype(np.float32) * 3
    w, res = rng.standard_normal(1000).astype(np.float32), rng.standard_normal((7, 1000))
    out = np.full_like(x, np.nan)
    lockstep.run(ops.rms_norm(32, residual=True), (7,), x, w, res.astype(np.float32), out,
                 1000, 1e-6)
    assert rel_err(out, res + ref.rms_norm(x, w, 1e-6)) < 1e-5


@pytest.mark.parametrize("head_dim,n_heads,n_kv,shared,rounds", [
    (64, 9, 3, 1, 4), (64, 9, 3, 3, 4), (128, 8, 8, 1, 4), (64, 8, 4, 2, 4),
    (128, 8, 2, 1, FEW_TOKEN_ROUNDS), (64, 9, 3, 3, 8)])
def test_attention(device, head_dim, n_heads, n_kv, shared, rounds):
    """shared: query heads of one KV head a workgroup takes (ops.attention_heads); rounds:
    keys a subgroup scores a round (kernel_choice.attention_rounds)."""
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
    got = run(device, ops.attention(device.subgroup_size, head_dim, shared, rounds=rounds),
              (len(pick) * n_heads // shared,), q,
              np.zeros_like(q), cache_k.astype(np.float16).view(np.uint32),
              cache_v.astype(np.float16).view(np.uint32), qpos, qrows, tables, n_heads, n_kv,
              tables.shape[1], bs, scale)["out"]
    assert rel_err(got, want) < 1e-5


def rope_attention_case(device, style, pairs, scale, normed, head_dim, n_heads, n_kv, shared,
                        mods, run_kernel, rounds=ops.KEYS_PER_ROUND):
    """A decode step's rope_store_kv (normed: norm_rope_store_kv) and attention, unfused on
    the device and as one launch (ops.attention's rope), from the same cache: every key but
    each sequence's last stored beforehand, the rest of the cache poisoned (f16 NaNs). The
    fused launch writes the same cache words, bit for bit, and nothing else; its output is
    the unfused one's (the own key's terms added first) and the reference's."""
    bs, nb, eps, sg = 16, 64, 1e-6, device.subgroup_size if device else 32
    lengths = [1, 300, 57, 33] if device else [1, 40, 17]
    tables, positions, seq_rows, k, v = paged_case(n_kv, head_dim, lengths, bs, nb)
    last = np.array([np.nonzero(seq_rows == s)[0][-1] for s in range(len(lengths))])
    T, qpos, qrows = len(last), positions[last], seq_rows[last]
    q = rng.standard_normal((T, n_heads, head_dim)).astype(np.float32)
    q_w, k_w = (rng.uniform(0.5, 1.5, head_dim).astype(np.float32) for _ in range(2))
    inv_freq = (1.0 / 10000 ** (np.arange(pairs) / pairs)).astype(np.float32)
    turn = lambda x, w, p: ref.rope(ref.rms_norm(x, w, eps) if normed else x,  # noqa: E731
                                    p, inv_freq, style, scale)
    kr = turn(k, k_w, positions)
    before_k, before_v = (np.full((nb, bs, n_kv, head_dim), np.nan, np.float32)
                          for _ in range(2))
    earlier = np.setdiff1d(np.arange(len(positions)), last)
    ref.store_kv(kr[earlier], v[earlier], before_k, before_v, positions[earlier],
                 seq_rows[earlier], tables)
    words = [c.astype(np.float16).view(np.uint32) for c in (before_k, before_v)]
    norms, eps_ = ([q_w, k_w], [eps]) if normed else ([], [])
    att_scale = head_dim ** -0.5
    cache = lambda kc, vc: (kc.copy(), vc.copy(), qpos, qrows, tables)  # noqa: E731
    rope_kernel = ops.norm_rope_store_kv(style, sg, scale) if normed else \
        ops.rope_store_kv(style, scale)
    grid = -(-T * (n_heads + n_kv) // (ops.WG // sg)) if normed else \
        -(-T * (n_heads + n_kv) * head_dim // 2 // ops.WG)
    unfused = run_kernel(rope_kernel, (grid,), q.copy(), k[last], v[last], *cache(*words),
                         inv_freq, *norms, T, n_heads, n_kv, head_dim, pairs, tables.shape[1],
                         bs, *eps_)
    for name, before in zip(("k_cache", "v_cache"), words):     # a "w" buffer comes poisoned
        unfused[name] = np.where(unfused[name] == 0xFFFFFFFF, before, unfused[name])
    plain = ops.attention(sg, head_dim, shared, rounds=rounds, **mods)
    want_out = run_kernel(plain, (T * n_heads // shared,), unfused["q"],
                          np.zeros_like(q), unfused["k_cache"], unfused["v_cache"], qpos, qrows,
                          tables, n_heads, n_kv, tables.shape[1], bs, att_scale)["out"]
    fused = ops.attention(sg, head_dim, shared, rope=(style, scale, normed), rounds=rounds,
                          **mods)
    got = run_kernel(fused, (T * n_heads // shared,), q, np.zeros_like(q), *cache(*words),
                     n_heads, n_kv, tables.shape[1], bs, att_scale, k[last], v[last],
                     inv_freq, *norms, pairs, *eps_)
    for name in ("k_cache", "v_cache"):
        assert np.array_equal(got[name], unfused[name]), name
    assert rel_err(got["out"], want_out) < 1e-5
    full_k, full_v = (c.view(np.float16).astype(np.float32) for c in
                      (got["k_cache"], got["v_cache"]))
    want = ref.attention(turn(q, q_w, qpos), full_k, full_v, qpos, qrows, tables, att_scale,
                         **mods)
    assert rel_err(got["out"], want) < 1e-4


@pytest.mark.parametrize("style,pairs,scale,normed", [("neox", 32, 1.0, True),
                                                      ("normal", 24, 1.19, False),
                                                      ("normal", 64, 1.0, True),
                                                      ("neox", 24, 1.0, False)])
@pytest.mark.parametrize("head_dim,n_heads,n_kv,shared,mods,rounds", [
    (64, 9, 3, 1, {}, 4), (64, 8, 4, 2, {}, 4), (128, 8, 2, 1, {}, FEW_TOKEN_ROUNDS),
    (64, 8, 2, 2, {"window": 40, "softcap": 30.0}, 4)])
def test_attention_folds_the_rope(device, style, pairs, scale, normed, head_dim, n_heads, n_kv,
                                  shared, mods, rounds):
    if pairs * 2 > head_dim:
        pytest.skip("more pairs than the head has")
    rope_attention_case(device, style, pairs, scale, normed, head_dim, n_heads, n_kv, shared,
                        mods, lambda kernel, grid, *args: run(device, kernel, grid, *args),
                        rounds)


@pytest.mark.parametrize("style,normed", [("neox", True), ("normal", False)])
def test_attention_folds_the_rope_in_lockstep_at_32_lanes(style, normed):
    """The same at NVIDIA's subgroup size, run by numpy (tests/lockstep.py)."""
    def run_lockstep(kernel, grid, *args):
        args = [a.copy() if isinstance(a, np.ndarray) else a for a in args]
        lockstep.run(kernel, grid, *args)
        return {p.name: a for p, a in zip(kernel.params, args)
                if p.kind == "buffer" and p.access in ("w", "rw")}
    rope_attention_case(None, style, 48, 1.0, normed, 128, 8, 2, 1, {}, run_lockstep,
                        FEW_TOKEN_ROUNDS)


@pytest.mark.parametrize("head_dim,n_heads,n_kv", [(128, 32, 8), (64, 9, 3), (128, 32, 2),
                                                   (256, 8, 4)])
def test_attention_decode_on_the_tensor_cores(cuda_device, head_dim, n_heads, n_kv):
    """flash.attention_decode: the last token of sequences of 1 to 700 keys, within the f16
    rounding of q and of the probabilities of numpy's attention; every output written."""
    from poot.kernels import flash
    bs, nb = 16, 256
    lengths = [1, 300, 57, 700, 64, 65, 1000]
    tables, positions, seq_rows, k, v = paged_case(n_kv, head_dim, lengths, bs, nb)
    cache_k, cache_v = (np.zeros((nb, bs, n_kv, head_dim), np.float32) for _ in range(2))
    ref.store_kv(k.astype(np.float16).astype(np.float32), v.astype(np.float16).astype(np.float32),
                 cache_k, cache_v, positions, seq_rows, tables)
    pick = np.array([np.nonzero(seq_rows == s)[0][-1] for s in range(len(lengths))])
    q = rng.standard_normal((len(pick), n_heads, head_dim)).astype(np.float32)
    qpos, qrows = positions[pick], seq_rows[pick]
    scale = head_dim ** -0.5
    want = ref.attention(q, cache_k, cache_v, qpos, qrows, tables, scale)
    got = run(cuda_device, flash.attention_decode(head_dim, n_heads // n_kv),
              (len(pick) * n_kv,), q, np.full_like(q, np.nan),
              cache_k.astype(np.float16).view(np.uint32),
              cache_v.astype(np.float16).view(np.uint32), qpos, qrows, tables, n_heads, n_kv,
              tables.shape[1], bs, scale)["out"]
    assert rel_err(got, want) < 2e-3


def prompt_attention_case(head_dim, n_heads, n_kv, window=0, cap=0.0):
    """A step with prompt tokens: whose 16-token tiles attention_tiles takes (the first two of
    A's 37 new tokens after 40 cached, C's full tile and G's last, partial tile) and which it
    leaves (tiles of several sequences, decode tokens). Returns (tiled, q, numpy's attention
    (with a sliding `window` and a soft-`cap` where given), the kernels' arguments after q and
    out)."""
    bs, nb = 16, 128
    new = {"A": (40, 37), "C": (0, 27), "B": (300, 1), "D": (5, 1), "E": (100, 3),
           "G": (0, 21)}
    lengths = [start + n for start, n in new.values()]
    tables, positions, seq_rows, k, v = paged_case(n_kv, head_dim, lengths, bs, nb)
    cache_k, cache_v = (np.zeros((nb, bs, n_kv, head_dim), np.float32) for _ in range(2))
    ref.store_kv(k.astype(np.float16).astype(np.float32), v.astype(np.float16).astype(np.float32),
                 cache_k, cache_v, positions, seq_rows, tables)
    qpos = np.concatenate([np.arange(start, start + n) for start, n in new.values()]).astype(
        np.int32)
    qrows = np.concatenate([[s] * n for s, (_, n) in enumerate(new.values())]).astype(np.int32)
    T = len(qpos)
    tiled = np.array(ops.tiled_tokens(qrows))      # the host's rule, which the runner follows
    assert list(np.nonzero(tiled)[0]) == [*range(32), *range(48, 64), *range(80, 90)]
    q = rng.standard_normal((T, n_heads, head_dim)).astype(np.float32)
    scale = head_dim ** -0.5
    want = ref.attention(q, cache_k, cache_v, qpos, qrows, tables, scale, window, cap)
    cache = (cache_k.astype(np.float16).view(np.uint32), cache_v.astype(np.float16).view(np.uint32),
             qpos, qrows, tables, n_heads, n_kv, tables.shape[1], bs, scale, T)
    return tiled, q, want, cache


ATTENTION_HEADS = [(128, 8, 2), (64, 9, 3), (64, 4, 4)]


def prompt_tiles(kind, head_dim, n_heads, n_kv, T, **mods):
    """(kernel, grid) of prompt attention's tensor-core kernel `kind` (PROMPT_TILES) over a
    step of T tokens, as the runner launches it."""
    make, grid = PROMPT_TILES[kind]
    heads = ops.attention_tile_heads(n_heads, n_kv)
    return make(head_dim, heads, **mods), grid(T, n_heads, heads)


@pytest.mark.parametrize("kind", PROMPT_TILES)
@pytest.mark.parametrize("head_dim,n_heads,n_kv", ATTENTION_HEADS)
def test_attention_tiles(cuda_device, kind, head_dim, n_heads, n_kv):
    """attention_tiles (and attention_flash, its drop-in) writes its tiles' tokens, within the
    f16 rounding of q * scale and of the probabilities (2^-11 each) of numpy's attention, and
    leaves the others unwritten (poisoned)."""
    tiled, q, want, cache = prompt_attention_case(head_dim, n_heads, n_kv)
    kernel, grid = prompt_tiles(kind, head_dim, n_heads, n_kv, len(q))
    got = run(cuda_device, kernel, grid, q, np.zeros_like(q), *cache)["out"]
    assert np.all(np.isnan(got[~tiled]))
    assert rel_err(got[tiled], want[tiled]) < 2e-3


@pytest.mark.parametrize("head_dim,n_heads,n_kv", ATTENTION_HEADS)
def test_attention_untiled_leaves_the_tiles(device, head_dim, n_heads, n_kv):
    """attention(untiled=True), on every target: the tokens attention_tiles does not take, as
    attention computes them, and the tiles' tokens unwritten (poisoned)."""
    tiled, q, want, cache = prompt_attention_case(head_dim, n_heads, n_kv)
    shared = ops.attention_heads(n_heads, n_kv, head_dim, device.subgroup_size)
    got = run(device, ops.attention(device.subgroup_size, head_dim, shared, untiled=True),
              (len(q) * n_heads // shared,), q, np.zeros_like(q), *cache)["out"]
    assert np.all(np.isnan(got[tiled]))
    assert rel_err(got[~tiled], want[~tiled]) < 1e-5


def split_partials(q, keys, values, qpos, qrows, split_tokens, n_splits, scale):
    """numpy's (o, m, l) of every (token, head, split): keys/values [rows, L, heads, D]."""
    T, H, D = q.shape
    want = np.zeros((T, H, n_splits, D + 2), np.float32)
    want[..., D] = ops.LOWEST
    for t in range(T):
        for s in range(n_splits):
            lo, hi = s * split_tokens, min((s + 1) * split_tokens, qpos[t] + 1)
            if lo >= hi:
                continue
            k, v = keys[qrows[t], lo:hi], values[qrows[t], lo:hi]      # [n, H, D]
            scores = np.einsum("hd,nhd->hn", q[t], k) * scale
            m = scores.max(axis=1)
            p = np.exp(scores - m[:, None])
            want[t, :, s, :D] = np.einsum("hn,nhd->hd", p, v)
            want[t, :, s, D], want[t, :, s, D + 1] = m, p.sum(axis=1)
    return want


@pytest.mark.parametrize("head_dim,n_heads,n_kv,lengths,split_tokens,n_splits,prefill", [
    (64, 4, 4, [20], 64, 4, False),                    # shorter than one split
    (64, 4, 2, [64, 128], 64, 3, False),               # ends on a split boundary
    (64, 9, 3, [700, 1, 300, 57], 32, 24, False),      # many splits, grouped KV heads
    (128, 8, 2, [150, 40], 48, 4, True),               # prefill: every token of a sequence
    (128, 8, 8, [97, 33, 260], 40, 7, True),           # splits not a whole number of blocks
])
@pytest.mark.parametrize("shared", [False, True])
def test_split_attention(device, head_dim, n_heads, n_kv, lengths, split_tokens, n_splits,
                         prefill, shared):
    """shared: a workgroup takes the query heads of a KV head ops.attention_heads gives."""
    heads = ops.attention_heads(n_heads, n_kv, head_dim, device.subgroup_size) if shared else 1
    bs, nb = 16, 128
    tables, positions, seq_rows, k, v = paged_case(n_kv, head_dim, lengths, bs, nb)
    k16, v16 = k.astype(np.float16), v.astype(np.float16)
    cache_k, cache_v = (np.zeros((nb, bs, n_kv, head_dim), np.float32) for _ in range(2))
    ref.store_kv(k16.astype(np.float32), v16.astype(np.float32), cache_k, cache_v, positions,
                 seq_rows, tables)
    # the last token of every sequence; with prefill, every token of the first (causal)
    last = [np.nonzero(seq_rows == s)[0][-1] for s in range(len(lengths))]
    pick = np.concatenate([np.nonzero(seq_rows == 0)[0] if prefill else [], last[1:], last[:1]])
    pick = pick.astype(np.int64)
    q = rng.standard_normal((len(pick), n_heads, head_dim)).astype(np.float32)
    qpos, qrows = positions[pick], seq_rows[pick]
    scale = head_dim ** -0.5
    T = len(pick)
    partials = run(device, ops.attention_split(device.subgroup_size, head_dim, heads),
                   (T * n_heads // heads, n_splits), q, np.zeros((T, n_heads, n_splits, head_dim + 2), np.float32),
                   cache_k.astype(np.float16).view(np.uint32),
                   cache_v.astype(np.float16).view(np.uint32), qpos, qrows, tables, n_heads,
                   n_kv, tables.shape[1], bs, scale, split_tokens)["partials"]

    group = n_heads // n_kv
    seq = [np.repeat(c[tables].reshape(len(lengths), -1, n_kv, head_dim), group, axis=2)
           for c in (cache_k, cache_v)]
    want = split_partials(q, *seq, qpos, qrows, split_tokens, n_splits, scale)
    used = want[..., head_dim + 1] > 0
    assert np.array_equal(partials[~used], want[~used]), "neutral partials: (0..., lowest, 0)"
    got_m, want_m = partials[..., head_dim][used], want[..., head_dim][used]
    assert np.max(np.abs(got_m - want_m)) < 1e-5 * np.max(np.abs(want_m))
    assert rel_err(partials[..., head_dim + 1][used], want[..., head_dim + 1][used]) < 1e-5
    assert rel_err(partials[..., :head_dim][used], want[..., :head_dim][used]) < 1e-5

    got = run(device, ops.attention_combine(head_dim), (T * n_heads,), partials,
              np.zeros_like(q), n_splits)["out"]
    assert rel_err(got, ref.attention(q, cache_k, cache_v, qpos, qrows, tables, scale)) < 1e-5


def test_top_candidates(device):
    """Each chunk's best TOP_KEEP (value, index) pairs, best first, lower index first among
    equal values, and its largest value and sum of exp((value - largest) / temperature): rows
    with ties inside and across chunks, and a short last chunk."""
    n = 3 * choice.TOP_CHUNK + 777
    chunks = -(-n // choice.TOP_CHUNK)
    logits = rng.standard_normal((3, n)).astype(np.float32)
    logits[1, 5:40] = logits[1, 3000:3020] = logits[1].max() + 1     # 55 equal best values
    logits[2, ::97] = np.float32(0.5)                                # equal values everywhere
    temperature = np.array([0.7, 0.0, 1.9], np.float32)      # 0: the sums at 1
    got = run(device, choice.top_candidates(device.subgroup_size), (3, chunks), logits, temperature,
              np.zeros((3, chunks, choice.TOP_KEEP), np.float32),
              np.zeros((3, chunks, choice.TOP_KEEP), np.int32), np.zeros((3, chunks), np.float32),
              np.zeros((3, chunks), np.float32), n)
    for r in range(3):
        t = temperature[r] if temperature[r] > 0 else 1.0
        for c in range(chunks):
            lo = c * choice.TOP_CHUNK
            part = logits[r, lo:lo + choice.TOP_CHUNK]
            want = lo + np.argsort(-part, kind="stable")[:choice.TOP_KEEP]
            assert got["indices"][r, c].tolist() == want.tolist()
            assert np.array_equal(got["values"][r, c], logits[r, want])
            assert got["maxima"][r, c] == part.max()
            exact = np.exp((part.astype(np.float64) - part.max()) / t).sum()
            assert abs(got["sums"][r, c] - exact) < 1e-5 * exact


@pytest.mark.parametrize("vocab", [5, 3001, 128256])
def test_draw(device, vocab):
    """Each sampled row's token is the one sampling.choose draws, exactly: flat and peaked rows,
    ties (a third rounded), banned, NaN and infinite logits, every cut alone and together,
    tiny and large temperatures; greedy and forced rows keep the token they came with. A
    large vocabulary puts many tokens in one step (the bins' sums and the span walked)."""
    R = 16
    scale = np.where(np.arange(R) % 2, 0.3, rng.choice([3.0, 12.0], R))[:, None]  # odd rows flat
    x = (rng.standard_normal((R, vocab)) * scale).astype(np.float32)
    x[::3] = np.round(x[::3])
    x[1, rng.random(vocab) < 0.3] = BANNED
    x[2, :3] = [np.nan, np.inf, -np.inf]
    rows = SamplingRows(
        temperature=np.array([0.0, 1.0, 0.7, 1.7, 0.01, 1.0, 1.0, 0.9] * 2, np.float32),
        top_k=np.array([0, 0, 3, 0, 0, 50, 1, 700, 0, 0, 0, 7, 0, 40, 0, 0], np.int32),
        top_p=np.array([1, 0.9, 1, 0.5, 0.999, 0.95, 1, 0.8, 1, 0, 0.3, 1, 0.99, 0.9, 1, 1],
                       np.float32),
        min_p=np.array([0, 0, 0, 0.05, 0, 0, 0, 0, 0.2, 0, 0, 0, 0.01, 0.1, 1.0, 0], np.float32),
        seed=rng.integers(0, 2**63, R).astype(np.uint64), step=rng.integers(0, 9999, R))
    rows.forced = np.full(R, -1, np.int32)
    rows.forced[15] = 3
    greedy = np.nanargmax(np.where(np.isnan(x), -np.inf, x), axis=1).astype(np.int32)
    got = run(device, choice.draw(device.subgroup_size), (R,), x, sampling.draw_rows(rows, R),
              sampling.EXP2, greedy.copy(), vocab)["token"]
    want = [int(greedy[r]) if rows.forced[r] >= 0 else sampling.choose(
        x[r], *sampling.choice_args(rows, r)) for r in range(R)]
    assert got.tolist() == want
    if vocab > 1000:
        assert np.count_nonzero(np.array(want) != greedy) >= 3  # rows the draw moved


@pytest.mark.parametrize("chunks", [1, 7, 64])
def test_argmax(device, chunks):
    """Both halves: the rows' chunks (7 leaves a short last one), then their best."""
    logits = rng.standard_normal((5, 49153)).astype(np.float32)
    logits[3, 100] = logits[3, 7000] = logits[3].max() + 1     # ties: the lower index wins,
    logits[4, 20000] = logits[4, 20001] = logits[4].max() + 1  # across chunks and within one
    n = logits.shape[1]
    sg = device.subgroup_size
    part = run(device, choice.argmax_chunks(sg), (5, chunks), logits,
               np.full((5, chunks), np.nan, np.float32), np.full((5, chunks), -1, np.int32), n,
               -(-n // chunks))
    got = run(device, choice.argmax(sg), (5,), part["values"], part["indices"],
              np.full(5, -1, np.int32), chunks)["token"]
    assert got.tolist() == [int(np.argmax(r)) for r in logits]


def test_feed_tokens(device):
    """A step launched ahead takes the tokens of the one before where its feed names a
    row; its other tokens, and those past n, keep what was there (poisoned here)."""
    chosen = rng.integers(0, 1 << 30, 300).astype(np.int32)
    feed = rng.integers(0, 300, 500).astype(np.int32)
    feed[rng.random(500) < 0.3] = -1
    n = 437                                         # past the workgroup's width, short of all
    got = run(device, choice.feed_tokens(), (1,), chosen, feed, np.zeros(500, np.int32),
              n)["tokens"]
    want = np.where(feed >= 0, chosen[np.maximum(feed, 0)], -1)
    want[n:] = -1
    assert got.tolist() == want.tolist()


def test_logit_edits(device):
    """A step's rows edited in place as sampling.edit_logits defines: a row with edits (past a
    workgroup's worth, bans among them), one with a mask, one with both (masked tokens among
    its edits), one with neither (left as it was); the vocabulary not a multiple of 32; each
    row by one workgroup and by three."""
    R, n = 5, 4999
    words = -(-n // 32)
    logits = (rng.standard_normal((R, n)) * 4).astype(np.float32)
    logits[:, :50] = np.abs(logits[:, :50]) + 0.5       # both signs of x among the edits
    logits[:, 50:100] = -np.abs(logits[:, 50:100]) - 0.5

    def edits(count):
        tokens = np.concatenate([rng.choice(100, min(count, 60), replace=False),
                                 100 + rng.choice(n - 100, max(count - 60, 0), replace=False)])
        add = rng.standard_normal(count).astype(np.float32)
        add[rng.random(count) < 0.1] = -np.inf
        return tokens, rng.uniform(0.3, 2.5, count).astype(np.float32), add

    rows = SamplingRows.greedy(R)
    rows.edits = LogitEdits.of(R, {0: edits(700), 2: edits(90), 4: edits(1)})
    allowed = rng.random((R, words * 32)) < 0.3
    allowed[:, n:] = False
    rows.masked = np.array([False, True, True, False, False])
    rows.masks = np.packbits(allowed, axis=1, bitorder="little").view(np.uint32)
    rows.masks[~rows.masked] = 0xFFFFFFFF
    mask_of = np.array([-1, 0, 1, -1, -1], np.int32)
    want = edit_logits(logits, rows)
    for parts in (1, 3):            # a row over one workgroup, over several
        got = run(device, choice.logit_edits(), (R, parts), logits, rows.edits.row_start,
                  rows.edits.tokens, rows.edits.repeat, rows.edits.add, mask_of,
                  rows.masks[rows.masked], n, words)["logits"]
        assert np.array_equal(got == BANNED, want == BANNED)
        assert np.array_equal(got[3], logits[3])
        np.testing.assert_allclose(got, want, rtol=3e-7, atol=0)   # a division: 2.5 ulp (Vulkan)
