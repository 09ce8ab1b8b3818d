"""A token's choice of experts where the launch that reads it makes it: mma_vec's choosing
variant of a one-token step ranks every expert at once with its whole workgroup
(`ranked_choice`), the ids experts.py's route kernels find in `used` rounds of a subgroup
maximum; and the weight of a chosen expert (`denominator`), in the arithmetic both share, so
both give the same bits.
"""
from .lang import F32, I32
from .ops import LOWEST


def denominator(k, mine, values, tops, n, normalize):
    """What a chosen expert's exp(top - tops[0]) is divided by: the softmax sum over all n
    logits (from the largest, tops[0]; each lane holding `values`, the logits of its experts
    `mine`, LOWEST past n), or with `normalize` the chosen ones' sum, in their order."""
    total = None
    for e, v in zip(mine, values):
        share = k.select(e < n, k.exp(v - tops[0]), 0.0)
        total = share if total is None else total + share
    if not normalize:
        return k.subgroup_add(total)
    out = None
    for top in tops:
        share = k.exp(top - tops[0])
        out = share if out is None else out + share
    return out


def ranked_choice(k, logits, t, n, used, slots, subgroup_size, workgroup):
    """Token t's `used` experts chosen by the whole workgroup (every thread calls it: it waits
    at barriers), as the route kernels choose them: the largest of logits[t, :n] first, ties
    to the lower index, only logits above LOWEST (never NaN), id n where fewer are. Returns
    shared arrays: the ids [used], their logits [used], and the logits [slots *
    subgroup_size] (LOWEST past n).

    An expert's rank is the count of logits above it, or equal and before it; workgroup /
    (slots * subgroup_size) adjacent threads (at least one) count a share of the logits each
    and add their counts, and the expert of rank j < used is the j-th chosen."""
    width = slots * subgroup_size
    held = k.shared("route_logits", F32, width)
    chosen = k.shared("route_chosen", I32, used)
    tops = k.shared("route_tops", F32, used)
    tid = k.thread_id()
    with k.for_(tid, width, workgroup) as e:
        held[e] = k.select(e < n, logits[t * n + k.min(e, n - 1)], LOWEST)
    with k.if_(tid < used):
        chosen[tid] = n
        tops[tid] = LOWEST
    k.barrier()
    per = workgroup // width if width <= workgroup and workgroup % width == 0 else 1
    span = width // per
    part = tid % per if per > 1 else 0
    with k.for_(tid / per if per > 1 else tid, width, workgroup // per) as e:
        v = held[e]
        rank = k.var(I32, 0)
        with k.for_(part * span, part * span + span, 4) as i:
            for j, o in enumerate(held.load(i, 4)):
                ahead = (o > v) | (o.eq(v) & (i + j < e))
                rank.set(k.select(ahead, rank.get() + 1, rank.get()))
        total = rank.get()
        step = 1
        while step < per:                   # the expert's threads are adjacent lanes
            total = total + k.shuffle_xor(total, step)
            step *= 2
        ours = (v > LOWEST) & (total < used)
        with k.if_(ours & part.eq(0) if per > 1 else ours):
            chosen[total] = e
            tops[total] = v
    k.barrier()
    return chosen, tops, held
