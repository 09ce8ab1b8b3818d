"""The step's small kernels: embedding, RMSNorm, RoPE, KV store, attention (in one pass, or split
along the context and combined), SwiGLU, add, gather, and a device group's all_reduce and
all_gather (the logits' edits and the choice of tokens are choice.py's). Each function returns
a Kernel for a subgroup size; the numpy meaning of each is the op of the same name in
poot/ir/reference.py.

Activations are f32 [tokens, features]; the KV cache holds f16 pairs in u32 words,
[blocks, block_size, kv_heads, head_dim / 2].
"""
import math
import struct
from contextlib import nullcontext
from functools import cache

from . import activations
from .softcap import capped, first_key, sees, suffix, window_start
from .lang import F16, F32, I32, U32, KernelBuilder
from .quant import reader

WG = 256
LOWEST = -3.4028234663852886e38     # the lowest finite f32: wgpu's translator refuses -inf


def cache_slot(tables, row, position, table_width, block_size):
    """The paged cache's slot of a sequence's position: its block (from the sequence's row of
    block tables) times block_size, plus the position within the block."""
    return tables[row * table_width + position / block_size] * block_size + position % block_size


def block_reduce(k, value, subgroup_size, scratch, op="add"):
    """The sum (or max) of `value` over the workgroup, in every thread. Uses scratch[0:WG/sub]."""
    part = k.subgroup_add(value) if op == "add" else k.subgroup_max(value)
    n_sub = WG // subgroup_size
    if n_sub == 1:
        return part
    with k.if_(k.lane_id().eq(0)):
        scratch[k.subgroup_id()] = part
    k.barrier()
    total = k.var(F32, 0.0 if op == "add" else LOWEST)
    with k.for_(0, n_sub) as i:
        v = scratch[i]
        total.set(total.get() + v if op == "add" else k.max(total.get(), v))
    k.barrier()
    return total.get()


@cache
def rms_norm(subgroup_size, residual=False):
    """out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, plus res[r] with `residual` (Gemma's norms
    after attention and the feed-forward, added to the residual stream); one workgroup per
    row. grid (rows)."""
    k = KernelBuilder(f"rms_norm_s{subgroup_size}" + "_residual" * residual, (WG,))
    x, w = k.buffer("x", F32), k.buffer("w", F32)
    res = k.buffer("res", F32) if residual else None
    out = k.buffer("out", F32, "w")
    n, eps = k.scalar("n", I32), k.scalar("eps", F32)
    scratch = k.shared("scratch", F32, WG // subgroup_size)
    base, tid = k.block_id() * n, k.thread_id()
    acc = k.var(F32, 0.0)
    with k.for_(tid, n, WG) as i:
        v = x[base + i]
        acc.set(k.fma(v, v, acc.get()))
    total = block_reduce(k, acc.get(), subgroup_size, scratch)
    scale = k.rsqrt(total / n.to(F32) + eps)
    with k.for_(tid, n, WG) as i:
        y = x[base + i] * scale * w[i]
        out[base + i] = y if res is None else y + res[base + i]
    return k.build()


@cache
def elementwise(op, activation=None):
    """out[i] = a[i] + b[i % len(b)] ("add"), or the gated unit of a[i] and b[i] ("glu", of
    `activation`: kernels/activations.py). grid (ceil(n/WG))."""
    k = KernelBuilder(op if op == "add" else activations.UNITS[activation], (WG,))
    a, b, out = k.buffer("a", F32), k.buffer("b", F32), k.buffer("out", F32, "w")
    n, nb = k.scalar("n", I32), k.scalar("n_b", I32)
    i = k.block_id() * WG + k.thread_id()
    with k.if_(i < n):
        x = a[i]
        if op == "add":
            out[i] = x + b[i % nb]
        else:
            out[i] = activations.glu(k, activation, x, b[i])
    return k.build()


@cache
def scale():
    """out[i] = x[i] * s; grid (ceil(n/WG))."""
    k = KernelBuilder("scale", (WG,))
    x, out = k.buffer("x", F32), k.buffer("out", F32, "w")
    n, s = k.scalar("n", I32), k.scalar("s", F32)
    i = k.block_id() * WG + k.thread_id()
    with k.if_(i < n):
        out[i] = x[i] * s
    return k.build()


@cache
def gather_rows():
    """out[r, :] = x[index[r], :]; grid (R)."""
    k = KernelBuilder("gather_rows", (WG,))
    x, index, out = k.buffer("x", F32), k.buffer("index", I32), k.buffer("out", F32, "w")
    n = k.scalar("n", I32)
    r = k.block_id()
    src = index[r] * n
    with k.for_(k.thread_id(), n, WG) as i:
        out[r * n + i] = x[src + i]
    return k.build()


@cache
def embedding(dtype, scaled=False):
    """out[t, :] = table[ids[t], :] from the table's device planes (`scaled`: times a further
    scalar, the graph's scale); grid (T)."""
    r = reader(dtype)
    k = KernelBuilder(f"embedding_{dtype.lower()}" + "_scaled" * scaled, (WG,))
    buf = {name: k.buffer(f"w_{name}", U32) for name in r.plane_names}
    ids, out = k.buffer("ids", I32), k.buffer("out", F32, "w")
    cols = k.scalar("cols", I32)
    scale = k.scalar("scale", F32) if scaled else None
    t = k.block_id()
    row = ids[t]
    with k.for_(k.thread_id(), cols // r.block_elems, WG) as block:
        for j, v in enumerate(r.decode(k, buf, row, block, cols)):
            out[t * cols + block * r.block_elems + j] = v if scale is None else v * scale
    return k.build()


# pi/2 in three parts: the first two have so few bits that q * part is exact for q < 2**17
# (angles up to about 200,000 radians: positions times a rope frequency of at most 1).
HALF_PI = (101 / 64, -15 / 2048, math.pi / 2 - 101 / 64 + 15 / 2048)


def sin_cos(k, angle):
    """sin and cos of an f32 angle, to a few ulp on every target: reduced exactly by pi/2
    (Cody-Waite, without relying on fused multiply-add), then Taylor polynomials on
    [-pi/4, pi/4], then the quadrant. Targets' own sin/cos may be far coarser (Vulkan allows
    2^-11 absolute error)."""
    q = k.floor(angle * (2 / math.pi) + 0.5)
    y = angle - q * HALF_PI[0] - q * HALF_PI[1] - q * HALF_PI[2]
    y2 = y * y
    sin = cos = None
    for n in (11, 9, 7, 5, 3):                     # y - y^3/3! + ... - y^11/11!
        term = (-1) ** (n // 2) / math.factorial(n)
        sin = term if sin is None else k.fma(sin, y2, term)
    sin = k.fma(sin * y2, y, y)
    for n in (12, 10, 8, 6, 4, 2):                 # 1 - y^2/2! + ... + y^12/12!
        term = (-1) ** (n // 2) / math.factorial(n)
        cos = term if cos is None else k.fma(cos, y2, term)
    cos = k.fma(cos, y2, 1.0)
    quadrant = q.to(I32) & 3
    swap = (quadrant & 1).eq(1)
    s, c = k.select(swap, cos, sin), k.select(swap, sin, cos)
    s = k.select((quadrant & 2).eq(2), -s, s)
    c = k.select(((quadrant + 1) & 2).eq(2), -c, c)
    return s, c


def _scaled(name, scale):
    """A rope kernel's name: a scale other than 1 (LongRoPE's attention factor, multiplying
    the rotated pairs) is part of the kernel, so of its name (its f32 bits)."""
    if scale == 1.0:
        return name
    return f"{name}_x{struct.unpack('<I', struct.pack('<f', scale))[0]:08x}"


def _turn(k, angle, scale):
    """sin and cos of `angle`, times `scale`."""
    sin, cos = sin_cos(k, angle)
    return (sin, cos) if scale == 1.0 else (sin * scale, cos * scale)


@cache
def rope(style, scale=1.0):
    """Rotates pairs of x[t, h, :] in place by positions[t] * inv_freq[i], times `scale`; grid
    (ceil(T * heads * n_pairs / WG)). normal pairs (2i, 2i+1), neox pairs (i, i + half)."""
    k = KernelBuilder(_scaled(f"rope_{style}", scale), (WG,))
    x, positions, inv_freq = k.buffer("x", F32, "rw"), k.buffer("positions", I32), k.buffer(
        "inv_freq", F32)
    n_tokens, n_heads, head_dim, n_pairs = (k.scalar(s, I32) for s in
                                            ("n_tokens", "n_heads", "head_dim", "n_pairs"))
    g = k.block_id() * WG + k.thread_id()
    with k.if_(g < n_tokens * n_heads * n_pairs):
        pair = g % n_pairs
        th = g / n_pairs                            # token * n_heads + head
        t = th / n_heads
        _rotate(k, x, th * head_dim, pair, n_pairs, positions[t].to(F32) * inv_freq[pair],
                style, scale)
    return k.build()


def _rotate(k, x, base, pair, n_pairs, angle, style, scale):
    """Rotates pair `pair` of the head at x[base] in place by `angle`, times `scale`: dims
    (2 pair, 2 pair + 1) normal, (pair, pair + n_pairs) neox."""
    sin, cos = _turn(k, angle, scale)
    if style == "normal":
        ia, ib = base + pair * 2, base + pair * 2 + 1
    else:
        ia, ib = base + pair, base + pair + n_pairs
    a, b = x[ia], x[ib]
    x[ia] = a * cos - b * sin
    x[ib] = a * sin + b * cos


@cache
def store_kv():
    """k, v f32 [T, kv_heads, head_dim] -> their cache slots, as f16 pairs; grid
    (ceil(T * kv_heads * head_dim / 2 / WG))."""
    k = KernelBuilder("store_kv", (WG,))
    key, value = k.buffer("k", F32), k.buffer("v", F32)
    k_cache, v_cache = k.buffer("k_cache", U32, "w"), k.buffer("v_cache", U32, "w")
    positions, seq_rows, tables = k.buffer("positions", I32), k.buffer("seq_rows", I32), \
        k.buffer("block_tables", I32)
    n_tokens, words, table_width, block_size = (k.scalar(s, I32) for s in (
        "n_tokens", "words_per_token", "table_width", "block_size"))
    g = k.block_id() * WG + k.thread_id()
    with k.if_(g < n_tokens * words):
        t, wd = g / words, g % words
        pos = positions[t]
        slot = cache_slot(tables, seq_rows[t], pos, table_width, block_size)
        src = t * words * 2 + wd * 2
        k_cache[slot * words + wd] = k.pack_half2(key[src], key[src + 1])
        v_cache[slot * words + wd] = k.pack_half2(value[src], value[src + 1])
    return k.build()


@cache
def rope_store_kv(style, scale=1.0):
    """A layer's rope of q and k and its store_kv in one launch: q [T, heads, head_dim] rotated
    in place, k rotated on the way into the cache (k itself is only read: a neox pair spans two
    threads' words), v stored as it is. One thread per (token, head of q then of k/v, word of two
    dims); grid (ceil(T * (heads + kv_heads) * head_dim / 2 / WG)). Pairs and scale as in
    `rope`."""
    k = KernelBuilder(_scaled(f"rope_store_kv_{style}", scale), (WG,))
    q, key, value = k.buffer("q", F32, "rw"), k.buffer("k", F32), k.buffer("v", F32)
    k_cache, v_cache = k.buffer("k_cache", U32, "w"), k.buffer("v_cache", U32, "w")
    positions, seq_rows, tables = k.buffer("positions", I32), k.buffer("seq_rows", I32), \
        k.buffer("block_tables", I32)
    inv_freq = k.buffer("inv_freq", F32)
    n_tokens, n_heads, n_kv, head_dim, n_pairs, table_width, block_size = (
        k.scalar(s, I32) for s in ("n_tokens", "n_heads", "n_kv_heads", "head_dim", "n_pairs",
                                   "table_width", "block_size"))
    half = head_dim / 2
    heads = n_heads + n_kv
    g = k.block_id() * WG + k.thread_id()
    with k.if_(g < n_tokens * heads * half):
        word, th = g % half, g / half
        t, h = th / heads, th % heads
        angle = positions[t].to(F32)
        with k.if_(h < n_heads) as stmt:
            with k.if_(word < n_pairs):
                _rotate(k, q, (t * n_heads + h) * head_dim, word, n_pairs,
                        angle * inv_freq[word], style, scale)
        with k.else_(stmt):
            kvh = h - n_heads
            base = (t * n_kv + kvh) * head_dim
            ka, kb = _roped_word(k, style, lambda j: key[base + j], word, n_pairs, angle,
                                 inv_freq, scale)
            pos = positions[t]
            slot = cache_slot(tables, seq_rows[t], pos, table_width, block_size) * n_kv + kvh
            k_cache[slot * half + word] = k.pack_half2(ka, kb)
            v_cache[slot * half + word] = k.pack_half2(value[base + word * 2],
                                                       value[base + word * 2 + 1])
    return k.build()


@cache
def norm_rope_store_kv(style, subgroup_size, scale=1.0):
    """rope_store_kv with each head's RMSNorm before its rope (Qwen3's and Gemma 3's q and k
    norms: one weight of head_dim for q's heads, one for k's): one subgroup per (token, head
    of q then of k/v), which sums the head's squares over its lanes, then rotates and stores
    as rope_store_kv does, every dim scaled (those past the rotated pairs too); v is stored as
    it is. grid (ceil(T * (heads + kv_heads) / (WG / subgroup_size)))."""
    k = KernelBuilder(_scaled(f"norm_rope_store_kv_{style}_s{subgroup_size}", scale), (WG,))
    q, key, value = k.buffer("q", F32, "rw"), k.buffer("k", F32), k.buffer("v", F32)
    k_cache, v_cache = k.buffer("k_cache", U32, "w"), k.buffer("v_cache", U32, "w")
    positions, seq_rows, tables = k.buffer("positions", I32), k.buffer("seq_rows", I32), \
        k.buffer("block_tables", I32)
    inv_freq, q_norm, k_norm = (k.buffer(s, F32) for s in ("inv_freq", "q_norm", "k_norm"))
    n_tokens, n_heads, n_kv, head_dim, n_pairs, table_width, block_size = (
        k.scalar(s, I32) for s in ("n_tokens", "n_heads", "n_kv_heads", "head_dim", "n_pairs",
                                   "table_width", "block_size"))
    eps = k.scalar("eps", F32)
    heads, lane = n_heads + n_kv, k.lane_id()
    th = k.block_id() * (WG // subgroup_size) + k.subgroup_id()    # the subgroup's head
    with k.if_(th < n_tokens * heads):                  # the same for every lane of it
        t, h = th / heads, th % heads
        angle = positions[t].to(F32)
        with k.if_(h < n_heads) as stmt:
            base = (t * n_heads + h) * head_dim
            r = _head_rms(k, q, base, head_dim, eps, lane, subgroup_size)

            def normed(j):
                return q[base + j] * r * q_norm[j]
            with k.for_(lane, n_pairs, subgroup_size) as pair:
                sin, cos = _turn(k, angle * inv_freq[pair], scale)
                ia, ib = (pair * 2, pair * 2 + 1) if style == "normal" else (pair, pair + n_pairs)
                a, b = normed(ia), normed(ib)
                q[base + ia] = a * cos - b * sin
                q[base + ib] = a * sin + b * cos
            with k.for_(n_pairs * 2 + lane, head_dim, subgroup_size) as d:     # unrotated
                q[base + d] = normed(d)
        with k.else_(stmt):
            kvh = h - n_heads
            base = (t * n_kv + kvh) * head_dim
            r = _head_rms(k, key, base, head_dim, eps, lane, subgroup_size)

            def normed(j):
                return key[base + j] * r * k_norm[j]
            slot = cache_slot(tables, seq_rows[t], positions[t], table_width, block_size) * \
                n_kv + kvh
            half = head_dim / 2
            with k.for_(lane, half, subgroup_size) as word:
                d = word * 2
                ka, kb = _roped_word(k, style, normed, word, n_pairs, angle, inv_freq, scale)
                k_cache[slot * half + word] = k.pack_half2(ka, kb)
                v_cache[slot * half + word] = k.pack_half2(value[base + d], value[base + d + 1])
    return k.build()


def _head_rms(k, x, base, head_dim, eps, lane, subgroup_size):
    """1 / sqrt(mean of squares + eps) of the head at x[base], in every lane of the subgroup
    that reads it."""
    acc = k.var(F32, 0.0)
    with k.for_(lane, head_dim, subgroup_size) as d:
        v = x[base + d]
        acc.set(k.fma(v, v, acc.get()))
    dims = float(head_dim) if isinstance(head_dim, int) else head_dim.to(F32)
    return k.rsqrt(k.subgroup_add(acc.get()) / dims + eps)


def _roped_word(k, style, load, word, n_pairs, angle, inv_freq, scale):
    """Dims 2 word and 2 word + 1 of a head (`load(j)` reads its dim j) after the rope by
    `angle` (a position) times inv_freq, times `scale`: normal pairs (2i, 2i + 1), neox
    (i, i + n_pairs); dims past the rotated pairs as they are."""
    d = word * 2
    if style == "normal":                   # dims d, d + 1 are pair `word`
        rotated = word < n_pairs
        sin, cos = _turn(k, angle * inv_freq[k.min(word, n_pairs - 1)], scale)
        a, b = load(d), load(d + 1)
        return k.select(rotated, a * cos - b * sin, a), k.select(rotated, a * sin + b * cos, b)
    return tuple(_neox_dim(k, load, i, n_pairs, angle, inv_freq, scale) for i in (d, d + 1))


def _neox_dim(k, load, i, n_pairs, angle, inv_freq, scale):
    """Dim i of a head (`load(j)` reads its dim j) after a neox rotation (times `scale`): pair
    i with i + n_pairs below n_pairs, pair i - n_pairs with i - n_pairs up to 2 n_pairs,
    unrotated beyond."""
    low, rotated = i < n_pairs, i < n_pairs * 2
    pair = k.select(low, i, k.select(rotated, i - n_pairs, 0))
    partner = k.select(low, i + n_pairs, k.select(rotated, i - n_pairs, i))
    sin, cos = _turn(k, angle * inv_freq[pair], scale)
    mine, other = load(i), load(partner)
    turned = k.select(low, mine * cos - other * sin, other * sin + mine * cos)
    return k.select(rotated, turned, mine)


KEYS_PER_ROUND = 4      # keys a subgroup scores per round of the attention loop (loads in flight)
MAX_SHARED_HEADS = 8    # query heads one attention workgroup takes for their shared KV head
SHARED_SUMS_BYTES = 16384  # the subgroups' sums of a workgroup's heads: Vulkan's least limit


def attention_heads(n_heads, n_kv_heads, head_dim, subgroup_size):
    """Query heads an attention workgroup takes: the most of those sharing a KV head that
    divide their number, at most MAX_SHARED_HEADS, with every subgroup's sums of them in
    SHARED_SUMS_BYTES of shared memory."""
    group = n_heads // n_kv_heads
    sums = WG // subgroup_size * head_dim * 4
    return max(h for h in range(1, min(group, MAX_SHARED_HEADS) + 1)
               if group % h == 0 and (h == 1 or h * sums <= SHARED_SUMS_BYTES))


def _attention_params(k, out, cache="r"):
    """The parameters every attention kernel starts with, declared on k in their order: q, the
    output buffer named `out`, the paged cache (`cache`: its access) and its tables, the head
    counts, the table's width, the block size and the scale."""
    buffers = [k.buffer("q", F32), k.buffer(out, F32, "w"), k.buffer("k_cache", U32, cache),
               k.buffer("v_cache", U32, cache), k.buffer("positions", I32),
               k.buffer("seq_rows", I32), k.buffer("block_tables", I32)]
    scalars = [k.scalar(s, I32) for s in ("n_heads", "n_kv_heads", "table_width", "block_size")]
    return (*buffers, *scalars, k.scalar("scale", F32))


def _attention(subgroup_size, head_dim, split, heads, untiled=False, window=0, softcap=0.0,
               rope=None, rounds=KEYS_PER_ROUND):
    """The body of both attention kernels: the subgroups of one workgroup share the keys
    [lo, hi) of its token and `heads` query heads of one KV head, each subgroup taking
    `rounds` consecutive keys a round (every head scoring the same K and V rows), with
    its own running max and sum per head (see `attention`); the subgroups' sums are then
    combined and either normalised (split=False: lo, hi = 0, L) or written as the partials of
    split block_id(1) (split=True). A `window` starts the keys at window_start, a `softcap`
    caps each score (kernels/softcap.py). `rope` (one-pass only): see `attention`."""
    if head_dim % 2:
        raise ValueError(f"head_dim {head_dim}: even")
    if rope is not None and (split or untiled):
        raise ValueError("attention: the rope is folded into the one-pass kernel only")
    half, sg = head_dim // 2, subgroup_size
    per_lane = -(-half // sg)                       # cache words a lane holds of each key row
    n_sub = WG // sg
    name = "attention_split" if split else "attention"
    name = f"{name}_d{head_dim}_s{subgroup_size}" + f"_h{heads}" * (heads > 1) + \
        f"_k{rounds}" * (rounds != KEYS_PER_ROUND) + "_untiled" * untiled + suffix(window, softcap)
    if rope is not None:
        style, turn_scale, normed = rope
        name = _scaled(f"{name}_rope_{style}" + "_norm" * normed, turn_scale)
    k = KernelBuilder(name, (WG,))
    q, out, k_cache, v_cache, positions, seq_rows, tables, n_heads, n_kv, table_width, \
        block_size, scale = _attention_params(k, "partials" if split else "out",
                                              "r" if rope is None else "rw")
    split_tokens = k.scalar("split_tokens", I32) if split else None
    n_tokens = k.scalar("n_tokens", I32) if untiled else None
    if rope is not None:
        key, value, inv_freq = (k.buffer(s, F32) for s in ("k", "v", "inv_freq"))
        q_norm, k_norm = (k.buffer(s, F32) for s in ("q_norm", "k_norm")) if normed else \
            (None, None)
        n_pairs = k.scalar("n_pairs", I32)
        eps = k.scalar("eps", F32) if normed else None
    maxima = k.shared("maxima", F32, n_sub * heads)
    sums = k.shared("sums", F32, n_sub * heads)
    partial = k.shared("partial", F32, n_sub * heads * head_dim)
    block, tid, lane, sub = k.block_id(), k.thread_id(), k.lane_id(), k.subgroup_id()
    per_token = n_heads / heads
    t, h0 = block / per_token, block % per_token * heads
    kvh = h0 / (n_heads / n_kv)
    if untiled:                 # attention_tiles took this token
        with k.if_(tiled_token_tile(k, seq_rows, n_tokens, t - t % ATTENTION_TILE)):
            k.return_()
    length = positions[t] + 1
    if split:       # a split past the length scans nothing: its partial is the neutral one
        lo = k.block_id(1) * split_tokens
        hi = k.min(lo + split_tokens, length)
    else:           # with the rope, the token's own key comes from registers, not the loop
        lo, hi = 0, length if rope is None else length - 1
    if window:
        lo = k.max(window_start(k, length - 1, window), lo)
    row = seq_rows[t]
    # lane's words of a key row: lane, lane + sg, ...; past half (a wide subgroup, a small head)
    # a lane reads word 0 and weighs it nothing
    words = [lane + sg * i for i in range(per_lane)]
    valid = [None if half % sg == 0 else w < half for w in words]
    words = [w if ok is None else k.select(ok, w, 0) for w, ok in zip(words, valid)]
    if rope is not None:
        angle = positions[t].to(F32)

        def roped(x, base, gain):
            """The head at x[base] normed (where the rope has norms) and rotated, as
            norm_rope_store_kv leaves it: (dim 2w, dim 2w + 1) of each of the lane's words."""
            load = lambda j: x[base + j]  # noqa: E731
            if normed:
                r = _head_rms(k, x, base, head_dim, eps, lane, sg)
                load = lambda j: x[base + j] * r * gain[j]  # noqa: E731
            return [_roped_word(k, style, load, w, n_pairs, angle, inv_freq, turn_scale)
                    for w in words]
    qv = []                                         # [head][word] (q of 2w, q of 2w + 1) * scale
    for hh in range(heads):
        first = (t * n_heads + h0 + hh) * head_dim
        dims = roped(q, first, q_norm) if rope is not None else \
            [[q[first + 2 * w + e] for e in (0, 1)] for w in words]
        pairs = []
        for pair, ok in zip(dims, valid):
            pair = [v * scale for v in pair]
            pairs.append(pair if ok is None else [k.select(ok, v, 0.0) for v in pair])
        qv.append(pairs)

    def score_of(hh, key_words):
        """Head hh's score of a key row (its words as the lane holds them, unpacked)."""
        dot = None
        for (qa, qb), (ka, kb) in zip(qv[hh], key_words):
            dot = k.fma(ka, qa, kb * qb if dot is None else k.fma(kb, qb, dot))
        score = k.subgroup_add(dot)
        return capped(k, score, softcap) if softcap else score

    running_max = [k.var(F32, LOWEST) for _ in range(heads)]
    running_sum = [k.var(F32, 0.0) for _ in range(heads)]
    acc = [[k.var(F32, 0.0) for _ in range(2 * per_lane)] for _ in range(heads)]
    if rope is not None:
        # the token's own key and value: subgroup 0 makes them as norm_rope_store_kv would
        # store them (f16), starts its sums with them, and the KV head's first workgroup
        # stores them; the other keys are earlier steps' (StepBatch.one_position_each)
        with k.if_(sub.eq(0)):
            base = (t * n_kv + kvh) * head_dim
            key_words = [k.pack_half2(*pair) for pair in roped(key, base, k_norm)]
            value_words = [k.pack_half2(value[base + 2 * w], value[base + 2 * w + 1])
                           for w in words]
            with k.if_((h0 % (n_heads / n_kv)).eq(0)):
                slot = (cache_slot(tables, row, length - 1, table_width, block_size) * n_kv
                        + kvh) * half
                for w, ok, kw, vw in zip(words, valid, key_words, value_words):
                    with k.if_(ok) if ok is not None else nullcontext():
                        k_cache[slot + w] = kw
                        v_cache[slot + w] = vw
            own_k = [k.unpack_half2(w) for w in key_words]
            own_v = [v for w in value_words for v in k.unpack_half2(w)]
            for hh in range(heads):
                running_max[hh].set(score_of(hh, own_k))
                running_sum[hh].set(1.0)
                for var, v in zip(acc[hh], own_v):
                    var.set(v)
    with k.for_(lo + sub * rounds, hi, n_sub * rounds) as j0:
        keys = [k.min(j0 + u, hi - 1) for u in range(rounds)]
        bases = [(cache_slot(tables, row, j, table_width, block_size) * n_kv + kvh) * half
                 for j in keys]
        kw = [[k.unpack_half2(k_cache[base + w]) for w in words] for base in bases]
        vw = [[k.unpack_half2(v_cache[base + w]) for w in words] for base in bases]
        for hh in range(heads):
            scores = []
            for u in range(rounds):
                score = score_of(hh, kw[u])
                scores.append(score if u == 0 else k.select(j0 + u < hi, score, LOWEST))
            new_max = running_max[hh].get()
            for score in scores:
                new_max = k.max(new_max, score)
            correction = k.exp(running_max[hh].get() - new_max)
            probs = [k.exp(score - new_max) for score in scores]
            total = running_sum[hh].get() * correction
            for p in probs:
                total = total + p
            running_sum[hh].set(total)
            running_max[hh].set(new_max)
            for i in range(per_lane):
                for e in (0, 1):
                    value = acc[hh][2 * i + e].get() * correction
                    for u, p in enumerate(probs):
                        value = k.fma(p, vw[u][i][e], value)
                    acc[hh][2 * i + e].set(value)
    for hh in range(heads):
        with k.if_(lane.eq(0)):
            maxima[sub * heads + hh] = running_max[hh].get()
            sums[sub * heads + hh] = running_sum[hh].get()
        for i, (w, ok) in enumerate(zip(words, valid)):
            for e in (0, 1):
                at = (sub * heads + hh) * head_dim + 2 * w + e
                if ok is None:
                    partial[at] = acc[hh][2 * i + e].get()
                else:
                    with k.if_(ok):
                        partial[at] = acc[hh][2 * i + e].get()
    k.barrier()
    # per head, the subgroups' sums, each weighed by exp(its max - the largest); a subgroup
    # that scanned nothing (max lowest, sum 0) weighs nothing unless none scanned anything
    with k.for_(tid, heads * head_dim, WG) as at:
        hh, d = at / head_dim, at % head_dim
        top = k.var(F32, LOWEST)
        with k.for_(0, n_sub) as s:
            top.set(k.max(top.get(), maxima[s * heads + hh]))
        num, den = k.var(F32, 0.0), k.var(F32, 0.0)
        with k.for_(0, n_sub) as s:
            weight = k.exp(maxima[s * heads + hh] - top.get())
            num.set(k.fma(weight, partial[(s * heads + hh) * head_dim + d], num.get()))
            den.set(k.fma(weight, sums[s * heads + hh], den.get()))
        th = t * n_heads + h0 + hh
        if split:
            base = (th * k.num_blocks(1) + k.block_id(1)) * (head_dim + 2)
            out[base + d] = num.get()
            with k.if_(d.eq(0)):
                out[base + head_dim] = top.get()
                out[base + head_dim + 1] = den.get()
        else:
            out[th * head_dim + d] = num.get() / den.get()
    return k.build()


ATTENTION_TILE = 16     # query tokens of an attention_tiles workgroup: one mma row block
KEY_BLOCK = 64          # keys an attention_tiles round scores


def tiled_token_tile(k, seq_rows, n_tokens, t0):
    """Whether the step's tokens t0.. t0 + ATTENTION_TILE - 1 (those before n_tokens) are two
    or more of one sequence: the tiles attention_tiles takes (a bool Value, the same in every
    thread that asks)."""
    row = seq_rows[t0]
    same = (n_tokens - t0) >= 2
    for i in range(1, ATTENTION_TILE):
        t = t0 + i
        same = same & ((t >= n_tokens) | seq_rows[k.min(t, n_tokens - 1)].eq(row))
    return same


def tiled_tokens(seq_rows):
    """tiled_token_tile on the host: for each token of a step (its sequences' rows), whether
    attention_tiles takes it."""
    rows, out = list(seq_rows), []
    for t0 in range(0, len(rows), ATTENTION_TILE):
        tile = rows[t0:t0 + ATTENTION_TILE]
        out += [len(tile) >= 2 and all(r == tile[0] for r in tile)] * len(tile)
    return out


def attention_tile_heads(n_heads, n_kv_heads):
    """Query heads (one subgroup each) of an attention_tiles workgroup: the most of one KV head's
    that divide their number, at most 8."""
    group = n_heads // n_kv_heads
    return max(h for h in range(1, min(group, 8) + 1) if group % h == 0)


def query_state(k, q, tokens, n_heads, h, head_dim, quad, scale):
    """A tensor-core attention lane's start for its two query rows `tokens` of head h: the A
    fragments of S (q * scale rounded to f16 pairs, one k16 step each) and the online
    softmax's running maxima, sums and output accumulators."""
    qa = []
    for s in range(head_dim // 16):
        words = []
        for j in range(4):
            at = (tokens[j % 2] * n_heads + h) * head_dim + 16 * s + 2 * quad + 8 * (j // 2)
            words.append(k.pack_half2(q[at] * scale, q[at + 1] * scale))
        qa.append(words)
    running_max = [k.var(F32, LOWEST) for _ in range(2)]
    running_sum = [k.var(F32, 0.0) for _ in range(2)]
    acc = [[k.var(F32, 0.0) for _ in range(4)] for _ in range(head_dim // 8)]
    return qa, running_max, running_sum, acc


@cache
def attention_tiles(head_dim, heads, window=0, softcap=0.0):
    """The tiles of `attention` on the tensor cores (flash attention; fragment_load and mma,
    f16 operands, f32 sums): workgroup (i, g) takes the step's tokens 16 i.. (ATTENTION_TILE)
    where tiled_token_tile says they are two or more of one sequence, and `heads` query heads
    g * heads.. of one KV head, subgroup w head g * heads + w. Rounds of KEY_BLOCK keys of the
    sequence, up to the tile's last position: K and V rows copied into shared memory (once for
    all heads), scores S = (q * scale, rounded to f16) K^T, each key past a token's position
    masked, a running max and sum per token (the 4 lanes of a row share them), and
    O += P V with P the scores' exponentials rounded to f16 (the accumulator of S is the A
    operand of P V as it lies), V by transposed fragment loads. out as `attention` writes it;
    the other tiles are left to attention(untiled=True). head_dim a multiple of 16, at most 256.
    A `window` starts the rounds at the tile's first window_start and masks the keys before
    each token's, a `softcap` caps the scores (kernels/softcap.py).
    grid (ceil(T / ATTENTION_TILE), n_heads / heads)."""
    if head_dim % 16 or head_dim > 256:
        raise ValueError(f"attention_tiles: head_dim {head_dim} is no multiple of 16 up to 256")
    half, row_words = head_dim // 2, head_dim // 2 + 4     # rows padded: ldmatrix's 8 rows
    k = KernelBuilder(f"attention_tiles_d{head_dim}_h{heads}" + suffix(window, softcap),
                      (32 * heads,))
    q, out, k_cache, v_cache, positions, seq_rows, tables, n_heads, n_kv, table_width, \
        block_size, scale = _attention_params(k, "out")
    n_tokens = k.scalar("n_tokens", I32)
    ks = k.shared("keys", U32, KEY_BLOCK * row_words)
    vs = k.shared("values", U32, KEY_BLOCK * row_words)
    tid, lane, warp = k.thread_id(), k.lane_id(), k.subgroup_id()
    t0 = k.block_id(0) * ATTENTION_TILE
    with k.if_(~tiled_token_tile(k, seq_rows, n_tokens, t0)):
        k.return_()
    h = k.block_id(1) * heads + warp
    kvh = k.block_id(1) * heads / (n_heads / n_kv)
    row = seq_rows[t0]
    t_last = k.min(t0 + ATTENTION_TILE, n_tokens) - 1
    last = positions[t0]
    for i in range(1, ATTENTION_TILE):
        last = k.max(last, positions[k.min(t0 + i, t_last)])
    g, quad = lane >> 2, lane & 3
    tokens = [k.min(t0 + g, t_last), k.min(t0 + g + 8, t_last)]     # the lane's two rows
    limits = [positions[t] for t in tokens]
    first = window and first_key(
        k, [positions[k.min(t0 + i, t_last)] for i in range(ATTENTION_TILE)], window)
    qa, running_max, running_sum, acc = query_state(k, q, tokens, n_heads, h, head_dim, quad,
                                                    scale)
    parts = KEY_BLOCK * half // 4                           # 16-byte parts of a round's rows
    with k.for_(first, last + 1, KEY_BLOCK) as j0:
        k.barrier()                                         # the last round is done with them
        for p in range(-(-parts // (32 * heads))):
            i = tid + p * 32 * heads
            inside = i < parts if parts % (32 * heads) else None
            key, part = i / (half // 4), i % (half // 4)
            j = k.min(j0 + key, last)
            at = (cache_slot(tables, row, j, table_width, block_size) * n_kv + kvh) * half \
                + part * 4
            to = key * row_words + part * 4
            if inside is None:
                k.copy_async(ks, to, k_cache, at)
                k.copy_async(vs, to, v_cache, at)
            else:
                with k.if_(inside):
                    k.copy_async(ks, to, k_cache, at)
                    k.copy_async(vs, to, v_cache, at)
        k.copy_commit()
        k.copy_wait(0)
        k.barrier()
        scores = [[0.0] * 4 for _ in range(KEY_BLOCK // 8)]
        for s in range(head_dim // 16):
            for pair in range(KEY_BLOCK // 16):
                words = k.fragment_load(ks, (16 * pair + (lane & 7) + (lane >> 4) * 8) * row_words
                                        + s * 8 + ((lane >> 3) & 1) * 4)
                for n, b in ((2 * pair, words[:2]), (2 * pair + 1, words[2:])):
                    scores[n] = k.mma(F16, qa[s], b, [k.coerce(v, F32) for v in scores[n]])
        # masks: key j0 + 8 n + 2 quad + e % 2 of row e // 2
        for n in range(KEY_BLOCK // 8):
            scores[n] = [k.select(sees(j0 + 8 * n + 2 * quad + e % 2, limits[e // 2], window),
                                  capped(k, v, softcap) if softcap else v, LOWEST)
                         for e, v in enumerate(scores[n])]
        corrections, probs = [], [[None] * 4 for _ in scores]
        for r in range(2):
            top = running_max[r].get()
            for n in range(KEY_BLOCK // 8):
                top = k.max(top, k.max(scores[n][2 * r], scores[n][2 * r + 1]))
            top = k.max(top, k.shuffle_xor(top, 1))
            top = k.max(top, k.shuffle_xor(top, 2))
            total = None
            for n in range(KEY_BLOCK // 8):
                for e in (2 * r, 2 * r + 1):
                    keep = sees(j0 + 8 * n + 2 * quad + e % 2, limits[r], window)
                    probs[n][e] = k.select(keep, k.exp(scores[n][e] - top), 0.0)
                    total = probs[n][e] if total is None else total + probs[n][e]
            total = total + k.shuffle_xor(total, 1)
            total = total + k.shuffle_xor(total, 2)
            correction = k.exp(running_max[r].get() - top)
            running_sum[r].set(running_sum[r].get() * correction + total)
            running_max[r].set(top)
            corrections.append(correction)
        for n in range(head_dim // 8):
            for e, v in enumerate(acc[n]):
                v.set(v.get() * corrections[e // 2])
        for kk in range(KEY_BLOCK // 16):
            a = [k.pack_half2(probs[2 * kk + j // 2][2 * (j % 2)],
                              probs[2 * kk + j // 2][2 * (j % 2) + 1]) for j in range(4)]
            for dp in range(head_dim // 16):
                words = k.fragment_load(vs, (16 * kk + 8 * ((lane >> 3) & 1) + (lane & 7))
                                        * row_words + 8 * dp + 4 * (lane >> 4), trans=True)
                for n, b in ((2 * dp, words[:2]), (2 * dp + 1, words[2:])):
                    d = k.mma(F16, a, b, [v.get() for v in acc[n]])
                    for v, value in zip(acc[n], d):
                        v.set(value)
    for n in range(head_dim // 8):
        for e, v in enumerate(acc[n]):
            t = t0 + g + 8 * (e // 2)
            with k.if_(t < n_tokens):
                out[(t * n_heads + h) * head_dim + 8 * n + 2 * quad + e % 2] = \
                    v.get() / running_sum[e // 2].get()
    return k.build()


@cache
def attention(subgroup_size, head_dim, heads=1, untiled=False, window=0, softcap=0.0,
              rope=None, rounds=KEYS_PER_ROUND):
    """out[t, h] = softmax(q[t, h] . K[:L] * scale) V[:L], L = positions[t] + 1, over the paged
    f16 cache of the token's sequence; KV head = h / (heads / kv_heads). One workgroup per
    token and `heads` query heads of one KV head (attention_heads: they read its K and V rows
    once). Its subgroups take turns at the keys, `rounds` consecutive keys a round (their K
    and V words all loaded before any arithmetic, so a lane has that many rows in flight), a
    lane holding the same few words of q, K and V rows (a subgroup sum gives a key's score);
    each subgroup keeps its own running max, sum and weighted sum of values for each head, and
    the subgroups' are combined at the end. grid (T * n_heads / heads). `untiled`: the tokens
    attention_tiles takes (tiled_token_tile; a further scalar n_tokens) are left to it.
    `window`, `softcap`: the graph's attention attributes (kernels/softcap.py).

    `rope` = (style, scale, normed): the layer's rope_store_kv (normed: norm_rope_store_kv)
    folded in, a launch fewer, for steps whose every token's earlier keys were stored by
    earlier steps: q is read as the projection left it and rotated in registers, and the
    token's own key and value are made, stored and scored by the workgroup, not read from the
    cache. Further buffers k, v, inv_freq (then q_norm, k_norm) and scalars n_pairs (then
    eps), as rope_store_kv's."""
    return _attention(subgroup_size, head_dim, False, heads, untiled, window, softcap, rope,
                      rounds)


@cache
def attention_split(subgroup_size, head_dim, heads=1, window=0, softcap=0.0):
    """The first half of split attention (flash decoding), for when the one-pass workgroups
    would leave the device idle: workgroup (t, heads h.., s) scans keys [s * split_tokens,
    min((s + 1) * split_tokens, L)) as `attention` does and writes, unnormalised,
    partials[t, h, s] = (sum_j p_j V_j [head_dim], m, l), m = the range's largest score,
    p_j = exp(score_j - m), l = sum_j p_j. A split past L writes (0..., lowest f32, 0), which
    weighs nothing in `attention_combine`. grid (T * n_heads / heads, splits)."""
    return _attention(subgroup_size, head_dim, True, heads, window=window, softcap=softcap)


@cache
def attention_combine(head_dim):
    """The second half of split attention: out[t, h] = sum_s w_s o_s / sum_s w_s l_s over the
    partials (o_s, m_s, l_s) of `attention_split`, w_s = exp(m_s - max_s m_s); a neutral split
    (m_s lowest, l_s and o_s zero) adds nothing. grid (T * heads)."""
    k = KernelBuilder(f"attention_combine_d{head_dim}", (WG,))
    partials, out = k.buffer("partials", F32), k.buffer("out", F32, "w")
    n_splits = k.scalar("n_splits", I32)
    th, stride = k.block_id(), head_dim + 2
    first = th * n_splits * stride
    with k.for_(k.thread_id(), head_dim, WG) as d:
        m = k.var(F32, LOWEST)
        with k.for_(0, n_splits) as s:
            m.set(k.max(m.get(), partials[first + s * stride + head_dim]))
        num, den = k.var(F32, 0.0), k.var(F32, 0.0)
        with k.for_(0, n_splits) as s:
            base = first + s * stride
            w = k.exp(partials[base + head_dim] - m.get())
            num.set(k.fma(w, partials[base + d], num.get()))
            den.set(k.fma(w, partials[base + head_dim + 1], den.get()))
        out[th * head_dim + d] = num.get() / den.get()
    return k.build()


@cache
def all_reduce(world, residual=False):
    """out[i] = residual[i] + part_0[i] + ... + part_{world-1}[i] for start <= i < stop, four
    elements a thread: the partial sums of a device group's ranks, each read from its own
    device's memory (peer access). Every rank adds in rank order, so the sums agree bit for bit
    on every device. start, stop multiples of 4; grid (ceil((stop - start) / (4 WG)))."""
    k = KernelBuilder(f"all_reduce_w{world}" + "_residual" * residual, (WG,))
    parts = [k.buffer(f"part{j}", F32) for j in range(world)]
    res = k.buffer("residual", F32) if residual else None
    out = k.buffer("out", F32, "w")
    start, stop = k.scalar("start", I32), k.scalar("stop", I32)
    i = start + (k.block_id() * WG + k.thread_id()) * 4
    with k.if_(i < stop):
        total = parts[0].load(i, 4)
        for part in parts[1:]:
            total = [a + b for a, b in zip(total, part.load(i, 4))]
        if residual:
            total = [a + b for a, b in zip(res.load(i, 4), total)]
        out.store(i, *total)
    return k.build()


@cache
def all_gather(world):
    """out[r, c] = part_j[r, c - start_j] for start_j <= c < start_{j+1} (start_0 = 0,
    start_world = columns): the slices [rows, start_{j+1} - start_j] of a device group's ranks
    side by side, each read from its own device's memory (peer access). One thread per element;
    grid (ceil(columns / WG), rows)."""
    k = KernelBuilder(f"all_gather_w{world}", (WG,))
    parts = [k.buffer(f"part{j}", F32) for j in range(world)]
    out = k.buffer("out", F32, "w")
    columns = k.scalar("columns", I32)
    starts = [0] + [k.scalar(f"start{j}", I32) for j in range(1, world)] + [columns]
    r, c = k.block_id(1), k.block_id() * WG + k.thread_id()

    def take(j):
        """Column c from rank j's slice where it lies there, else from a later rank's."""
        width, column = (starts[j + 1] - starts[j], c - starts[j]) if j else (starts[1], c)
        if j == world - 1:
            out[r * columns + c] = parts[j][r * width + column]
            return
        with k.if_(c < starts[j + 1]) as stmt:
            out[r * columns + c] = parts[j][r * width + column]
        with k.else_(stmt):
            take(j + 1)

    with k.if_(c < columns):
        take(0)
    return k.build()
