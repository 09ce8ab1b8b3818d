"""The kernels that read a step's logits: their edits in place (logit_edits: engine/sampling.py's
edit_logits), the greedy choice (argmax_chunks, then argmax: sampling's greedy choice), the draw
of sampled rows (draw: sampling's choose), each row's best candidates with their sums
(top_candidates: what sampling.logprobs_among scores a token from), and the tokens fed to a
step launched ahead (feed_tokens).
"""
from functools import cache, reduce

from .lang import F32, I32, U32, KernelBuilder
from .ops import LOWEST, WG, block_reduce


@cache
def logit_edits():
    """The logits of a step's rows edited in place (engine/sampling.py's edit_logits): for row
    r, edit j of row_start[r] <= j < row_start[r + 1] sets the logit x of token tokens[j] to
    max((x / repeat[j] if x > 0 else x * repeat[j]) + add[j], LOWEST); then, where mask_of[r]
    is not -1, every token whose bit is 0 in row mask_of[r] of `masks` (bit t % 32 of word
    t // 32, `words` words a row) becomes LOWEST. A row names each token at most once. The
    thread that edits a token applies the mask to it too, so the two passes never race: a token
    both touch gets LOWEST from both. Workgroup (r, c) of grid (R, parts) takes every parts-th
    workgroup's share of row r's edits and tokens, so a row of a large vocabulary is spread
    over several; a row without edits or a mask does nothing."""
    k = KernelBuilder("logit_edits", (WG,))
    logits = k.buffer("logits", F32, "rw")
    row_start, tokens = k.buffer("row_start", I32), k.buffer("tokens", I32)
    repeat, add = k.buffer("repeat", F32), k.buffer("add", F32)
    mask_of, masks = k.buffer("mask_of", I32), k.buffer("masks", U32)
    n, words = k.scalar("n", I32), k.scalar("words", I32)
    r, first = k.block_id(), k.block_id(1) * WG + k.thread_id()
    stride = k.num_blocks(1) * WG
    m = mask_of[r]
    row, mask_row = r * n, k.max(m, 0) * words     # no mask: row 0 is read, and not used

    def banned(t):
        return (m >= 0) & ((masks[mask_row + (t >> 5)] >> (t & 31)) & 1).eq(0)

    with k.for_(row_start[r] + first, row_start[r + 1], stride) as j:
        t = tokens[j]
        x, scale = logits[row + t], repeat[j]
        edited = k.max(k.select(x > 0.0, x / scale, x * scale) + add[j], LOWEST)
        logits[row + t] = k.select(banned(t), LOWEST, edited)
    with k.if_(m >= 0):
        with k.for_(first, n, stride) as t:
            with k.if_(banned(t)):
                logits[row + t] = LOWEST
    return k.build()


def _best_of_workgroup(k, value, index):
    """(value, index) of the workgroup's best pair in every thread's (value, index): the
    largest value, the lowest index among equals; a tree over shared memory."""
    best_v, best_i = k.shared("best_v", F32, WG), k.shared("best_i", I32, WG)
    tid = k.thread_id()
    best_v[tid], best_i[tid] = value, index
    k.barrier()
    stride = WG // 2
    while stride:
        with k.if_(tid < stride):
            ov, oi = best_v[tid + stride], best_i[tid + stride]
            mv, mi = best_v[tid], best_i[tid]
            better = (ov > mv) | ((ov.eq(mv)) & (oi < mi))
            best_v[tid] = k.select(better, ov, mv)
            best_i[tid] = k.select(better, oi, mi)
        k.barrier()
        stride //= 2
    return best_v[0], best_i[0]


@cache
def argmax_chunks(subgroup_size):
    """The first half of the greedy choice, so a row of a large vocabulary is read by many
    workgroups at once: workgroup (r, c) writes the largest of logits[r, c*chunk : (c+1)*chunk]
    (and n) and its index, the lowest among equals, to values[r, c] and indices[r, c].
    grid (R, chunks)."""
    k = KernelBuilder(f"argmax_chunks_s{subgroup_size}", (WG,))
    logits = k.buffer("logits", F32)
    values, indices = k.buffer("values", F32, "w"), k.buffer("indices", I32, "w")
    n, chunk = k.scalar("n", I32), k.scalar("chunk", I32)
    r, c, tid = k.block_id(), k.block_id(1), k.thread_id()
    lo = c * chunk
    hi = k.min(lo + chunk, n)
    bv, bi = k.var(F32, LOWEST), k.var(I32, 0)
    with k.for_(lo + tid, hi, WG) as i:
        v = logits[r * n + i]
        with k.if_(v > bv.get()):
            bv.set(v)
            bi.set(i)
    value, index = _best_of_workgroup(k, bv.get(), bi.get())
    with k.if_(tid.eq(0)):
        at = r * k.num_blocks(1) + c
        values[at] = value
        indices[at] = index
    return k.build()


@cache
def argmax(subgroup_size):
    """token[r] = the index of the largest logits[r, :] (lowest index on ties), from the
    `chunks` (value, index) pairs argmax_chunks left for row r. grid (R)."""
    k = KernelBuilder(f"argmax_s{subgroup_size}", (WG,))
    values, indices = k.buffer("values", F32), k.buffer("indices", I32)
    token = k.buffer("token", I32, "w")
    chunks = k.scalar("chunks", I32)
    r, tid = k.block_id(), k.thread_id()
    bv, bi = k.var(F32, LOWEST), k.var(I32, 0)
    with k.for_(tid, chunks, WG) as j:          # chunks in order: a tie keeps the lower index
        v, i = values[r * chunks + j], indices[r * chunks + j]
        with k.if_((v > bv.get()) | (v.eq(bv.get()) & (i < bi.get()))):
            bv.set(v)
            bi.set(i)
    _, index = _best_of_workgroup(k, bv.get(), bi.get())
    with k.if_(tid.eq(0)):
        token[r] = index
    return k.build()


@cache
def feed_tokens():
    """tokens[t] = chosen[feed[t]] where feed[t] >= 0, for t < n: a step launched before the
    last one landed takes that step's tokens (argmax's, or the draw's) as its input where they
    are not known on the host yet. grid (1)."""
    k = KernelBuilder("feed_tokens", (WG,))
    chosen, feed = k.buffer("chosen", I32), k.buffer("feed", I32)
    tokens = k.buffer("tokens", I32, "w")
    n = k.scalar("n", I32)
    with k.for_(k.thread_id(), n, WG) as t:
        row = feed[t]
        with k.if_(row >= 0):
            tokens[t] = chosen[row]
    return k.build()


TOP_CHUNK = 2048        # logits of a row one top_candidates workgroup sorts
TOP_KEEP = 64           # the best of them it keeps


@cache
def top_candidates(subgroup_size):
    """The best TOP_KEEP logits of each TOP_CHUNK-long chunk of a row, best first (highest
    value, then lowest index), with their indices: so a row's best k <= TOP_KEEP are among its
    chunks' candidates, in the order engine/sampling.py's choose() sorts a row. Workgroup
    (r, c) sorts logits[r, c*TOP_CHUNK : (c+1)*TOP_CHUNK] in shared memory (a bitonic network:
    every (value, index) key differs, so the order is total; past n, the lowest value at
    indices past n sorts last) and writes values[r, c, :] and indices[r, c, :], and the chunk's
    largest logit m and sum of exp((logit - m) / t) to maxima[r, c] and sums[r, c], t the row's
    temperature[r] (1 where that is not positive). grid (R, chunks)."""
    k = KernelBuilder(f"top_candidates_s{subgroup_size}", (WG,))
    logits, temperature = k.buffer("logits", F32), k.buffer("temperature", F32)
    values, indices = k.buffer("values", F32, "w"), k.buffer("indices", I32, "w")
    maxima, sums = k.buffer("maxima", F32, "w"), k.buffer("sums", F32, "w")
    n = k.scalar("n", I32)
    keys, ids = k.shared("keys", F32, TOP_CHUNK), k.shared("ids", I32, TOP_CHUNK)
    r, c, tid = k.block_id(), k.block_id(1), k.thread_id()
    for j in range(TOP_CHUNK // WG):
        i = tid + j * WG
        at = c * TOP_CHUNK + i
        keys[i] = k.select(at < n, logits[r * n + k.min(at, n - 1)], LOWEST)
        ids[i] = at
    k.barrier()
    size = 2
    while size <= TOP_CHUNK:
        stride = size // 2
        while stride >= 1:
            shift = stride.bit_length() - 1
            for j in range(TOP_CHUNK // 2 // WG):
                pair = tid + j * WG
                a = ((pair >> shift) << (shift + 1)) | (pair & (stride - 1))
                b = a + stride
                va, vb, ia, ib = keys[a], keys[b], ids[a], ids[b]
                a_first = (va > vb) | (va.eq(vb) & (ia < ib))
                # runs of `size` alternate best-first and worst-first, the last one best-first
                best_first = (a & size).eq(0)
                swap = (best_first & ~a_first) | (~best_first & a_first)
                keys[a], keys[b] = k.select(swap, vb, va), k.select(swap, va, vb)
                ids[a], ids[b] = k.select(swap, ib, ia), k.select(swap, ia, ib)
            k.barrier()
            stride //= 2
        size *= 2
    top = keys[0]
    t = temperature[r]
    scale = 1.0 / k.select(t > 0.0, t, 1.0)
    part = k.var(F32, 0.0)
    for j in range(TOP_CHUNK // WG):
        i = tid + j * WG
        with k.if_(ids[i] < n):
            part.set(part.get() + k.exp((keys[i] - top) * scale))
    at = (r * k.num_blocks(1) + c) * TOP_KEEP + tid
    with k.if_(tid < TOP_KEEP):
        values[at] = keys[tid]
        indices[at] = ids[tid]
    k.barrier()                                 # the keys are read: they become the scratch
    total = block_reduce(k, part.get(), subgroup_size, keys)
    with k.if_(tid.eq(0)):
        maxima[r * k.num_blocks(1) + c] = top
        sums[r * k.num_blocks(1) + c] = total
    return k.build()


# The device's draw (engine/sampling.py defines it): a token's weight is EXP2[q % STEPS] >>
# (q // STEPS), q its step below the highest logit; the draw's row parameters, DRAW_WORDS u32s a
# row of `draw_rows`: the step scale (f32 bits), top_k (0: none), top_p as a fraction of 2^32,
# the last step min_p keeps, the row's random bits, and flags.
STEP_BITS = 14
STEPS = 1 << STEP_BITS
WEIGHT_BITS = 31
Q_LAST = 32 * STEPS - 1
DRAW_WORDS, FLAGS = 6, 5        # a row's words, and which of them holds its flags
DRAWS, TOP_P_CUT = 1, 2         # flags: the row samples (else its greedy token stands); top_p < 1
COARSE = 512                    # bins of q >> FINE_BITS: Q_LAST >> FINE_BITS < COARSE
FINE_BITS = 10                  # a coarse bin's steps, 2^FINE_BITS: FINE_BITS / WG a thread's
SPAN_UNIT = 256                 # a span of the draw is a multiple of this many ids
UNROLL = 4                      # a histogram pass's tokens a thread loads at once
HIGHEST = 3.4028234663852886e38


@cache
def draw(subgroup_size):
    """token[r] = the token engine/sampling.py's choose draws for row r of `logits` (edited),
    where the row samples (draw_rows' flags; token[r] holds its greedy token on entry,
    argmax's, whose logit is the row's highest). One workgroup a row; grid (R).

    Every cut keeps a prefix of the ranking (step, then id): the tokens at steps below `last`
    and the first n (in id order) at `last`. A cut's prefix is found from a histogram of the
    row's steps in COARSE bins (each bin's count and weight, by shared atomics), then one of
    the 2^FINE_BITS steps of the bin it falls in (their counts), then n; top_k's prefix
    first, then top_p's within it, min_p's (the steps up to its last) last. The draw is the
    prefix whose running weight passes bits / 2^32 of the kept weight, found the same way: its
    token is the n-th at its step, in id order, found by each span of ids' count of that
    step's tokens (a subgroup a span), then that span walked by the workgroup. Weights are u32
    and their sums (hi, lo) pairs of u32: exact in any order, as the definition's integers
    are."""
    k = KernelBuilder(f"draw_s{subgroup_size}", (WG,))
    logits, rows = k.buffer("logits", F32), k.buffer("draw_rows", U32)
    table, token = k.buffer("exp2", U32), k.buffer("token", I32, "rw")
    n = k.scalar("n", I32)
    c_count, c_lo, c_hi = (k.shared(name, U32, COARSE) for name in ("c_count", "c_lo", "c_hi"))
    f_count = k.shared("f_count", U32, 1 << FINE_BITS)
    s_hi, s_lo = k.shared("s_hi", U32, WG), k.shared("s_lo", U32, WG)
    slot = k.shared("slot", U32, 3)
    r, tid = k.block_id(), k.thread_id()
    at = r * DRAW_WORDS
    flags = rows[at + FLAGS]
    with k.if_((flags & DRAWS).eq(0)):
        k.return_()
    scale, top_k, top_p = rows[at].bitcast(F32), rows[at + 1], rows[at + 2]
    min_last, bits = rows[at + 3], rows[at + 4]
    row = r * n
    zero, one = k.const(0, U32), k.const(1, U32)
    utid = tid.bitcast(U32)

    def clean(x):
        return k.select(x.eq(x), k.min(k.max(x, LOWEST), HIGHEST), LOWEST)

    top = clean(logits[row + token[r]])

    def step(i):
        return k.min((top - clean(logits[row + i])) * scale, float(Q_LAST)).to(U32)

    def weight(q):
        return table[(q & (STEPS - 1)).bitcast(I32)] >> (q >> STEP_BITS)

    def each_step():
        """(id, step) of every token of the row, this thread's, UNROLL loaded at once (ids
        past n repeat the last token's step)."""
        with k.for_(tid, n, WG * UNROLL) as i0:
            ids = [i0 + u * WG for u in range(UNROLL)]
            yield from zip(ids, [step(k.min(i, n - 1)) for i in ids])

    def add(a, b):
        lo = a[1] + b[1]
        return a[0] + b[0] + k.select(lo < a[1], one, zero), lo

    def sub(a, b):
        return a[0] - b[0] - k.select(a[1] < b[1], one, zero), a[1] - b[1]

    def at_least(a, b):
        return (a[0] > b[0]) | (a[0].eq(b[0]) & (a[1] >= b[1]))

    def where(cond, a):
        return k.select(cond, a[0], zero), k.select(cond, a[1], zero)

    def times(a, b):
        """a * b of u32s as a pair, from 16-bit halves (every target's 32-bit multiply)."""
        a0, a1, b0, b1 = a & 0xFFFF, a >> 16, b & 0xFFFF, b >> 16
        low, mid1, mid2 = a0 * b0, a0 * b1, a1 * b0
        mid = (low >> 16) + (mid1 & 0xFFFF) + (mid2 & 0xFFFF)
        return a1 * b1 + (mid1 >> 16) + (mid2 >> 16) + (mid >> 16), (low & 0xFFFF) | (mid << 16)

    def fraction(m, x, up):
        """m * x / 2^32 (m a u32, x a pair), rounded down or up."""
        a, b = times(m, x[1]), times(m, x[0])
        lo = a[0] + b[1]
        out = (b[0] + k.select(lo < a[0], one, zero), lo)
        return add(out, (zero, k.select(a[1].ne(0), one, zero))) if up else out

    def scan(value):
        """(the sum of the values of the threads before this one, of all of them), pairs."""
        total = value
        s_hi[tid], s_lo[tid] = value
        k.barrier()
        offset = 1
        while offset < WG:
            back = k.max(tid - offset, 0)
            total = add(total, where(tid >= offset, (s_hi[back], s_lo[back])))
            k.barrier()
            s_hi[tid], s_lo[tid] = total
            k.barrier()
            offset *= 2
        whole = (s_hi[WG - 1], s_lo[WG - 1])
        k.barrier()
        return sub(total, value), whole

    def reaching(items, target):
        """(index, the running sum before it) of the item whose running sum first reaches
        target (at least 1): `items`, (index, pair), this thread's in order, the threads' in
        thread order."""
        mine = items[0][1]
        for _, value in items[1:]:
            mine = add(mine, value)
        before = scan(mine)[0]
        for index, value in items:
            after = add(before, value)
            with k.if_(~at_least(before, target) & at_least(after, target)):
                slot[0], slot[1], slot[2] = index, before[0], before[1]
            before = after
        k.barrier()
        found = (slot[0], (slot[1], slot[2]))
        k.barrier()
        return found

    def total(values):
        return scan(values)[1]

    per_thread = (1 << FINE_BITS) // WG

    def bin_steps(b):
        """(step, its tokens' weight, their count) of this thread's steps of coarse bin b:
        a pass over the row counts them."""
        fine = [e + per_thread * tid for e in range(per_thread)]
        for j in fine:
            f_count[j] = zero
        k.barrier()
        for i, q in each_step():
            with k.if_((i < n) & (q >> FINE_BITS).eq(b)):
                k.atomic_add(f_count, (q & ((1 << FINE_BITS) - 1)).bitcast(I32), one)
        k.barrier()
        out = []
        for j in fine:
            q = (b << FINE_BITS) | j.bitcast(U32)
            out.append((q, times(f_count[j], weight(q)), f_count[j]))
        k.barrier()
        return out

    def bins_below(b):
        """The weight of the coarse bins before b."""
        return total(reduce(add, [where((2 * utid + e) < b, (c_hi[2 * tid + e],
                                                              c_lo[2 * tid + e]))
                                  for e in (0, 1)]))

    def weight_below(step):
        """The weight of the row's tokens at steps before `step`."""
        steps = bin_steps(step >> FINE_BITS)
        return add(bins_below(step >> FINE_BITS),
                   total(reduce(add, [where(q < step, mass) for q, mass, _ in steps])))

    def prefix(target, by_weight):
        """(step, n, weight of the steps before) of the shortest prefix of the ranking whose
        running count or weight reaches target (at least 1)."""
        def coarse(j):
            return (c_hi[j], c_lo[j]) if by_weight else (zero, c_count[j])
        b, before = reaching([((2 * tid + e).bitcast(U32), coarse(2 * tid + e)) for e in (0, 1)],
                             target)
        steps = bin_steps(b)
        q, inside = reaching([(q, mass if by_weight else (zero, count))
                              for q, mass, count in steps], sub(target, before))
        below = add(bins_below(b), total(reduce(add, [where(j < q, mass)
                                                       for j, mass, _ in steps])))
        rest = sub(sub(target, before), inside)
        if not by_weight:
            return q, rest[1], below
        unit, m = weight(q), zero               # the most tokens of step q short of rest
        for bit in range(18, -1, -1):
            more = m | (1 << bit)
            m = k.select(at_least(times(more, unit), rest), m, more)
        return q, m + 1, below

    # the row's histogram: each coarse bin's weight (and count, for a top-k cut)
    has_top_k = top_k.ne(0) & (top_k < n.bitcast(U32))
    has_top_p = (flags & TOP_P_CUT).ne(0)
    for j in (tid, tid + WG):
        c_count[j], c_lo[j], c_hi[j] = zero, zero, zero
    k.barrier()
    for i, q in each_step():
        with k.if_(i < n):
            b = (q >> FINE_BITS).bitcast(I32)
            with k.if_(has_top_k):              # (counts place a top-k cut alone)
                k.atomic_add(c_count, b, one)
            w = weight(q)
            old = k.atomic_add(c_lo, b, w)
            with k.if_(old + w < old):
                k.atomic_add(c_hi, b, one)
    k.barrier()

    # the prefix the cuts keep, (last, kept), and its weight
    last, kept = k.var(U32, Q_LAST + 1), k.var(U32, 0)          # all of the row
    whole = total(reduce(add, [(c_hi[2 * tid + e], c_lo[2 * tid + e]) for e in (0, 1)]))
    kept_hi, kept_lo = k.var(U32, 0), k.var(U32, 0)
    kept_hi.set(whole[0])
    kept_lo.set(whole[1])

    def keep(step, count, below):
        last.set(step)
        kept.set(count)
        weight_kept = add(below, times(count, weight(k.min(step, Q_LAST))))
        kept_hi.set(weight_kept[0])
        kept_lo.set(weight_kept[1])

    with k.if_(has_top_k):
        keep(*prefix((zero, top_k), False))
    with k.if_(has_top_p):
        target = fraction(top_p, (kept_hi.get(), kept_lo.get()), True)
        none = target[0].eq(0) & target[1].eq(0)            # top_p 0 keeps one token
        keep(*prefix((target[0], k.select(none, one, target[1])), True))
    with k.if_((min_last < Q_LAST) & (min_last + 1 <= last.get())):
        keep(min_last + 1, zero, weight_below(min_last + 1))

    # the draw: the token where the ranking's running weight first passes bits / 2^32 of the
    # kept weight, the n-th (in id order) of those at its step: found by each span of ids'
    # count of them (a subgroup a span, its loads side by side), then that span walked together
    goal = add(fraction(bits, (kept_hi.get(), kept_lo.get()), False), (zero, one))
    drawn, nth, _ = prefix(goal, True)
    span = (n + WG * SPAN_UNIT - 1) / (WG * SPAN_UNIT) * SPAN_UNIT
    lane, n_sub = k.lane_id(), WG // subgroup_size
    with k.for_(k.subgroup_id(), WG, n_sub) as b:
        there = k.var(U32, 0)
        with k.for_(lane, span, SPAN_UNIT) as j0:
            for u in range(SPAN_UNIT // subgroup_size):
                i = b * span + j0 + u * subgroup_size
                there.set(there.get() + k.select((i < n) & step(k.min(i, n - 1)).eq(drawn),
                                                 one, zero))
        counted = k.subgroup_add(there.get())
        with k.if_(lane.eq(0)):
            f_count[b] = counted
    k.barrier()
    in_span = f_count[tid]
    k.barrier()
    which, before = reaching([(utid, (zero, in_span))], (zero, nth))
    first = which.bitcast(I32) * span
    seen = k.var(U32, 0)
    seen.set(before[1])
    with k.for_(first, k.min(first + span, n), WG) as i0:
        i = i0 + tid
        hit = (i < k.min(first + span, n)) & step(k.min(i, n - 1)).eq(drawn)
        ahead, all_hits = scan((zero, k.select(hit, one, zero)))
        with k.if_(hit & (seen.get() + ahead[1] + 1).eq(nth)):
            token[r] = i
        seen.set(seen.get() + all_hits[1])
    return k.build()
