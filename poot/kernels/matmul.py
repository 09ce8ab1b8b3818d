"""Matrix products against weights in their device layout (quant.py): y[t, m] = x[t, :] . W[m, :].

`matvec` is the decode kernel: a subgroup per weight row streams the row once for all of the
step's few tokens (bandwidth-bound: each weight byte is read once per step). Tokens beyond its
`tokens` constant run in further launches over the token axis (grid y). `tiled` is written for
many tokens (prefill, large batches): a workgroup computes a 64-token x 64-row tile, decoding
each weight block once into shared memory for all 64 tokens. It is checked on every target but
the runner does not route to it yet: its first version measured slower than the grouped matvec
on the H200 (docs/benchmarks.md), and this one is not yet timed there.
"""
from functools import cache

from .lang import F32, I32, U32, KernelBuilder
from .quant import reader

WORKGROUP = 256


@cache
def matvec(dtype, subgroup_size, tokens=1, unroll=None, residual=False, norm=False, outputs=1,
           swiglu=False):
    """y[t, m] for t < n_tokens; grid (ceil(rows / subgroups per workgroup), ceil(T / tokens)).

    Buffers: planes of W (u32), x f32 [T, cols], y f32 [T, rows] (with `residual`: y = W x + r,
    r [T, rows] read at y's index, so r may be y itself); scalars rows, cols, n_tokens.
    cols must be a multiple of the reader's block (32 for block formats, 8 for floats).

    Fused variants, each saving a launch and a round trip of its activation through memory:
    - `norm`: x is RMS-normalised first, y = W (x * g) / sqrt(mean(x^2) + eps), with g f32
      [cols] (buffer `norm`, after x) and scalar eps (last). Each subgroup streams all of x for
      its row anyway, so it sums the squares of what it loads; no other thread is waited for.
    - `outputs` > 1: W is several matrices stacked row-wise (q, k and v) and y is split the
      same way: rows [split_i, split_i+1) go to buffer y_i as [T, split_i+1 - split_i]; scalars
      split_1 .. split_{outputs-1} follow n_tokens.
    - `swiglu`: two matrices of the same shape, planes gate_* then up_*; a subgroup takes row m
      of both and y[t, m] = silu(gate . x) * (up . x).
    """
    if residual and (outputs > 1 or swiglu):
        raise ValueError("matvec: a residual is added to one plain output only")
    if swiglu and outputs > 1:
        raise ValueError("matvec: swiglu writes one output")
    r = reader(dtype)
    matrices = ("gate", "up") if swiglu else ("w",)
    # the same weight loads in flight per lane whether it streams one row or two
    unroll = unroll or (4 if dtype in ("F32", "F16", "BF16") else 2) // len(matrices)
    name = f"matvec_{dtype.lower()}_t{tokens}_u{unroll}_s{subgroup_size}"
    name += "_norm" * norm + f"_split{outputs}" * (outputs > 1) + "_swiglu" * swiglu
    name += "_residual" * residual
    k = KernelBuilder(name, (WORKGROUP,))
    bufs = [{p: k.buffer(f"{m}_{p}", U32) for p in r.plane_names} for m in matrices]
    x = k.buffer("x", F32)
    gain = k.buffer("norm", F32) if norm else None
    ys = [k.buffer("y" if outputs == 1 else f"y{i}", F32, "w") for i in range(outputs)]
    res = k.buffer("residual", F32) if residual else None

    rows, cols, n_tokens = k.scalar("rows", I32), k.scalar("cols", I32), k.scalar("n_tokens", I32)
    splits = [k.scalar(f"split_{i}", I32) for i in range(1, outputs)]
    eps = k.scalar("eps", F32) if norm else None
    row = k.block_id(0) * (WORKGROUP // subgroup_size) + k.subgroup_id()
    t0 = k.block_id(1) * tokens
    lane = k.lane_id()
    with k.if_(row >= rows):
        k.return_()
    acc = [[k.var(F32, 0.0) for _ in range(tokens)] for _ in matrices]
    squares = [k.var(F32, 0.0) for _ in range(tokens)] if norm else []
    n_blocks = cols // r.block_elems
    stride = subgroup_size * unroll

    def accumulate(blocks):
        """Adds the blocks' products to acc; every block's loads come before any arithmetic,
        so a lane has `len(blocks)` weight loads in flight."""
        values = [[r.decode(k, buf, row, block, cols) for block in blocks] for buf in bufs]
        for t in range(tokens):
            with k.if_(t0 + t < n_tokens):
                totals = [a[t].get() for a in acc]
                square = squares[t].get() if norm else None
                for j, block in enumerate(blocks):
                    xrow = (t0 + t) * cols + block * r.block_elems
                    for i in range(0, r.block_elems, 4):     # 4 x values live at a time
                        gains = gain.load(block * r.block_elems + i, 4) if norm else None
                        for e, xv in enumerate(x.load(xrow + i, 4)):
                            if norm:
                                square = k.fma(xv, xv, square)
                                xv = xv * gains[e]
                            for m, matrix in enumerate(values):
                                totals[m] = k.fma(matrix[j][i + e], xv, totals[m])
                for a, total in zip(acc, totals):
                    a[t].set(total)
                if norm:
                    squares[t].set(square)

    whole = n_blocks / stride * stride               # blocks in whole unrolled rounds
    with k.for_(lane, whole, stride) as block:
        accumulate([block + u * subgroup_size for u in range(unroll)])
    with k.for_(whole + lane, n_blocks, subgroup_size) as block:
        accumulate([block])
    for t in range(tokens):
        sums = [k.subgroup_add(a[t].get()) for a in acc]
        if norm:
            scale = k.rsqrt(k.subgroup_add(squares[t].get()) / cols.to(F32) + eps)
            sums = [s * scale for s in sums]
        with k.if_((lane.eq(0)) & (t0 + t < n_tokens)):
            if swiglu:
                gate, up = sums
                value = gate / (1.0 + k.exp(-gate)) * up
            else:
                value = sums[0]
            bounds = [None, *splits, rows]
            for i, y in enumerate(ys):
                if outputs == 1:
                    at = (t0 + t) * rows + row
                    y[at] = value + res[at] if residual else value
                    continue
                first, end = bounds[i] or 0, bounds[i + 1]
                inside = row < end if i == 0 else (row >= first) & (row < end)
                with k.if_(inside):
                    y[(t0 + t) * (end - first) + row - first] = value
    return k.build()


TILE = 64            # tokens and rows of a tiled workgroup's output; 4 x 4 per thread


def tile_depth(dtype):
    """Columns of one step of the tiled kernel: whole decode units, at least 32."""
    unit = reader(dtype).block_elems
    return max(unit, 32)


@cache
def tiled(dtype, residual=False):
    """y[t, m] for t < n_tokens by 64 x 64 tiles; grid (ceil(rows / 64), ceil(T / 64)).

    Same buffers and scalars as matvec; cols must be a multiple of tile_depth(dtype). Each step
    over the columns stages x [64 tokens x depth] and the dequantised W [64 rows x depth] in
    shared memory; thread (tx, ty) accumulates rows tx + 16j and tokens ty + 16i. A W row's
    columns are rotated by the row number, so the 16 consecutive rows a warp reads at one
    column fall in 16 different banks (the x reads are broadcasts).
    """
    r = reader(dtype)
    depth = tile_depth(dtype)
    units = depth // r.block_elems
    name = f"tiled_{dtype.lower()}" + "_residual" * residual
    k = KernelBuilder(name, (WORKGROUP,))
    buf = {name: k.buffer(f"w_{name}", U32) for name in r.plane_names}
    x = k.buffer("x", F32)
    y = k.buffer("y", F32, "w")
    res = k.buffer("residual", F32) if residual else None
    rows, cols, n_tokens = k.scalar("rows", I32), k.scalar("cols", I32), k.scalar("n_tokens", I32)
    xs = k.shared("xs", F32, TILE * depth)
    ws = k.shared("ws", F32, TILE * depth)
    rotate = depth - 1                              # depth is a power of two
    tid = k.thread_id()
    tx, ty = tid % 16, tid / 16
    m0, t0 = k.block_id(0) * TILE, k.block_id(1) * TILE
    acc = [[k.var(F32, 0.0) for _ in range(4)] for _ in range(4)]
    with k.for_(0, cols, depth) as c0:
        # stage x: TILE * depth floats, 4 at a time
        with k.for_(tid * 4, TILE * depth, WORKGROUP * 4) as i:
            t, c = i / depth, i % depth
            inside = t0 + t < n_tokens
            values = x.load(k.select(inside, (t0 + t) * cols + c0 + c, 0), 4)
            for e, v in enumerate(values):
                xs[t * depth + c + e] = k.select(inside, v, 0.0)
        # stage W: TILE rows x `units` decode units, one unit per thread at a time
        with k.for_(tid, TILE * units, WORKGROUP) as j:
            row, u = j / units, j % units
            m = k.min(m0 + row, rows - 1)           # rows past the end decode a real row
            for e, v in enumerate(r.decode(k, buf, m, c0 / r.block_elems + u, cols)):
                ws[row * depth + ((u * r.block_elems + e + row) & rotate)] = v
        k.barrier()
        with k.for_(0, depth) as c:
            a = [xs[(ty + 16 * i) * depth + c] for i in range(4)]
            b = [ws[(tx + 16 * j) * depth + ((c + tx + 16 * j) & rotate)] for j in range(4)]
            for i in range(4):
                for j in range(4):
                    acc[i][j].set(k.fma(a[i], b[j], acc[i][j].get()))
        k.barrier()
    for i in range(4):
        t = t0 + ty + 16 * i
        for j in range(4):
            m = m0 + tx + 16 * j
            with k.if_((t < n_tokens) & (m < rows)):
                at = t * rows + m
                y[at] = acc[i][j].get() + res[at] if residual else acc[i][j].get()
    return k.build()
