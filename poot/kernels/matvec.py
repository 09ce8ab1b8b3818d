"""The decode matmul against weights in their device layout (quant.py):
y[t, m] = x[t, :] . W[m, :].

`matvec`: a subgroup streams a weight row (or a few: `rows_per`; or a share of its columns:
`split`) once for all of the step's few tokens (bandwidth-bound: each weight byte is read once
per step). Tokens beyond its `tokens` constant run in further launches over the token axis
(grid y): devices without matrix instructions run every step so. Its fused variants (a folded
norm, stacked outputs, a gated unit, a residual) are named and declared here for mma_vec.py's
kernel too, which takes the same buffers and scalars.
"""
from functools import cache

from . import activations
from .lang import F32, I32, U32, KernelBuilder
from .quant import reader
from .x16 import normed_row

WORKGROUP = 256


def matvec_unroll(dtype, streams):
    """Blocks a lane loads of each of its `streams` rows before any arithmetic: the same
    weight loads in flight per lane however many rows it streams."""
    return max(1, (4 if dtype in ("F32", "F16", "BF16") else 2) // streams)


@cache
def matvec(dtype, subgroup_size, tokens=1, unroll=None, residual=False, norm=False, outputs=1,
           glu=None, rows_per=1, split=1, normed_out=None):
    """y[t, m] for t < n_tokens; grid matvec_grid(rows, n_tokens, subgroup_size, tokens,
    rows_per, split).

    Buffers: planes of W (u32), x f32 [T, cols], y f32 [T, rows] (with `residual`: y = W x + r,
    r [T, rows] read at y's index, so r may be y itself); scalars rows, cols, n_tokens.
    cols must be a multiple of the reader's block (32 for block formats, 8 for floats).

    A subgroup streams `rows_per` consecutive rows (of each matrix) at once: each x value it
    loads (and with `norm`, each gain and square) serves all of them, so the loads of x, which
    come from cache, do not outnumber the weights' own. With `split` > 1, that many subgroups
    of the workgroup share the rows, each streaming every split-th run of the columns, and add
    their sums through shared memory (in a fixed order): for matrices of few, long rows, whose
    one-subgroup-a-row launch would leave the device's multiprocessors short of loads.

    Fused variants, each saving a launch and a round trip of its activation through memory:
    - `norm`: x is RMS-normalised first, y = W (x * g) / sqrt(mean(x^2) + eps), with g f32
      [cols] (buffer `norm`, after x) and scalar eps (last). Each subgroup streams all of x for
      its rows anyway, so it sums the squares of what it loads; no other thread is waited for.
    - `normed_out` (with `norm`; a weight format): one workgroup more, the last, writes x
      normed as norm_x16 makes it for an mma_vec of that format (buffer x16, after eps): a
      router's, for its experts' mma_vec, which chooses the routes itself.
    - `outputs` > 1: W is several matrices stacked row-wise (q, k and v) and y is split the
      same way: rows [split_i, split_i+1) go to buffer y_i as [T, split_i+1 - split_i]; scalars
      split_1 .. split_{outputs-1} follow n_tokens.
    - `glu` (an activation of kernels/activations.py): two matrices of the same shape, planes
      gate_* then up_*; a subgroup takes rows m.. of both and y[t, m] = glu(gate . x, up . x).
    """
    r = reader(dtype)
    matrices = ("gate", "up") if glu else ("w",)
    unroll = unroll or matvec_unroll(dtype, len(matrices) * rows_per)
    name = f"matvec_{dtype.lower()}_t{tokens}_u{unroll}_s{subgroup_size}"
    name += f"_r{rows_per}" * (rows_per > 1) + f"_k{split}" * (split > 1)
    name += f"_normed_{normed_out.lower()}" if normed_out is not None else ""
    k = KernelBuilder(name + variant_name(residual, norm, outputs, glu), (WORKGROUP,))
    bufs, x, gain, ys, res, rows, cols, n_tokens, splits, eps = matvec_params(
        k, dtype, residual, norm, outputs, glu)
    t0 = k.block_id(1) * tokens
    if normed_out is not None:
        if not norm:
            raise ValueError("matvec: normed_out is a norm variant's")
        x16 = k.buffer("x16", U32, "w")
        scratch = k.shared("norm_scratch", F32, WORKGROUP // subgroup_size)
        load = lambda base, i: x.load(base + i, 4)  # noqa: E731
        with k.if_(k.block_id(0).eq(k.num_blocks(0) - 1)):
            for t in range(tokens):
                with k.if_(t0 + t < n_tokens):
                    normed_row(k, normed_out, subgroup_size, gain, x16, load, load,
                               (t0 + t) * cols, cols, eps, scratch)
            k.return_()
    n_sub = WORKGROUP // subgroup_size
    if n_sub % split:
        raise ValueError(f"matvec: split {split} does not divide {n_sub} subgroups")
    sub = k.subgroup_id()
    part = sub % split if split > 1 else 0
    first = (k.block_id(0) * (n_sub // split) + (sub / split if split > 1 else sub)) * rows_per
    lane = k.lane_id()
    if split == 1:
        with k.if_(first >= rows):
            k.return_()
    # rows past the end read the last row again and store nothing (a split workgroup keeps
    # every subgroup to its barrier)
    my_rows = [first if split == 1 else k.min(first, rows - 1)] + \
        [k.min(first + i, rows - 1) for i in range(1, rows_per)]
    acc = [[[k.var(F32, 0.0) for _ in range(tokens)] for _ in my_rows] for _ in matrices]
    squares = [k.var(F32, 0.0) for _ in range(tokens)] if norm else []
    n_blocks = cols // r.block_elems
    stride = subgroup_size * unroll * split

    def accumulate(blocks):
        """Adds the blocks' products to acc; every block's loads come before any arithmetic,
        so a lane has `len(blocks)` weight loads of each row in flight. A block quant's scale
        (and low) multiplies the dot product of each of its segments once (decode_scaled)."""
        # [matrix][row][block]: the unit's segments (decode_scaled), all of one length; several
        # scales a unit (the K quants') are applied value by value where several tokens would
        # keep every segment's sums live (ptxas spills them)
        if tokens > 1 and r.scales_per_unit > 1:
            units = [[[[(r.decode(k, buf, row, block, cols), None, None)] for block in blocks]
                      for row in my_rows] for buf in bufs]
        else:
            units = [[[r.decode_scaled(k, buf, row, block, cols) for block in blocks]
                      for row in my_rows] for buf in bufs]
        segments = units[0][0][0]
        length = len(segments[0][0])                 # values a segment
        lows = any(low is not None for _, _, low in segments)
        for t in range(tokens):
            with k.if_(t0 + t < n_tokens):
                totals = [[a[t].get() for a in per_row] for per_row in acc]
                square = squares[t].get() if norm else None
                for j, block in enumerate(blocks):
                    xrow = (t0 + t) * cols + block * r.block_elems
                    for seg in range(r.block_elems // length):
                        dots = [[None for _ in matrix] for matrix in units]
                        x_sum = None
                        for i in range(seg * length, (seg + 1) * length, 4):  # 4 x values live
                            gains = gain.load(block * r.block_elems + i, 4) if norm else None
                            for e, xv in enumerate(x.load(xrow + i, 4)):
                                if norm:
                                    square = k.fma(xv, xv, square)
                                    xv = xv * gains[e]
                                if lows:
                                    x_sum = xv if x_sum is None else x_sum + xv
                                for m, matrix in enumerate(units):
                                    for q, per_block in enumerate(matrix):
                                        v = per_block[j][seg][0][i - seg * length + e]
                                        dots[m][q] = v * xv if dots[m][q] is None else \
                                            k.fma(v, xv, dots[m][q])
                        for m, matrix in enumerate(units):
                            for q in range(len(matrix)):
                                _, scale, low = matrix[q][j][seg]
                                if scale is None:
                                    totals[m][q] = totals[m][q] + dots[m][q]
                                    continue
                                totals[m][q] = k.fma(dots[m][q], scale, totals[m][q])
                                if low is not None:
                                    totals[m][q] = k.fma(low, x_sum, totals[m][q])
                for per_row, row_totals in zip(acc, totals):
                    for a, total in zip(per_row, row_totals):
                        a[t].set(total)
                if norm:
                    squares[t].set(square)

    # a round: `unroll` runs of subgroup_size blocks for each of the split subgroups
    whole = n_blocks / stride * stride               # blocks in whole unrolled rounds
    with k.for_(lane + part * (subgroup_size * unroll), whole, stride) as block:
        accumulate([block + u * subgroup_size for u in range(unroll)])
    with k.for_(whole + lane + part * subgroup_size, n_blocks, subgroup_size * split) as block:
        accumulate([block])
    # per token: each matrix's and row's sum, then the sum of squares
    sums = [[[k.subgroup_add(per_row[q][t].get()) for per_row in acc] for q in range(rows_per)]
            + ([[k.subgroup_add(squares[t].get())]] if norm else []) for t in range(tokens)]
    if split > 1:
        flat = [v for per_token in sums for per_row in per_token for v in per_row]
        shared = k.shared("sums", F32, n_sub * len(flat))
        with k.if_(lane.eq(0)):
            for i, v in enumerate(flat):
                shared[sub * len(flat) + i] = v
        k.barrier()
        base = (sub - part) * len(flat)             # the first subgroup of these rows
        totals = []
        for i in range(len(flat)):
            total = shared[base + i]
            for j in range(1, split):
                total = total + shared[base + j * len(flat) + i]
            totals.append(total)
        it = iter(totals)
        sums = [[[next(it) for _ in per_row] for per_row in per_token] for per_token in sums]
    for t in range(tokens):
        scale = None
        if norm:
            scale = k.rsqrt(sums[t][rows_per][0] / cols.to(F32) + eps)
        for q in range(rows_per):
            row = first + q
            row_sums = [v * scale for v in sums[t][q]] if norm else sums[t][q]
            ours = lane.eq(0) if split == 1 else lane.eq(0) & part.eq(0)
            with k.if_(ours & (t0 + t < n_tokens) & (row < rows)):
                store_row(k, ys, res, splits, rows, t0 + t, row, row_sums, glu)
    return k.build()


def store_row(k, ys, res, splits, rows, token, row, sums, glu):
    """Stores a matvec variant's value (mma_vec's too) of one row and token: the gated unit of
    the row's two sums with `glu`, else its sum; plus the residual (res, read at y's index), or
    into the stacked output its row falls in (splits)."""
    value = activations.glu(k, glu, *sums) if glu else sums[0]
    bounds = [None, *splits, rows]
    for i, y in enumerate(ys):
        if len(ys) == 1:
            at = token * rows + row
            y[at] = value + res[at] if res is not None else value
            continue
        start, end = bounds[i] or 0, bounds[i + 1]
        inside = row < end if i == 0 else (row >= start) & (row < end)
        with k.if_(inside):
            y[token * (end - start) + row - start] = value


def variant_name(residual, norm, outputs, glu):
    """The name suffix of a matvec variant (mma_vec's too), once checked."""
    if residual and (outputs > 1 or glu):
        raise ValueError("matvec: a residual is added to one plain output only")
    if glu and outputs > 1:
        raise ValueError("matvec: a gated unit writes one output")
    return "_norm" * norm + f"_split{outputs}" * (outputs > 1) + \
        (f"_{activations.UNITS[glu]}" if glu else "") + "_residual" * residual


def matvec_params(k, dtype, residual, norm, outputs, glu, x16=False):
    """A matvec variant's parameters, declared on k in their order (mma_vec takes the same):
    (W's planes by matrix, x, norm gain, outputs, residual, rows, cols, n_tokens, splits, eps),
    None where the variant has none; with x16 (mma_vec's) x is u32 words of rounded pairs."""
    matrices = ("gate", "up") if glu else ("w",)
    bufs = [{p: k.buffer(f"{m}_{p}", U32) for p in reader(dtype).plane_names} for m in matrices]
    x = k.buffer("x16", U32) if x16 else k.buffer("x", F32)
    gain = k.buffer("norm", F32) if norm else None
    ys = [k.buffer("y" if outputs == 1 else f"y{i}", F32, "w") for i in range(outputs)]
    res = k.buffer("residual", F32) if residual else None
    rows, cols, n_tokens = k.scalar("rows", I32), k.scalar("cols", I32), k.scalar("n_tokens", I32)
    splits = [k.scalar(f"split_{i}", I32) for i in range(1, outputs)]
    eps = k.scalar("eps", F32) if norm else None
    return bufs, x, gain, ys, res, rows, cols, n_tokens, splits, eps


def matvec_grid(rows, n_tokens, subgroup_size, tokens=1, rows_per=1, split=1):
    """The grid of a matvec launch over `rows` rows and n_tokens tokens."""
    per_group = WORKGROUP // subgroup_size // split * rows_per
    return (-(-rows // per_group), -(-n_tokens // tokens))


MATVEC_WORKGROUPS_PER_SM = 4     # a launch with fewer splits its rows' columns over subgroups
MAX_MATVEC_SPLIT = 8


def matvec_split(dtype, rows, cols, subgroup_size, rows_per, multiprocessors, matrices=1):
    """The `split` of a matvec over a [rows, cols] matrix: doubled while the launch has fewer
    than MATVEC_WORKGROUPS_PER_SM workgroups a multiprocessor and each subgroup would still
    stream at least a whole unrolled run of blocks a lane."""
    n_sub = WORKGROUP // subgroup_size
    lane_blocks = cols // reader(dtype).block_elems // subgroup_size
    unroll = matvec_unroll(dtype, matrices * rows_per)
    split = 1
    while (split * 2 <= min(MAX_MATVEC_SPLIT, n_sub)
           and matvec_grid(rows, 1, subgroup_size, 1, rows_per, split)[0]
           < MATVEC_WORKGROUPS_PER_SM * multiprocessors
           and lane_blocks // (split * 2) >= unroll):
        split *= 2
    return split
