"""The kernels of a mixture-of-experts block: the router's choice (`route`: the ops top_k and
route_weights), the routes grouped by expert (`expert_groups`; both in one launch for decode
steps, `route_grouped`), each expert's matrix over its
routes (`expert_matvec`) and the weighted sum of a token's experts (`expert_sum`). Their numpy
meanings are the ops of those names in poot/ir/reference.py (expert_groups is the runner's own:
the order in which expert_matvec takes the routes).

A route is one (token, chosen expert) pair, numbered t * used + j; the expert ids stay on the
device from the router to the sum, so a step reads nothing back: expert_matvec's grid covers as
many experts as the step's routes could choose, each workgroup column taking the next chosen
one or none. expert_matvec streams each
chosen expert's rows once for all the routes that chose it (a step of many tokens reads each
expert once, not once a token), from the stacked weight [experts * rows, cols] in its device
layout (quant.py). Devices that run mma_vec on a format take its expert variant instead (the
same buffers but a norm's, on the tensor cores: engine/expert_steps.py says which).
"""
from functools import cache

from . import activations, mma_vec
from .lang import F32, I32, U32, KernelBuilder
from .ops import LOWEST
from .quant import reader
from .routes import denominator
from .x16 import mma_operand, normed_row, quant_pairs

WG = 256
MAX_EXPERTS = 1024
TOKEN_GROUPS = (1, 2, 4, 8)     # routes an expert_matvec subgroup takes a pass
GROUPED_ROUTES = 512            # route_grouped keeps this many routes' choices (64 tokens of 8)


def route_slots(n_experts, subgroup_size):
    """The logits a lane of a route kernel holds (its experts lane, lane + subgroup_size, ...):
    the kernel serves any count of experts up to slots * subgroup_size."""
    return -(-n_experts // subgroup_size)


def _choose(k, logits, ids, w, t, n, used, normalize, subgroup_size, slots, kept=None):
    """Token t's choice by one subgroup: ids[t, j] = the j-th largest of logits[t, :n] (ties to
    the lower index), `used` rounds of a subgroup maximum over the experts not yet chosen;
    w[t, j] = its softmax probability over all n (the denominator from the first round's, the
    largest), divided by the chosen ones' sum where `normalize`. Lane 0 writes them (and the
    ids into the shared array `kept` too, where given).

    Each lane loads its `slots` logits once, all at a time, and the rounds compare registers:
    a round that read them again waited on memory `slots` loads in a row."""
    lane = k.lane_id()
    mine = [lane + i * subgroup_size for i in range(slots)]
    values = [k.select(e < n, logits[t * n + k.min(e, n - 1)], LOWEST) for e in mine]
    chosen, tops = [], []
    for _ in range(used):
        best, best_at = k.var(F32, LOWEST), k.var(I32, n)
        for e, v in zip(mine, values):      # each lane's experts rise: the first of equals stays
            free = v > best.get()           # (LOWEST, an expert past n's, never does)
            for c in chosen:
                free = free & e.ne(c)
            best.set(k.select(free, v, best.get()))
            best_at.set(k.select(free, e, best_at.get()))
        top = k.subgroup_max(best.get())
        chosen.append(k.subgroup_min(k.select(best.get().eq(top), best_at.get(), n)))
        tops.append(top)
    over = denominator(k, mine, values, tops, n, normalize)
    with k.if_(lane.eq(0)):
        for j, (at, top) in enumerate(zip(chosen, tops)):
            ids[t * used + j] = at
            w[t * used + j] = k.exp(top - tops[0]) / over
            if kept is not None:
                kept[t * used + j] = at


def _group(k, expert_of, n_routes, n_experts, offsets, routes, active, load4=None):
    """The routes grouped by expert, by the workgroup: offsets[e] .. offsets[e + 1] are expert
    e's entries of routes, in route order; active lists the experts some route chose, in
    order, then -1s. expert_of(r): route r's expert; load4(r), where given, the experts of
    routes r .. r + 3 (r a multiple of 4; -1 past the last route), a load for four.

    A thread an expert counts its routes; each thread's run of consecutive experts is summed,
    and a scan over the threads in shared memory gives each run's first place among the routes
    and among the chosen experts (log2(WG) steps, no thread walking all the experts); then a
    thread an expert places its routes."""
    counts = k.shared("counts", I32, MAX_EXPERTS + 4)    # an expert's routes, then its first place
    sums = k.shared("sums", I32, 2 * WG)                 # the scan's: routes, then chosen experts
    tid = k.thread_id()

    def each_route(e, found):
        """found(r) for each route r of expert e, in order."""
        if load4 is None:
            with k.for_(0, n_routes) as r:
                with k.if_(expert_of(r).eq(e)):
                    found(r)
            return
        with k.for_(0, n_routes, 4) as r:
            for j, v in enumerate(load4(r)):
                with k.if_(v.eq(e)):
                    found(r + j)

    with k.for_(tid, n_experts, WG) as e:
        count = k.var(I32, 0)
        each_route(e, lambda r: count.set(count.get() + 1))
        counts[e] = count.get()
    k.barrier()
    per = (n_experts + WG - 1) / WG                      # this thread's run of experts
    first = tid * per
    last = k.min(first + per, n_experts)
    mine, chosen = k.var(I32, 0), k.var(I32, 0)
    with k.for_(first, last) as e:
        c = counts[e]
        mine.set(mine.get() + c)
        chosen.set(k.select(c > 0, chosen.get() + 1, chosen.get()))
    total, picked = k.var(I32, mine.get()), k.var(I32, chosen.get())
    sums[tid] = mine.get()
    sums[WG + tid] = chosen.get()
    k.barrier()
    step = 1
    while step < WG:                                      # inclusive sums over threads 0..tid
        with k.if_(tid >= step):
            total.set(total.get() + sums[tid - step])
            picked.set(picked.get() + sums[WG + tid - step])
        k.barrier()
        sums[tid] = total.get()
        sums[WG + tid] = picked.get()
        k.barrier()
        step *= 2
    at, slot = k.var(I32, total.get() - mine.get()), k.var(I32, picked.get() - chosen.get())
    with k.for_(first, last) as e:
        c = counts[e]
        offsets[e] = at.get()
        counts[e] = at.get()
        with k.if_(c > 0):
            active[slot.get()] = e
            slot.set(slot.get() + 1)
        at.set(at.get() + c)
    with k.if_(tid.eq(0)):
        offsets[n_experts] = sums[WG - 1]
    n_active = sums[2 * WG - 1]
    with k.for_(tid, n_experts, WG) as e:
        with k.if_(e >= n_active):
            active[e] = -1
    k.barrier()

    def place(e):
        at = k.var(I32, counts[e])

        def found(r):
            routes[at.get()] = r
            at.set(at.get() + 1)
        each_route(e, found)
    with k.for_(tid, n_experts, WG) as e:
        place(e)


def _route_params(k):
    logits = k.buffer("logits", F32)
    return logits, k.buffer("ids", I32, "w"), k.buffer("w", F32, "w")


@cache
def route(subgroup_size, used, normalize, slots):
    """A router's choice, the ops top_k and route_weights in one launch (_choose), one
    subgroup a token: ids [T, used] and w [T, used] from logits [T, n], n at most
    slots * subgroup_size (route_slots). grid (T)."""
    k = KernelBuilder(f"route{used}_s{subgroup_size}_v{slots}" + "_norm" * normalize,
                      (subgroup_size,))
    logits, ids, w = _route_params(k)
    n = k.scalar("n", I32)
    _choose(k, logits, ids, w, k.block_id(), n, used, normalize, subgroup_size, slots)
    return k.build()


@cache
def route_grouped(subgroup_size, used, normalize, slots, norm_x16=None, grouped=True):
    """route, then expert_groups, in one workgroup: for steps of at most GROUPED_ROUTES
    routes (decode steps), whose choices the workgroup keeps in shared memory for the
    grouping. Buffers route's, then expert_groups' outputs; scalars n (at most
    slots * subgroup_size), n_tokens. grid (1).

    With `norm_x16` (a weight format), then mma_vec.norm_x16's words of the step's x for the
    experts' mma_vec of that format, token after token (for steps of a few tokens, a launch
    fewer): buffers x f32 [T, cols], norm (the gain), x16 after active; scalars cols, eps
    after n_tokens. Not `grouped`: route's outputs alone (no expert_groups buffers), for
    expert launches that take each route by its id (mma_vec's by_route)."""
    name = f"route_grouped{used}_s{subgroup_size}_v{slots}" + "_norm" * normalize
    if norm_x16 is not None:
        name += f"_x16_{mma_operand(norm_x16).name}" + "_pairs" * quant_pairs(norm_x16)
    k = KernelBuilder(name + "_ungrouped" * (not grouped), (WG,))
    logits, ids, w = _route_params(k)
    if grouped:
        offsets, routes = k.buffer("offsets", I32, "w"), k.buffer("routes", I32, "w")
        active = k.buffer("active", I32, "w")
    if norm_x16 is not None:
        x, gain, x16 = k.buffer("x", F32), k.buffer("norm", F32), k.buffer("x16", U32, "w")
    n, n_tokens = k.scalar("n", I32), k.scalar("n_tokens", I32)
    kept = k.shared("kept", I32, GROUPED_ROUTES + 4) if grouped else None
    n_routes = n_tokens * used
    with k.for_(k.subgroup_id(), n_tokens, WG // subgroup_size) as t:
        _choose(k, logits, ids, w, t, n, used, normalize, subgroup_size, slots, kept)
    if grouped:
        tid = k.thread_id()
        with k.if_(tid < 4):                # past the last route, for the loads of four
            kept[n_routes + tid] = -1
        k.barrier()
        _group(k, lambda r: kept[r], n_routes, n, offsets, routes, active,
               lambda r: kept.load(r, 4))
    if norm_x16 is not None:
        cols, eps = k.scalar("cols", I32), k.scalar("eps", F32)
        scratch = k.shared("scratch", F32, WG // subgroup_size)
        load = lambda base, i: x.load(base + i, 4)  # noqa: E731
        with k.for_(0, n_tokens) as t:
            normed_row(k, norm_x16, subgroup_size, gain, x16, load, load, t * cols, cols, eps,
                       scratch)
    return k.build()


@cache
def expert_groups(fours=False):
    """The routes grouped by expert (_group) from their ids [routes]; one workgroup
    (n_experts <= MAX_EXPERTS). grid (1). `fours`: n_routes is a multiple of 4 (tokens that
    each use a multiple of 4 experts), so the ids are read four a load."""
    k = KernelBuilder("expert_groups" + "_x4" * fours, (WG,))
    ids = k.buffer("ids", I32)
    offsets, routes = k.buffer("offsets", I32, "w"), k.buffer("routes", I32, "w")
    active = k.buffer("active", I32, "w")
    n_routes, n_experts = k.scalar("n_routes", I32), k.scalar("n_experts", I32)
    _group(k, lambda r: ids[r], n_routes, n_experts, offsets, routes, active,
           (lambda r: ids.load(r, 4)) if fours else None)
    return k.build()


@cache
def expert_matvec(dtype, subgroup_size, tokens=1, glu=None, rows_per=1, norm=False):
    """y[r, m] = W[e, m, :] . x[r / x_per, :] for every route r of expert e; with `glu` (gate
    then up planes) y[r, m] = glu(gate[e, m] . x, up[e, m] . x). A subgroup streams `rows_per`
    consecutive rows of one expert (so that each x value it loads serves them all, as
    matvec.matvec's do) for `tokens` of its routes at a time (more routes: the rows again, from
    cache). grid expert_grid(rows, slots, subgroup_size, rows_per): workgroup column s takes
    the expert active[s] (expert_groups), none where that is -1.

    Buffers: W's planes (u32; [experts * rows, cols]), x f32, offsets, routes and active
    (expert_groups), y f32 [routes, rows]; scalars rows, cols, x_per (the routes a row of x
    serves: a token's `used` where x is the token's, 1 where each route has its own). With
    `norm`, x is RMS-normalised first as in matvec.matvec (its gain g f32 [cols], buffer
    `norm` after x, and scalar eps last): the subgroup streams all of x for its rows anyway."""
    r = reader(dtype)
    matrices = ("gate", "up") if glu else ("w",)
    name = f"expert_matvec_{dtype.lower()}_t{tokens}_s{subgroup_size}" + f"_r{rows_per}" * (
        rows_per > 1) + "_norm" * norm
    k = KernelBuilder(name + (f"_{activations.UNITS[glu]}" if glu else ""), (WG,))
    bufs = [{p: k.buffer(f"{m}_{p}", U32) for p in r.plane_names} for m in matrices]
    x = k.buffer("x", F32)
    gain = k.buffer("norm", F32) if norm else None
    offsets, routes = k.buffer("offsets", I32), k.buffer("routes", I32)
    active = k.buffer("active", I32)
    y = k.buffer("y", F32, "w")
    rows, cols, x_per = k.scalar("rows", I32), k.scalar("cols", I32), k.scalar("x_per", I32)
    eps = k.scalar("eps", F32) if norm else None
    first = (k.block_id(0) * (WG // subgroup_size) + k.subgroup_id()) * rows_per
    expert, lane = active[k.block_id(1)], k.lane_id()
    with k.if_((first >= rows) | (expert < 0)):
        k.return_()
    start = offsets[expert]
    count = offsets[expert + 1] - start
    # rows past the end read the last row again and store nothing
    mine_rows = [expert * rows + k.min(first + q, rows - 1) for q in range(rows_per)]

    def accumulate(route, block, values, sums, squares):
        """Adds a route's products with the block's decoded values (of each matrix and row)
        to its sums (vars, [matrix][row]), 4 x values live at a time; with `norm`, the squares
        of its x to its `squares` var."""
        xrow = (route / x_per) * cols + block * r.block_elems
        totals = [[v.get() for v in per_matrix] for per_matrix in sums]
        square = squares.get() if norm else None
        for i in range(0, r.block_elems, 4):
            xs = x.load(xrow + i, 4)
            if norm:
                gains = gain.load(block * r.block_elems + i, 4)
                for xv in xs:
                    square = k.fma(xv, xv, square)
                xs = [xv * g for xv, g in zip(xs, gains)]
            for m, per_values in enumerate(values):
                for q, vs in enumerate(per_values):
                    for v, xv in zip(vs[i:i + 4], xs):
                        totals[m][q] = k.fma(v, xv, totals[m][q])
        for per_matrix, row_totals in zip(sums, totals):
            for v, total in zip(per_matrix, row_totals):
                v.set(total)
        if norm:
            squares.set(square)

    with k.for_(0, count, tokens) as c:
        mine = [routes[start + k.min(c + t, count - 1)] for t in range(tokens)]
        acc = [[[k.var(F32, 0.0) for _ in range(tokens)] for _ in mine_rows] for _ in matrices]
        squares = [k.var(F32, 0.0) for _ in range(tokens)] if norm else []
        with k.for_(lane, cols // r.block_elems, subgroup_size) as block:
            values = [[r.decode(k, buf, row, block, cols) for row in mine_rows] for buf in bufs]
            for t in range(tokens):
                with k.if_(c + t < count):          # the same in the whole subgroup
                    accumulate(mine[t], block, values,
                               [[per_row[t] for per_row in per_matrix] for per_matrix in acc],
                               squares[t] if norm else None)
        scales = [k.rsqrt(k.subgroup_add(sq.get()) / cols.to(F32) + eps) for sq in squares]
        for q in range(rows_per):
            for t in range(tokens):
                sums = [k.subgroup_add(per_matrix[q][t].get()) for per_matrix in acc]
                if norm:
                    sums = [v * scales[t] for v in sums]
                value = activations.glu(k, glu, *sums) if glu else sums[0]
                with k.if_(lane.eq(0) & (c + t < count) & (first + q < rows)):
                    y[mine[t] * rows + first + q] = value
    return k.build()


def expert_tokens(dtype):
    """The routes an expert_matvec of a weight format may take a pass: TOKEN_GROUPS', but one
    for the K quants, whose decoded units (64 values a matrix) leave no registers for the sums
    of several."""
    return (1,) if dtype in ("Q4_K", "Q6_K") else TOKEN_GROUPS


def expert_grid(rows, slots, subgroup_size, rows_per=1):
    """The grid of an expert_matvec launch: each of its rows once for `slots` experts, as many
    as the step's routes can choose (its tokens times the experts each uses, at most all)."""
    return (-(-rows // (WG // subgroup_size * rows_per)), slots)


@cache
def expert_sum(used, residual=False):
    """out[t, m] = sum_j w[t, j] * y[t, j, m] (+ res[t, m], read at out's index, so it may be
    out itself). grid (ceil(T * cols / WG))."""
    k = KernelBuilder(f"expert_sum{used}" + "_residual" * residual, (WG,))
    y, w = k.buffer("y", F32), k.buffer("w", F32)
    res = k.buffer("residual", F32) if residual else None
    out = k.buffer("out", F32, "w")
    n_tokens, cols = k.scalar("n_tokens", I32), k.scalar("cols", I32)
    i = k.block_id() * WG + k.thread_id()
    with k.if_(i < n_tokens * cols):
        t, m = i / cols, i % cols
        total = res[i] if residual else None
        for j in range(used):
            part = w[t * used + j] * y[(t * used + j) * cols + m]
            total = part if total is None else total + part
        out[i] = total
    return k.build()


@cache
def expert_sum_norm_x16(used, dtype, subgroup_size=mma_vec.SUBGROUP):
    """expert_sum with its residual (the same bits), then mma_vec.norm_x16's words of the sum
    for the mma_vec of weight format dtype that reads it through its norm: the next layer's
    first matmul, a launch fewer a layer. Buffers expert_sum's (y, w, residual, out), norm
    (the gain), x16; scalars cols (a multiple of 8), eps. One workgroup a token; grid (T)."""
    name = f"expert_sum{used}_norm_x16_{mma_operand(dtype).name}"
    k = KernelBuilder(name + "_pairs" * quant_pairs(dtype), (WG,))
    y, w = k.buffer("y", F32), k.buffer("w", F32)
    res, out = k.buffer("residual", F32), k.buffer("out", F32, "rw")
    gain, x16 = k.buffer("norm", F32), k.buffer("x16", U32, "w")
    cols, eps = k.scalar("cols", I32), k.scalar("eps", F32)
    t = k.block_id()

    def summed(base, i):
        total = res.load(base + i, 4)
        for j in range(used):
            weight = w[t * used + j]
            part = y.load((t * used + j) * cols + i, 4)
            total = [a + weight * b for a, b in zip(total, part)]
        out.store(base + i, *total)
        return total

    normed_row(k, dtype, subgroup_size, gain, x16, summed, lambda base, i: out.load(base + i, 4),
               t * cols, cols, eps, k.shared("scratch", F32, WG // subgroup_size))
    return k.build()
