"""Prompt attention on the tensor cores in workgroups of 128 query rows: the long-prefill variant
of ops.attention_tiles, a drop-in for it (the same parameters, the same 16-token tiles taken,
ops.tiled_tokens, and the same output), with its own grid (flash_grid).

A workgroup holds up to eight subgroups, each 16 tokens of one query head (the fragment work of
attention_tiles, unchanged), so each K/V round copied into shared memory serves 128 query rows
rather than 64; the rounds are double-buffered (the next round's asynchronous copies fly while
this one is multiplied); scores are in log2 units (q times scale and log2(e), so one ex2 a
probability); masks are computed only in the rounds that cross a subgroup's diagonal or window
edge; and the tiles furthest into their sequences start first (the causal tail is short).
"""
import math
from functools import cache

from .lang import F16, F32, I32, U32, KernelBuilder
from .ops import (LOWEST, ATTENTION_TILE, _attention_params, cache_slot, query_state,
                  tiled_token_tile)
from .softcap import capped, sees, suffix, window_start

FLASH_WARPS = 8         # subgroups of a workgroup at most (the default): 128 query rows
LOG2E = math.log2(math.e)
MOST = 2 ** 31 - 1


def flash_blocks(heads, warps=FLASH_WARPS):
    """16-token blocks of a workgroup taking `heads` query heads (one subgroup a block and
    head): as many as keep it within `warps` subgroups (one at least)."""
    return max(1, warps // heads)


def flash_key_block(head_dim):
    """Keys a round copies and scores, so that a thread's scores, sums and q fit its registers
    without spilling: 64 from head_dim 80 to 128, 32 below (ptxas keeps a subgroup of that
    size to 128 registers), 16 above."""
    return 32 if head_dim < 80 else 64 if head_dim <= 128 else 16


def flash_grid(T, n_heads, heads, warps=FLASH_WARPS):
    """The grid of attention_flash over a step of T tokens: (query head groups, tiles), so that
    the workgroups start in order of their tiles, every head group's last tile first."""
    return (n_heads // heads, -(-T // (ATTENTION_TILE * flash_blocks(heads, warps))))


@cache
def attention_flash(head_dim, heads, window=0, softcap=0.0, warps=FLASH_WARPS):
    """The tiles of ops.attention_tiles (the same parameters; the tokens tiled_token_tile takes,
    the others left unwritten), workgroup (g, i) taking flash_blocks(heads, warps) 16-token
    blocks from the step's end backwards (tile n - 1 - i) and `heads` query heads g * heads.. of
    one KV head, subgroup w head g * heads + w % heads of block w // heads (`warps`: subgroups a
    workgroup at most, but one block of `heads` at least; named where not FLASH_WARPS).

    Blocks of one sequence that follow each other form a run, which shares the rounds of its
    keys: rounds of flash_key_block keys from the run's first key (its tokens' first
    window_start) to its last position, K and V copied two stages deep, each subgroup of the
    run scoring S = (q * scale * log2(e), rounded to f16) K^T (a softcap caps the scores in
    natural units first), masking only in rounds that hold a key one of its tokens does not
    see, and O += P V with P = 2^(S - running max) rounded to f16. head_dim a multiple of 16,
    at most 256. grid flash_grid(T, n_heads, heads, warps)."""
    if head_dim % 16 or head_dim > 256:
        raise ValueError(f"attention_flash: head_dim {head_dim} is no multiple of 16 up to 256")
    blocks, keys = flash_blocks(heads, warps), flash_key_block(head_dim)
    threads = 32 * heads * blocks
    half, row_words = head_dim // 2, head_dim // 2 + 4     # rows padded: ldmatrix's 8 rows
    stage = keys * row_words                                # words of one round of K (or V)
    k = KernelBuilder(f"attention_flash_d{head_dim}_h{heads}" + suffix(window, softcap)
                      + f"_g{warps}" * (warps != FLASH_WARPS), (threads,))
    q, out, k_cache, v_cache, positions, seq_rows, tables, n_heads, n_kv, table_width, \
        block_size, scale = _attention_params(k, "out")
    n_tokens = k.scalar("n_tokens", I32)
    ks = k.shared("keys", U32, 2 * stage)
    vs = k.shared("values", U32, 2 * stage)
    info = k.shared("blocks", I32, 4 * blocks)     # per block: taken, row, first key, last
    tid, lane, warp = k.thread_id(), k.lane_id(), k.subgroup_id()
    g, quad = lane >> 2, lane & 3
    t0 = (k.num_blocks(1) - 1 - k.block_id(1)) * (ATTENTION_TILE * blocks)
    mine_block = warp / heads
    h = k.block_id(0) * heads + warp % heads
    kvh = k.block_id(0) * heads / (n_heads / n_kv)

    # this subgroup's block: whether the tiles take it, its tokens' positions and the lane's rows
    tb = t0 + mine_block * ATTENTION_TILE
    at_block = k.min(tb, n_tokens - 1)
    taken = tiled_token_tile(k, seq_rows, n_tokens, at_block) & (tb < n_tokens)
    t_last = k.min(tb + ATTENTION_TILE, n_tokens) - 1
    mine_pos = positions[k.min(tb + (lane & 15), t_last)]
    least, last = k.subgroup_min(mine_pos), k.subgroup_max(mine_pos)
    first = window_start(k, least, window) if window else k.const(0, I32)
    tokens = [k.min(tb + g, t_last), k.min(tb + g + 8, t_last)]     # the lane's two rows
    limits = [positions[t] for t in tokens]
    with k.if_((warp % heads).eq(0) & lane.eq(0)):
        for i, v in enumerate((taken.to(I32), seq_rows[at_block], first, last)):
            info[mine_block * 4 + i] = v
    k.barrier()

    def runs():
        """(taken, lead) of each block, read where they are used (not held in registers): its
        run starts at block `lead`; a block starts one unless the block before is taken and of
        the same sequence."""
        taken_b = [info[4 * b].ne(0) for b in range(blocks)]
        rows_b = [info[4 * b + 1] for b in range(blocks)]
        leads, lead = [], k.const(0, I32)
        for b in range(blocks):
            if b:
                starts = ~(taken_b[b - 1] & rows_b[b - 1].eq(rows_b[b]))
                lead = k.select(starts, b, lead)
            leads.append(lead)
        return taken_b, leads

    leads = runs()[1]
    mine_lead = leads[0]
    for b in range(1, blocks):
        mine_lead = k.select(mine_block.eq(b), leads[b], mine_lead)

    qs = scale if softcap else scale * LOG2E
    qa, running_max, running_sum, acc = query_state(k, q, tokens, n_heads, h, head_dim, quad,
                                                    qs)
    k_lane = ((lane & 7) + (lane >> 4) * 8) * row_words + ((lane >> 3) & 1) * 4
    v_lane = (8 * ((lane >> 3) & 1) + (lane & 7)) * row_words + 4 * (lane >> 4)

    def fetch(row, hi, j0, base):
        """Starts copying keys j0.. (clamped to hi) of K and V into the stage at `base`."""
        parts = keys * half // 4                            # 16-byte parts of a round's rows
        for p in range(-(-parts // threads)):
            i = tid + p * threads
            key, part = i / (half // 4), i % (half // 4)
            j = k.min(j0 + key, hi)
            at = (cache_slot(tables, row, j, table_width, block_size) * n_kv + kvh) * half \
                + part * 4
            to = base + key * row_words + part * 4
            if parts % threads == 0:
                k.copy_async(ks, to, k_cache, at)
                k.copy_async(vs, to, v_cache, at)
            else:
                with k.if_(i < parts):
                    k.copy_async(ks, to, k_cache, at)
                    k.copy_async(vs, to, v_cache, at)

    def multiply(j0, base, masked):
        """This subgroup's round of keys j0.. at `base`: scores, softmax, O += P V."""
        scores = [[0.0] * 4 for _ in range(keys // 8)]
        for s in range(head_dim // 16):
            for pair in range(keys // 16):
                words = k.fragment_load(ks, base + k_lane + 16 * pair * row_words + s * 8)
                for n, b in ((2 * pair, words[:2]), (2 * pair + 1, words[2:])):
                    scores[n] = k.mma(F16, qa[s], b, [k.coerce(v, F32) for v in scores[n]])
        if softcap:
            scores = [[capped(k, v, softcap) * LOG2E for v in row] for row in scores]
        if masked:      # key j0 + 8 n + 2 quad + e % 2 of row e // 2
            scores = [[k.select(sees(j0 + 8 * n + 2 * quad + e % 2, limits[e // 2], window), v,
                                LOWEST) for e, v in enumerate(row)]
                      for n, row in enumerate(scores)]
        probs = online_softmax(k, scores, running_max, running_sum, acc, masked)
        for kk in range(keys // 16):
            a = [k.pack_half2(probs[2 * kk + j // 2][2 * (j % 2)],
                              probs[2 * kk + j // 2][2 * (j % 2) + 1]) for j in range(4)]
            for dp in range(head_dim // 16):
                words = k.fragment_load(vs, base + v_lane + 16 * kk * row_words + 8 * dp,
                                        trans=True)
                for n, b in ((2 * dp, words[:2]), (2 * dp + 1, words[2:])):
                    d = k.mma(F16, a, b, [v.get() for v in acc[n]])
                    for v, value in zip(acc[n], d):
                        v.set(value)

    with k.for_(0, blocks) as b:
        # the run starting at block b (none: lo > hi): its sequence and keys
        lo, hi = k.const(MOST, I32), k.const(-1, I32)
        taken_b, leads = runs()
        for c in range(blocks):
            member = leads[c].eq(b) & taken_b[c]
            lo = k.select(member, k.min(lo, info[4 * c + 2]), lo)
            hi = k.select(member, k.max(hi, info[4 * c + 3]), hi)
        with k.if_(lo <= hi):
            row = info[4 * b + 1]
            mine = taken & mine_lead.eq(b)
            rounds = (hi - lo) / keys + 1
            fetch(row, hi, lo, k.const(0, I32))
            k.copy_commit()
            with k.for_(0, rounds) as r:
                j0 = lo + r * keys
                with k.if_(r + 1 < rounds):
                    fetch(row, hi, j0 + keys, ((r + 1) & 1) * stage)
                k.copy_commit()
                k.copy_wait(1)
                k.barrier()
                base = (r & 1) * stage
                # masks where a key of the round is past a token or before its window
                crosses = j0 + (keys - 1) > least
                if window:
                    crosses = crosses | (j0 <= last - window)
                with k.if_(mine):
                    with k.if_(crosses) as stmt:
                        multiply(j0, base, True)
                    with k.else_(stmt):
                        multiply(j0, base, False)
                k.barrier()
    with k.if_(taken):
        for n in range(head_dim // 8):
            for e, v in enumerate(acc[n]):
                t = tb + g + 8 * (e // 2)
                with k.if_(t < n_tokens):
                    out[(t * n_heads + h) * head_dim + 8 * n + 2 * quad + e % 2] = \
                        v.get() / running_sum[e // 2].get()
    return k.build()


DECODE_WARPS = 4        # subgroups of a decode workgroup, each 16 keys of a round


def online_softmax(k, scores, running_max, running_sum, acc, masked):
    """One tile's step of the running softmax of a subgroup's two rows (scores [n][e]: row
    e // 2, the quad's four lanes holding a row's keys): each row's new maximum, its keys'
    exp2 weights (returned, [n][e]), its running sum, and the accumulator acc [d][e] scaled by
    how far the maximum moved. `masked`: a row whose scores are all masked (lowest) weighs
    them 0, also before it has seen a key."""
    corrections, probs = [], [[None] * 4 for _ in scores]
    for r in range(2):
        top = running_max[r].get()
        for row in scores:
            top = k.max(top, k.max(row[2 * r], row[2 * r + 1]))
        top = k.max(top, k.shuffle_xor(top, 1))
        top = k.max(top, k.shuffle_xor(top, 2))
        floor = k.select(top.eq(LOWEST), 0.0, top) if masked else top
        total = None
        for n, row in enumerate(scores):
            for e in (2 * r, 2 * r + 1):
                probs[n][e] = k.exp2(row[e] - floor)
                total = probs[n][e] if total is None else total + probs[n][e]
        total = total + k.shuffle_xor(total, 1)
        total = total + k.shuffle_xor(total, 2)
        correction = k.exp2(running_max[r].get() - top)
        running_sum[r].set(k.fma(running_sum[r].get(), correction, total))
        running_max[r].set(top)
        corrections.append(correction)
    for row in acc:
        for e, v in enumerate(row):
            v.set(v.get() * corrections[e // 2])
    return probs


@cache
def attention_decode(head_dim, heads, untiled=False, warps=DECODE_WARPS):
    """`attention` on the tensor cores for decode tokens (the same parameters and output; no
    window or cap): workgroup b takes token b / (n_heads / heads) and `heads` (at most 16) query
    heads of one KV head as the rows of one 16-row tile, the other rows zero and never stored.
    Rounds of 16 x `warps` keys of the token's sequence up to its position, K and V copied into
    shared memory two stages deep by every thread; subgroup w scores keys 16 w.. of a round,
    S = (q * scale * log2(e), rounded to f16) K^T, keeps a running max and sum a row and
    O += P V (P rounded to f16, V by transposed fragment loads); the subgroups' O, max and sum
    are added at the end through shared memory, each weighed by 2^(its max - the largest).
    head_dim a multiple of 16, at most 256. grid (T * n_heads / heads). `untiled`: the tokens
    the prompt tiles take (tiled_token_tile; a further scalar n_tokens) are left to them."""
    if head_dim % 16 or head_dim > 256 or not 1 <= heads <= 16:
        raise ValueError(f"attention_decode: head_dim {head_dim} (a multiple of 16 up to 256), "
                         f"heads {heads} (1 to 16)")
    keys, threads = 16 * warps, 32 * warps
    half, row_words = head_dim // 2, head_dim // 2 + 4     # rows padded: ldmatrix's 8 rows
    stage = keys * row_words
    k = KernelBuilder(f"attention_decode_d{head_dim}_h{heads}" + "_untiled" * untiled +
                      f"_g{warps}" * (warps != DECODE_WARPS), (threads,))
    q, out, k_cache, v_cache, positions, seq_rows, tables, n_heads, n_kv, table_width, \
        block_size, scale = _attention_params(k, "out")
    n_tokens = k.scalar("n_tokens", I32) if untiled else None
    ks = k.shared("keys", U32, 2 * stage)
    vs = k.shared("values", U32, 2 * stage)
    sums = k.shared("sums", F32, warps * heads * (head_dim + 2))
    tid, lane, warp = k.thread_id(), k.lane_id(), k.subgroup_id()
    g, quad = lane >> 2, lane & 3
    per_token = n_heads / heads
    t, h0 = k.block_id() / per_token, k.block_id() % per_token * heads
    kvh = h0 / (n_heads / n_kv)
    if untiled:                 # the prompt tiles took this token
        with k.if_(tiled_token_tile(k, seq_rows, n_tokens, t - t % ATTENTION_TILE)):
            k.return_()
    row, hi = seq_rows[t], positions[t]                 # the sequence, its last key

    # the A fragments of the tile: row r is head h0 + r's q * scale * log2(e) (zero past heads)
    qs = scale * LOG2E
    qa = []
    for s in range(head_dim // 16):
        words = []
        for j in range(4):
            r = g + 8 * (j % 2)
            at = (t * n_heads + h0 + k.min(r, heads - 1)) * head_dim + 16 * s + 2 * quad + \
                8 * (j // 2)
            pair = [q[at] * qs, q[at + 1] * qs]
            if heads < 16:
                pair = [k.select(r < heads, v, 0.0) for v in pair]
            words.append(k.pack_half2(*pair))
        qa.append(words)
    running_max = [k.var(F32, LOWEST) for _ in range(2)]
    running_sum = [k.var(F32, 0.0) for _ in range(2)]
    acc = [[k.var(F32, 0.0) for _ in range(4)] for _ in range(head_dim // 8)]
    k_lane = ((lane & 7) + (lane >> 4) * 8) * row_words + ((lane >> 3) & 1) * 4
    v_lane = (8 * ((lane >> 3) & 1) + (lane & 7)) * row_words + 4 * (lane >> 4)

    def fetch(j0, base):
        """Starts copying keys j0.. (clamped to hi) of K and V into the stage at `base`."""
        parts = keys * half // 4                            # 16-byte parts of a round's rows
        for p in range(-(-parts // threads)):
            i = tid + p * threads
            key, part = i / (half // 4), i % (half // 4)
            j = k.min(j0 + key, hi)
            at = (cache_slot(tables, row, j, table_width, block_size) * n_kv + kvh) * half \
                + part * 4
            to = base + key * row_words + part * 4
            with k.if_(i < parts):
                k.copy_async(ks, to, k_cache, at)
                k.copy_async(vs, to, v_cache, at)

    def multiply(j0, base, masked):
        """This subgroup's 16 keys j0.. at `base`: scores, softmax, O += P V."""
        scores = [[0.0] * 4 for _ in range(2)]
        for s in range(head_dim // 16):
            words = k.fragment_load(ks, base + k_lane + s * 8)
            for n, b in ((0, words[:2]), (1, words[2:])):
                scores[n] = k.mma(F16, qa[s], b, [k.coerce(v, F32) for v in scores[n]])
        if masked:      # key j0 + 8 n + 2 quad + e % 2 past the token's position
            scores = [[k.select(j0 + 8 * n + 2 * quad + e % 2 <= hi, v, LOWEST)
                       for e, v in enumerate(row_)] for n, row_ in enumerate(scores)]
        probs = online_softmax(k, scores, running_max, running_sum, acc, False)
        a = [k.pack_half2(probs[j // 2][2 * (j % 2)], probs[j // 2][2 * (j % 2) + 1])
             for j in range(4)]
        for dp in range(head_dim // 16):
            words = k.fragment_load(vs, base + v_lane + 8 * dp, trans=True)
            for n, b in ((2 * dp, words[:2]), (2 * dp + 1, words[2:])):
                d = k.mma(F16, a, b, [v.get() for v in acc[n]])
                for v, value in zip(acc[n], d):
                    v.set(value)

    rounds = hi / keys + 1
    fetch(k.const(0, I32), k.const(0, I32))
    k.copy_commit()
    with k.for_(0, rounds) as r:
        j0 = r * keys
        with k.if_(r + 1 < rounds):
            fetch(j0 + keys, ((r + 1) & 1) * stage)
        k.copy_commit()
        k.copy_wait(1)
        k.barrier()
        mine = j0 + 16 * warp
        base = (r & 1) * stage + 16 * warp * row_words
        with k.if_(mine + 15 <= hi) as stmt:
            multiply(mine, base, False)
        with k.else_(stmt):
            with k.if_(mine <= hi):
                multiply(mine, base, True)
        k.barrier()

    # each subgroup's rows (heads) into shared memory: O, then its max and sum
    for e2 in range(2):
        r = g + 8 * e2
        with k.if_(r < heads):
            at = (warp * heads + r) * (head_dim + 2)
            for n in range(head_dim // 8):
                for e in (2 * e2, 2 * e2 + 1):
                    sums[at + 8 * n + 2 * quad + e % 2] = acc[n][e].get()
            with k.if_(quad.eq(0)):
                sums[at + head_dim] = running_max[e2].get()
                sums[at + head_dim + 1] = running_sum[e2].get()
    k.barrier()
    with k.for_(tid, heads * head_dim, threads) as i:
        hh, d = i / head_dim, i % head_dim
        top = k.var(F32, LOWEST)
        for w in range(warps):
            top.set(k.max(top.get(), sums[(w * heads + hh) * (head_dim + 2) + head_dim]))
        num, den = k.var(F32, 0.0), k.var(F32, 0.0)
        for w in range(warps):
            at = (w * heads + hh) * (head_dim + 2)
            weight = k.exp2(sums[at + head_dim] - top.get())
            num.set(k.fma(weight, sums[at + d], num.get()))
            den.set(k.fma(weight, sums[at + head_dim + 1], den.get()))
        out[(t * n_heads + h0 + hh) * head_dim + d] = num.get() / den.get()
    return k.build()
