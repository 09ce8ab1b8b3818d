"""The step's small kernels: embedding, RMSNorm, RoPE, KV store, attention, SwiGLU, add, gather,
argmax. Each function returns a Kernel for a subgroup size; the numpy meaning of each is the op of
the same name in poot/ir/reference.py (argmax: the greedy choice of engine/sampling.py).

Activations are f32 [tokens, features]; the KV cache holds f16 pairs in u32 words,
[blocks, block_size, kv_heads, head_dim / 2].
"""
import math

from .lang import F32, I32, U32, KernelBuilder
from .quant import reader

WG = 256


def block_reduce(k, value, subgroup_size, scratch, op="add"):
    """The sum (or max) of `value` over the workgroup, in every thread. Uses scratch[0:WG/sub]."""
    part = k.subgroup_add(value) if op == "add" else k.subgroup_max(value)
    n_sub = WG // subgroup_size
    if n_sub == 1:
        return part
    with k.if_(k.lane_id().eq(0)):
        scratch[k.subgroup_id()] = part
    k.barrier()
    total = k.var(F32, 0.0 if op == "add" else -math.inf)
    with k.for_(0, n_sub) as i:
        v = scratch[i]
        total.set(total.get() + v if op == "add" else k.max(total.get(), v))
    k.barrier()
    return total.get()


def rms_norm(subgroup_size):
    """out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w; one workgroup per row. grid (rows)."""
    k = KernelBuilder(f"rms_norm_s{subgroup_size}", (WG,))
    x, w, out = k.buffer("x", F32), k.buffer("w", F32), k.buffer("out", F32, "w")
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
        out[base + i] = x[base + i] * scale * w[i]
    return k.build()


def elementwise(op):
    """out[i] = a[i] + b[i % len(b)] ("add"), or silu(a[i]) * b[i] ("swiglu"). grid (ceil(n/WG))."""
    k = KernelBuilder(f"{op}", (WG,))
    a, b, out = k.buffer("a", F32), k.buffer("b", F32), k.buffer("out", F32, "w")
    n, nb = k.scalar("n", I32), k.scalar("n_b", I32)
    i = k.block_id() * WG + k.thread_id()
    with k.if_(i < n):
        x = a[i]
        if op == "add":
            out[i] = x + b[i % nb]
        else:
            out[i] = x / (1.0 + k.exp(-x)) * b[i]
    return k.build()


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


def embedding(dtype):
    """out[t, :] = table[ids[t], :] from the table's device planes; grid (T)."""
    r = reader(dtype)
    k = KernelBuilder(f"embedding_{dtype.lower()}", (WG,))
    buf = {name: k.buffer(f"w_{name}", U32) for name in r.plane_names}
    ids, out = k.buffer("ids", I32), k.buffer("out", F32, "w")
    cols = k.scalar("cols", I32)
    t = k.block_id()
    row = ids[t]
    with k.for_(k.thread_id(), cols // r.block_elems, WG) as block:
        for j, v in enumerate(r.decode(k, buf, row, block, cols)):
            out[t * cols + block * r.block_elems + j] = v
    return k.build()


def sin_cos(k, angle):
    """sin and cos of an f32 angle of any size: reduced to [-pi, pi] first (Cody-Waite, two
    parts of 2*pi), since hardware approximations are only accurate near zero."""
    turns = k.floor(angle * (1.0 / (2 * math.pi)) + 0.5)
    hi = 6.28125                                    # 2*pi in two parts, the first exact
    lo = 2 * math.pi - hi
    r = k.fma(turns, -lo, k.fma(turns, -hi, angle))
    return k.sin(r), k.cos(r)


def rope(style):
    """Rotates pairs of x[t, h, :] in place by positions[t] * inv_freq[i]; grid
    (ceil(T * heads * n_pairs / WG)). normal pairs (2i, 2i+1), neox pairs (i, i + half)."""
    k = KernelBuilder(f"rope_{style}", (WG,))
    x, positions, inv_freq = k.buffer("x", F32, "rw"), k.buffer("positions", I32), k.buffer(
        "inv_freq", F32)
    n_tokens, n_heads, head_dim, n_pairs = (k.scalar(s, I32) for s in
                                            ("n_tokens", "n_heads", "head_dim", "n_pairs"))
    g = k.block_id() * WG + k.thread_id()
    with k.if_(g < n_tokens * n_heads * n_pairs):
        pair = g % n_pairs
        th = g / n_pairs                            # token * n_heads + head
        t = th / n_heads
        sin, cos = sin_cos(k, positions[t].to(F32) * inv_freq[pair])
        base = th * head_dim
        if style == "normal":
            ia, ib = base + pair * 2, base + pair * 2 + 1
        else:
            ia, ib = base + pair, base + pair + n_pairs
        a, b = x[ia], x[ib]
        x[ia] = a * cos - b * sin
        x[ib] = a * sin + b * cos
    return k.build()


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
        block = tables[seq_rows[t] * table_width + pos / block_size]
        slot = block * block_size + pos % block_size
        src = t * words * 2 + wd * 2
        k_cache[slot * words + wd] = k.pack_half2(key[src], key[src + 1])
        v_cache[slot * words + wd] = k.pack_half2(value[src], value[src + 1])
    return k.build()


def attention(subgroup_size, head_dim):
    """out[t, h] = softmax(q[t, h] . K[:L] * scale) V[:L], L = positions[t] + 1, over the paged
    f16 cache of the token's sequence; KV head = h / (heads / kv_heads). One workgroup per
    (token, head), keys in chunks of WG with a running max and sum. grid (T * heads)."""
    if head_dim % 2 or head_dim > WG:
        raise ValueError(f"head_dim {head_dim}: even and at most {WG}")
    half = head_dim // 2
    k = KernelBuilder(f"attention_d{head_dim}_s{subgroup_size}", (WG,))
    q, out = k.buffer("q", F32), k.buffer("out", F32, "w")
    k_cache, v_cache = k.buffer("k_cache", U32), k.buffer("v_cache", U32)
    positions, seq_rows, tables = k.buffer("positions", I32), k.buffer("seq_rows", I32), \
        k.buffer("block_tables", I32)
    n_heads, n_kv, table_width, block_size = (k.scalar(s, I32) for s in (
        "n_heads", "n_kv_heads", "table_width", "block_size"))
    scale = k.scalar("scale", F32)
    scratch = k.shared("scratch", F32, WG // subgroup_size)
    probs = k.shared("probs", F32, WG)
    qs = k.shared("q", F32, head_dim)
    th, tid = k.block_id(), k.thread_id()
    t, h = th / n_heads, th % n_heads
    kvh = h / (n_heads / n_kv)
    length = positions[t] + 1
    row = seq_rows[t]
    with k.if_(tid < head_dim):
        qs[tid] = q[th * head_dim + tid]
    k.barrier()
    running_max, running_sum = k.var(F32, -math.inf), k.var(F32, 0.0)
    acc = k.var(F32, 0.0)                          # out[tid] for tid < head_dim
    with k.for_(0, length, WG) as start:
        j = start + tid
        score = k.var(F32, -math.inf)
        with k.if_(j < length):
            block = tables[row * table_width + j / block_size]
            base = ((block * block_size + j % block_size) * n_kv + kvh) * half
            dot = k.var(F32, 0.0)
            for w in range(half):
                ka, kb = k.unpack_half2(k_cache[base + w])
                dot.set(k.fma(ka, qs[2 * w], k.fma(kb, qs[2 * w + 1], dot.get())))
            score.set(dot.get() * scale)
        chunk_max = block_reduce(k, score.get(), subgroup_size, scratch, "max")
        new_max = k.max(running_max.get(), chunk_max)
        p = k.exp(score.get() - new_max)
        probs[tid] = p
        chunk_sum = block_reduce(k, p, subgroup_size, scratch)    # its barriers publish probs
        correction = k.exp(running_max.get() - new_max)
        running_sum.set(k.fma(running_sum.get(), correction, chunk_sum))
        running_max.set(new_max)
        with k.if_(tid < head_dim):
            total = k.var(F32, 0.0)
            with k.for_(0, k.min(length - start, WG)) as i:
                jj = start + i
                block = tables[row * table_width + jj / block_size]
                base = ((block * block_size + jj % block_size) * n_kv + kvh) * half
                va, vb = k.unpack_half2(v_cache[base + tid / 2])
                v = k.select((tid & 1).eq(0), va, vb)
                total.set(k.fma(probs[i], v, total.get()))
            acc.set(k.fma(acc.get(), correction, total.get()))
        k.barrier()                                 # probs is rewritten by the next chunk
    with k.if_(tid < head_dim):
        out[th * head_dim + tid] = acc.get() / running_sum.get()
    return k.build()


def argmax(subgroup_size):
    """token[r] = the index of the largest logits[r, :] (lowest index on ties); grid (R)."""
    k = KernelBuilder(f"argmax_s{subgroup_size}", (WG,))
    logits, token = k.buffer("logits", F32), k.buffer("token", I32, "w")
    n = k.scalar("n", I32)
    best_v, best_i = k.shared("best_v", F32, WG), k.shared("best_i", I32, WG)
    r, tid = k.block_id(), k.thread_id()
    bv, bi = k.var(F32, -math.inf), k.var(I32, 0)
    with k.for_(tid, n, WG) as i:
        v = logits[r * n + i]
        with k.if_(v > bv.get()):
            bv.set(v)
            bi.set(i)
    best_v[tid], best_i[tid] = bv.get(), bi.get()
    k.barrier()
    stride = WG // 2
    while stride:                                    # tree over shared memory
        with k.if_(tid < stride):
            ov, oi = best_v[tid + stride], best_i[tid + stride]
            mv, mi = best_v[tid], best_i[tid]
            better = (ov > mv) | ((ov.eq(mv)) & (oi < mi))
            best_v[tid] = k.select(better, ov, mv)
            best_i[tid] = k.select(better, oi, mi)
        k.barrier()
        stride //= 2
    with k.if_(tid.eq(0)):
        token[r] = best_i[0]
    return k.build()
