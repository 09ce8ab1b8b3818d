"""Matrix products on the tensor cores against weights in their device layout (quant.py):
y[t, m] = x[t, :] . W[m, :]. (The decode matmul of devices without them, and of short steps of
weights mma_vec.py does not decode, is matvec.py's; the runner names it here too.)

`mma_tiled` is the kernel of devices with matrix instructions (lang.py's fragment_load and mma)
for every step of the runner's mma_min_tokens or more (engine/kernel_choice.py; shorter ones run
mma_vec.py's kernel where it decodes the model's weights, from mma_vec.least_tokens): 128 x 128
tiles on the tensor cores, operands rounded to f16 (bf16 for BF16 weights). Where its tiles
would not fill the device (decode-sized steps, small matrices) it is split along the columns
(mma_launch): each slice writes a partial tile and `split_sum` adds them, in a fixed order.
Other pipelines of mma_tiled (MMA_VARIANTS: async copies a few steps ahead, x rounded once
beforehand by `mma_x16`, deeper steps, Hopper's wgmma) are measured by scripts/bench-matmul; the
runner picks one per weight format and device (kernel_choice.mma_choice). `dequant_f16` decodes
a weight to f16 once, for long steps that then run F16's tiles over it.
"""
from dataclasses import dataclass
from functools import cache

from . import activations
from .lang import BF16, BOX_COLS, F16, F32, I32, U32, U64, KernelBuilder
from .matvec import WORKGROUP, store_row, variant_name
from .matvec import matvec, matvec_grid, matvec_split  # noqa: F401 (the runner's matmul.matvec)
from .quant import reader
from .x16 import mma_operand, pack

# mma_tiled: a workgroup of 8 subgroups computes `tokens` (MMA_TOKENS, or 32 or 64 for short
# steps, whose workgroups would otherwise compute rows of tokens that are not there) x
# MMA_ROWS of y, `depth` (MMA_DEPTH unless asked) columns a step; subgroup w owns tokens
# tokens/2 (w % 2).. and rows 32 (w // 2)... Shared tiles hold a row (a token of x, a row of W) as
# `depth` 16-bit values in u32 words, padded by 16 bytes so the 8 rows one fragment_load reads
# start depth/2 + 4 words apart: in 8 different groups of 4 banks.
MMA_TOKENS, MMA_ROWS, MMA_DEPTH = 128, 128, 64
MMA_TOKEN_TILES = (32, 64, MMA_TOKENS)
# wgmma's widest n: a 128-row x 256-token tile reads a quarter fewer bytes of W and x a product
# than two 128-token tiles (mma_launch's `wide`)
WIDE_TOKENS = 256
MMA_DEPTHS = (64, 128)
# wgmma (sm_90a): each warpgroup's 64 rows of the 128-row tile, steps of 64 columns (a row's
# 128 bytes: one swizzle span), tiles aligned to the 1024 bytes of a swizzle pattern.
WGMMA_ROWS, WGMMA_DEPTH, WGMMA_ALIGN = 64, 64, 1024
MMA_WORKGROUP = 256
ROW_WORDS = MMA_DEPTH // 2 + 4
WARP_ROWS = 32
# A matmul whose tiles give fewer workgroups than the device has multiprocessors (decode-sized
# steps, small matrices) is split along its columns: about SPLIT_BLOCKS_PER_SM workgroups a
# multiprocessor, each slice at least MIN_SPLIT_STEPS steps long, since every slice writes a
# whole partial tile.
SPLIT_BLOCKS_PER_SM = 2
MIN_SPLIT_STEPS = 2
# Shared memory of a workgroup that lets two run on a multiprocessor of sm_90 (228 KiB, 1 KiB of
# it reserved a workgroup): a staged mma_tiled that fits asks for registers that let two in too.
TWO_RESIDENT_SHARED = 113 * 1024
# The pipelines scripts/bench-matmul measures against each other, as mma_tiled's keywords
# (mma_tiled's docstring says what each changes); kernel_choice.mma_choice names the one a
# device runs.
MMA_VARIANTS = {
    "regs": {},
    "x16": {"x16": True},
    "s3": {"stages": 3},
    "s4": {"stages": 4},
    "s3x16": {"stages": 3, "x16": True},
    "s4x16": {"stages": 4, "x16": True},
    "d128s2x16": {"depth": 128, "stages": 2, "x16": True},
    "wg3": {"stages": 3, "x16": True, "wgmma": True},
    "wg4": {"stages": 4, "x16": True, "wgmma": True},
    "wg3f1": {"stages": 3, "x16": True, "wgmma": True, "in_flight": 1},
    "wg4f1": {"stages": 4, "x16": True, "wgmma": True, "in_flight": 1},
    "wg5f1": {"stages": 5, "x16": True, "wgmma": True, "in_flight": 1},
    "wg4t": {"stages": 4, "x16": True, "wgmma": True, "in_flight": 1, "tensor_copy": True},
    "wg5t": {"stages": 5, "x16": True, "wgmma": True, "in_flight": 1, "tensor_copy": True},
}


def a_fragment_index(lane, token, step, row_words=ROW_WORDS):
    """The word of the x tile this lane names to fragment_load for mma's `a`: the 16 x 16 block
    of tokens token.. and columns 16 step.. (matrices: tokens 0-7 of columns 0-7, tokens 8-15,
    then the same of columns 8-15). An int for an int lane, a Value for a Value."""
    return (token + (lane & 15)) * row_words + step * 8 + (lane >> 4) * 4


def b_fragment_index(lane, row, step, row_words=ROW_WORDS):
    """The word of the W tile this lane names for `b` of two mma n-tiles, rows row.. and
    row + 8.., columns 16 step..: matrices (rows 0-7, columns 0-7), (0-7, 8-15) make the first
    n-tile's `b`, then the same of rows 8-15 the second's."""
    return (row + (lane & 7) + (lane >> 4) * 8) * row_words + step * 8 + ((lane >> 3) & 1) * 4


def accumulator_position(lane, j):
    """(token, row) within a 16 x 8 mma tile of accumulator value j of `lane`."""
    return (lane >> 2) + 8 * (j >> 1), 2 * (lane & 3) + (j & 1)


@cache
def mma_tiled(dtype, residual=False, tokens=MMA_TOKENS, split=False, depth=MMA_DEPTH,
              stages=None, x16=False, outputs=1, wgmma=False, in_flight=0, glu=None,
              glu_x16=None, tensor_copy=False):
    """y[t, m] for t < n_tokens on matrix instructions; grid (ceil(T / tokens), ceil(rows / 128))
    (mma_launch picks tokens and the split; MmaLaunch.grid). The token tiles are the grid's
    first axis, so the workgroups that run at once are every token tile of a few W tiles: each
    W tile is read from memory once while x, read by all, stays in the L2 cache.

    Same buffers and scalars as matvec (cols a multiple of 8, and of the reader's block), so
    the runner swaps it in for long steps. Each step of `depth` columns: x [tokens x depth] is
    rounded to the operand type (mma_operand: f16, bf16 for BF16 weights) and W [128 rows x
    depth] is copied (F16, BF16) or decoded and rounded to f16 (F32, block quants) into shared
    memory; then each subgroup runs depth / 16 k-steps of mma (m16n8k16) over its tokens / 2 x
    32 rows, accumulating in f32 registers. By default the next step's x and F16/BF16 W are
    loaded into registers before this step's mma, so their latency hides behind the tensor
    cores. Edges: tokens past n_tokens read x's first values and rows past `rows` read row
    rows - 1 (neither is stored), columns past cols read as zeros.

    `split`: grid z is a slice of the columns, split_columns(z, split_cols, cols) (a further
    scalar split_cols, a multiple of `depth`), and the buffer y is `partials`
    [slices, n_tokens, rows]: each workgroup stores its slice's partial tile there, and
    split_sum adds the slices (and the residual) into y.

    `outputs` > 1 (unsplit, no residual): the rows are those of weights stacked row-wise (q, k
    and v), each part's rows stored to its own output y0, y1, ... as matvec's stacked outputs
    are (store_row; scalars split_1.. after n_tokens: the first row of each part but the first).

    Pipelines (MMA_VARIANTS; kernel_choice.mma_choice names a device's). Decode steps stream W
    once and are bound by how many of its bytes are in flight. The default holds one step (16 KB
    of W) a workgroup in registers, and only from its loads, after the second barrier of a step,
    to its stores, after the first barrier of the next: the wait at a barrier for the slowest
    subgroup is time with nothing of its own in flight.
    - `stages` S (2 or more; F16 and BF16 weights, whose words are operands as they are): W
      goes straight into shared memory by copy_async (cp.async) into a ring of S tiles, S - 1
      steps ahead of the mma: (S - 1) x 16 KB of W in flight a workgroup all the time, in no
      register, and one barrier a step (the one after the wait for this step's copies also
      says every subgroup is done with the tile the next copies overwrite). x (f32) is loaded
      into registers before a step's mma and rounded into the next slot after them. Shared
      memory: S x (x tile + W tile), 27 KiB a stage for 64 tokens, 36 KiB for 128; past 48 KiB
      it is dynamic (codegen/ptx.py), and two workgroups a multiprocessor (what the registers
      allow at 256 threads and 65-128 each) fit while it is at most ~113 KiB.
    - `x16`: the buffer is `x16`, u32 [T, cols / 2], x already rounded to the operand pairwise
      (mma_x16, once per matmul input, which q, k and v share). A workgroup reads 2 bytes of x
      a value instead of 4, converts nothing, and with `stages` copies x by copy_async too, so
      no register waits for memory.
    - `depth` 128: a step reads 256 contiguous bytes of each W row instead of 128 and has half
      the barriers per byte; its tiles are twice the size (51 KiB a stage for 64 tokens).
    - `wgmma` (with `stages` and `x16`; F16 and BF16; sm_90a): the products run on the
      warpgroup matrix instructions instead of mma: each of the two warpgroups multiplies its
      64 rows of the W tile by all `tokens` tokens of the x tile (W as A, x as B: m64 n=tokens
      k16), reading both straight from shared memory, where a row (of W, or a token of x) is its
      step's 128 bytes with their 16-byte parts swizzled (part p of row r at p ^ (r % 8):
      wgmma_descriptor). A step's wgmma run while the next copies are started; every thread
      waits for them before the step's end, so the ring slot the next step's copies overwrite
      is free once all have passed its barrier.
    - `in_flight` 1 (with wgmma): a step waits only for the step before's wgmma, so the tensor
      cores always have the next step's queued; the copies then run S - 2 steps ahead (the
      slot of the step before the last is the one known free at a step's barrier).
    - `tensor_copy` (with wgmma and in_flight; sm_90a; cols a multiple of 8): one thread starts
      a step's tiles as three tensor copies (lang.tensor_load: W's two 64-row boxes, x's box of
      `tokens` rows), which swizzle as wgmma reads and write zeros past the matrices; each ring
      slot has a transaction barrier that every thread waits on instead of copy_wait. No
      thread computes an address or issues a copy of its own.

    `glu` (an activation; with wgmma, unsplit): W is a gated unit's gate rows stacked on its
    up rows (`rows` both, half each) and a tile takes 64 of each, the first warpgroup gate's
    and the second up's of the same units, so that it stores the unit itself: y [n_tokens,
    half], grid (..., ceil(half / 64)) (MmaLaunch.unit_grid). The second warpgroup's sums
    reach the first through shared memory, each thread's to its twin, which holds gate's sums
    of the same places.
    With `glu_x16` (the weight format of the x16 matmul that reads the unit next) the buffer is
    `y16`, u32 [n_tokens, half / 2], the units rounded to that matmul's operand two a word
    (split_sum's x16 words; half even).
    """
    if split and residual:
        raise ValueError("a split mma_tiled leaves the residual to split_sum")
    if outputs > 1 and (split or residual):
        raise ValueError("mma_tiled: stacked outputs are stored unsplit and with no residual "
                         "(split_sum routes a split launch's rows)")
    if tokens not in MMA_TOKEN_TILES and not (wgmma and tokens == WIDE_TOKENS):
        raise ValueError(f"mma_tiled: a token tile is one of {MMA_TOKEN_TILES} ({WIDE_TOKENS} "
                         f"on wgmma), not {tokens}")
    if depth not in MMA_DEPTHS:
        raise ValueError(f"mma_tiled: a step is one of {MMA_DEPTHS} columns, not {depth}")
    raw = dtype in ("F16", "BF16")                 # words already hold operand pairs
    if stages is not None and (stages < 2 or not raw):
        raise ValueError(f"mma_tiled: stages (2 or more) copy F16 or BF16 words as they are; "
                         f"got {stages} for {dtype}")
    if wgmma and not (stages and x16 and depth == WGMMA_DEPTH):
        raise ValueError(f"mma_tiled: wgmma reads staged x16 tiles of {WGMMA_DEPTH} columns")
    if in_flight not in (0, 1) or in_flight and not (wgmma and stages >= 3):
        raise ValueError("mma_tiled: in_flight 1 keeps a wgmma step running, 3 stages or more")
    if glu and not wgmma or glu and (split or residual or outputs > 1) or glu_x16 and not glu:
        raise ValueError("mma_tiled: a gated unit's tiles are unsplit wgmma ones storing it alone")
    if tensor_copy and not in_flight:
        raise ValueError("mma_tiled: tensor copies feed the in_flight wgmma pipeline")
    r = reader(dtype)
    operand = mma_operand(dtype)
    name = f"mma_tiled_{dtype.lower()}" + f"_t{tokens}" * (tokens != MMA_TOKENS) + \
        f"_d{depth}" * (depth != MMA_DEPTH) + f"_s{stages}" * bool(stages) + "_x16" * x16 + \
        "_wgmma" * wgmma + f"_f{in_flight}" * bool(in_flight) + "_tma" * tensor_copy + \
        "_split" * split + \
        "_residual" * residual + f"_out{outputs}" * (outputs > 1) + \
        (f"_{activations.UNITS[glu]}" if glu else "") + \
        (f"_x16_{mma_operand(glu_x16).name}" if glu_x16 else "")
    row_words = WGMMA_DEPTH // 2 if wgmma else depth // 2 + 4
    x_tile, w_tile = tokens * row_words, MMA_ROWS * row_words
    two = stages and (stages * (x_tile + w_tile) * 4 <= TWO_RESIDENT_SHARED)
    k = KernelBuilder(name, (MMA_WORKGROUP,), resident=2 if two else 1)
    buf = {name: k.buffer(f"w_{name}", U32) for name in r.plane_names}
    x = k.buffer("x16", U32) if x16 else k.buffer("x", F32)
    if outputs > 1:
        ys = [k.buffer(f"y{i}", F32, "w") for i in range(outputs)]
    elif glu_x16:
        y16 = k.buffer("y16", U32, "w")
    else:
        y = k.buffer("partials" if split else "y", F32, "w")
    res = k.buffer("residual", F32) if residual else None
    rows, cols, n_tokens = k.scalar("rows", I32), k.scalar("cols", I32), k.scalar("n_tokens", I32)
    parts_at = [k.scalar(f"split_{i}", I32) for i in range(1, outputs)]
    align = WGMMA_ALIGN if wgmma else 16
    xs = k.shared("xs", U32, (stages or 1) * x_tile, align)
    ws = k.shared("ws", U32, (stages or 1) * w_tile, align)
    tid, lane, warp = k.thread_id(), k.lane_id(), k.subgroup_id()
    m0, t0 = k.block_id(1) * MMA_ROWS, k.block_id(0) * tokens
    if glu:                         # W tile row r: gate's unit g0 + r, then up's g0 + r - 64
        g0, half = k.block_id(1) * WGMMA_ROWS, rows / 2
    if split:
        piece = k.block_id(2)
        begin, end = split_columns(piece, k.scalar("split_cols", I32), cols, k.min)
    else:
        begin, end = k.const(0, I32), cols

    # A thread moves x and W in parts of 16 bytes: 4 f32 of x, or 4 words (8 values) of W or x16.
    x_values = 8 if x16 else 4
    x_row_parts, w_row_parts = depth // x_values, depth // 8
    x_parts = tokens * x_row_parts // MMA_WORKGROUP
    w_parts = MMA_ROWS * w_row_parts // MMA_WORKGROUP
    x_shift, w_shift = x_row_parts.bit_length() - 1, w_row_parts.bit_length() - 1

    def place(row, part, words):
        """The shared word of a row's part of `words` words (4: 16 bytes), swizzled for wgmma."""
        return row * row_words + (part ^ (row & 7) if wgmma else part) * words

    # The selects that zero columns past the end come at the stores, so that nothing waits for a
    # prefetch's loads until the next step. (A slice's end is a whole step but for the last, so
    # `end` masks the prefetch past a slice and the same columns past cols as `cols` would.)
    def x_part(p, c0):
        """(shared word, x element or x16 word, inside) of part p: 4 or 8 values of a token."""
        i = tid + p * MMA_WORKGROUP
        row, part = i >> x_shift, i & (x_row_parts - 1)
        t, c = t0 + row, c0 + part * x_values
        at = t * cols + c
        return place(row, part, x_values // 2), at >> 1 if x16 else at, \
            (t < n_tokens) & (c < end)

    def w_part(p, c0):
        """(shared word, W word, inside) of part p: 4 words (8 values) of a row."""
        i = tid + p * MMA_WORKGROUP
        row, part = i >> w_shift, i & (w_row_parts - 1)
        c = c0 + part * 8
        if glu:
            unit = k.min(g0 + (row & (WGMMA_ROWS - 1)), half - 1)
            m = k.select(row < WGMMA_ROWS, unit, half + unit)
        else:
            m = k.min(m0 + row, rows - 1)
        return place(row, part, 4), m * r.row_words("values", cols) + (c >> 1), c < end

    def fetch_x(c0):
        values = []
        for p in range(x_parts):
            _, at, inside = x_part(p, c0)
            values += x.load(k.select(inside, at, 0), 4)
        return values

    def fetch_w_words(c0):
        words = []
        for p in range(w_parts):
            _, at, inside = w_part(p, c0)
            words += buf["values"].load(k.select(inside, at, 0), 4)
        return words

    def store_x(values, c0, base=0):
        for p in range(x_parts):
            to, _, inside = x_part(p, c0)
            if x16:
                xs.store(base + to, *[k.select(inside, w, 0) for w in values[4 * p:4 * p + 4]])
                continue
            v = [k.select(inside, value, 0.0) for value in values[4 * p:4 * p + 4]]
            xs.store(base + to, pack(k, operand, v[0], v[1]), pack(k, operand, v[2], v[3]))

    def store_w_words(words, c0):
        for p in range(w_parts):
            to, _, inside = w_part(p, c0)
            ws.store(to, *[k.select(inside, w, 0) for w in words[4 * p:4 * p + 4]])

    def decode_w(c0):
        """Block quants: each thread decodes whole units of a W row into the shared tile."""
        unit = r.block_elems
        units = depth // unit
        n_units = cols / unit
        with k.for_(tid, MMA_ROWS * units, MMA_WORKGROUP) as j:
            row, u = j / units, j % units
            m = k.min(m0 + row, rows - 1)
            block = c0 / unit + u
            inside = block < n_units
            values = r.decode(k, buf, m, k.min(block, n_units - 1), cols)
            words = [pack(k, operand, k.select(inside, values[e], 0.0),
                          k.select(inside, values[e + 1], 0.0)) for e in range(0, unit, 2)]
            for e in range(0, unit // 2, 4):
                ws.store(row * row_words + u * (unit // 2) + e, *words[e:e + 4])

    if tensor_copy:
        w_map = k.tensor_map("w_map", buf["values"], "cols", "rows", WGMMA_ROWS)
        x_map = k.tensor_map("x_map", x, "cols", "n_tokens", tokens)
        full = k.shared("full", U64, stages)            # a ring slot's transaction barrier
        phase = k.var(I32, 0)                           # the phase of this step's slot
        with k.if_(tid.eq(0)):
            for s in range(stages):
                k.barrier_init(full, s, 1)
        k.barrier()
        if glu:
            w_rows = (g0, half + g0)
        else:
            w_rows = (m0, m0 + WGMMA_ROWS)

    def tensor_step(c0, slot):
        """Thread 0 starts the step at column c0 into ring slot `slot` (none past the slice)."""
        with k.if_(tid.eq(0) & (c0 < end)):
            k.barrier_expect(full, slot, (MMA_ROWS + tokens) * BOX_COLS * 2)
            for half_tile, row in enumerate(w_rows):
                k.tensor_load(w_map, ws, slot * w_tile + half_tile * WGMMA_ROWS * row_words, c0,
                              row, full, slot)
            k.tensor_load(x_map, xs, slot * x_tile, c0, t0, full, slot)

    def copy_step(c0, slot):
        """Starts the copies of the step at column c0 into ring slot `slot`, as one batch."""
        if tensor_copy:
            return tensor_step(c0, slot)
        for p in range(w_parts):
            to, at, inside = w_part(p, c0)
            k.copy_async(ws, slot * w_tile + to, buf["values"], k.select(inside, at, 0), inside)
        for p in range(x_parts if x16 else 0):
            to, at, inside = x_part(p, c0)
            k.copy_async(xs, slot * x_tile + to, x, k.select(inside, at, 0), inside)
        k.copy_commit()

    warp_tokens = tokens // 2
    wt, wn = (warp & 1) * warp_tokens, (warp >> 1) * WARP_ROWS
    tiles_t, tiles_n = warp_tokens // 16, WARP_ROWS // 8
    if wgmma:
        acc = [k.var(F32, 0.0) for _ in range(tokens // 2)]
    else:
        acc = [[[k.var(F32, 0.0) for _ in range(4)] for _ in range(tiles_n)]
               for _ in range(tiles_t)]

    def compute_wgmma(slot):
        """Starts the step's wgmma: this warpgroup's 64 W rows (A) by the tile's tokens (B)."""
        a = k.shared_address(ws, slot * w_tile + (warp >> 2) * (WGMMA_ROWS * row_words))
        b = k.shared_address(xs, slot * x_tile)
        k.wgmma_fence()
        for ks in range(WGMMA_DEPTH // 16):
            k.wgmma(operand, wgmma_descriptor(k, a + 32 * ks), wgmma_descriptor(k, b + 32 * ks),
                    acc)
        k.wgmma_commit()

    def compute(slot=0):
        for ks in range(depth // 16):
            a = [k.fragment_load(xs, slot * x_tile + a_fragment_index(lane, wt + 16 * i, ks,
                                                                      row_words))
                 for i in range(tiles_t)]
            b = []
            for pair in range(tiles_n // 2):
                words = k.fragment_load(ws, slot * w_tile + b_fragment_index(
                    lane, wn + 16 * pair, ks, row_words))
                b += [words[:2], words[2:]]
            for i in range(tiles_t):
                for j in range(tiles_n):
                    d = k.mma(operand, a[i], b[j], [v.get() for v in acc[i][j]])
                    for v, value in zip(acc[i][j], d):
                        v.set(value)

    if stages:
        ahead = stages - 1 - in_flight              # steps whose copies run ahead of the mma
        for s in range(ahead):
            copy_step(begin + s * depth, s)
        if not x16:
            store_x(fetch_x(begin), begin)
        slot = k.var(I32, 0)                        # this step's slot of the ring
        with k.for_(begin, end, depth) as c0:
            now = slot.get()
            if tensor_copy:                         # this step's tiles are in ...
                k.barrier_wait(full, now, phase.get())
            else:
                k.copy_wait(ahead - 1)              # this step's copies are done ...
                if wgmma:
                    k.async_proxy_fence()           # ... and visible to wgmma ...
            k.barrier()                             # ... everyone's, and the last step's mma
            after = k.select(now.eq(stages - 1), 0, now + 1)
            if in_flight:                           # the slot `ahead` steps on
                into = k.select(now + ahead >= stages, now + ahead - stages, now + ahead)
            else:                                   # the slot of the step before
                into = k.select(now.eq(0), stages - 1, now - 1)
            if wgmma and in_flight:
                copy_step(c0 + ahead * depth, into)
                compute_wgmma(now)
                k.wgmma_wait(in_flight)
            elif wgmma:
                compute_wgmma(now)
                copy_step(c0 + ahead * depth, into)
                k.wgmma_wait(0)
            else:
                copy_step(c0 + ahead * depth, into)
                values = [] if x16 else fetch_x(c0 + depth)
                compute(now)
                if not x16:
                    store_x(values, c0 + depth, after * x_tile)
            slot.set(after)
            if tensor_copy:
                phase.set(k.select(now.eq(stages - 1), phase.get() ^ 1, phase.get()))
        if not tensor_copy:
            k.copy_wait(0)
        if in_flight:
            k.wgmma_wait(0)
    else:
        x_next = [k.var(x.param.dtype, v) for v in fetch_x(begin)]
        w_next = [k.var(U32, w) for w in fetch_w_words(begin)] if raw else []
        with k.for_(begin, end, depth) as c0:
            k.barrier()                             # the last step's mma are done with the tiles
            store_x([v.get() for v in x_next], c0)
            if raw:
                store_w_words([w.get() for w in w_next], c0)
            else:
                decode_w(c0)
            k.barrier()
            for v, value in zip(x_next, fetch_x(c0 + depth)):
                v.set(value)
            if raw:
                for w, word in zip(w_next, fetch_w_words(c0 + depth)):
                    w.set(word)
            compute()

    def store(v, t, m):
        with k.if_((t < n_tokens) & (m < rows)):
            at = t * rows + m
            if outputs > 1:
                store_row(k, ys, None, parts_at, rows, t, m, [v.get()], False)
            elif split:
                y[piece * n_tokens * rows + at] = v.get()
            else:
                y[at] = v.get() + res[at] if residual else v.get()

    if glu:
        _store_units(k, acc, xs, ws, y16 if glu_x16 else y, glu, glu_x16, g0, t0, half,
                     n_tokens)
        return k.build()
    if wgmma:
        base = m0 + (warp >> 2) * WGMMA_ROWS + (warp & 3) * 16 + (lane >> 2)
        for j, v in enumerate(acc):
            store(v, t0 + 8 * (j >> 2) + 2 * (lane & 3) + (j & 1), base + 8 * ((j >> 1) & 1))
        return k.build()
    for i in range(tiles_t):
        for j in range(tiles_n):
            for e, v in enumerate(acc[i][j]):
                dt, dm = accumulator_position(lane, e)
                store(v, t0 + wt + 16 * i + dt, m0 + wn + 8 * j + dm)
    return k.build()


def _store_units(k, acc, xs, ws, y, glu, glu_x16, g0, t0, half, n_tokens):
    """A glu tile's stores (mma_tiled): every thread puts its sums in shared memory (gate's
    warpgroup in ws, up's in xs; sum j of thread i of its warpgroup at word j * 128 + i), then
    both warpgroups make the units, each half of the places: thread i of either takes the
    places of thread i of gate's, sums j in its half. In wgmma's accumulator layout a thread's
    sums j and j + 1 are two tokens of one unit, and the thread four lanes on holds the next
    unit's: each pair of them trades one value (shuffle_xor 4) so that each holds two
    neighbouring units of one token, one word."""
    threads = MMA_WORKGROUP // 2
    tid, lane, warp = k.thread_id(), k.lane_id(), k.subgroup_id()
    own = tid & (threads - 1)
    k.barrier()                             # every wgmma and copy is done with the tiles
    with k.if_(warp < 4) as gate:
        for j, v in enumerate(acc):
            ws[j * threads + own] = v.get().bitcast(U32)
    with k.else_(gate):
        for j, v in enumerate(acc):
            xs[j * threads + own] = v.get().bitcast(U32)
    k.barrier()
    unit = g0 + (warp & 3) * 16 + (lane >> 2)
    ours = len(acc) // 2                    # the sums a warpgroup makes units of
    first_j = (warp >> 2) * ours

    def unit_of(j):                         # j: this warpgroup's half, from 0
        at = (first_j + j) * threads + own
        return activations.glu(k, glu, ws[at].bitcast(F32), xs[at].bitcast(F32))

    def token(j):
        jj = first_j + j
        return t0 + 8 * (jj >> 2) + 2 * (lane & 3) + (jj & 1)

    def place(j):
        return unit + 8 * (((first_j + j) >> 1) & 1)

    if glu_x16 is None:
        for j in range(ours):
            with k.if_((token(j) < n_tokens) & (place(j) < half)):
                y[token(j) * half + place(j)] = unit_of(j)
        return
    odd = (lane >> 2) & 1                   # this thread's unit is the odd one of its word
    operand = mma_operand(glu_x16)
    for j in range(0, ours, 2):
        # an even unit's thread keeps token j's word, an odd one's token j + 1's
        a, b = unit_of(j), unit_of(j + 1)
        theirs = k.shuffle_xor(k.select(odd.eq(1), a, b), 4)
        word = k.select(odd.eq(1), pack(k, operand, theirs, b), pack(k, operand, a, theirs))
        t, first = token(j) + odd, place(j) - odd
        with k.if_((t < n_tokens) & (first < half)):
            y[t * (half / 2) + (first >> 1)] = word


def wgmma_descriptor(k, address):
    """The u64 wgmma descriptor of a K-major tile at shared byte `address` (a u32 Value): rows
    of 128 bytes, 16-byte parts swizzled within each 8 rows (128-byte swizzle, the 8 rows
    1024 bytes apart: the stride offset; the leading offset is unused), the bit fields of
    the PTX ISA's matrix descriptor: start >> 4 in bits 0-13, leading offset >> 4 in 16-29,
    stride offset >> 4 in 32-45, swizzle mode in 62-63 (1: 128 bytes)."""
    fields = (1 << 16) | ((8 * 128 >> 4) << 32) | (1 << 62)
    return ((address & 0x3FFFF) >> 4).to(U64) | k.const(fields, U64)


@cache
def dequant_f16(dtype):
    """out [rows, cols / 2] (u32: f16 pairs, the lower column in the low half) = W decoded and
    rounded to f16 as mma_tiled's decoding rounds it (mma_operand), so an F16 mma_tiled over
    `out` multiplies the operands the format's own would. cols a multiple of the format's
    block; grid (ceil(rows * cols / block / WORKGROUP)), a thread a block."""
    if mma_operand(dtype) != F16:
        raise ValueError(f"dequant_f16 of {dtype}: its operand is not f16")
    r = reader(dtype)
    unit = r.block_elems
    if unit % 8:
        raise ValueError(f"dequant_f16: {dtype}'s blocks of {unit} are no whole 16-byte stores")
    k = KernelBuilder(f"dequant_f16_{dtype.lower()}", (WORKGROUP,))
    buf = {name: k.buffer(f"w_{name}", U32) for name in r.plane_names}
    out = k.buffer("out", U32, "w")
    rows, cols = k.scalar("rows", I32), k.scalar("cols", I32)
    units = cols / unit
    j = k.block_id() * WORKGROUP + k.thread_id()
    with k.if_(j < rows * units):
        m, u = j / units, j % units
        values = r.decode(k, buf, m, u, cols)
        words = [pack(k, F16, values[e], values[e + 1]) for e in range(0, unit, 2)]
        at = m * (cols / 2) + u * (unit // 2)
        for e in range(0, unit // 2, 4):
            out.store(at + e, *words[e:e + 4])
    return k.build()


@cache
def mma_x16(dtype):
    """x16 [n / 2] (u32) = x [n] (f32) rounded to the operand type of `dtype`'s mma (mma_operand)
    two values a word, the lower column in the low half: what an x16 mma_tiled reads. n a
    multiple of 4; grid (ceil(n / 4 / WORKGROUP))."""
    operand = mma_operand(dtype)
    k = KernelBuilder(f"mma_x16_{operand.name}", (WORKGROUP,))
    x, x16 = k.buffer("x", F32), k.buffer("x16", U32, "w")
    n = k.scalar("n", I32)
    i = (k.block_id() * WORKGROUP + k.thread_id()) * 4
    with k.if_(i < n):
        v = x.load(i, 4)
        x16.store(i >> 1, pack(k, operand, v[0], v[1]), pack(k, operand, v[2], v[3]))
    return k.build()


def split_columns(piece, split_cols, cols, minimum=min):
    """[begin, end) of the columns slice `piece` of a split mma_tiled sums: ints, or Values
    with minimum=k.min."""
    begin = piece * split_cols
    return begin, minimum(begin + split_cols, cols)


@cache
def split_sum(residual=False, outputs=1, glu=None, x16=None):
    """y[i] = partials[0, i] + ... + partials[splits - 1, i] (+ residual[i]) for i < n: a split
    mma_tiled's slices added in slice order, so a step gives the same bits every run.
    grid (ceil(n / WORKGROUP)).

    `outputs` > 1: the partials' rows are stacked weights' (scalars rows, split_1.. after
    splits), each sum stored to its part's output (store_row). `glu` (an activation): they are
    gate's rows then up's, `half` (a scalar after splits) each, and y [n_tokens, half] (n its
    size) takes the gated unit of each pair of sums: the unit of a stacked gate/up launch, which
    needs this pass even unsplit (a workgroup's tile holds gate's rows or up's, not both).

    `x16` (with glu: the weight format of the x16 mma_tiled that reads the unit next):
    the buffer is `x16`, u32 [n / 2], the values rounded to that matmul's operand two a word
    (mma_x16's words, so that launch is not needed); a thread makes one word, grid
    (ceil(n / 2 / WORKGROUP)), half even."""
    if x16 is not None and not glu:
        raise ValueError("split_sum: x16 words are a gated unit's")
    name = variant_name(residual, False, outputs, glu)
    name += "" if x16 is None else f"_x16_{mma_operand(x16).name}"
    k = KernelBuilder("split_sum" + name, (WORKGROUP,))
    partials = k.buffer("partials", F32)
    if x16 is None:
        ys = [k.buffer("y" if outputs == 1 else f"y{i}", F32, "w") for i in range(outputs)]
    else:
        words = k.buffer("x16", U32, "w")
    res = k.buffer("residual", F32) if residual else None
    n, splits = k.scalar("n", I32), k.scalar("splits", I32)
    rows = k.scalar("rows", I32) if outputs > 1 else None
    parts_at = [k.scalar(f"split_{i}", I32) for i in range(1, outputs)]
    half = k.scalar("half", I32) if glu else None
    i = k.block_id() * WORKGROUP + k.thread_id()

    def summed(at, stride):
        total = k.var(F32, partials[at])
        with k.for_(1, splits) as piece:
            total.set(total.get() + partials[piece * stride + at])
        return total.get()

    if x16 is not None:                 # values 2i and 2i + 1, of one token (half even)
        with k.if_(2 * i < n):
            first = 2 * i
            gate_at = first + (first / half) * half
            pair = []
            for j in range(2):
                pair.append(activations.glu(k, glu, summed(gate_at + j, 2 * n),
                                            summed(gate_at + half + j, 2 * n)))
            words[i] = pack(k, mma_operand(x16), *pair)
        return k.build()
    with k.if_(i < n):
        if glu:                         # i = t * half + c: gate at t * 2 half + c, up half on
            gate_at = i + (i / half) * half
            store_row(k, ys, None, [], half, i / half, i % half,
                      [summed(gate_at, 2 * n), summed(gate_at + half, 2 * n)], glu)
        elif outputs > 1:
            store_row(k, ys, None, parts_at, rows, i / rows, i % rows, [summed(i, n)], None)
        else:
            total = summed(i, n)
            ys[0][i] = total + res[i] if residual else total
    return k.build()


@dataclass(frozen=True)
class MmaLaunch:
    """How a matmul of some step length runs on mma_tiled: its token tile, and its columns in
    `splits` slices of split_cols (one slice: not split)."""
    tokens: int
    splits: int
    split_cols: int

    def grid(self, rows, n_tokens):
        """mma_tiled's grid: token tiles first (its docstring says why), then row tiles, slices."""
        return (-(-n_tokens // self.tokens), -(-rows // MMA_ROWS), self.splits)

    def unit_grid(self, rows, n_tokens):
        """The grid of a gated unit's tiles over stacked gate and up rows (mma_tiled's glu)."""
        return (-(-n_tokens // self.tokens), -(-rows // 2 // WGMMA_ROWS), self.splits)

    def partial_floats(self, rows, n_tokens):
        """The size of the partials buffer a split launch writes (0 unsplit)."""
        return self.splits * n_tokens * rows if self.splits > 1 else 0


def mma_launch(rows, cols, n_tokens, multiprocessors, depth=MMA_DEPTH,
               per_sm=SPLIT_BLOCKS_PER_SM, min_steps=MIN_SPLIT_STEPS, one_wave=False,
               least_tile=MMA_TOKEN_TILES[0], wide=False):
    """The MmaLaunch of a [rows, cols] matmul over n_tokens on a device of `multiprocessors`:
    the smallest token tile of MMA_TOKEN_TILES, from least_tile, that holds the step (128 past
    64 tokens); split along the columns when the tiles alone give fewer
    workgroups than multiprocessors, into slices of whole `depth` steps (so of whole quant
    blocks), every slice non-empty, at least min_steps long unless the columns are fewer.

    The slices aim at per_sm workgroups a multiprocessor: at least that many by default, which
    can start a second wave of workgroups, run after the first (Llama-8B's down projection at
    64 tokens: 32 tiles x 9 slices = 288 workgroups, 24 more than 2 x 132 run at once);
    `one_wave` takes at most that many, so all run at once, with longer slices (fewer partials
    to write and add too). `wide` (wgmma): WIDE_TOKENS past MMA_TOKENS, where those tiles alone
    give every multiprocessor a workgroup (a split wide tile writes twice the partials)."""
    tokens = next((t for t in MMA_TOKEN_TILES[:-1] if least_tile <= t and n_tokens <= t),
                  MMA_TOKENS)
    if wide and n_tokens > MMA_TOKENS and \
            -(-rows // MMA_ROWS) * -(-n_tokens // WIDE_TOKENS) >= multiprocessors:
        tokens = WIDE_TOKENS
    blocks = -(-rows // MMA_ROWS) * -(-n_tokens // tokens)
    steps = -(-cols // depth)
    if blocks >= multiprocessors:
        return MmaLaunch(tokens, 1, steps * depth)
    slots = per_sm * multiprocessors
    want = max(1, slots // blocks) if one_wave else -(-slots // blocks)
    per = max(min_steps, -(-steps // want))
    return MmaLaunch(tokens, -(-steps // per), per * depth)


def mma_launches(rows, cols, least, most, multiprocessors, **policy):
    """{n_tokens: MmaLaunch} standing for every step length least..most: a launch depends on
    the length only through its token tile and count of token tiles, so the longest length of
    each such run stands for it (the one that needs the most partials)."""
    out, low = {}, 1
    for end in (*MMA_TOKEN_TILES[:-1], *range(MMA_TOKENS, most + MMA_TOKENS, MMA_TOKENS)):
        if end >= least and low <= most:
            n = min(end, most)
            out[n] = mma_launch(rows, cols, n, multiprocessors, **policy)
        low = end + 1
    return out
