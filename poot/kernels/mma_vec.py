"""mma_vec: the decode matmul on the tensor cores, y[t, m] = x[t, :] . W[m, :] for steps of up
to 8 tokens a token tile, 1, 2 or 4 token tiles a launch (further launches along grid y for
more), with matvec.matvec's buffers, scalars and fused variants (stacked outputs, a gated unit,
residual; a norm is norm_x16's, launched before), for devices with mma and f16x2 arithmetic
(ptx).

Why: matvec's lanes each take whole weight units (a 32-value quant block), so the x values of
neighbouring lanes lie 128 bytes apart and each 16-byte load of x touches as many cache lines as
lanes; at a few tokens those loads, and the per-value decoding arithmetic, bound it far below
the weights' bandwidth (docs/benchmarks.md). Here a subgroup computes `tiles` tiles of 16
weight rows x 8 tokens with mma m16n8k16 (lang.py's layouts): W is the A operand (lane (g, q),
g = lane // 4, q = lane % 4, holds rows g and g + 8 of a tile) and x the B operand (lane (g, q)
holds token g). The tensor cores do the multiplying, and x is loaded once for all the rows of
the subgroup's tiles. With `token_tiles` > 1 each A fragment (the weights, decoded once) meets
the B fragments of that many 8-token tiles, each tile with accumulators of its own.

The columns: a dot product's terms may be added in any order, so the 16 k-slots of an mma need not
be 16 consecutive columns, only the same ones for A and B. Lane q's k-slots, across a group of 128
columns (8 mma steps), are columns it loads whole: the 32-value unit 4G + q of group G (a Q4_0/Q4_1
block's 16 bytes of nibbles, a Q8_0 block's 32 bytes, half of a Q4_K sub-block pair: 16 bytes whose
low nibbles are one sub-block's values and high ones the next's, or a Q6_K value group: 8 words of
ql and of qh; the formats of quant.UNIT_FORMATS: their unit of 32 consecutive values), or for
F16/BF16 the four 8-value units 16G + 4i + q. Its values go in the order that turns them into f16
pairs with the fewest operations: a quant word's nibbles or bytes 0 and 2, then 1 and 3, OR-ed under
the f16 exponent of 1024 (0x6400), so the pair holds 1024 + q exactly; one f16x2 subtraction takes
off 1024 and the bias, one multiplication applies the scale (rounded once to f16: mma_tiled's
rounding of decoded weights). Q4_1 and Q4_K, whose value q * d + low can cancel, are made in f32 and
rounded once, as are the UNIT_FORMATS' values (their reader's decoding: one mechanism for every
other format), paired as a quant word's. x takes the same order: f32 loads of its 4-value runs, each
pair rounded to f16 (bf16 for BF16 weights), or with `x16` the words norm_x16 stored in that order.

A round is `unroll` consecutive groups, their weights loaded before any arithmetic; with
`pipeline` the next round's weights are loaded before this round's arithmetic (registers
carried from round to round), for launches too small to hide a round's loads with other
subgroups' work.

Sums are f32 (the mma accumulators). With `split` > 1 that many subgroups of the workgroup
share the rows, each taking every split-th group of columns, and add their tiles through shared
memory in a fixed order. Columns need not be whole groups (a multiple of the unit: 32 for block
quants, 8 for floats): the last group's missing units weigh zero.
"""
from contextlib import ExitStack
from functools import cache

from .lang import F32, I32, U32, KernelBuilder
from .matvec import WORKGROUP, matvec_params, store_row, variant_name
from .quant import UNIT_FORMATS, _small_int, reader
from .routes import denominator, ranked_choice
from .x16 import mma_operand, normed_row, pack, quant_pairs

GROUP = 128                      # columns of one pass of a subgroup: 8 mma steps of 16
TOKENS = 8                       # the mma's n: the tokens of a token tile
DTYPES = ("F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K", *UNIT_FORMATS)
SUBGROUP = 32
EXPONENT = 0x64006400            # two f16 1024s: OR-ed over bits below 1024, 1024 + those bits
# f16x2 words subtracted from 1024 + bits: 1024 + the format's bias (Q8_0's bytes have their
# sign bit flipped first, so they are 128 above the signed value)
OFFSET = {"Q4_0": 0x64086408, "Q8_0": 0x64806480, "Q6_K": 0x64206420}
# two f16 64s: a unit of their mantissa is 1/16, so bits 4-7 OR-ed over them make 64 + those
# bits as a nibble (Q4_0's high nibbles, no shift); less 72, the nibble less Q4_0's bias of 8
HIGH_NIBBLES, HIGH_OFFSET = 0x54005400, 0x54805480


def supported(dtype):
    return dtype in DTYPES


def grid(rows, n_tokens, tiles=1, split=1, token_tiles=1):
    """The grid of an mma_vec launch over `rows` rows and n_tokens tokens."""
    per_group = WORKGROUP // SUBGROUP // split * 16 * tiles
    return (-(-rows // per_group), -(-n_tokens // (TOKENS * token_tiles)))


def least_tokens(dtype):
    """The shortest step a device that runs mma_vec should give it rather than matvec.matvec:
    one token for Q4_0 and the K quants, whose one-token matvec decodes too slowly; two for F16,
    BF16 and Q4_1, whose one-token matvec is ahead, and Q8_0, where mma_vec gains little and the
    default model's output head (Q8_0) keeps the f32 x its greedy tokens were checked with
    (measurements: docs/benchmarks.md, "the kernel choices"). The UNIT_FORMATS' one-token
    matvec decodes more per value than Q4_0's: one token too."""
    return 1 if dtype in ("Q4_0", "Q4_K", "Q6_K") or dtype in UNIT_FORMATS else 2


def most_tokens(dtype):
    """The longest step a device that runs mma_vec should give it rather than mma_tiled: 32
    tokens of Q4_0 (four token tiles beat mma_tiled there), 8 of F16 and BF16 (the fused
    mma_tiled passes them from 9), 16 of the rest (docs/benchmarks.md, "the kernel choices")."""
    if dtype == "Q4_0":
        return 4 * TOKENS
    return TOKENS if dtype in ("F16", "BF16") else 2 * TOKENS


def token_tiles(dtype, n_tokens):
    """The token tiles of an mma_vec launch for a step of n_tokens (further launches along
    grid y where they hold fewer): Q4_0 one up to 24 tokens and four past them, the others one
    (docs/benchmarks.md, "the kernel choices")."""
    if n_tokens <= TOKENS:
        return 1
    return 4 if dtype == "Q4_0" and n_tokens > 3 * TOKENS else 1


def shape(dtype, rows, cols, multiprocessors, token_tiles=1, experts=False, x16=False):
    """The tiles, split, unroll, pipeline, chains and token_tiles (mma_vec's keywords) of an mma_vec
    over `rows` rows: F16/BF16 one tile a subgroup, the columns split over all 8 subgroups, two
    groups a round, pipelined; block quants two tiles, split while the launch has fewer than 1.5
    workgroups a multiprocessor, pipelined where it has fewer workgroups than multiprocessors; Q4_1,
    Q4_K, Q6_K and the UNIT_FORMATS one tile. Pipelined only where a subgroup has two rounds or more
    (with one the prefetch only loads that round again). Two accumulator chains for Q4_0 at one
    token tile, one for the rest and where token tiles make chains of their own. Four token tiles of
    a block quant take one row tile (two spill registers on sm_90). Q4_0 rows that fill the device
    unsplit at one token tile (an output head; `experts`: the rows of an expert launch's experts
    together, left as they are) take one tile, split 2 and one group a round. Q4_0 rows too few
    to fill the device even split 8 ways take one tile, one chain and no pipeline where x comes
    as norm_x16's words (`x16`) or one tile's workgroups are no more than the multiprocessors,
    and then one group a round where x comes as f32.
    The measurements behind each: docs/benchmarks.md, "the kernel choices", "an output head's
    shape" and "mma_vec's shapes swept in the step"."""
    rounds = lambda split: cols // (GROUP * 2 * split)  # noqa: E731  (a subgroup's, unroll 2)
    if dtype in ("F16", "BF16"):
        return dict(tiles=1, split=8, unroll=2, pipeline=rounds(8) >= 2, chains=1,
                    token_tiles=token_tiles)
    # one tile where a unit's decoding takes the registers (Q6_K's 18 words a unit and row;
    # Q4_1, Q4_K and the UNIT_FORMATS decode in f32)
    tiles = 1 if dtype in ("Q4_1", "Q4_K", "Q6_K") or dtype in UNIT_FORMATS or \
        token_tiles > 2 else 2
    split = 1
    while split < WORKGROUP // SUBGROUP and grid(rows, 1, tiles, split)[0] < 1.5 * multiprocessors:
        split *= 2
    # the IQ4 formats' code lookups take the registers of a second group's loads (ptxas spills
    # hundreds of bytes of a gated unit's with two): one group a round
    unroll = 1 if dtype in ("IQ4_NL", "IQ4_XS") else 2
    few = grid(rows, 1, tiles, split)[0] < 1.5 * multiprocessors
    if dtype == "Q4_0" and token_tiles == 1 and tiles == 2 and few and \
            (x16 or grid(rows, 1, 1, split)[0] <= multiprocessors):
        # rows that leave multiprocessors idle: twice the workgroups, each with one tile's
        # loads in flight and no dependent round ahead of them; one group a round where x
        # comes as f32 (its words converted in the loop take the second group's registers)
        return dict(tiles=1, split=split, unroll=2 if x16 else 1, chains=1, pipeline=False,
                    token_tiles=1)
    if dtype == "Q4_0" and token_tiles == 1 and split == 1 and tiles == 2 and not experts:
        # rows that fill the device unsplit (an output head): four times the workgroups, each
        # lighter (one tile, two subgroups a tile, one group a round), keep more reads in flight
        tiles, split, unroll = 1, 2, 1
    return dict(tiles=tiles, split=split, unroll=unroll,
                chains=2 if dtype == "Q4_0" and token_tiles == 1 else 1,
                pipeline=grid(rows, 1, tiles, split)[0] < multiprocessors and rounds(split) >= 2,
                token_tiles=token_tiles)


@cache
def norm_x16(dtype, subgroup_size=SUBGROUP):
    """x16[t] (u32 [T, cols / 2]) = x[t] / sqrt(mean(x[t]^2) + eps) * gain, rounded to the
    operand of dtype's mma and paired as mma_vec's B words take them (quant_pairs): the RMSNorm
    before an mma_vec, made once a step instead of in each of its subgroups. One workgroup a
    token; grid (T). cols a multiple of 8."""
    operand, pairs = mma_operand(dtype), quant_pairs(dtype)
    k = KernelBuilder(f"norm_x16_{operand.name}" + "_pairs" * pairs, (WORKGROUP,))
    x, gain, x16 = k.buffer("x", F32), k.buffer("norm", F32), k.buffer("x16", U32, "w")
    load = lambda base, i: x.load(base + i, 4)  # noqa: E731
    return _normed_pairs(k, dtype, subgroup_size, gain, x16, load, load)


@cache
def reduce_norm_x16(dtype, world, subgroup_size=SUBGROUP):
    """norm_x16 of out[t] = residual[t] + (part_0[t] + ... + part_{world-1}[t]), out stored as
    well: a tensor group's all_reduce (ops.all_reduce's sums, in the same order, so every rank
    holds the same bits) and the RMSNorm of the mma_vec after it in one launch. Buffers: the
    ranks' partials (each from its own device's memory), residual, out, norm (the gain), x16;
    scalars cols, eps. One workgroup a token; grid (T). cols a multiple of 8."""
    operand, pairs = mma_operand(dtype), quant_pairs(dtype)
    k = KernelBuilder(f"reduce_norm_x16_w{world}_{operand.name}" + "_pairs" * pairs,
                      (WORKGROUP,))
    parts = [k.buffer(f"part{j}", F32) for j in range(world)]
    residual, out = k.buffer("residual", F32), k.buffer("out", F32, "rw")
    gain, x16 = k.buffer("norm", F32), k.buffer("x16", U32, "w")

    def reduce(base, i):
        total = parts[0].load(base + i, 4)
        for part in parts[1:]:
            total = [a + b for a, b in zip(total, part.load(base + i, 4))]
        total = [a + b for a, b in zip(residual.load(base + i, 4), total)]
        out.store(base + i, *total)
        return total

    return _normed_pairs(k, dtype, subgroup_size, gain, x16, reduce,     # then what it stored
                         lambda base, i: out.load(base + i, 4))


def _normed_pairs(k, dtype, subgroup_size, gain, x16, first_read, second_read):
    """The rest of norm_x16 and reduce_norm_x16 after their buffers: a token's row read 4
    values at a time by `first_read` to sum its squares, by `second_read` to norm it."""
    cols, eps = k.scalar("cols", I32), k.scalar("eps", F32)
    scratch = k.shared("scratch", F32, WORKGROUP // subgroup_size)
    normed_row(k, dtype, subgroup_size, gain, x16, first_read, second_read, k.block_id() * cols,
               cols, eps, scratch)
    return k.build()


def _chain_sum(chains):
    """Accumulators of parallel chains, [chain][j], added in chain order: [j]."""
    out = chains[0]
    for chain in chains[1:]:
        out = [a + b for a, b in zip(out, chain)]
    return out


def _flatten(tree):
    """(the leaves of nested lists, in order; a function that puts new leaves in their place)."""
    leaves = []

    def walk(node):
        if isinstance(node, (list, tuple)):
            return [walk(child) for child in node]
        leaves.append(node)
        return len(leaves) - 1

    shape = walk(tree)

    def rebuild(new, node=shape):
        return [rebuild(new, child) for child in node] if isinstance(node, list) else new[node]

    return leaves, rebuild


def _load(buffer, index, n):
    """n consecutive u32 words from index (a multiple of 4 for n of 4 or more), in wide loads."""
    if n == 1:
        return [buffer[index]]
    return [w for i in range(0, n, 4) for w in buffer.load(index + i, 4)]


@cache
def mma_vec(dtype, residual=False, norm=False, outputs=1, glu=None, tiles=1, split=1,
            unroll=1, pipeline=False, chains=1, x16=False, token_tiles=1, experts=False,
            by_route=False, choose=None):
    """y[t, m] for t < n_tokens; grid(rows, n_tokens, tiles, split, token_tiles). Buffers and
    scalars as matvec.matvec's of the same variant but norm: a norm comes before, from
    norm_x16, and `x16` reads its words (u32 [T, cols / 2]: x normed, rounded and paired as the
    B operand takes it) for x. `tiles`: 16-row tiles a subgroup computes; `split`: subgroups
    sharing a tile's columns; `unroll`: 128-column groups a round; `pipeline`: the next round's
    weights loaded before this round's arithmetic; `chains`: a tile's mma steps alternate
    between that many accumulators (independent dependency chains), added at the end;
    `token_tiles`: tiles of 8 tokens a launch computes on each weight it loads (one pass over
    the weights for up to 8 * token_tiles tokens).

    `experts`: the matvec of a mixture of experts (kernels/experts.py's expert_matvec, on the
    tensor cores), whose tokens are an expert's routes gathered: W is [experts * rows, cols]
    and workgroup column s takes expert active[s] (none where it is -1), its routes
    routes[offsets[e]:offsets[e + 1]] 8 * token_tiles at a time, each reading x row
    route / x_per and writing y[route, :]. Buffers: W's planes, x (x16), offsets, routes,
    active, y; scalars rows, cols, x_per; grid (grid(rows, 1, tiles, split)[0], slots).
    `by_route` (experts, one token tile): workgroup column s takes route s alone, its expert
    ids[s] (the route's choice, buffer ids in place of offsets, routes and active; a further
    scalar n_experts), for steps whose routes each choose a different expert (one token's): a
    load before the weights' where the groups take three in a row. grid (grid(rows, 1, tiles,
    split)[0], routes). `choose` (by_route; (used, normalize, slots) as the route kernels take
    them): the workgroup chooses its route's expert itself from the router's logits
    (kernels/routes.py; buffers logits, then ids and w written, in place of ids), and the
    first workgroup of each route column writes its id and weight for the launches after it:
    a one-token step needs no route launch."""
    if dtype not in DTYPES:
        raise ValueError(f"mma_vec: no mma decoding of {dtype} (one of {DTYPES})")
    n_sub = WORKGROUP // SUBGROUP
    if n_sub % split:
        raise ValueError(f"mma_vec: split {split} does not divide {n_sub} subgroups")
    if norm:
        raise ValueError("mma_vec: the norm is norm_x16's, launched before (x16)")
    operand = mma_operand(dtype)
    quant = dtype not in ("F16", "BF16")
    matrices = ("gate", "up") if glu else ("w",)
    name = f"mma_vec_{dtype.lower()}_u{unroll}" + f"_r{tiles}" * (tiles > 1) + "_p" * pipeline
    name += f"_k{split}" * (split > 1) + f"_c{chains}" * (chains > 1) + "_x16" * x16
    name += f"_n{token_tiles}" * (token_tiles > 1)
    name += variant_name(residual, False, outputs, glu) + "_routes" * by_route
    if choose is not None:
        used, normalize, n_slots = choose
        name += f"_choose{used}_v{n_slots}" + "_norm" * normalize
    if experts and (residual or outputs > 1):
        raise ValueError("mma_vec: an expert matvec writes one output, with no residual")
    if by_route and (not experts or token_tiles > 1):
        raise ValueError("mma_vec: by_route is an expert matvec's, of one token tile")
    if choose is not None and not by_route:
        raise ValueError("mma_vec: a launch chooses its routes only by_route")
    k = KernelBuilder("expert_" * experts + name, (WORKGROUP,))
    planes = reader(dtype).plane_names
    if experts:
        bufs, x, groups, ys, rows, cols, x_per = _expert_params(k, dtype, matrices, x16,
                                                                by_route, choose is not None)
        res, splits = None, []
    else:
        bufs, x, _, ys, res, rows, cols, n_tokens, splits, _ = matvec_params(
            k, dtype, residual, False, outputs, glu, x16)

    sub, lane = k.subgroup_id(), k.lane_id()
    g, q = lane >> 2, lane & 3
    slots = n_sub // split
    slot, part = (sub / split, sub % split) if split > 1 else (sub, 0)
    first = (k.block_id(0) * slots + slot) * (16 * tiles)
    # an expert's routes, TOKENS * token_tiles a pass: the rest of the kernel is that loop's
    # body (closed before the build); a dense launch's tokens, from grid y
    passes = ExitStack()
    if by_route:
        route = k.block_id(1)
        n_tokens, t0 = 1, 0
        n_experts = k.scalar("n_experts", I32)
        if choose is None:
            expert = groups[0][route]
        else:
            logits, ids, weights = groups
            j = route % used
            chosen, tops, held = ranked_choice(k, logits, route / used, n_experts, used, n_slots,
                                               SUBGROUP, WORKGROUP)
            expert = chosen[j]
            with k.if_(k.block_id(0).eq(0) & sub.eq(0)):
                mine = [lane + i * SUBGROUP for i in range(n_slots)]
                over = denominator(k, mine, [held[e] for e in mine],
                                   [tops[i] for i in range(used)], n_experts, normalize)
                with k.if_(lane.eq(0)):
                    ids[route] = expert
                    weights[route] = k.exp(tops[j] - tops[0]) / over
        with k.if_((expert < 0) | (expert >= n_experts)):  # no expert's (a route of NaN
            k.return_()                                     # logits): nothing, as grouped
        routes_at = lambda t: route  # noqa: E731
        x_rows = [route / x_per * (cols >> 1 if x16 else cols)]
    elif experts:
        offsets, routes, active = groups
        expert = active[k.block_id(1)]
        with k.if_(expert < 0):             # the whole workgroup: no barrier waits for it
            k.return_()
        start = offsets[expert]
        n_tokens = offsets[expert + 1] - start
        t0 = passes.enter_context(k.for_(0, n_tokens, TOKENS * token_tiles))
        routes_at = lambda t: routes[start + t]  # noqa: E731
        x_rows = [routes_at(k.min(t0 + TOKENS * j + g, n_tokens - 1)) / x_per *
                  (cols >> 1 if x16 else cols) for j in range(token_tiles)]
    else:
        t0 = k.block_id(1) * (TOKENS * token_tiles)
        # lanes of tokens past the step read the last token's x (same lines, nothing stored)
        x_rows = [k.min(t0 + TOKENS * j + g, n_tokens - 1) * (cols >> 1 if x16 else cols)
                  for j in range(token_tiles)]
    # rows past the end read the last row again and store nothing
    my_rows = [[k.min(first + 16 * r + 8 * h + g, rows - 1) for h in range(2)]
               for r in range(tiles)]
    if experts:
        my_rows = [[expert * rows + row for row in pair] for pair in my_rows]
    # [matrix][tile][token tile][chain]: the 4 accumulators of each mma dependency chain
    acc = [[[[[k.var(F32, 0.0) for _ in range(4)] for _ in range(chains)]
             for _ in range(token_tiles)] for _ in range(tiles)] for _ in matrices]
    unit = 32 if quant else 8
    n_units = cols / unit
    word_rows = {p: reader(dtype).row_words(p, cols) for p in planes}

    def unit_loads(buf, row, u):
        """The words of unit u of a row: (weight words, the words its scales come from)."""
        at = lambda plane, first, n: _load(buf[plane], row * word_rows[plane] + first, n)  # noqa
        if dtype in ("F16", "BF16"):
            return at("values", u * 4, 4), []
        if dtype in UNIT_FORMATS:
            return reader(dtype).unit_words(k, buf, row, u, cols), []
        if dtype == "Q8_0":
            return at("quants", u * 8, 8), at("scales", u >> 1, 1)
        if dtype in ("Q4_0", "Q4_1"):
            return at("quants", u * 4, 4), at("scales", u if dtype == "Q4_1" else u >> 1, 1)
        if dtype == "Q4_K":      # unit u: half u & 1 of sub-block pair (u >> 1) & 3
            return at("quants", u * 4, 4), at("head", (u >> 3) * 4, 4)
        b, h, g_ = u >> 3, (u >> 2) & 1, u & 3    # Q6_K: super-block, half, value group
        words = at("ql", b * 32 + h * 16 + (g_ & 1) * 8, 8) + at("qh", b * 16 + h * 8, 8)
        return words, at("scales", b * 4 + h * 2 + (g_ >> 1), 1) + at("d", b >> 1, 1)

    def units_of(G, check):
        """Lane q's units of column group G: [(unit, valid)] (a missing unit of the last,
        part group clamped to unit 0, valid False)."""
        out = []
        for u in [G * 4 + q] if quant else [G * 16 + 4 * i + q for i in range(4)]:
            valid = u < n_units if check else None
            out.append((k.select(valid, u, 0) if check else u, valid))
        return out

    def weight_loads(units):
        """Each unit's words and scale words, by matrix, tile and half."""
        return [[[[unit_loads(buf, row, u) for row in my_rows[r]] for r in range(tiles)]
                 for buf in bufs] for u, _ in units]

    def x_runs(u):
        """(base, offsets): the columns of the 4-value x runs of a unit, base + each offset,
        one run a step, in step order (a multiple of 8 and that plus 4 always both among them);
        quant words pair values 0-2 and 1-3 (b_words), float words 0-1 and 2-3."""
        if dtype in ("Q8_0", "Q6_K") or dtype in UNIT_FORMATS:
            return u * 32, [4 * i for i in range(8)]
        if dtype == "Q4_K":      # low nibbles: values of sub-block 2p; high: of 2p + 1
            base = (u >> 3) * 256 + ((u >> 1) & 3) * 64 + (u & 1) * 16
            return base, [off for i in range(4) for off in (4 * i, 32 + 4 * i)]
        if quant:                # low nibbles: values 4i.., high: 16 + 4i..
            return u * 32, [off for i in range(4) for off in (4 * i, 16 + 4 * i)]
        return u * 8, [0, 4]

    def x16_words(u, valid, x_row):
        """The B words of a unit's steps from x16 (a token tile's: x_row): its runs' word pairs,
        loaded 4 words at a time (two runs of 8 aligned columns)."""
        base, offsets = x_runs(u)
        at = base >> 1
        words = {}
        for off in sorted(offsets):
            if off not in words:
                loaded = x.load(x_row + at + off // 2, 4)
                words[off], words[off + 4] = loaded[:2], loaded[2:]
        out = [w for off in offsets for w in words[off]]
        return [k.select(valid, w, 0) for w in out] if valid is not None else out

    def b_words(run):
        a, b, c, d = run
        if quant:
            return pack(k, operand, a, c), pack(k, operand, b, d)
        return pack(k, operand, a, b), pack(k, operand, c, d)

    def splat(word, high):
        """The f16 half of a word in both halves."""
        half = word >> 16 if high else word & 0xFFFF
        return half | (half << 16)

    def f16_splat(value):
        return k.pack_half2(value, value)

    def a_pairs(loads, u):
        """A unit's f16 pairs, 2 a step, in step order, from its words (decoded and scaled for
        quants): 1024 + q under the f16 exponent, less OFFSET, times the scale (plus the low
        or minus the minimum)."""
        words, scale_words = loads
        if not quant:
            return list(words)
        if dtype == "Q6_K":
            return q6_k_pairs(words, scale_words, u)
        if dtype in UNIT_FORMATS:              # values 4i and 4i + 2, then 4i + 1 and 4i + 3
            values = [v if scale is None else v * scale if low is None else k.fma(v, scale, low)
                      for vs, scale, low in reader(dtype).unit_segments(k, words, u)
                      for v in vs]
            return [k.pack_half2(values[i + a], values[i + a + 2])
                    for i in range(0, 32, 4) for a in (0, 1)]
        nibbles = (0, 8, 4, 12)  # word i: low nibbles of bytes 0, 2 and 1, 3, then the high ones
        if dtype in ("Q4_1", "Q4_K"):
            # q * d + low cancels where the low is near -q * d: rounding d and low to f16
            # apart would cost their error on the larger terms, so the value is made in f32
            # and rounded once
            if dtype == "Q4_1":
                d, low = k.unpack_half2(scale_words[0])
                d, low = (d, d), (low, low)
            else:
                d, low = q4_k_scales(scale_words, (u >> 1) & 3)
            return [k.pack_half2(*[k.fma(_small_int(w >> (s + half), 0xF, 0), d[s % 8 == 4],
                                         low[s % 8 == 4]) for half in (0, 16)])
                    for w in words for s in nibbles]
        if dtype == "Q8_0":
            raw = [((w >> s) & 0x00FF00FF) ^ 0x00800080 for w in words for s in (0, 8)]
            values = [k.half2("sub", bits | EXPONENT, OFFSET[dtype]) for bits in raw]
        else:   # Q4_0: the high nibbles (bits 4-7) under 64's exponent, unshifted (HIGH_NIBBLES)
            values = []
            for w in words:
                shifted = w >> 8
                values += [k.half2("sub", (v & 0x000F000F) | EXPONENT, OFFSET[dtype])
                           for v in (w, shifted)]
                values += [k.half2("sub", (v & 0x00F000F0) | HIGH_NIBBLES, HIGH_OFFSET)
                           for v in (w, shifted)]
        d = k.select((u & 1).eq(0), splat(scale_words[0], False), splat(scale_words[0], True))
        return [k.half2("mul", v, d) for v in values]

    def q4_k_scales(head, p):
        """(d * sc, -dmin * m) in f32 of sub-blocks 2p and 2p + 1, from the head words (d and
        dmin, then 12 bytes of 6-bit scales and minima: quant.py's _q4_k)."""
        d, dmin = k.unpack_half2(head[0])
        scales, lows = [], []
        for j in (2 * p, 2 * p + 1):
            shift = (j & 3) * 8
            a, b, c = [(w >> shift) & 0xFF for w in head[1:]]   # bytes j%4, 4 + j%4, 8 + j%4
            first = (j >> 2).eq(0)                              # j < 4
            sc = k.select(first, a & 63, (c & 0xF) | ((a >> 6) << 4))
            m = k.select(first, b & 63, (c >> 4) | ((b >> 6) << 4))
            scales.append(d * sc.to(F32))
            lows.append(-(dmin * m.to(F32)))
        return scales, lows

    def q6_k_pairs(words, scale_words, u):
        """Q6_K: 4 low bits from ql, 2 high from qh, x = d * sc * (q - 32), an int8 scale for
        each 16 values (quant.py's _q6_k); word i of ql and of qh hold values 4i.. ."""
        b, h, g_ = u >> 3, (u >> 2) & 1, u & 3
        ql, qh = words[:8], words[8:]
        low_shift, high_shift = (g_ >> 1) * 4, g_ * 2
        pair = k.unpack_half2(scale_words[1])
        d = k.select((b & 1).eq(0), pair[0], pair[1])
        scales = []
        for part in range(2):                        # values 0..15 and 16..31 of the unit
            index = h * 8 + g_ * 2 + part
            sc = ((scale_words[0].bitcast(I32) << (24 - 8 * (index & 3))) >> 24).to(F32)
            scales.append(f16_splat(sc * d))
        pairs = []
        for i in range(8):
            for s in (0, 8):
                bits = ((ql[i] >> (low_shift + s)) & 0x000F000F) | \
                    (((qh[i] >> (high_shift + s)) & 0x00030003) << 4)
                value = k.half2("sub", bits | EXPONENT, OFFSET[dtype])
                pairs.append(k.half2("mul", value, scales[i // 4]))
        return pairs

    def accumulate(groups, check, weights=None):
        """Adds the products of column groups `groups` to acc; `weights`: their weight_loads,
        made beforehand (pipelined), else loaded here before any arithmetic."""
        units = [unit for G in groups for unit in units_of(G, check)]
        weights = weights or weight_loads(units)
        loaded = [(u, loads, valid) for (u, valid), loads in zip(units, weights)]
        # the x loads before any arithmetic (a missing unit, its loads clamped to unit 0,
        # weighs zero), per token tile
        b_all = []
        for x_row in x_rows:
            if x16:
                b_all.append([w for u, _, valid in loaded
                              for w in x16_words(u, valid if check else None, x_row)])
                continue
            runs = []
            for u, _, valid in loaded:
                base, offsets = x_runs(u)
                for off in offsets:
                    xs = x.load(x_row + base + off, 4)
                    runs.append([k.select(valid, v, 0.0) for v in xs] if check else xs)
            b_all.append([w for xs in runs for w in b_words(xs)])
        totals = [[[[[a.get() for a in chain] for chain in tt] for tt in tile] for tile in m]
                  for m in acc]
        steps = []      # per step: its B words by token tile, and by matrix and tile its A words
        for u, loads, _ in loaded:
            per_mt = [[[a_pairs(loads[m][r][h], u) for h in range(2)] for r in range(tiles)]
                      for m in range(len(matrices))]
            n_steps = len(per_mt[0][0][0]) // 2
            for s in range(n_steps):
                b = [words[len(steps) * 2:len(steps) * 2 + 2] for words in b_all]
                a = [[[per_mt[m][r][0][2 * s], per_mt[m][r][1][2 * s],
                       per_mt[m][r][0][2 * s + 1], per_mt[m][r][1][2 * s + 1]]
                      for r in range(tiles)] for m in range(len(matrices))]
                steps.append((b, a))
        for i, (b, a) in enumerate(steps):
            for m in range(len(matrices)):
                for r in range(tiles):
                    for j in range(token_tiles):
                        chain = totals[m][r][j][i % chains]
                        chain[:] = k.mma(operand, a[m][r], b[j], chain)
        for m in range(len(matrices)):
            for r in range(tiles):
                for j in range(token_tiles):
                    for c in range(chains):
                        for var, total in zip(acc[m][r][j][c], totals[m][r][j][c]):
                            var.set(total)

    # rounds of `unroll` consecutive groups (one run of each row, loads before arithmetic),
    # every split-th round to a subgroup; the groups left, one at a time; then a part group
    n_groups = cols / GROUP
    rounds = n_groups / unroll
    round_groups = lambda i: [i * unroll + u for u in range(unroll)]  # noqa: E731
    if pipeline:
        # the next round's weights are loaded before this round's arithmetic, into
        # registers carried round to round (the last round loads its own again)
        with k.if_(part < rounds):
            words, rebuild = _flatten(weight_loads(
                [unit for G in round_groups(part) for unit in units_of(G, False)]))
            carried = [k.var(U32, w) for w in words]
            with k.for_(part, rounds, split) as i:
                ahead = k.min(i + split, rounds - 1)
                following, _ = _flatten(weight_loads(
                    [unit for G in round_groups(ahead) for unit in units_of(G, False)]))
                accumulate(round_groups(i), False, rebuild([v.get() for v in carried]))
                for var, word in zip(carried, following):
                    var.set(word)
    else:
        with k.for_(part, rounds, split) as i:
            accumulate(round_groups(i), False)
    if unroll > 1:
        with k.for_(rounds * unroll + part, n_groups, split) as G:
            accumulate([G], False)
    last = (cols % GROUP).ne(0)
    with k.if_(last & part.eq(0) if split > 1 else last):
        accumulate([n_groups], True)

    # each lane: 4 sums a matrix, tile and token tile (D: row g + 8 (j // 2), token 2q + j % 2)
    values = [v for m in acc for tile in m for tt in tile
              for v in _chain_sum([[v.get() for v in chain] for chain in tt])]
    if split > 1:
        shared = k.shared("sums", F32, n_sub * len(values) * SUBGROUP)
        for i, v in enumerate(values):
            shared[(sub * len(values) + i) * SUBGROUP + lane] = v
        k.barrier()
        base = (sub - part) * len(values)
        values = [shared[(base + i) * SUBGROUP + lane] for i in range(len(values))]
        for p in range(1, split):
            values = [v + shared[((base + p * len(values)) + i) * SUBGROUP + lane]
                      for i, v in enumerate(values)]
        if experts and not by_route:
            k.barrier()                     # read before the next pass writes them
    it = iter(values)
    sums = [[[[next(it) for _ in range(4)] for _ in range(token_tiles)] for _ in range(tiles)]
            for _ in matrices]
    ours = part.eq(0) if split > 1 else None
    for r in range(tiles):
        for tt in range(token_tiles):
            for j in range(4):
                row = first + 16 * r + g + 8 * (j >> 1)
                token = t0 + TOKENS * tt + 2 * q + (j & 1)
                got = [sums[m][r][tt][j] for m in range(len(matrices))]
                inside = (row < rows) & (token < n_tokens)
                with k.if_(inside & ours if split > 1 else inside):
                    store_row(k, ys, res, splits, rows, routes_at(token) if experts else token,
                              row, got, glu)
    passes.close()
    return k.build()


def _expert_params(k, dtype, matrices, x16, by_route, choose=False):
    """An expert mma_vec's parameters, declared on k in their order: (W's planes by matrix,
    x, [offsets, routes, active] or [ids] by route or [logits, ids, w] choosing, [y], rows,
    cols, x_per)."""
    bufs = [{p: k.buffer(f"{m}_{p}", U32) for p in reader(dtype).plane_names} for m in matrices]
    x = k.buffer("x16", U32) if x16 else k.buffer("x", F32)
    if choose:
        groups = [k.buffer("logits", F32), k.buffer("ids", I32, "w"), k.buffer("w", F32, "w")]
    else:
        groups = [k.buffer(name, I32) for name in
                  (("ids",) if by_route else ("offsets", "routes", "active"))]
    y = k.buffer("y", F32, "w")
    return (bufs, x, groups, [y], k.scalar("rows", I32), k.scalar("cols", I32),
            k.scalar("x_per", I32))
