"""Matrix products against weights in their device layout (quant.py): y[t, m] = x[t, :] . W[m, :].

`matvec` is the decode kernel: a subgroup per weight row streams the row once for all of the
step's few tokens (bandwidth-bound: each weight byte is read once per step). Tokens beyond its
`tokens` constant run in further launches over the token axis (grid y).
"""
from .lang import F32, I32, U32, KernelBuilder
from .quant import reader

WORKGROUP = 256


def matvec(dtype, subgroup_size, tokens=1):
    """y[t, m] for t < n_tokens; grid (ceil(rows / subgroups per workgroup), ceil(T / tokens)).

    Buffers: planes of W (u32), x f32 [T, cols], y f32 [T, rows]; scalars rows, cols, n_tokens.
    cols must be a multiple of the reader's block (32 for block formats, 8 for floats).
    """
    r = reader(dtype)
    k = KernelBuilder(f"matvec_{dtype.lower()}_t{tokens}_s{subgroup_size}", (WORKGROUP,))
    buf = {name: k.buffer(f"w_{name}", U32) for name in r.plane_names}
    x = k.buffer("x", F32)
    y = k.buffer("y", F32, "w")
    rows, cols, n_tokens = k.scalar("rows", I32), k.scalar("cols", I32), k.scalar("n_tokens", I32)
    row = k.block_id(0) * (WORKGROUP // subgroup_size) + k.subgroup_id()
    t0 = k.block_id(1) * tokens
    lane = k.lane_id()
    with k.if_(row >= rows):
        k.return_()
    acc = [k.var(F32, 0.0) for _ in range(tokens)]
    n_blocks = cols // r.block_elems
    with k.for_(lane, n_blocks, subgroup_size) as block:
        values = r.decode(k, buf, row, block, cols)
        base = block * r.block_elems
        for t in range(tokens):
            xrow = (t0 + t) * cols + base
            with k.if_(t0 + t < n_tokens):
                xs = [v for i in range(0, r.block_elems, 4) for v in x.load(xrow + i, 4)]
                total = acc[t].get()
                for wv, xv in zip(values, xs):
                    total = k.fma(wv, xv, total)
                acc[t].set(total)
    for t in range(tokens):
        s = k.subgroup_add(acc[t].get())
        with k.if_((lane.eq(0)) & (t0 + t < n_tokens)):
            y[(t0 + t) * rows + row] = s
    return k.build()

