"""Which kernel runs each lowered step on one device: the policy, with its constants named.

The choices depend on the device's capabilities and multiprocessors, the weights' formats and
shapes, and the step's length: a matvec (matmul.matvec, or mma_vec on matrix instructions) for
short steps, the tiled tensor-core matmul (matmul.mma_tiled, split along its columns where its
tiles would not fill the device) for long ones; attention one workgroup a token and head, split
along the context for long decodes, on the tensor cores for prompt tiles (PROMPT_KERNEL). The
measurements behind each constant are in docs/benchmarks.md. Nothing here allocates or
launches: the runner (device_runner.py) asks and issues.
"""
import math
from collections import Counter

from ..formats.quants import QUANTS
from ..kernels import flash, matmul, mma_vec, ops
from ..kernels.lang import TENSOR_COPY, WGMMA
from .lowering import next_matmul, normed_after, part_rows

TOKEN_GROUPS = (1, 2, 4, 8)     # matvec variants: tokens sharing one pass over the weights
ARGMAX_CHUNKS = 64              # workgroups reading one row of logits for the greedy choice
SHARED_HEADS_PER_SM = 1         # attention workgroups a multiprocessor before they share KV heads
FEW_TOKEN_ROUNDS = 16           # keys a round of attention workgroups that share no KV head
MULTIPROCESSORS = 132           # an H100's or H200's, for a device that does not say its own
# Steps this long run their matmuls on matrix instructions: the grouped matvec's x loads bind
# it from two tokens on, where the tiled kernel reads the weights once for all of them. Where
# the device runs mma_vec for every weight, mma_vec takes the steps up to mma_vec.most_tokens.
MMA_MIN_TOKENS = 2
# Steps of more than this many tokens (a multiple of mma_tiled's 128-token tile, so that every
# length a launch of mma_launches stands for agrees) decode a block-quant (or F32) weight to f16
# once, then multiply it on wgmma as F16: decoding once beats decoding in every tile.
DEQUANT_PAST_TOKENS = 256
SPLIT_TOKENS = 512              # keys per workgroup when attention is split along the context,
MAX_SPLITS = 32                 # ... and more when the context would need more splits than this
SPLIT_MIN_CONTEXT = 4096        # shorter contexts keep one workgroup per (token, head): two
                                # launches cost more than the split saves there
# Prompt attention's tensor-core kernel, by name in PROMPT_TILES: (kernel of head_dim, heads and
# the attention_mods, grid of T tokens over n_heads query heads, `heads` a workgroup). All take
# the same tokens (ops.tiled_tokens) with the same arguments; "flash" serves 128 query rows a
# K/V round (eight subgroups), "flash4" 64 (four: more workgroups a multiprocessor), "tiles"
# 16 tokens of a KV head's query heads.
PROMPT_TILES = {
    "flash": (flash.attention_flash, flash.flash_grid),
    "flash4": (lambda *a, **mods: flash.attention_flash(*a, **mods, warps=4),
               lambda *a: flash.flash_grid(*a, warps=4)),
    "tiles": (ops.attention_tiles,
              lambda T, n_heads, heads: (-(-T // ops.ATTENTION_TILE), n_heads // heads)),
}
PROMPT_KERNEL = "flash"
# A tensor group reduces messages this long in two phases (reduce-scatter, then all-gather):
# each peer's partial is read once rather than by every rank, which pays from three devices on.
TWO_PHASE_FLOATS = 1 << 18


def mma_choice(dtype, caps=frozenset(), tokens=matmul.MMA_TOKENS):
    """(mma_tiled keywords, mma_launch split policy) of the tensor-core matmul of a weight
    format on a device of `caps`, for a launch of the token tile `tokens`: F16 and BF16 weights
    stream through a ring of asynchronous copies (three stages) with x rounded once beforehand
    (mma_x16), their splits kept to one wave of two workgroups a multiprocessor. Where the
    device has wgmma and the tensor copies (sm_90a) the products run on it, fed by tensor
    copies with one step's wgmma kept running while the next is waited for (`in_flight`); long
    steps take 256-token tiles there (mma_launch's `wide`), four stages deep (what shared
    memory holds), the 128-token tile five and the shorter ones four. The formats decoded in
    the kernel keep the register pipeline (their words are not operands as they are)."""
    if dtype not in ("F16", "BF16"):
        return {}, {}
    policy = {"per_sm": 2, "one_wave": True}
    if WGMMA in caps and TENSOR_COPY in caps:
        stages = 5 if tokens == matmul.MMA_TOKENS else 4
        return {"stages": stages, "x16": True, "wgmma": True, "in_flight": 1,
                "tensor_copy": True}, dict(policy, wide=True)
    return {"stages": 3, "x16": True}, policy


def tiled_x16_format(dtype):
    """The format whose mma_vec x16 words are those an x16 mma_tiled of weight format `dtype`
    reads: x rounded to its operand (mma_operand) in column order (mma_vec's block-quant
    pairing is not mma_tiled's)."""
    return "BF16" if dtype == "BF16" else "F16"


def sum_x16_formats(choice, steps, i, long):
    """The weight formats whose x16 the launch of sum steps[i] (all_reduce, expert_sum) may
    make for the matmul next (DeviceRunner._sum_x16): none or one."""
    after = normed_after(steps, i)
    if after is not None and long and choice.mma_launches(after):
        return [tiled_x16_format(choice.tiled_weight(after).dtype)]
    if after is not None and not long and any(
            choice.matvec(after.weight, n, after.variant)[2] for n in choice.groups(after.weight)):
        return [after.weight.dtype]
    return []


def tiled_norm_x16(dtype):
    """The norm_x16 whose words an x16 mma_tiled of weight format `dtype` reads."""
    return mma_vec.norm_x16(tiled_x16_format(dtype))


def matvec_rows(dtype, group, matrices=1):
    """Weight rows a matvec subgroup streams at once (of each of its `matrices`: two for the
    gate/up SwiGLU) for one token, so that each x value it loads serves them all: two for float
    weights, four for the 32-value block quants (a block's 18-34 bytes would otherwise ask for
    128 bytes of x), two of each matrix for their SwiGLU (four spill registers on RDNA); the K
    quants (256-value super-blocks) and IQ4_NL (a table lookup a value) keep one, their
    decoding leaves no registers for more (four rows of IQ4_NL spill on gfx908's wave64).
    Several tokens (group > 1) already share each row's loads: one row."""
    if group > 1 or QUANTS[dtype].block_elems == 256 or dtype == "IQ4_NL":
        return 1
    return 2 if dtype in ("F32", "F16", "BF16") else 4 // matrices


def runs_mma(graph, caps):
    """Whether a device of `caps` runs the tensor-core matmul of every weight of the graph."""
    dtypes = {t.dtype for t in graph.weights.values() if len(t.shape) == 2}
    return bool(dtypes) and all(matmul.mma_tiled(d).caps <= caps for d in dtypes)


def attention_mods(op):
    """The attributes of an attention op its kernels are built with (a sliding `window`, a
    `softcap`: kernels/softcap.py), where the op has them."""
    return {key: op.attrs[key] for key in ("window", "softcap") if key in op.attrs}


class KernelChoice:
    """The kernels of one runner's lowered steps on its device. Choices are made once for each
    weight shape and variant (the layers repeat them; a plan builds a runner for each of its
    candidates) and shared by a runner's lanes."""

    def __init__(self, device, model, steps, stacked, max_tokens, max_seqs, mma):
        self.device, self.model = device, model
        self.steps, self.part_of = steps, part_rows(stacked)
        self.uses = Counter(t.name for op in steps for t in op.inputs)
        self.max_tokens, self.max_seqs = max_tokens, max_seqs
        self.mma = mma                  # every weight runs mma_tiled on this device
        self.multiprocessors = getattr(device, "multiprocessors", None) or MULTIPROCESSORS
        self._chosen = {}
        # steps of mma_min_tokens or more run their matmuls on the tensor cores
        self.mma_min_tokens = MMA_MIN_TOKENS
        dtypes = {op.weight.dtype for op in steps if op.kind == "matmul"}
        if dtypes and all(self.mma_vec_runs(d) for d in dtypes):
            self.mma_min_tokens = 1 + min(mma_vec.most_tokens(d) for d in dtypes)

    def elements(self, shape):
        sizes = {"T": self.max_tokens, "R": self.max_seqs}
        return math.prod(sizes.get(d, d) for d in shape)

    def _once(self, key, choose):
        if key not in self._chosen:
            self._chosen[key] = choose()
        return self._chosen[key]

    # ---- matvecs ------------------------------------------------------------------------------
    def mma_vec_runs(self, dtype):
        return mma_vec.supported(dtype) and mma_vec.mma_vec(dtype).caps <= self.device.caps

    def runs_mma_vec(self, w):
        """Whether weight w's matvecs of 8 tokens run on mma_vec."""
        return self.mma_vec_runs(w.dtype) and w.shape[1] % 8 == 0

    def matvec(self, w, group, variant):
        """(kernel, grid of n tokens, its norm_x16 or None) of weight w's matvec (its variant)
        for a token group: from mma_vec.least_tokens on a device that runs it, mma_vec
        (mma_vec.shape; columns a multiple of 8), whose norm a norm_x16 launch makes
        beforehand; else matmul.matvec, its rows a subgroup (matvec_rows), its subgroups a row
        (matvec_split)."""
        key = ("matvec", w.dtype, w.shape, group, tuple(sorted(variant.items())))
        return self._once(key, lambda: self._choose_matvec(w, group, variant))

    def _choose_matvec(self, w, group, variant):
        rows = w.shape[0]
        if group >= mma_vec.least_tokens(w.dtype) and self.runs_mma_vec(w):
            tt = max(1, group // mma_vec.TOKENS)
            shape = mma_vec.shape(w.dtype, *w.shape, self.multiprocessors, tt,
                                  x16=bool(variant["norm"]))
            prep = None
            if variant["norm"]:
                variant, prep = dict(variant, norm=False, x16=True), mma_vec.norm_x16(w.dtype)
            kernel = mma_vec.mma_vec(w.dtype, **shape, **variant)
            return kernel, lambda n: mma_vec.grid(rows, n, shape["tiles"], shape["split"],
                                                  tt), prep
        sg = self.device.subgroup_size
        matrices = 2 if variant.get("glu") else 1
        rows_per = matvec_rows(w.dtype, group, matrices)
        split = matmul.matvec_split(w.dtype, *w.shape, sg, rows_per, self.multiprocessors,
                                    matrices)
        kernel = matmul.matvec(w.dtype, sg, group, rows_per=rows_per, split=split, **variant)
        return kernel, lambda n: matmul.matvec_grid(rows, n, sg, group, rows_per, split), None

    def groups(self, w):
        """The token groups of weight w's matvec kernels: TOKEN_GROUPS, and on mma_vec its
        launches of several token tiles (mma_vec.token_tiles)."""
        if not self.runs_mma_vec(w):
            return TOKEN_GROUPS
        return self._once(("groups", w.dtype, w.shape[1]), lambda: TOKEN_GROUPS + tuple(sorted(
            {self.group_of(w, n) for n in range(TOKEN_GROUPS[-1] + 1,
                                                mma_vec.most_tokens(w.dtype) + 1)}
            - set(TOKEN_GROUPS))))

    def group_of(self, w, n):
        """The token group of n tokens' matvec of w: the smallest that holds them; past 8 on
        mma_vec, 8 tokens a token tile of its launch (mma_vec.token_tiles; further launches
        along grid y for more)."""
        group = next((g for g in TOKEN_GROUPS if g >= n), TOKEN_GROUPS[-1])
        if n <= group or not self.runs_mma_vec(w):
            return group
        return mma_vec.TOKENS * mma_vec.token_tiles(w.dtype, n)

    def norm_x16_words(self):
        """The words of the largest x a step's norm_x16 makes (0: none does): its matmul's
        tokens on the steps that do not run the tensor-core lowering, times cols / 2."""
        short = self.mma_min_tokens - 1 if self.mma else self.max_tokens
        return max((min(self.elements(op.x.shape[:1]), short) * op.weight.shape[1] // 2
                    for op in self.steps if op.kind == "matmul" for n in self.groups(op.weight)
                    if self.matvec(op.weight, n, op.variant)[2] is not None), default=0)

    def tile_arenas(self, steps):
        """{arena: words} of what the tensor-core and mma_vec lowerings keep between launches,
        each sized by the largest step that needs it (0: none does), in allocation order."""
        tiled = self.tiled_ops()
        launches = [(op, n, launch) for op in tiled
                    for n, launch in self.mma_launches(op).items()]
        return {
            # the slices of a split mma_tiled (or a gated unit's unsplit sums), [splits, T, rows]
            "mma_partials": max((launch.splits * n * self.tiled_weight(op).shape[0]
                                 for op, n, launch in launches if launch.splits > 1 or
                                 op.up is not None and not self.stores_unit(op, launch, n)),
                                default=0),
            # a weight decoded to f16 pairs, [rows, cols / 2]
            "dequant_f16": max((math.prod(self.tiled_weight(op).shape) // 2 for op in tiled
                                if any(self.dequantizes(op, n) for n in self.mma_launches(op))),
                               default=0),
            # x rounded for the tensor cores, [T, cols / 2]
            "mma_x16": max((self.elements(op.x.shape[:1]) * op.weight.shape[1] // 2
                            for op in tiled if self.tiled_variant(op).get("x16")), default=0),
            # a gated unit stored by its tiles as x16, [T, half / 2]: it cannot share mma_x16,
            # which holds the tiles' own input meanwhile
            "mma_units_x16": max((n * self.tiled_weight(op).shape[0] // 4
                                  for i, op in enumerate(steps) if op in tiled
                                  and self.unit_x16(op, next_matmul(steps, i)) is not None
                                  for n, launch in self.mma_launches(op).items()
                                  if self.stores_unit(op, launch, n)), default=0),
            # x normed and rounded for mma_vec, [T, cols / 2]
            "norm_x16": self.norm_x16_words()}

    # ---- the tensor-core matmul ---------------------------------------------------------------
    def tiled_weight(self, op):
        """The weight a matmul step's mma_tiled reads: a SwiGLU's stacked gate and up, else
        the step's weight."""
        return self.part_of[op.weight.name][0] if op.up is not None else op.weight

    def mma_launch(self, w, n):
        """How the matmul of weight w over n tokens runs on the tensor cores (matmul.MmaLaunch),
        or None: a short step, or a device without the matrix instructions."""
        if n < self.mma_min_tokens or not matmul.mma_tiled(w.dtype).caps <= self.device.caps:
            return None
        return matmul.mma_launch(*w.shape, n, self.multiprocessors,
                                 **mma_choice(w.dtype, self.device.caps)[1])

    def mma_launches(self, op):
        """{n: MmaLaunch} standing for every length of a matmul step that runs on the tensor
        cores (matmul.mma_launches; {} without them): what the runner builds and the partials
        buffer holds."""
        w, most = self.tiled_weight(op), self.elements(op.x.shape[:1])
        return self._once(("mma_launches", w.dtype, w.shape, most), lambda: {} if self.mma_launch(
            w, most) is None else matmul.mma_launches(*w.shape, self.mma_min_tokens, most,
                                                      self.multiprocessors,
                                                      **mma_choice(w.dtype, self.device.caps)[1]))

    def tiled_variant(self, op, tokens=matmul.MMA_TOKENS):
        """mma_tiled's keywords for a matmul step in a token tile (mma_choice's pipeline),
        reading x16 where the step's norm is folded in (tiled_norm_x16 makes it)."""
        variant = mma_choice(op.weight.dtype, self.device.caps, tokens)[0]
        return dict(variant, x16=True) if op.norm is not None else variant

    def dequantizes(self, op, n):
        """Whether a matmul step of n tokens on the tensor cores first decodes its weight to
        f16 (matmul.dequant_f16, into the dequant_f16 arena) and multiplies it as F16 weights:
        formats other than F16/BF16 in steps of more than DEQUANT_PAST_TOKENS, on devices
        with wgmma, where the F16 tiles run on it."""
        return self.tiled_weight(op).dtype not in ("F16", "BF16") and \
            n > DEQUANT_PAST_TOKENS and WGMMA in self.device.caps

    def tiled_pipeline(self, op, launch, n=0):
        """(weight format, mma_tiled keywords) of a matmul step's MmaLaunch over n tokens: the
        step's own, or F16's over the weight decoded first (dequantizes)."""
        w, variant = self.tiled_weight(op), self.tiled_variant(op, launch.tokens)
        if self.dequantizes(op, n):        # F16's pipeline, on x16 where the format's is
            return "F16", mma_choice("F16", self.device.caps, launch.tokens)[0] \
                if variant.get("x16") else {}
        return w.dtype, variant

    def stores_unit(self, op, launch, n=0):
        """Whether a gated unit's unsplit launch on wgmma stores the unit from its tiles
        (mma_tiled's glu) rather than through split_sum."""
        return op.up is not None and launch.splits == 1 and \
            bool(self.tiled_pipeline(op, launch, n)[1].get("wgmma"))

    def mma_kernels(self, op, launch, after=None, n=0):
        """The kernels of a matmul step's MmaLaunch, in launch order (after its x16's): one
        mma_tiled writing the outputs (a gated unit's on wgmma too: stores_unit), or a split
        one and what adds its slices into them (a gated unit's elsewhere: only the sum sees
        gate's and up's together): split_sum, or where it can make the x16 of `after`, the
        matmul step next, the kernel makes_x16 names."""
        dtype, variant = self.tiled_pipeline(op, launch, n)
        residual, outputs = op.residual is not None, len(op.outputs)
        if self.stores_unit(op, launch, n):
            return [matmul.mma_tiled(dtype, tokens=launch.tokens, glu=op.glu,
                                     glu_x16=self.unit_x16(op, after), **variant)]
        if launch.splits == 1 and op.up is None:
            return [matmul.mma_tiled(dtype, residual, launch.tokens, outputs=outputs,
                                     **variant)]
        made = self.makes_x16(op, after, launch)
        return [matmul.mma_tiled(dtype, tokens=launch.tokens, split=True, **variant),
                made if made is not None else matmul.split_sum(residual, outputs, op.glu)]

    def makes_x16(self, op, after, launch):
        """The kernel by which a split (or SwiGLU) tensor-core matmul step `op` makes the x16
        the step `after` reads, in place of its split_sum and after's own rounding launch, or
        None: a SwiGLU whose only reader is after, on x16 and no norm: split_sum's x16
        variant (the f32 value is never stored); a residual sum that after reads through its
        norm: reduce_norm_x16 over the split's slices (views of the partials), which stores
        the sum as well. Two launches fewer a layer."""
        out = op.outputs[0]
        if after is None or after.x.name != out.name or launch.splits == 1 and \
                op.up is None or not self.mma_launches(after):
            return None
        dtype = self.tiled_weight(after).dtype
        if self.unit_x16(op, after) is not None:
            return matmul.split_sum(glu=op.glu, x16=dtype)
        if op.residual is not None and after.norm is not None and len(op.outputs) == 1:
            return mma_vec.reduce_norm_x16(tiled_x16_format(dtype), launch.splits)
        return None

    def unit_x16(self, op, after):
        """The weight format whose x16 words a gated unit step `op` can make for `after`, the
        matmul step next, in place of after's own rounding: where after alone reads the unit,
        on x16 and with no norm; else None."""
        out = op.outputs[0]
        if op.up is None or after is None or after.x.name != out.name or \
                after.norm is not None or self.uses[out.name] != 1 or \
                not self.mma_launches(after) or not self.tiled_variant(after).get("x16"):
            return None
        return self.tiled_weight(after).dtype

    def tiled_ops(self):
        """The matmul steps that run mma_tiled at some step length."""
        return [op for op in self.steps if op.kind == "matmul" and self.mma_launches(op)] \
            if self.mma else []

    def matmul_kernels(self, op, long=False, after=None):
        """Every kernel a matmul step may launch: its matvecs (with the norm_x16 before them),
        and in a step on the tensor cores (`long`) its x16 rounding, the weight's f16 decoding
        and the kernels of each of its MmaLaunches."""
        chosen = [self.matvec(op.weight, n, op.variant) for n in self.groups(op.weight)]
        matvecs = [k for kernel, _, prep in chosen for k in (kernel, prep) if k is not None]
        launches = self.mma_launches(op) if long else {}
        if not launches:
            return matvecs
        variant, dtype = self.tiled_variant(op), op.weight.dtype
        prep = [tiled_norm_x16(dtype)] if op.norm is not None else \
            [matmul.mma_x16(dtype)] if variant.get("x16") else []
        dequant = [matmul.dequant_f16(self.tiled_weight(op).dtype)] \
            if any(self.dequantizes(op, n) for n in launches) else []
        return matvecs + prep + dequant + [
            kernel for n, launch in launches.items()
            for kernel in self.mma_kernels(op, launch, after, n)]

    # ---- attention ----------------------------------------------------------------------------
    def attention_tiles(self, heads, kv_heads, **mods):
        """The tensor-core attention of steps with prompt tokens (PROMPT_TILES[PROMPT_KERNEL]),
        or None where the device lacks its instructions or the head size does not suit it.
        `mods`: the step's attention_mods."""
        head_dim = self.model.config.head_dim
        if head_dim % 16 or head_dim > 256:
            return None
        make = PROMPT_TILES[PROMPT_KERNEL][0]
        kernel = make(head_dim, ops.attention_tile_heads(heads, kv_heads), **mods)
        return kernel if kernel.caps <= self.device.caps else None

    def attention_tiles_grid(self, T, heads, kv_heads):
        """The grid of attention_tiles' kernel over a step of T tokens."""
        grid = PROMPT_TILES[PROMPT_KERNEL][1]
        return grid(T, heads, ops.attention_tile_heads(heads, kv_heads))

    def attention_heads(self, T, heads, kv_heads):
        """Query heads of one KV head an attention workgroup of a T-token step takes: as many as
        ops.attention_heads allows where T * kv_heads workgroups still give every
        multiprocessor SHARED_HEADS_PER_SM of them (then K and V rows are read once for their
        heads); else one, for the most workgroups at once (a one-token step)."""
        if self._few_attention_tokens(T, kv_heads):
            return 1
        return ops.attention_heads(heads, kv_heads, self.model.config.head_dim,
                                   self.device.subgroup_size)

    def attention_rounds(self, T, kv_heads):
        """Keys a subgroup of the one-pass attention of a T-token step scores a round
        (ops.attention's rounds): FEW_TOKEN_ROUNDS where its workgroups take a head each
        (attention_heads), few of them, each waiting on its loads with registers to spare for
        more in flight; else ops.KEYS_PER_ROUND."""
        return FEW_TOKEN_ROUNDS if self._few_attention_tokens(T, kv_heads) else \
            ops.KEYS_PER_ROUND

    def _few_attention_tokens(self, T, kv_heads):
        """Whether T * kv_heads attention workgroups leave a multiprocessor fewer than
        SHARED_HEADS_PER_SM."""
        return T * kv_heads < SHARED_HEADS_PER_SM * self.multiprocessors

    def attention_decode(self, T, heads, kv_heads, untiled=False, **mods):
        """The tensor cores' attention for a step's one-by-one tokens (flash.attention_decode:
        a KV head's query heads the rows of a tile), or None: where the device lacks the
        matrix instructions, the head size or group does not suit it, the op has a window or
        a cap (which it does not take), or T * kv_heads workgroups would leave multiprocessors
        idle (then the one-pass kernel's head shares or the split spread the work wider)."""
        head_dim, group = self.model.config.head_dim, heads // kv_heads
        if mods or head_dim % 16 or head_dim > 256 or group > 16 or \
                T * kv_heads < self.multiprocessors:
            return None
        kernel = flash.attention_decode(head_dim, group, untiled)
        return kernel if kernel.caps <= self.device.caps else None

    def attention_kernels(self, op, split, rope=None):
        """Every kernel an attention step may launch: the one-pass kernel for each share of
        heads and keys a round a step can take (and with the `rope` before it folded in, where
        given), the untiled one beside the tiles, the split ones where the context is split
        (`split`), and the tiles."""
        sg, head_dim = self.device.subgroup_size, self.model.config.head_dim
        heads, kv_heads = op.inputs[0].shape[1], op.inputs[1].shape[2]
        passes = {(self.attention_heads(T, heads, kv_heads), self.attention_rounds(T, kv_heads))
                  for T in (1, self.max_tokens)}
        shares = {1} | {shared for shared, _ in passes}
        mods = attention_mods(op)
        tiles = self.attention_tiles(heads, kv_heads, **mods)
        one_pass = [kernel for shared, rounds in sorted(passes) for kernel in
                    [ops.attention(sg, head_dim, shared, rounds=rounds, **mods)]
                    + ([ops.attention(sg, head_dim, shared, rope=rope, rounds=rounds, **mods)]
                       if rope else [])]
        return one_pass + [kernel for shared in sorted(shares) for kernel in (
            ([ops.attention(sg, head_dim, shared, untiled=True, **mods)] if tiles else [])
            + ([ops.attention_split(sg, head_dim, shared, **mods)] if split else []))] + \
            ([ops.attention_combine(head_dim)] if split else []) + ([tiles] if tiles else []) + \
            [kernel for untiled in (False, bool(tiles)) for kernel in
             [self.attention_decode(self.max_tokens, heads, kv_heads, untiled, **mods)] if kernel]
