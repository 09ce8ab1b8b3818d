"""The device runner: the model's step graph lowered to kernel launches on a Device.

Every device buffer comes from one list of (name, bytes, kind) that `allocations()` reports
before anything is allocated: weights in their device layout (kernels/quant.py), the paged KV
cache, the step's inputs, the arena slots that carry activations between kernels (assigned once
by liveness for the largest step), and the logits; q, k and v weights that one kernel reads
together are one stacked weight there (see `_lower`). Constructing a runner reads only the device's
capabilities, so the memory plan (engine/plan.py) sizes candidates from this same list;
`allocate()` then allocates it and `upload()` fills it. A step uploads the batch's small
arrays, issues the launches in graph order, and reads back the logits of the sampled rows;
sampling follows engine/sampling.py. The runner knows kernels and devices only through the
Device interface (backends/__init__.py), so the same lowering serves every backend.
"""
import copy
import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from ..errors import ModelRefused
from ..formats.quants import slice_raw
from ..ir.graph import Tensor
from ..kernels import matmul, mma_vec, ops
from ..kernels.lang import WGMMA
from ..kernels.quant import DEVICE_DTYPES, planes, reader
from . import placement
from .batch import StepBatch, StepOutput
from .sampling import (choice_args, choose_among, choose_sorted, logprobs_among, sample,
                       sample_row)

TOKEN_GROUPS = (1, 2, 4, 8)     # matvec variants: tokens sharing one pass over the weights
ARGMAX_CHUNKS = 64              # workgroups reading one row of logits for the greedy choice
SHARED_HEADS_PER_SM = 1         # attention workgroups a multiprocessor before they share KV heads


def mma_choice(dtype, caps=frozenset(), tokens=matmul.MMA_TOKENS):
    """(mma_tiled keywords, mma_launch split policy) of the tensor-core matmul of a weight
    format on a device of `caps`, for a launch of the token tile `tokens`, chosen from
    scripts/bench-matmul on the H200 (docs/benchmarks.md): F16 and BF16 weights stream through
    a three-stage ring of asynchronous copies with x rounded once beforehand (mma_x16), their
    splits kept to one wave of two workgroups a multiprocessor (a Llama-8B layer's matmuls:
    8.8 -> 6.4 ms at 64 tokens, 40 -> 30 ms at 512); where the device has wgmma (sm_90a) the
    products run on it, from four stages for the 32- and 64-token tiles and three for 128 (a
    layer at 32 / 64 / 128 / 512 tokens: 163 / 198 / 297 / 947 us on mma, 130 / 144 / 185 /
    603 on wgmma). The formats decoded in the kernel keep the register pipeline."""
    if dtype not in ("F16", "BF16"):
        return {}, {}
    policy = {"per_sm": 2, "one_wave": True}
    if WGMMA in caps:
        return {"stages": 4 if tokens < matmul.MMA_TOKENS else 3, "x16": True,
                "wgmma": True}, policy
    return {"stages": 3, "x16": True}, policy


def tiled_x16_format(dtype):
    """The format whose mma_vec x16 words are those an x16 mma_tiled of weight format `dtype`
    reads: x rounded to its operand (mma_operand) in column order (mma_vec's block-quant
    pairing is not mma_tiled's)."""
    return "BF16" if dtype == "BF16" else "F16"


def tiled_norm_x16(dtype):
    """The norm_x16 whose words an x16 mma_tiled of weight format `dtype` reads."""
    return mma_vec.norm_x16(tiled_x16_format(dtype))


def matvec_rows(dtype, group, matrices=1):
    """Weight rows a matvec subgroup streams at once (of each of its `matrices`: two for the
    gate/up SwiGLU) for one token: each x value it loads then serves them all. Measured on the
    H200 (docs/benchmarks.md): two for float weights, four for the 32-value block quants (a
    block's 18-34 bytes would otherwise ask for 128 bytes of x), two of each matrix for their
    SwiGLU (four spill registers on RDNA); the K quants keep one, their decoding leaves no
    registers for more. Several tokens (group > 1) already share each row's loads: one row."""
    if group > 1 or dtype in ("Q4_K", "Q6_K"):
        return 1
    return 2 if dtype in ("F32", "F16", "BF16") else 4 // matrices


# Steps this long run their matmuls on matrix instructions (split along the columns where the
# tiles alone would not fill the device): the tiled kernel (mma_tiled) from MMA_MIN_TOKENS,
# or where the device runs mma_vec for every weight of the model, mma_vec up to
# mma_vec.most_tokens and mma_tiled past them. Measured on the H200 (docs/benchmarks.md):
# the grouped matvec's x loads (a lane's 8 to 32 consecutive values, 32 lanes touching as
# many cache lines) bind it from two tokens on, 8B Q4_0 at 2, 4 and 8 tokens 96, 107, 106
# tok/s against the split mma_tiled's 183, 363, 715; mma_vec reads a matrix in about the same
# time for 1 to 8 tokens.
MMA_MIN_TOKENS = 2
MULTIPROCESSORS = 132           # an H100's or H200's, for a device that does not say its own
SHARES_INPUT = ("reshape", "rope", "rope_store_kv")   # run in place
# a tensor group reduces messages this long in two phases (reduce-scatter, then all-gather):
# each peer's partial is read once rather than by every rank, which pays from three devices on
TWO_PHASE_FLOATS = 1 << 18
# Steps of more than this many tokens (a multiple of mma_tiled's 128-token tile, so that every
# length a launch of mma_launches stands for agrees) decode a block-quant (or F32) weight to f16
# once, then multiply it on wgmma as F16 (_dequantizes): measured on 512-token prefills.
DEQUANT_PAST_TOKENS = 256
SPLIT_TOKENS = 512              # keys per workgroup when attention is split along the context,
MAX_SPLITS = 32                 # ... and more when the context would need more splits than this
SPLIT_MIN_CONTEXT = 4096        # shorter contexts keep one workgroup per (token, head): measured
                                # on the H200, two launches cost more than the split saves there


@dataclass(frozen=True)
class Step:
    """One launch of the lowered graph: an op, or ops fused into one kernel, and its tensors."""
    kind: str
    inputs: tuple
    output: object
    attrs: dict = field(default_factory=dict)

    @property
    def outputs(self):
        return (self.output,)


@dataclass(frozen=True)
class Matvec:
    """One matmul launch (kernels/matmul.py) with the work fused into it: the RMSNorm of its
    input (`norm`, the norm's weight), a residual add, several weights stacked row-wise into one
    (`weight` then names a stacked weight, and each part has its own output), or gate and up
    projections with the SwiGLU of the two (`weight` is gate's, `up` is up's)."""
    x: object
    weight: object
    outputs: tuple
    norm: object = None
    eps: float = 0.0
    residual: object = None
    up: object = None
    kind = "matmul"

    @property
    def inputs(self):
        return tuple(t for t in (self.x, self.norm, self.residual, self.weight, self.up)
                     if t is not None)

    @property
    def variant(self):
        """The matvec kernel's keyword arguments."""
        return dict(residual=self.residual is not None, norm=self.norm is not None,
                    outputs=len(self.outputs), swiglu=self.up is not None)


@dataclass(frozen=True)
class Allocation:
    name: str
    nbytes: int
    kind: str           # "weights" (and constants), "state" (the KV cache), "arenas" (per step)


class StepRunner:
    """A step's run, logits and sampling over the hooks a runner gives: _upload, _issue,
    _can_capture, _capture, _replay, _read and _synchronize (DeviceRunner for one device,
    GroupRunner in engine/group.py for a device group)."""
    kernel_times = None
    faults = None               # engine/faults.py: steps made to fail, for tests

    def run(self, batch, record=True):
        """Runs a step on the device, leaving logits and greedy tokens there.

        A pure decode step (every token sampled) runs as one replay of the launches recorded
        for its bucket, the next power of two of its size; the batch is padded to the bucket by
        repeating its last token, which rewrites the same cache slot with the same values.
        `record=False` issues every launch one by one instead (per-kernel device timing).
        A step whose longest sequence spans more than one attention split runs (and records)
        attention split along the context; shorter ones keep the one-pass kernel.
        """
        T, R = len(batch.tokens), len(batch.sample_tokens)
        long = self._set_long(int(batch.positions.max(initial=0)) + 1)
        faults = self.faults
        if faults is not None:
            faults.begin_step()
        if self.kernel_times is not None:
            self._upload(batch)
            self.device.start_timing()
            self._issue(T, R)
            if faults is not None:
                faults.end_step()
            for name, seconds in self.device.stop_timing():
                total = self.kernel_times.setdefault(name, [0, 0.0])
                total[0] += 1
                total[1] += seconds
            return R
        bucket = 1 << max(T - 1, 0).bit_length()
        if record and T == R and bucket <= self.max_seqs and self._can_capture():
            pad = bucket - T
            padded = batch if pad == 0 else StepBatch(
                *(np.concatenate([a, np.repeat(a[-1:], pad)]) for a in (
                    batch.tokens, batch.positions, batch.seq_rows)), batch.block_tables,
                np.concatenate([batch.sample_tokens, T - 1 + np.zeros(pad, np.int32)]),
                batch.sampling)
            self._upload(padded)
            graph = self.graphs.get((bucket, long))
            if graph is None:
                graph = self.graphs[bucket, long] = self._capture(
                    lambda: self._issue(bucket, bucket))
            if faults is not None:
                faults.end_step()
            self._replay(graph)
        else:
            self._upload(batch)
            self._issue(T, R)
            if faults is not None:
                faults.end_step()
        return R

    def recover(self):
        """After a step raised (a launch refused, a driver error, an injected fault): what it
        issued is waited for and nothing of it is held, so the next step starts as any does
        (a capture the error broke was ended where it broke). Raises when the device cannot
        even do that: a sticky driver error (CUDA's illegal address, Vulkan's device lost)
        fails every call after it, so the device is lost."""
        self._launched = None
        if self.faults is not None:
            self.faults.recover()
        self._synchronize()

    def logits(self, batch):
        """Runs a step; the logits of its sampled rows, float32 [R, vocab]."""
        return self._logits_of(self.run(batch))

    def _logits_of(self, R):
        """The last step's R rows of logits, read back."""
        raw = self._read(self._output_name(), R * self.vocab_size * 4)
        return np.frombuffer(raw, np.float32).reshape(R, self.vocab_size)

    def _logit_rows(self, rows):
        """Rows `rows` of the last step's logits, each read back alone: the rows a step's
        candidates left undecided are few, the rest need not cross to the host."""
        size = self.vocab_size * 4
        return {r: np.frombuffer(self._read(self._output_name(), size, r * size), np.float32)
                for r in rows}

    def step(self, batch):
        """Runs a step and returns its tokens (launch, then collect)."""
        self.launch(batch)
        return self.collect()

    def launch(self, batch):
        """Issues a step without waiting for it; collect() returns its tokens. A pipeline's
        lanes (engine/group.py) each have a step in flight this way."""
        self._launched = (batch, self.run(batch))

    def collect(self):
        """The tokens of the step launch() issued, once the device has done it.

        Steps without logprobs read back only the device's argmax (all rows greedy) or each
        row's candidates (ops.top_candidates: each chunk's best logits and sum), from which
        sampling.choose_among takes the definition's token; steps that report logprobs, the
        candidates with sums at temperature 1 (_step_with_logprobs); a row they cannot decide
        reads the logits and samples on the host (engine/sampling.py). So does every
        constrained row (SamplingRows.masks): no kernel applies masks yet."""
        batch, R = self._launched
        self._launched = None
        out = self._tokens(batch.sampling, R)
        rows = batch.sampling
        if rows.masked is not None:
            for r, logits in self._logit_rows(np.flatnonzero(rows.masked)).items():
                out.tokens[r], out.logprobs[r], out.top_ids[r], out.top_logprobs[r] = \
                    sample_row(logits, rows, r, rows.n_logprobs)
        return out

    def _tokens(self, rows, R):
        """collect()'s StepOutput of the last step's R rows, masks aside."""
        if R == 0:
            return _tokens_only(np.zeros(0, np.int32))
        if not self._has_candidates() and (rows.logprobs or rows.n_logprobs
                                           or np.any(rows.temperature > 0)):
            return sample(self._logits_of(R), rows)
        if rows.logprobs or rows.n_logprobs:
            return self._step_with_logprobs(R, rows)
        if not np.any(rows.temperature > 0):
            tokens = np.frombuffer(self._read("argmax", R * 4), np.int32)
            return _tokens_only(tokens.copy())
        candidates = self._candidates(R, rows.temperature)
        params = [choice_args(rows, r) for r in range(R)]
        tokens = [choose_among(*(part[r] for part in candidates), self.vocab_size, *params[r])
                  for r in range(R)]
        undecided = [r for r, token in enumerate(tokens) if token is None]
        for r, logits in self._logit_rows(undecided).items():   # the candidates could not tell
            tokens[r] = choose_sorted(logits, *params[r])
        return _tokens_only(np.array(tokens, np.int32))

    def _step_with_logprobs(self, R, rows):
        """The tokens and log probabilities (of the raw logits) of the last step's R rows, from
        their candidates: a row that reports log probabilities from candidates with sums at
        temperature 1 (sampling.logprobs_among), a row that does not (rows.reports) from
        candidates at its own temperature (choose_among); only the rows those cannot decide
        are taken from the logits read back (sampling.sample_row)."""
        k = rows.n_logprobs
        reports = np.ones(R, bool) if rows.reports is None else np.asarray(rows.reports, bool)
        temperature = np.where(reports | (rows.temperature <= 0), 1.0, rows.temperature)
        candidates = self._candidates(R, temperature.astype(np.float32))
        tokens, chosen = np.zeros(R, np.int32), np.zeros(R, np.float32)
        top, top_lp = np.zeros((R, k), np.int32), np.zeros((R, k), np.float32)
        undecided = []
        for r in range(R):
            part = [c[r] for c in candidates]
            if reports[r]:
                got = logprobs_among(*part, self.vocab_size, *choice_args(rows, r), k)
                if got is not None:
                    tokens[r], chosen[r], top[r], top_lp[r] = got
            else:
                got = choose_among(*part, self.vocab_size, *choice_args(rows, r))
                if got is not None:
                    tokens[r] = got
            if got is None:
                undecided.append(r)
        for r, logits in self._logit_rows(undecided).items():   # the candidates could not tell
            tokens[r], chosen[r], top[r], top_lp[r] = sample_row(logits, rows, r, k)
        return StepOutput(tokens=tokens, logprobs=chosen, top_ids=top, top_logprobs=top_lp)

    def _has_candidates(self):
        """Whether the runner leaves its rows' top_candidates on the device (_candidates)."""
        return False


def _tokens_only(tokens):
    """A StepOutput of tokens without log probabilities."""
    R = len(tokens)
    return StepOutput(tokens=tokens, logprobs=np.zeros(R, np.float32),
                      top_ids=np.zeros((R, 0), np.int32),
                      top_logprobs=np.zeros((R, 0), np.float32))


class DeviceRunner(StepRunner):
    def __init__(self, model, device, num_blocks, block_size=16, max_tokens=256, max_seqs=16,
                 part=None, split_tokens=None, check=True, context=None):
        """check=False: a runner only for its allocation list (a plan's candidate, of which the
        plan builds dozens), whose kernels are not checked against the device's capabilities:
        the runner of the chosen candidate does that. `context`: the longest sequence it serves
        (the model's unless less), which sizes its block tables and attention splits."""
        self.model, self.device, self.part = model, device, part
        self.base = None            # a lane's runner whose weights and KV cache it uses
        self._chosen = {}           # choices by weight shape (_matvec, _mma_launches, _groups)
        self.backend = device.backend
        self.block_size, self.num_blocks = block_size, num_blocks
        self.max_tokens, self.max_seqs = max_tokens, max_seqs
        self.vocab_size = model.config.vocab_size
        self.max_context = min(model.context_length, context or model.context_length)
        self.table_width = -(-min(self.max_context, num_blocks * block_size) // block_size)
        context = self.table_width * block_size
        if split_tokens is None:        # split only long contexts, in at most MAX_SPLITS pieces
            split_tokens = (max(SPLIT_TOKENS, -(-context // MAX_SPLITS))
                            if context >= SPLIT_MIN_CONTEXT else context)
        self.split_tokens = split_tokens
        self.attention_splits = -(-context // split_tokens)
        self.graph = model.step_graph(num_blocks, block_size, part)
        self.has_logits = "logits" in self.graph.outputs
        self.peers = [self]         # the runners of a tensor group, in rank order (group.py)
        self.two_phase_floats = TWO_PHASE_FLOATS
        self.long = False           # this step splits its attention (run() decides)
        self._step_rows = None      # the uploaded step's sequence rows (host), for attention
        self._step_tiles = None     # ... and which of its tokens attention_tiles takes
        self._shared = self._shared_buffers()
        self.mma = self._has_mma()
        self.steps, self.stacked = self._lower(stack_swiglu=self.mma)
        self._part_of = {}          # part of a stacked weight -> (stacked weight, first row)
        for whole, parts in self.stacked.values():
            for p, row in zip(parts, np.cumsum([0] + [p.shape[0] for p in parts[:-1]])):
                self._part_of[p.name] = (whole, int(row))
        # steps of mma_min_tokens or more, on a device with matrix instructions, run their
        # matmuls on the tensor cores (mma_tiled, _launch_tiled)
        self.mma_min_tokens = MMA_MIN_TOKENS
        if self._has_mma_vec():
            self.mma_min_tokens = 1 + min(mma_vec.most_tokens(op.weight.dtype)
                                          for op in self.steps if op.kind == "matmul")
        self._uses, self._slot_of, self._slot_sizes = self._assign_slots(self.steps)
        if check:
            self._check_supported()
        self.buffers, self.graphs = {}, {}
        self._host = {}             # staged: step input or output -> its host_array int32s
        self.kernel_times = None      # kernel name -> [launches, seconds] under device timing

    def lane(self):
        """A runner of the same step on this one's weights and KV cache, with step inputs and
        arenas of its own, so that its steps may run while this one's do (a pipeline's lane,
        engine/group.py)."""
        other = copy.copy(self)
        other.base = self
        other.buffers, other.graphs, other._host = {}, {}, {}
        other.kernel_times = None
        return other

    # -- the plan ------------------------------------------------------------------------------
    def _shared_buffers(self):
        """What a tensor group reads from each other's memory lives in buffers of its own, not
        in the arenas: the partial sums of the all_reduces in two buffers used in turn, each
        all_gather's slice in one (group.py's barriers make both safe). {value's name: (buffer
        name, value)}."""
        out, seen = {}, Counter()
        for op in self.graph.ops:
            x = op.inputs[0]
            if op.kind == "all_reduce":
                out[x.name] = (f"reduce.{seen[op.kind] % 2}", x)
            elif op.kind == "all_gather":
                out[x.name] = (f"gather.{seen[op.kind]}", x)
            seen[op.kind] += 1
        return out

    def _lower(self, stack_swiglu=False):
        """The graph's ops as launch steps, fusing ops into one kernel where what passes
        between them is used only there:
        - an rms_norm read only by matmuls is folded into each of them;
        - a swiglu of two matmuls of one input becomes one matmul over both weights;
        - an add whose input is a matmul used only there (a residual add) becomes the matmul's
          epilogue;
        - the other matmuls of one input whose weights share a dtype (q, k, v) become one
          over their weights stacked row-wise (returned by name: (stacked weight, parts)),
          each part's rows written to its own output, so q, k and v stay separate values;
        - the ropes of q and k and the store_kv of k become one kernel, where q goes on only
          to the attention that reads that cache;
        - an add of an all_reduce's sum (a tensor group's) becomes the reduction's epilogue.
        With stack_swiglu (a device that runs the tensor-core matmul) a SwiGLU's gate and up
        weights are stacked too, so that mma_tiled reads them in one launch (twice the rows, a
        wave of workgroups where each alone would split); the matvecs read each part.
        A fused step takes the place of its first op. (A SwiGLU formed as the down projection
        reads it was measured slower: every row recomputes it.)"""
        ops_ = self.graph.ops
        uses = Counter(t.name for op in ops_ for t in op.inputs)
        uses.update(t.name for t in self.graph.outputs.values())
        producer = {op.output.name: op for op in ops_}
        order = {id(op): i for i, op in enumerate(ops_)}
        users = {}
        for op in ops_:
            for t in op.inputs:
                users.setdefault(t.name, []).append(op)

        def made_once(t, kind):
            """The op of `kind` that makes t, where t is used once, else None."""
            op = producer.get(t.name)
            return op if op is not None and op.kind == kind and uses[t.name] == 1 else None

        place = {}      # id(op) -> the step lowered in its place, or None where it is fused away
        pair = []       # (gate, up) weights of the SwiGLUs, where stacked
        for op in ops_:
            if op.kind == "add":
                for mine, other in ((0, 1), (1, 0)):
                    reduce = made_once(op.inputs[mine], "all_reduce")
                    if reduce is not None and op.inputs[other].kind == "value":
                        place[id(reduce)] = Step("all_reduce", (reduce.inputs[0], op.inputs[other]),
                                                 op.output, dict(reduce.attrs, residual=True))
                        place[id(op)] = None
                        break
            elif op.kind == "all_reduce":
                place.setdefault(id(op), Step("all_reduce", op.inputs, op.output,
                                              dict(op.attrs, residual=False)))
        norm_of = {}
        for op in ops_:
            readers = users.get(op.output.name, [])
            if op.kind == "rms_norm" and readers and uses[op.output.name] == len(readers) and \
                    all(r.kind == "matmul" and r.inputs[0].name == op.output.name
                        for r in readers):
                norm_of[op.output.name] = op
                place[id(op)] = None

        def matvec(x, weight, outputs, **fused):
            norm = norm_of.get(x.name)
            if norm is not None:
                fused.update(norm=norm.inputs[1], eps=norm.attrs["eps"])
                x = norm.inputs[0]
            return Matvec(x, weight, tuple(outputs), **fused)

        for op in ops_:
            if id(op) in place:
                continue
            if op.kind == "swiglu":
                gate, up = (made_once(t, "matmul") for t in op.inputs)
                if gate and up and gate.inputs[0].name == up.inputs[0].name and \
                        gate.inputs[1].dtype == up.inputs[1].dtype and \
                        gate.inputs[1].shape == up.inputs[1].shape:
                    first, second = sorted((gate, up), key=lambda m: order[id(m)])
                    place[id(first)] = matvec(gate.inputs[0], gate.inputs[1], [op.output],
                                              up=up.inputs[1])
                    place[id(second)] = place[id(op)] = None
                    if stack_swiglu:
                        pair.append((gate.inputs[1], up.inputs[1]))
            elif op.kind == "add":
                for mine, other in ((0, 1), (1, 0)):
                    maker = made_once(op.inputs[mine], "matmul")
                    if maker is not None and id(maker) not in place and \
                            op.inputs[other].kind == "value":
                        place[id(maker)] = matvec(maker.inputs[0], maker.inputs[1], [op.output],
                                                  residual=op.inputs[other])
                        place[id(op)] = None
                        break
            elif op.kind == "store_kv":
                self._fuse_rope_store_kv(op, users, order, made_once, place)

        groups = {}
        for op in ops_:
            if op.kind == "matmul" and id(op) not in place:
                w = op.inputs[1]
                alone = uses[w.name] > 1                # its planes serve another op too
                key = (op.inputs[0].name, w.dtype, w.shape[1], id(op) if alone else None)
                groups.setdefault(key, []).append(op)
        stacked = {}

        def stack(parts):
            weight = Tensor("+".join(p.name for p in parts),
                            (sum(p.shape[0] for p in parts), parts[0].shape[1]),
                            parts[0].dtype, "weight")
            stacked[weight.name] = (weight, parts)
            return weight

        for parts in pair:
            stack(parts)
        for members in groups.values():
            parts = tuple(m.inputs[1] for m in members)
            weight = stack(parts) if len(parts) > 1 else parts[0]
            place[id(members[0])] = matvec(members[0].inputs[0], weight,
                                           [m.output for m in members])
            for m in members[1:]:
                place[id(m)] = None

        steps = []
        for op in ops_:
            if id(op) not in place:
                steps.append(Step(op.kind, op.inputs, op.output, op.attrs))
            elif place[id(op)] is not None:
                steps.append(place[id(op)])
        return steps, stacked

    @staticmethod
    def _fuse_rope_store_kv(store, users, order, made_once, place):
        """rope(q), rope(k), store_kv(k, v) -> one rope_store_kv step in store_kv's place,
        when the roped q is read only by the attention over the cache store_kv writes."""
        k_rope = made_once(store.inputs[0], "rope")
        attention = next((u for u in users.get(store.output.name, ())
                          if u.kind == "attention" and order[id(u)] > order[id(store)]), None)
        q_rope = made_once(attention.inputs[0], "rope") if attention is not None else None
        if k_rope is None or q_rope is None or \
                [t.name for t in k_rope.inputs[1:]] != [t.name for t in q_rope.inputs[1:]] or \
                k_rope.attrs != q_rope.attrs or len(users.get(q_rope.inputs[0].name, ())) != 1:
            return
        q, k = q_rope.inputs[0], k_rope.inputs[0]
        place[id(store)] = Step("rope_store_kv", (q, k, *store.inputs[1:], q_rope.inputs[2]),
                                q_rope.output, q_rope.attrs)
        place[id(k_rope)] = place[id(q_rope)] = None

    def _check_supported(self):
        for t in self.graph.weights.values():
            if len(t.shape) == 2 and t.dtype not in DEVICE_DTYPES:
                raise ModelRefused(f"{self.backend}: {self.device.name}: weight {t.name} is "
                                   f"{t.dtype}; the device kernels read "
                                   f"{', '.join(DEVICE_DTYPES)}")
        for kernel in self._kernels():
            missing = kernel.caps - self.device.caps
            if missing:
                raise ModelRefused(f"{self.backend}: {self.device.name}: kernel {kernel.name} "
                                   f"needs {', '.join(sorted(missing))}, which the device lacks")

    def _kernels(self):
        sg, cfg = self.device.subgroup_size, self.model.config
        seen = {}
        for long, steps in ((False, self.steps), (True, self.steps if self.mma else ())):
            for i, step in enumerate(steps):
                for kernel in self._kernels_of(step, sg, cfg, long, self._next_matmul(steps, i)):
                    seen.setdefault(kernel.name, kernel)
                after = None if step.kind != "all_reduce" else self._normed_after(steps, i)
                if after is not None and long and self._mma_launches(after):
                    kernel = mma_vec.reduce_norm_x16(
                        tiled_x16_format(self._tiled_weight(after).dtype), step.attrs["world"])
                    seen.setdefault(kernel.name, kernel)
                elif after is not None and not long and any(
                        self._matvec(after.weight, n, after.variant)[2]
                        for n in self._groups(after.weight)):
                    kernel = mma_vec.reduce_norm_x16(after.weight.dtype, step.attrs["world"])
                    seen.setdefault(kernel.name, kernel)
        if self.has_logits:
            seen.setdefault("argmax_chunks", ops.argmax_chunks(sg))
            seen.setdefault("argmax", ops.argmax(sg))
            seen.setdefault("top_candidates", ops.top_candidates(sg))
        return list(seen.values())

    def _kernels_of(self, op, sg, cfg, long=False, after=None):
        if op.kind == "matmul":
            chosen = [self._matvec(op.weight, n, op.variant) for n in self._groups(op.weight)]
            matvecs = [k for kernel, _, prep in chosen for k in (kernel, prep) if k is not None]
            launches = self._mma_launches(op) if long else {}
            if not launches:
                return matvecs
            variant, dtype = self._tiled_variant(op), op.weight.dtype
            prep = [tiled_norm_x16(dtype)] if op.norm is not None else \
                [matmul.mma_x16(dtype)] if variant.get("x16") else []
            dequant = [matmul.dequant_f16(self._tiled_weight(op).dtype)] \
                if any(self._dequantizes(op, n) for n in launches) else []
            return matvecs + prep + dequant + [
                kernel for n, launch in launches.items()
                for kernel in self._mma_kernels(op, launch, after, n)]
        if op.kind == "embedding":
            return [ops.embedding(op.inputs[0].dtype)]
        if op.kind == "rms_norm":
            return [ops.rms_norm(sg)]
        if op.kind == "add":
            return [ops.elementwise("add")]
        if op.kind == "swiglu":
            return [ops.elementwise("swiglu")]
        if op.kind == "rope":
            return [ops.rope(op.attrs["style"])]
        if op.kind == "store_kv":
            return [ops.store_kv()]
        if op.kind == "rope_store_kv":
            return [ops.rope_store_kv(op.attrs["style"])]
        if op.kind == "attention":
            heads, kv_heads = op.inputs[0].shape[1], op.inputs[1].shape[2]
            shares = {1, self._attention_heads(self.max_tokens, heads, kv_heads)}
            tiles = self._attention_tiles(heads, kv_heads)
            return [kernel for shared in sorted(shares) for kernel in (
                [ops.attention(sg, cfg.head_dim, shared)]
                + ([ops.attention(sg, cfg.head_dim, shared, untiled=True)] if tiles else [])
                + ([ops.attention_split(sg, cfg.head_dim, shared)]
                   if self.attention_splits > 1 else []))] + \
                ([ops.attention_combine(cfg.head_dim)] if self.attention_splits > 1 else []) + \
                ([tiles] if tiles else [])
        if op.kind == "gather":
            return [ops.gather_rows()]
        if op.kind == "all_reduce":
            return [ops.all_reduce(op.attrs["world"], op.attrs["residual"])]
        if op.kind == "all_gather":
            return [ops.all_gather(op.attrs["world"])]
        return []

    def _has_mma_vec(self):
        """Whether the device runs mma_vec for every matmul weight of the graph."""
        dtypes = {op.weight.dtype for op in self.steps if op.kind == "matmul"}
        return bool(dtypes) and all(self._mma_vec_runs(d) for d in dtypes)

    def _mma_vec_runs(self, dtype):
        return mma_vec.supported(dtype) and mma_vec.mma_vec(dtype).caps <= self.device.caps

    def _has_mma(self):
        """Whether the device runs the tensor-core matmul of every weight of the graph."""
        dtypes = {t.dtype for t in self.graph.weights.values() if len(t.shape) == 2}
        return bool(dtypes) and all(matmul.mma_tiled(d).caps <= self.device.caps for d in dtypes)

    def _mma_launch(self, w, n):
        """How the matmul of weight w over n tokens runs on the tensor cores (matmul.MmaLaunch),
        or None: a short step, or a device without the matrix instructions."""
        if n < self.mma_min_tokens or not matmul.mma_tiled(w.dtype).caps <= self.device.caps:
            return None
        return matmul.mma_launch(*w.shape, n, self._multiprocessors(), **mma_choice(w.dtype)[1])

    def _mma_launches(self, op):
        """{n: MmaLaunch} standing for every length of a matmul step that runs on the tensor
        cores (matmul.mma_launches; {} without them): what _kernels builds and the partials
        buffer holds."""
        w, most = self._tiled_weight(op), self._elements(op.x.shape[:1])
        key = ("mma_launches", w.dtype, w.shape, most)
        if key not in self._chosen:
            self._chosen[key] = {} if self._mma_launch(w, most) is None else \
                matmul.mma_launches(*w.shape, self.mma_min_tokens, most, self._multiprocessors(),
                                    **mma_choice(w.dtype)[1])
        return self._chosen[key]

    def _multiprocessors(self):
        return getattr(self.device, "multiprocessors", None) or MULTIPROCESSORS

    def _tiled_weight(self, op):
        """The weight a matmul step's mma_tiled reads: a SwiGLU's stacked gate and up, else
        the step's weight."""
        return self._part_of[op.weight.name][0] if op.up is not None else op.weight

    def _tiled_variant(self, op, tokens=matmul.MMA_TOKENS):
        """mma_tiled's keywords for a matmul step in a token tile (mma_choice's pipeline),
        reading x16 where the step's norm is folded in (tiled_norm_x16 makes it)."""
        variant = mma_choice(op.weight.dtype, self.device.caps, tokens)[0]
        return dict(variant, x16=True) if op.norm is not None else variant

    def _dequantizes(self, op, n):
        """Whether a matmul step of n tokens on the tensor cores first decodes its weight to
        f16 (matmul.dequant_f16, into the dequant_f16 arena) and multiplies it as F16 weights:
        formats other than F16/BF16 in steps of more than DEQUANT_PAST_TOKENS, on devices
        with wgmma, where the F16 tiles run on it and the decoding, once for all the step's
        tokens, costs less than decoding in every tile."""
        w = self._tiled_weight(op)
        return w.dtype not in ("F16", "BF16") and n > DEQUANT_PAST_TOKENS and \
            WGMMA in self.device.caps

    def _mma_kernels(self, op, launch, after=None, n=0):
        """The kernels of a matmul step's MmaLaunch, in launch order (after its x16's): one
        mma_tiled writing the outputs, or a split one and what adds its slices into them
        (a SwiGLU's always: only the sum sees gate's and up's together): split_sum, or where
        it can make the x16 of `after`, the matmul step next, the kernel _makes_x16 names."""
        w, variant = self._tiled_weight(op), self._tiled_variant(op, launch.tokens)
        dtype = w.dtype
        if self._dequantizes(op, n):        # F16's pipeline, on x16 where the format's is
            dtype = "F16"
            variant = mma_choice(dtype, self.device.caps, launch.tokens)[0] \
                if variant.get("x16") else {}
        residual, outputs = op.residual is not None, len(op.outputs)
        if launch.splits == 1 and op.up is None:
            return [matmul.mma_tiled(dtype, residual, launch.tokens, outputs=outputs,
                                     **variant)]
        made = self._makes_x16(op, after, launch)
        return [matmul.mma_tiled(dtype, tokens=launch.tokens, split=True, **variant),
                made if made is not None else matmul.split_sum(residual, outputs,
                                                               op.up is not None)]

    def _tiled_ops(self):
        """The matmul steps that run mma_tiled at some step length."""
        return [op for op in self.steps if op.kind == "matmul" and self._mma_launches(op)] \
            if self.mma else []

    def _mma_x16_words(self):
        """The words of the largest x a step's x16 mma_tiled reads rounded (0: none does)."""
        return max((self._elements(op.x.shape[:1]) * op.weight.shape[1] // 2
                    for op in self._tiled_ops() if self._tiled_variant(op).get("x16")),
                   default=0)

    def _elements(self, shape):
        sizes = {"T": self.max_tokens, "R": self.max_seqs}
        return math.prod(sizes.get(d, d) for d in shape)

    def _assign_slots(self, steps):
        """(uses, slot of each value, slot sizes) of a lowering: arena slots by liveness, a
        value taking a free slot of its size at its op and freeing it after its last use; a
        reshape, and rope and rope_store_kv (which rotate q in place), share their input's
        slot."""
        ops_ = steps
        last_use, alias = {}, {}
        for i, op in enumerate(ops_):
            for t in op.inputs:
                last_use[t.name] = i
            if op.kind in SHARES_INPUT:
                alias[op.output.name] = alias.get(op.inputs[0].name, op.inputs[0].name)
        for name, root in alias.items():        # a slot lives until its last alias is used
            last_use[root] = max(last_use.get(root, 0), last_use.get(name, 0))
        for t in self.graph.outputs.values():
            last_use[t.name] = len(ops_)
        free, slot_of, sizes = {}, {}, []
        for i, op in enumerate(ops_):
            for out in op.outputs:
                if op.kind == "all_gather" and out.name not in last_use:
                    continue        # read by no op here: the ranks that do not keep the logits
                if out.kind == "value" and op.kind not in SHARES_INPUT and \
                        out.name not in self._shared:
                    size = self._elements(out.shape) * 4
                    pool = free.setdefault(size, [])
                    slot = pool.pop() if pool else len(sizes)
                    if slot == len(sizes):
                        sizes.append(size)
                    slot_of[out.name] = slot
                elif op.kind in SHARES_INPUT:
                    slot_of[out.name] = slot_of[alias[out.name]]
            for t in dict.fromkeys(op.inputs):     # once each, in order: the same slots every run
                root = alias.get(t.name, t.name)
                if t.kind == "value" and last_use.get(root) == i and root in slot_of:
                    free.setdefault(sizes[slot_of[root]], []).append(slot_of[root])
        uses = {}
        for op in ops_:
            for t in op.inputs:
                uses[t.name] = uses.get(t.name, 0) + 1
        return uses, slot_of, sizes

    def allocations(self):
        """Every device buffer the runner will hold, in allocation order (a lane's: only the
        arenas, its base holds the rest)."""
        if self.base is not None:
            return [a for a in self._allocations() if a.kind == "arenas"]
        return self._allocations()

    def _allocations(self):
        out = []
        for t in self._device_weights():
            if len(t.shape) == 2:
                for plane, words in self._planes_of(t).items():
                    out.append(Allocation(f"{t.name}:{plane}", words * 4, "weights"))
            else:
                out.append(Allocation(t.name, self._elements(t.shape) * 4, "weights"))
        for name, (t, array) in self.graph.consts.items():
            out.append(Allocation(name, array.nbytes, "weights"))
        for name, t in self.graph.state.items():      # f16 keys / values
            out.append(Allocation(name, math.prod(t.shape) * 2, "state"))
        inputs = self._inputs_layout()
        step = [("inputs", sum(inputs.values()))] if self._packed() else list(inputs.items())
        if self.has_logits:
            step += [("argmax", self.max_seqs), ("argmax_values", self.max_seqs * ARGMAX_CHUNKS),
                     ("argmax_indices", self.max_seqs * ARGMAX_CHUNKS)]
            chunks = self.max_seqs * self._candidate_chunks()
            step += [("top_temperature", self.max_seqs), ("top_values", chunks * ops.TOP_KEEP),
                     ("top_indices", chunks * ops.TOP_KEEP), ("top_maxima", chunks),
                     ("top_sums", chunks)]
        if "hidden" in self.graph.inputs:   # a pipeline stage's input, copied from the last
            step.append(("hidden", self.max_tokens * self.model.config.d_model))
        shared = {}
        for name, x in self._shared.values():
            shared[name] = max(shared.get(name, 0), self._elements(x.shape))
        step += list(shared.items())
        out += [Allocation(name, words * 4, "arenas") for name, words in step]
        out += [Allocation(f"arena.{i}", size, "arenas") for i, size in enumerate(self._slot_sizes)]
        if self.attention_splits > 1:       # (o [head_dim], m, l) of each token, head and split
            heads = next(op.inputs[0].shape[1] for op in self.steps if op.kind == "attention")
            words = (self._split_rows() * heads * self.attention_splits
                     * (self.model.config.head_dim + 2))
            out.append(Allocation("attention_partials", words * 4, "arenas"))
        partials = self._mma_partials()
        if partials:                        # the slices of a split mma_tiled, [splits, T, rows]
            out.append(Allocation("mma_partials", partials * 4, "arenas"))
        if self._dequant_words():           # a weight decoded to f16 pairs, [rows, cols / 2]
            out.append(Allocation("dequant_f16", self._dequant_words() * 4, "arenas"))
        if self._mma_x16_words():           # x rounded for the tensor cores, [T, cols / 2]
            out.append(Allocation("mma_x16", self._mma_x16_words() * 4, "arenas"))
        if self._norm_x16_words():          # x normed and rounded for mma_vec, [T, cols / 2]
            out.append(Allocation("norm_x16", self._norm_x16_words() * 4, "arenas"))
        return out

    def _dequant_words(self):
        """The words of the largest weight a step decodes to f16 first (0: none does)."""
        return max((math.prod(self._tiled_weight(op).shape) // 2 for op in self._tiled_ops()
                    if any(self._dequantizes(op, n) for n in self._mma_launches(op))),
                   default=0)

    def _mma_partials(self):
        """The floats of the largest partial sums a split matmul of any step writes."""
        return max((launch.splits * n * self._tiled_weight(op).shape[0]
                    if launch.splits > 1 or op.up is not None else 0
                    for op in self._tiled_ops()
                    for n, launch in self._mma_launches(op).items()), default=0)

    def _split_rows(self):
        return min(self.max_tokens, self.max_seqs)

    def _splits_attention(self, T):
        """Whether a step of T tokens runs attention split along the context (flash decoding):
        when the longest context the runner holds spans several splits and the step is
        decode-sized (at most max_seqs tokens; a larger step's T * heads workgroups fill the
        device already). The splits cover that longest context, whatever the step's lengths,
        so a captured decode graph serves every length: splits past a token's length write
        neutral partials. Only steps whose longest sequence spans more than one split take it
        (run() records the two kinds of decode step apart)."""
        return self.long and T <= self._split_rows()

    def _planes_of(self, t):
        r = reader(t.dtype)
        return {p: t.shape[0] * r.row_words(p, t.shape[1]) for p in r.plane_names}

    def _device_weights(self):
        """The graph's weights as the device holds them: a stacked weight in place of its
        parts (at the first part), the rest as they are."""
        stacked = {parts[0].name: w for w, parts in self.stacked.values()}
        inside = {p.name for _, parts in self.stacked.values() for p in parts}
        for t in self.graph.weights.values():
            if t.name in stacked:
                yield stacked[t.name]
            elif t.name not in inside:
                yield t

    # -- allocation and upload -----------------------------------------------------------------
    def allocate(self):
        """Allocates every buffer of allocations(), and nothing else: what the device holds
        afterwards is what the plan counted (engine/plan.py checks it)."""
        if self.base is not None:
            self.buffers.update((a.name, self.base.buffers[a.name]) for a in
                                self._allocations() if a.kind != "arenas")
        for a in self.allocations():
            self.buffers[a.name] = self.device.alloc(a.nbytes)
        if self._staged():
            words = self._inputs_layout()
            self._host_inputs = self.device.host_array(sum(words.values()) * 4).view(np.int32)
            at = 0
            for name, n in words.items():
                if self._packed():
                    self.buffers[name] = self.device.view(self.buffers["inputs"], at * 4)
                self._host[name] = self._host_inputs[at:at + n]
                at += n
            self._host["argmax"] = self.device.host_array(self.max_seqs * 4).view(np.int32)

    def _inputs_layout(self):
        """{step input: int32 words}, in the order of the `inputs` buffer (staged): the block
        tables last, so a step copies only the rows it has."""
        return {"tokens": self.max_tokens, "positions": self.max_tokens,
                "seq_rows": self.max_tokens, "sample_tokens": self.max_seqs,
                "block_tables": self.max_seqs * self.table_width}

    def _staged(self):
        """Whether a step's inputs and greedy tokens go through host memory of the device's
        (host_array: page-locked on ptx, a host-visible buffer on a discrete GPU's vulkan),
        copied by the step itself, recorded with its launches: no writes or reads of their own.
        The device says where (step_staging): that memory is not the device's, which the plan
        sizes."""
        return getattr(self.device, "step_staging", False)

    def _packed(self):
        """Staged, the inputs are one buffer (views of it, one copy a step) where the device
        has views of buffers (ptx); else a copy each."""
        return self._staged() and hasattr(self.device, "view")

    def upload(self):
        """Writes weights and constants into their buffers and builds every kernel's program
        (a lane: only the programs, its base wrote the weights)."""
        dev = self.device
        if self.base is not None:
            self.programs = {k.name: dev.program(k) for k in self._kernels()}
            return
        for t in self._device_weights():
            if len(t.shape) == 2:
                for plane, words in self._file_planes(t).items():
                    dev.write(self.buffers[f"{t.name}:{plane}"], words)
            else:
                array = self.graph.slice_of(t.name, self.model.weight_array(t.name))
                dev.write(self.buffers[t.name], np.ascontiguousarray(array, np.float32))
        for name, (t, array) in self.graph.consts.items():
            dev.write(self.buffers[name], array)
        self.programs = {k.name: dev.program(k) for k in self._kernels()}
        dev.synchronize()

    def _file_planes(self, t):
        """The device planes of a weight from the file's bytes (a tensor group's shard of
        them: graph.slices); a stacked weight's are its parts' planes, row after row."""
        _, parts = self.stacked.get(t.name, (t, (t,)))
        each = []
        for p in parts:
            info = self.model.file.tensors[self.model._file_names[p.name]]
            raw = self.model.file.raw(info.name)
            if p.name in self.graph.slices:
                raw = slice_raw(p.dtype, raw, info.shape, *self.graph.slices[p.name])
            each.append(planes(p.dtype, raw, p.shape))
        if len(each) == 1:
            return each[0]
        return {plane: np.concatenate([e[plane] for e in each]) for plane in each[0]}

    # -- a step --------------------------------------------------------------------------------
    def _buffer(self, tensor):
        """The buffer of a tensor."""
        if tensor.name in self._shared:
            return self.buffers[self._shared[tensor.name][0]]
        if tensor.kind == "value":
            return self.buffers[f"arena.{self._slot_of[tensor.name]}"]
        return self.buffers[tensor.name]

    def _shape(self, tensor, n_tokens, n_rows):
        return tuple({"T": n_tokens, "R": n_rows}.get(d, d) for d in tensor.shape)

    def _launch(self, kernel, grid, *args):
        if self.faults is not None:
            self.faults.launch()
        self.device.launch(self.programs[kernel.name], kernel, grid, args)

    def _upload(self, batch):
        T, R = len(batch.tokens), len(batch.sample_tokens)
        if T > self.max_tokens or R > self.max_seqs or len(batch.block_tables) > self.max_seqs:
            raise ValueError(f"step of {T} tokens / {R} rows exceeds the runner's "
                             f"{self.max_tokens} / {self.max_seqs}")
        self._step_rows, self._step_tiles = batch.seq_rows, None
        dev = self.device
        if self._staged():
            # the previous step's copies read this memory: they are done before it is rewritten
            dev.synchronize()
            for name in ("tokens", "positions", "seq_rows", "sample_tokens"):
                values = getattr(batch, name)
                self._host[name][:len(values)] = values
            n, width = batch.block_tables.shape
            tables = self._host["block_tables"].reshape(self.max_seqs, self.table_width)
            tables[:n, :width] = batch.block_tables
            tables[:n, width:] = 0
            return
        tables = np.zeros((self.max_seqs, self.table_width), np.int32)
        tables[:len(batch.block_tables), :batch.block_tables.shape[1]] = batch.block_tables
        for name in ("tokens", "positions", "seq_rows", "sample_tokens"):
            dev.write(self.buffers[name], np.ascontiguousarray(getattr(batch, name), np.int32))
        dev.write(self.buffers["block_tables"], tables)

    def _issue(self, T, R):
        """Issues every launch of a step of T tokens and R sampled rows, in graph order."""
        for _ in self.launches(T, R):
            pass

    def launches(self, T, R):
        """Issues the step's launches in graph order, as a generator: it stops before each
        all_reduce and all_gather (yielding the step), so a tensor group can put its barrier
        between the ranks' partial sums or slices and their reduction or gathering (group.py)."""
        sg, cfg = self.device.subgroup_size, self.model.config
        B = self._buffer
        wg = ops.WG
        long = self.mma and T >= self.mma_min_tokens
        if self._staged():
            # the inputs up to the block tables of as many sequences as the step has tokens
            rows = min(T, self.max_seqs)
            if self._packed():
                words = len(self._host_inputs) - (self.max_seqs - rows) * self.table_width
                self.device.write(self.buffers["inputs"], self._host_inputs[:words])
            else:
                for name, host in self._host.items():
                    if name != "argmax":
                        words = rows * self.table_width if name == "block_tables" else None
                        self.device.write(self.buffers[name], host[:words])
        rounded = None              # (x, gain, operand) that mma_x16 holds, until an op writes
        normed = None               # (x, gain, kernel) that norm_x16 holds, the same way
        steps = self.steps
        for i, op in enumerate(steps):
            ins, out = op.inputs, op.outputs[0]
            if R == 0 and "R" in out.shape:
                continue        # a step that samples no row (a prompt's chunk before its last)
            if op.kind not in ("matmul", "reshape"):
                rounded = normed = None
            if op.kind == "embedding":
                table = ins[0]
                self._launch(ops.embedding(table.dtype), (T,),
                             *self._weight_planes(table), B(ins[1]), B(out), table.shape[1])
            elif op.kind == "rms_norm":
                shape = self._shape(ins[0], T, R)
                rows = int(np.prod(shape[:-1]))
                self._launch(ops.rms_norm(sg), (rows,), B(ins[0]), B(ins[1]), B(out),
                             shape[-1], op.attrs["eps"])
            elif op.kind == "matmul" and long and \
                    self._mma_launch(self._tiled_weight(op), self._shape(op.x, T, R)[0]):
                rounded = self._launch_tiled(op, T, R, rounded, self._next_matmul(steps, i))
            elif op.kind == "matmul":
                w = op.weight
                n = self._shape(op.x, T, R)[0]
                rows, cols = w.shape
                planes_ = self._weight_planes(w) + (self._weight_planes(op.up) if op.up else [])
                norm = None if op.norm is None else (B(op.norm), op.eps)
                residual = [] if op.residual is None else [B(op.residual)]
                parts = self.stacked.get(w.name, (w, (w,)))[1]
                splits = [int(s) for s in np.cumsum([p.shape[0] for p in parts])[:-1]]
                normed = self._launch_matvec(
                    w, n, op.variant, planes_, B(op.x),
                    (*map(B, op.outputs), *residual, rows, cols, n, *splits), norm, normed)
            elif op.kind == "add":
                n = int(np.prod(self._shape(out, T, R)))
                nb = int(np.prod(self._shape(ins[1], T, R)))
                self._launch(ops.elementwise("add"), (-(-n // wg),), B(ins[0]), B(ins[1]), B(out), n, nb)
            elif op.kind == "swiglu":
                n = int(np.prod(self._shape(out, T, R)))
                self._launch(ops.elementwise("swiglu"), (-(-n // wg),), B(ins[0]), B(ins[1]), B(out), n, n)
            elif op.kind == "rope":
                x, positions, inv_freq = ins
                if self._uses[x.name] != 1 or B(x) != B(out):
                    raise RuntimeError("rope runs in place on a value used only by it")
                _, heads, hd = x.shape
                pairs = inv_freq.shape[0]
                self._launch(ops.rope(op.attrs["style"]), (-(-T * heads * pairs // wg),),
                             B(x), B(positions), B(inv_freq), T, heads, hd, pairs)
            elif op.kind == "store_kv":
                k, v, kc, vc, positions, seq_rows, tables_t = ins
                words = kc.shape[2] * cfg.head_dim // 2
                self._launch(ops.store_kv(), (-(-T * words // wg),), B(k), B(v), B(kc), B(vc),
                             B(positions), B(seq_rows), B(tables_t), T, words, self.table_width,
                             self.block_size)
            elif op.kind == "rope_store_kv":
                q, k, v, kc, vc, positions, seq_rows, tables_t, inv_freq = ins
                if self._uses[q.name] != 1 or B(q) != B(out):
                    raise RuntimeError("rope_store_kv rotates q in place: q is used only by it")
                _, heads, hd = q.shape
                kv_heads = k.shape[1]
                self._launch(ops.rope_store_kv(op.attrs["style"]),
                             (-(-T * (heads + kv_heads) * hd // 2 // wg),), B(q), B(k), B(v),
                             B(kc), B(vc), B(positions), B(seq_rows), B(tables_t), B(inv_freq),
                             T, heads, kv_heads, hd, inv_freq.shape[0], self.table_width,
                             self.block_size)
            elif op.kind == "attention":
                q, kc, vc, positions, seq_rows, tables_t = ins
                heads, kv_heads = q.shape[1], kc.shape[2]
                cache = (B(kc), B(vc), B(positions), B(seq_rows), B(tables_t), heads,
                         kv_heads, self.table_width, self.block_size, op.attrs["scale"])
                shared = self._attention_heads(T, heads, kv_heads)
                if self._splits_attention(T):
                    splits, partials = self.attention_splits, self.buffers["attention_partials"]
                    self._launch(ops.attention_split(sg, cfg.head_dim, shared),
                                 (T * heads // shared, splits), B(q), partials, *cache,
                                 self.split_tokens)
                    self._launch(ops.attention_combine(cfg.head_dim), (T * heads,),
                                 partials, B(out), splits)
                elif T > R and self._attention_tiles(heads, kv_heads) and \
                        any(taken := self._tiled_tokens(T)):
                    # a step with prompt tokens: the tiles of one sequence's tokens on the
                    # tensor cores, the other tokens (if any) one by one
                    self._launch(self._attention_tiles(heads, kv_heads),
                                 (-(-T // ops.ATTENTION_TILE),
                                  heads // ops.attention_tile_heads(heads, kv_heads)),
                                 B(q), B(out), *cache, T)
                    if not all(taken):
                        self._launch(ops.attention(sg, cfg.head_dim, shared, untiled=True),
                                     (T * heads // shared,), B(q), B(out), *cache, T)
                else:
                    self._launch(ops.attention(sg, cfg.head_dim, shared), (T * heads // shared,),
                                 B(q), B(out), *cache)
            elif op.kind == "gather":       # indices count from the step's first token
                x, index = ins
                self._launch(ops.gather_rows(), (R,), B(x), B(index), B(out),
                             x.shape[-1])
            elif op.kind == "all_reduce":
                held = yield from self._all_reduce(op, T, R, self._normed_after(steps, i), long)
                if long:
                    rounded = held
                else:
                    normed = held
            elif op.kind == "all_gather":
                yield from self._all_gather(op, T, R)
            elif op.kind == "reshape":
                continue
            else:
                raise ModelRefused(f"{self.device.name}: op {op.kind} has no kernel")
        # the greedy choice of every row, so greedy steps read back tokens, not logits
        if self.has_logits and R:
            logits = self.graph.outputs["logits"]
            chunks = ARGMAX_CHUNKS
            values, indices = (self.buffers[name] for name in ("argmax_values",
                                                               "argmax_indices"))
            self._launch(ops.argmax_chunks(sg), (R, chunks), B(logits), values, indices,
                         self.vocab_size, -(-self.vocab_size // chunks))
            self._launch(ops.argmax(sg), (R,), values, indices, self.buffers["argmax"], chunks)
            if self._staged():
                self.device.download(self._host["argmax"], self.buffers["argmax"], R * 4)

    def _launch_tiled(self, op, T, R, rounded, after=None):
        """A matmul step on the tensor cores (mma_tiled): x rounded to the operand beforehand
        where the pipeline reads x16 (mma_x16; tiled_norm_x16 where the step's norm is folded
        in), unless `rounded` says the buffer holds it already; then the tile launch, and where
        it is split or a SwiGLU, the split_sum, which also makes the x16 of `after` (the
        matmul step next) where _makes_x16 says so. Returns what the x16 buffer holds after."""
        B = self._buffer
        w, variant = self._tiled_weight(op), self._tiled_variant(op)
        rows, cols = w.shape
        n = self._shape(op.x, T, R)[0]
        launch = self._mma_launch(w, n)
        x = B(op.x)
        if variant.get("x16"):
            x = self.buffers["mma_x16"]
            held = (op.x.name, None if op.norm is None else op.norm.name,
                    matmul.mma_operand(w.dtype))
            if rounded != held:
                rounded = held
                if op.norm is None:
                    self._launch(matmul.mma_x16(w.dtype), (-(-n * cols // (4 * ops.WG)),),
                                 B(op.x), x, n * cols)
                else:
                    self._launch(tiled_norm_x16(w.dtype), (n,), B(op.x), B(op.norm), x, cols,
                                 op.eps)
        planes = self._weight_planes(w)
        if self._dequantizes(op, n):
            decoded = self.buffers["dequant_f16"]
            units = rows * cols // reader(w.dtype).block_elems
            self._launch(matmul.dequant_f16(w.dtype), (-(-units // matmul.WORKGROUP),), *planes,
                         decoded, rows, cols)
            planes = [decoded]
        outs = [B(t) for t in op.outputs]
        residual = [] if op.residual is None else [B(op.residual)]
        parts = self.stacked.get(w.name, (w, (w,)))[1]
        starts = [int(s) for s in np.cumsum([p.shape[0] for p in parts])[:-1]] \
            if len(outs) > 1 else []
        kernels = self._mma_kernels(op, launch, after, n)
        grid = launch.grid(rows, n)
        if len(kernels) == 1:
            self._launch(kernels[0], grid, *planes, x, *outs, *residual, rows, cols, n, *starts)
            return rounded
        tile, add = kernels
        partials = self.buffers["mma_partials"]
        self._launch(tile, grid, *planes, x, partials, rows, cols, n, launch.split_cols)
        if self._makes_x16(op, after, launch) is not None:
            x16, wg = self.buffers["mma_x16"], matmul.WORKGROUP
            if op.up is not None:
                half = rows // 2
                self._launch(add, (-(-n * half // (2 * wg)),), partials, x16, n * half,
                             launch.splits, half)
            else:
                views = [self.device.view(partials, j * n * rows * 4)
                         for j in range(launch.splits)]
                self._launch(add, (n,), *views, *residual, *outs, B(after.norm), x16, rows,
                             after.eps)
            return (after.x.name, None if after.norm is None else after.norm.name,
                    matmul.mma_operand(self._tiled_weight(after).dtype))
        if op.up is not None:
            half = rows // 2
            self._launch(add, (-(-n * half // matmul.WORKGROUP),), partials, *outs,
                         n * half, launch.splits, half)
        else:
            self._launch(add, (-(-n * rows // matmul.WORKGROUP),), partials, *outs, *residual,
                         n * rows, launch.splits, *([rows, *starts] if starts else []))
        return rounded

    @staticmethod
    def _next_matmul(steps, i):
        """The step after steps[i] (past reshapes) if it is a matmul, else None."""
        for op in steps[i + 1:]:
            if op.kind != "reshape":
                return op if op.kind == "matmul" else None
        return None

    def _makes_x16(self, op, after, launch):
        """The kernel by which a split (or SwiGLU) tensor-core matmul step `op` makes the x16
        the step `after` reads, in place of its split_sum and after's own rounding launch, or
        None: a SwiGLU whose only reader is after, on x16 and no norm: split_sum's x16
        variant (the f32 value is never stored); a residual sum that after reads through its
        norm: reduce_norm_x16 over the split's slices (views of the partials), which stores
        the sum as well. Two launches fewer a layer, a step of mma_min_tokens or more."""
        out = op.outputs[0]
        if after is None or after.x.name != out.name or launch.splits == 1 and \
                op.up is None or not self._mma_launches(after):
            return None
        dtype = self._tiled_weight(after).dtype
        if op.up is not None and after.norm is None and self._uses[out.name] == 1 and \
                self._tiled_variant(after).get("x16"):
            return matmul.split_sum(swiglu=True, x16=dtype)
        if op.residual is not None and after.norm is not None and len(op.outputs) == 1:
            return mma_vec.reduce_norm_x16(tiled_x16_format(dtype), launch.splits)
        return None

    def _attention_tiles(self, heads, kv_heads):
        """The tensor-core attention of steps with prompt tokens (ops.attention_tiles), or None
        where the device lacks its instructions or the head size does not suit it."""
        head_dim = self.model.config.head_dim
        if head_dim % 16 or head_dim > 256:
            return None
        kernel = ops.attention_tiles(head_dim, ops.attention_tile_heads(heads, kv_heads))
        return kernel if kernel.caps <= self.device.caps else None

    def _tiled_tokens(self, T):
        """Which of the step's T tokens attention_tiles takes (ops.tiled_tokens of the rows
        the step uploaded, worked out once a step; where they are not known, some and not
        others: both launches)."""
        rows = self._step_rows
        if rows is None or len(rows) != T:
            return [True, False]
        if self._step_tiles is None:
            self._step_tiles = ops.tiled_tokens(rows)
        return self._step_tiles

    def _attention_heads(self, T, heads, kv_heads):
        """Query heads of one KV head an attention workgroup of a T-token step takes: as many as
        ops.attention_heads allows where T * kv_heads workgroups still give every
        multiprocessor SHARED_HEADS_PER_SM of them (a 512-token prefill: its K and V rows
        are read once for their heads, 8B prefill 9.4k -> 10.2k tok/s on the H200; from one a
        multiprocessor on, not four: 1B F16 at 32 / 64 sequences 19,364 -> 20,134 / 29,470 ->
        31,404 tok/s, 8B F16 4,746 -> 4,823 / 7,793 -> 7,853); else one, for the most
        workgroups at once (a one-token step: 1B decode 809 -> 921 tok/s)."""
        if T * kv_heads < SHARED_HEADS_PER_SM * self._multiprocessors():
            return 1
        return ops.attention_heads(heads, kv_heads, self.model.config.head_dim,
                                   self.device.subgroup_size)

    def _matvec(self, w, group, variant):
        """(kernel, grid of n tokens, its norm_x16 or None) of weight w's matvec (its variant)
        for a token group: from mma_vec.least_tokens on a device that runs it, mma_vec
        (mma_vec.shape; columns a multiple of 8), whose norm a norm_x16 launch makes
        beforehand; else matmul.matvec, its rows a subgroup (matvec_rows), its subgroups a row
        (matvec_split). Chosen once a runner for each weight shape and variant (the layers'
        matmuls repeat them: a plan builds a runner for each of its candidates)."""
        key = ("matvec", w.dtype, w.shape, group, tuple(sorted(variant.items())))
        if key not in self._chosen:
            self._chosen[key] = self._choose_matvec(w, group, variant)
        return self._chosen[key]

    def _choose_matvec(self, w, group, variant):
        rows = w.shape[0]
        if group >= mma_vec.least_tokens(w.dtype) and self._runs_mma_vec(w):
            tt = max(1, group // mma_vec.TOKENS)
            shape = mma_vec.shape(w.dtype, *w.shape, self._multiprocessors(), tt)
            prep = None
            if variant["norm"]:
                variant, prep = dict(variant, norm=False, x16=True), mma_vec.norm_x16(w.dtype)
            kernel = mma_vec.mma_vec(w.dtype, **shape, **variant)
            return kernel, lambda n: mma_vec.grid(rows, n, shape["tiles"], shape["split"],
                                                  tt), prep
        sg = self.device.subgroup_size
        matrices = 2 if variant.get("swiglu") else 1
        rows_per = matvec_rows(w.dtype, group, matrices)
        split = matmul.matvec_split(w.dtype, *w.shape, sg, rows_per, self._multiprocessors(),
                                    matrices)
        kernel = matmul.matvec(w.dtype, sg, group, rows_per=rows_per, split=split, **variant)
        return kernel, lambda n: matmul.matvec_grid(rows, n, sg, group, rows_per, split), None

    def _norm_x16_words(self):
        """The words of the largest x a step's norm_x16 makes (0: none does): its matmul's
        tokens on the steps that do not run the tensor-core lowering, times cols / 2."""
        short = self.mma_min_tokens - 1 if self.mma else self.max_tokens
        return max((min(self._elements(op.x.shape[:1]), short) * op.weight.shape[1] // 2
                    for op in self.steps if op.kind == "matmul" for n in self._groups(op.weight)
                    if self._matvec(op.weight, n, op.variant)[2] is not None), default=0)

    def _groups(self, w):
        """The token groups of weight w's matvec kernels: TOKEN_GROUPS, and on mma_vec its
        launches of several token tiles (mma_vec.token_tiles)."""
        if not self._runs_mma_vec(w):
            return TOKEN_GROUPS
        key = ("groups", w.dtype, w.shape[1])     # asked per layer and plan candidate
        if key not in self._chosen:
            more = {self._group_of(w, n) for n in range(TOKEN_GROUPS[-1] + 1,
                                                         mma_vec.most_tokens(w.dtype) + 1)}
            self._chosen[key] = TOKEN_GROUPS + tuple(sorted(more - set(TOKEN_GROUPS)))
        return self._chosen[key]

    def _runs_mma_vec(self, w):
        """Whether weight w's matvecs of 8 tokens run on mma_vec."""
        return self._mma_vec_runs(w.dtype) and w.shape[1] % 8 == 0

    def _group_of(self, w, n):
        """The token group of n tokens' matvec of w: the smallest that holds them; past 8 on
        mma_vec, 8 tokens a token tile of its launch (mma_vec.token_tiles; further launches
        along grid y for more)."""
        group = next((g for g in TOKEN_GROUPS if g >= n), TOKEN_GROUPS[-1])
        if n <= group or not self._runs_mma_vec(w):
            return group
        return mma_vec.TOKENS * mma_vec.token_tiles(w.dtype, n)

    def _launch_matvec(self, w, n, variant, planes, x, rest, norm=None, normed=None):
        """The matvec of weight w (its variant) over n tokens: the smallest token group that
        holds them, further launches along grid y for more. Its arguments: the weight planes,
        x, (norm's gain,) `rest` (outputs, residual and the scalars but eps) (, eps), `norm`
        being (gain, eps) for a norm variant. A norm variant on mma_vec reads x from norm_x16,
        launched first unless `normed` says its buffer holds that x already. Returns what the
        buffer holds after: (x, gain, norm_x16 kernel) or `normed`."""
        kernel, grid, prep = self._matvec(w, self._group_of(w, n), variant)
        if prep is not None:
            gain, eps = norm
            x16 = self.buffers["norm_x16"]
            if normed != (x, gain, prep.name):
                normed = (x, gain, prep.name)
                self._launch(prep, (n,), x, gain, x16, w.shape[1], eps)
            args = (*planes, x16, *rest)
        elif norm is not None:
            args = (*planes, x, norm[0], *rest, norm[1])
        else:
            args = (*planes, x, *rest)
        self._launch(kernel, grid(n), *args)
        return normed

    def _normed_after(self, steps, i):
        """The matmul after steps[i] (an all_reduce with a residual) if it reads the reduced
        value through an RMSNorm on mma_vec, whose norm_x16 the reduction may make
        (reduce_norm_x16); else None."""
        op, after = steps[i], steps[i + 1] if i + 1 < len(steps) else None
        if after is None or after.kind != "matmul" or after.norm is None or \
                after.x.name != op.output.name or not op.attrs["residual"]:
            return None
        return after

    def _all_reduce(self, op, T, R, after=None, long=False):
        """The sum of the group's partials, plus the residual, into this rank's output; a
        generator that yields where the group must pass a barrier, returning what the norm_x16
        buffer holds after (as _launch_matvec). One phase: every rank sums the whole message
        from every rank's partials; where `after`, the matmul that follows, reads the sum
        through a norm on mma_vec, that one launch makes its norm_x16 too (reduce_norm_x16: a
        launch fewer, two for each layer of a tensor group); in a step on the tensor cores
        (`long`) where that matmul runs mma_tiled, it writes the tiled x16 instead and returns
        what mma_x16 holds (as _launch_tiled). Two phases (messages of
        two_phase_floats or more): each rank sums its own slice, then, after a barrier, copies
        the other slices from the ranks that summed them, reading each peer's partial once
        instead of whole."""
        n = int(np.prod(self._shape(op.output, T, R)))
        kernel = ops.all_reduce(op.attrs["world"], op.attrs["residual"])
        parts = [peer._buffer(op.inputs[0]) for peer in self.peers]
        rest = [self._buffer(t) for t in op.inputs[1:]] + [self._buffer(op.output)]
        yield op
        if n < self.two_phase_floats:
            rows, cols = self._shape(op.output, T, R)
            prep = None
            if after is not None and long:
                dtype = self._tiled_weight(after).dtype
                if self._mma_launch(self._tiled_weight(after), rows):
                    self._launch(mma_vec.reduce_norm_x16(tiled_x16_format(dtype), len(parts)),
                                 (rows,), *parts, *rest, self._buffer(after.norm),
                                 self.buffers["mma_x16"], cols, after.eps)
                    return (after.x.name, after.norm.name, matmul.mma_operand(dtype))
            elif after is not None:
                prep = self._matvec(after.weight, self._group_of(after.weight, rows),
                                    after.variant)[2]
            if prep is None:
                self._launch(kernel, (-(-n // (4 * ops.WG)),), *parts, *rest, 0, n)
                return None
            x, gain, x16 = rest[-1], self._buffer(after.norm), self.buffers["norm_x16"]
            self._launch(mma_vec.reduce_norm_x16(after.weight.dtype, len(parts)), (rows,),
                         *parts, *rest, gain, x16, cols, after.eps)
            return (x, gain, prep.name)
        slices = [(a * 4, b * 4) for a, b in placement.even(n // 4, len(self.peers))]
        start, stop = slices[self.peers.index(self)]
        self._launch(kernel, (-(-(stop - start) // (4 * ops.WG)),), *parts, *rest, start, stop)
        yield op
        for peer, (a, b) in zip(self.peers, slices):
            if peer is not self:
                self.device.copy(self.device.view(rest[-1], a * 4),
                                 self.device.view(peer._buffer(op.output), a * 4), (b - a) * 4)

    def _all_gather(self, op, T, R):
        """The group's slices of a value (each rank's logits of its rows of the output head),
        side by side into this rank's output; a generator that yields where the group must pass
        a barrier. Each slice stays in its rank's own buffer (_shared_buffers); only a rank that
        reads the whole (rank 0: the logits) copies the slices out of the others' memory, after
        the barrier. A rank rewrites its slice only at the next step's output head, after that
        step's first all_reduce barrier, which it passes only after rank 0 has done the work
        issued to it before, this copy among it: one buffer is enough."""
        yield op
        if op.output.name not in self._slot_of:
            return
        widths = [peer._shared[op.inputs[0].name][1].shape[-1] for peer in self.peers]
        starts = [int(s) for s in np.cumsum(widths)[:-1]]
        rows, columns = self._shape(op.output, T, R)
        self._launch(ops.all_gather(op.attrs["world"]), (-(-columns // ops.WG), rows),
                     *(peer._buffer(op.inputs[0]) for peer in self.peers),
                     self._buffer(op.output), columns, *starts)

    def _weight_planes(self, t):
        """The plane buffers of a device weight; for one part of a stacked weight (the
        tensor-core lowering reads q, k and v apart), views from the part's first row."""
        r = reader(t.dtype)
        if t.name in self._part_of:
            whole, row = self._part_of[t.name]
            return [self.device.view(self.buffers[f"{whole.name}:{p}"],
                                     row * r.row_words(p, t.shape[1]) * 4)
                    for p in r.plane_names]
        return [self.buffers[f"{t.name}:{p}"] for p in r.plane_names]

    def time_kernels(self):
        """Device timing from now on (--device-timing): every step launches kernel by kernel,
        each timed by the device, totals kept in kernel_times. Recordings are not used."""
        if not hasattr(self.device, "start_timing"):
            raise ValueError(f"{self.backend}: the device has no per-kernel timing")
        self.kernel_times = {}

    def _set_long(self, length):
        """Whether a step whose longest sequence holds `length` tokens splits its attention."""
        self.long = self.attention_splits > 1 and length > self.split_tokens
        return self.long

    # what StepRunner.run asks of the device
    def _can_capture(self):
        return hasattr(self.device, "capture")

    def _capture(self, issue):
        return self.device.capture(issue)

    def _synchronize(self):
        self.device.synchronize()

    def _replay(self, graph):
        self.device.replay(graph)

    def _has_candidates(self):
        return self.has_logits

    def _candidate_chunks(self):
        return -(-self.vocab_size // ops.TOP_CHUNK)

    def _candidates(self, R, temperature):
        """(values, ids [R, chunks, TOP_KEEP], maxima, sums [R, chunks]) of the last step's R
        rows of logits, from a launch of top_candidates after the step (sums at each row's
        temperature)."""
        chunks, B = self._candidate_chunks(), self.buffers
        self.device.write(B["top_temperature"], np.ascontiguousarray(temperature[:R], np.float32))
        self._launch(ops.top_candidates(self.device.subgroup_size), (R, chunks),
                     B[self._output_name()], B["top_temperature"], B["top_values"],
                     B["top_indices"], B["top_maxima"], B["top_sums"], self.vocab_size)
        out = []
        for name, dtype, width in (("top_values", np.float32, ops.TOP_KEEP),
                                   ("top_indices", np.int32, ops.TOP_KEEP),
                                   ("top_maxima", np.float32, 1), ("top_sums", np.float32, 1)):
            raw = self.device.read(B[name], R * chunks * width * 4)
            array = np.frombuffer(raw, dtype).reshape(R, chunks, width)
            out.append(array[..., 0] if width == 1 else array)
        return out

    def _read(self, name, nbytes, offset=0):
        """Bytes of a buffer of the runner that computes the logits."""
        if name in self._host:                  # staged: the step copied them out
            self.device.synchronize()
            return self._host[name][offset // 4:(offset + nbytes) // 4].tobytes()
        return self.device.read(self.buffers[name], nbytes, offset)

    def _output_name(self):
        return f"arena.{self._slot_of[self.graph.outputs['logits'].name]}"
