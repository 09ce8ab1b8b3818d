"""The kernels that read a step's logits: their edits in place (logit_edits: engine/sampling.py's
edit_logits), the greedy choice (argmax_chunks, then argmax: sampling's greedy choice), each
row's best candidates with their sums (top_candidates: what sampling.choose_among chooses from),
and the greedy tokens fed to a step launched ahead (feed_tokens).
"""
from functools import cache

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
    last one landed takes that step's greedy tokens (argmax's) as its input where they are
    not known on the host yet. grid (1)."""
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
