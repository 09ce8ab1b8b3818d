"""The device runner: a model's step graph lowered to kernel launches on one Device.

Every device buffer comes from one list of (name, bytes, kind) that `allocations()` reports
before anything is allocated: weights in their device layout (kernels/quant.py), the paged KV
cache, the step's inputs, the arena slots that carry activations between kernels (assigned once
by liveness for the largest step: lowering.assign_slots), and the logits; q, k and v weights that
one kernel reads together are one stacked weight there (lowering.lower). Constructing a runner
reads only the device's capabilities, so the memory plan (engine/plan.py) sizes candidates from
this same list; `allocate()` then allocates it and `upload()` fills it. A step uploads the
batch's small arrays (step_inputs.py: written, or staged through host memory) and issues each
lowered step by its kind's entry of STEPS (the kernels it
may launch, the method that launches them), with the kernels kernel_choice.py chooses. The
runner knows kernels and devices only through the Device interface (backends/__init__.py), so
the same lowering serves every backend; sampling is step_runner.py's.
"""
import copy
import math
from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..errors import ModelRefused
from ..formats.quants import slice_raw
from ..kernels import choice, matmul, mma_vec, ops, softcap
from ..kernels.quant import DEVICE_DTYPES, planes, reader
from .kernel_choice import (ARGMAX_CHUNKS, MAX_SPLITS, SPLIT_MIN_CONTEXT, SPLIT_TOKENS,
                            TWO_PHASE_FLOATS, KernelChoice, attention_mods, runs_mma,
                            sum_x16_formats, tiled_norm_x16, tiled_x16_format)
from .batch import TABLES
from .sampling import EXP2
from .kvcache import ring_tensors
from .lowering import (assign_slots, lower, next_matmul, normed_after, rope_before,
                       shared_buffers)
from . import expert_steps, placement
from .device_choice import EDITS_PER_ROW, DeviceChoice
from .step_inputs import StepInputs
from .step_runner import StepRunner


@dataclass(frozen=True)
class Allocation:
    name: str
    nbytes: int
    kind: str           # "weights" (and constants), "state" (the KV cache), "arenas" (per step)
    per_block: bool = True  # state: whether it grows with the KV blocks (a ring's does not)


class DeviceRunner(DeviceChoice, StepInputs, StepRunner):
    def __init__(self, model, device, num_blocks, block_size=16, max_tokens=256, max_seqs=16,
                 part=None, split_tokens=None, check=True, context=None, ring=None):
        """check=False: a runner only for its allocation list (a plan's candidate, of which the
        plan builds dozens), whose kernels are not checked against the device's capabilities:
        the runner of the chosen candidate does that. `context`: the longest sequence it serves
        (the model's unless less), which sizes its block tables and attention splits. `ring`
        (kvcache.Ring): its window layers' cache, of blocks of its own."""
        self.model, self.device, self.part = model, device, part
        self.base = None            # a lane's runner whose weights and KV cache it uses
        self.backend = device.backend
        self.block_size, self.num_blocks, self.ring = block_size, num_blocks, ring
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
        self.graph = model.step_graph(num_blocks, block_size, part,
                                      ring_blocks=ring.num_blocks if ring else 0)
        self._ringed = ring_tensors(self.graph)     # (state tensors that do not scale)
        self._table_inputs = [name for name in TABLES if name in self.graph.inputs]
        self.has_logits = "logits" in self.graph.outputs
        self.peers = [self]         # the runners of a tensor group, in rank order (group.py)
        self.two_phase_floats = TWO_PHASE_FLOATS
        self.long = False           # this step splits its attention (run() decides)
        self._step_rows = None      # the uploaded step's sequence rows (host), for attention
        self._one_position = False  # ... whether each sequence is at one position (batch.py)
        self._step_tiles = None     # ... and which of its tokens attention_tiles takes
        self._shared = shared_buffers(self.graph)
        # a device that runs every weight on the tensor cores stacks a gated unit's gate and
        # up, so that one mma_tiled reads both
        self.mma = runs_mma(self.graph, device.caps)
        self.steps, self.stacked = lower(self.graph, stack_glu=self.mma)
        self.choice = KernelChoice(device, model, self.steps, self.stacked, max_tokens,
                                   max_seqs, self.mma)
        self._uses, self._slot_of, self._slot_sizes = assign_slots(
            self.steps, self.graph.outputs.values(), self._shared, self.choice.elements)
        self._x16 = {"mma": None, "norm": None}     # what mma_x16 and norm_x16 hold (launches)
        if check:
            self._check_supported()
        self.buffers, self.graphs, self._launched = {}, {}, deque()
        # staged: each side's host_array memory (a second from the first step fed: a step
        # launched ahead writes the side the step in flight does not read); _host: in use
        self._sides, self._side = [], 0
        self._host = {}             # staged: step input or output -> its host_array int32s
        self._tables_written = {}   # staged: table -> per row, the columns it may hold
        self._idle = True           # the device has done every launch (waited for since)
        self._fed = False           # the uploaded step takes tokens of the last (feed_tokens)
        self._reading = None        # fed steps: the side of the step collect() reads back
        self._edited = False        # the uploaded step has logit edits on the device
        self._host_edits = []       # ... and rows whose edits did not fit, edited on the host
        self.kernel_times = None      # kernel name -> [launches, seconds] under device timing

    def lane(self):
        """A runner of the same step on this one's weights and KV cache, with step inputs and
        arenas of its own, so that its steps may run while this one's do (a pipeline's lane,
        engine/group.py)."""
        other = copy.copy(self)
        other.base = self
        other.buffers, other.graphs, other._host = {}, {}, {}
        other._sides, other._launched = [], deque()
        other.kernel_times = None
        return other

    def _check_supported(self):
        for t in self.graph.weights.values():
            if len(t.shape) >= 2 and t.dtype not in DEVICE_DTYPES:
                raise ModelRefused(f"{self.backend}: {self.device.name}: weight {t.name} is "
                                   f"{t.dtype}; the device kernels read "
                                   f"{', '.join(DEVICE_DTYPES)}")
        for kernel in self._kernels():
            kernel.require(self.device.caps, "the device", f"{self.backend}: {self.device.name}: ")

    def _kernels(self):
        """Every kernel the runner may launch (its programs, built once): each step's by its
        kind's entry of STEPS, for short steps and (on the tensor cores) long ones, and the
        logits' edits, greedy choice, draw and candidates."""
        sg = self.device.subgroup_size
        seen = {}
        for long, steps in ((False, self.steps), (True, self.steps if self.mma else ())):
            for i, step in enumerate(steps):
                if step.kind not in STEPS:
                    raise ModelRefused(f"{self.backend}: {self.device.name}: op {step.kind} "
                                       "has no kernel")
                for kernel in STEPS[step.kind].kernels(self, steps, i, long):
                    seen.setdefault(kernel.name, kernel)
        if self.has_logits:
            seen.setdefault("logit_edits", choice.logit_edits())
            seen.setdefault("argmax_chunks", choice.argmax_chunks(sg))
            seen.setdefault("argmax", choice.argmax(sg))
            seen.setdefault("top_candidates", choice.top_candidates(sg))
            seen.setdefault("draw", choice.draw(sg))
        if self.feeds:
            seen.setdefault("feed_tokens", choice.feed_tokens())
        return list(seen.values())

    # -- the plan ------------------------------------------------------------------------------
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
        rows = math.prod(t.shape[:-1])        # a stack of matrices: their rows one after another
        return {p: rows * r.row_words(p, t.shape[-1]) for p in r.plane_names}

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

    def allocations(self):
        """Every device buffer the runner will hold, in allocation order (a lane's: only the
        arenas, its base holds the rest)."""
        if self.base is not None:
            return [a for a in self._allocations() if a.kind == "arenas"]
        return self._allocations()

    def _allocations(self):
        out = []
        for t in self._device_weights():
            if len(t.shape) >= 2:
                for plane, words in self._planes_of(t).items():
                    out.append(Allocation(f"{t.name}:{plane}", words * 4, "weights"))
            else:
                out.append(Allocation(t.name, self.choice.elements(t.shape) * 4, "weights"))
        for name, (t, array) in self.graph.consts.items():
            out.append(Allocation(name, array.nbytes, "weights"))
        if self.has_logits:                 # the draw's table of weights (sampling.EXP2)
            out.append(Allocation("exp2", EXP2.nbytes, "weights"))
        for name, t in self.graph.state.items():      # f16 keys / values
            out.append(Allocation(name, math.prod(t.shape) * 2, "state",
                                  per_block=name not in self._ringed))
        inputs = self._inputs_layout()
        step = [("inputs", sum(inputs.values()))] if self._packed() else list(inputs.items())
        if self.has_logits:
            step += [("argmax", self.max_seqs), ("argmax_values", self.max_seqs * ARGMAX_CHUNKS),
                     ("argmax_indices", self.max_seqs * ARGMAX_CHUNKS)]
            chunks = self.max_seqs * self._candidate_chunks()
            step += [("top_temperature", self.max_seqs), ("top_values", chunks * choice.TOP_KEEP),
                     ("top_indices", chunks * choice.TOP_KEEP), ("top_maxima", chunks),
                     ("top_sums", chunks)]
            edits = self.max_seqs * EDITS_PER_ROW
            step += [("edit_starts", self.max_seqs + 1), ("edit_tokens", edits),
                     ("edit_repeat", edits), ("edit_add", edits),
                     ("edit_mask_of", self.max_seqs),
                     ("edit_masks", self.max_seqs * self._mask_words())]
        if "hidden" in self.graph.inputs:   # a pipeline stage's input, copied from the last
            step.append(("hidden", self.max_tokens * self.model.config.d_model))
        shared = {}
        for name, x in self._shared.values():
            shared[name] = max(shared.get(name, 0), self.choice.elements(x.shape))
        step += list(shared.items()) + expert_steps.buffers(self)
        out += [Allocation(name, words * 4, "arenas") for name, words in step]
        out += [Allocation(f"arena.{i}", size, "arenas") for i, size in enumerate(self._slot_sizes)]
        if self.attention_splits > 1:       # (o [head_dim], m, l) of each token, head and split
            heads = next(op.inputs[0].shape[1] for op in self.steps if op.kind == "attention")
            words = (self._split_rows() * heads * self.attention_splits
                     * (self.model.config.head_dim + 2))
            out.append(Allocation("attention_partials", words * 4, "arenas"))
        out += [Allocation(name, words * 4, "arenas")
                for name, words in self.choice.tile_arenas(self.steps).items() if words]
        return out

    # -- allocation and upload -----------------------------------------------------------------
    def allocate(self):
        """Allocates every buffer of allocations(), and nothing else: what the device holds
        afterwards is what the plan counted (engine/plan.py checks it)."""
        if self.base is not None:
            self.buffers.update((a.name, self.base.buffers[a.name]) for a in
                                self._allocations() if a.kind != "arenas")
        for a in self.allocations():
            self.buffers[a.name] = self.device.alloc(a.nbytes)
        self._allocate_inputs()

    def upload(self):
        """Writes weights and constants into their buffers and builds every kernel's program
        (a lane: only the programs, its base wrote the weights)."""
        dev = self.device
        if self.base is not None:
            self.programs = {k.name: dev.program(k) for k in self._kernels()}
            return
        for t in self._device_weights():
            if len(t.shape) >= 2:
                for plane, words in self._file_planes(t).items():
                    dev.write(self.buffers[f"{t.name}:{plane}"], words)
            else:
                array = self.graph.read(t.name, self.model.weight_array)
                dev.write(self.buffers[t.name], np.ascontiguousarray(array, np.float32))
        for name, (t, array) in self.graph.consts.items():
            dev.write(self.buffers[name], array)
        if self.has_logits:
            dev.write(self.buffers["exp2"], EXP2)
        self.programs = {k.name: dev.program(k) for k in self._kernels()}
        dev.synchronize()

    def _file_planes(self, t):
        """The device planes of a weight from the file's bytes (a tensor group's shard of
        them, or a fused tensor's part: graph.file_slice); a stacked weight's are its parts'
        planes, row after row."""
        _, parts = self.stacked.get(t.name, (t, (t,)))
        each = []
        for p in parts:
            part = self.graph.file_slice(p.name)
            raw = self.model.weight_raw(part.tensor)
            if part.rows is not None or part.cols is not None:
                shape = self.model.weight_shapes()[part.tensor][0]
                raw = slice_raw(p.dtype, raw, shape, part.rows, part.cols)
            each.append(planes(p.dtype, raw, (math.prod(p.shape[:-1]), p.shape[-1])))
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
        self._one_position = batch.one_position_each()
        self._upload_edits(batch.sampling)
        self._upload_inputs(batch)

    def _issue(self, T, R, choose=True):
        """Issues every launch of a step of T tokens and R sampled rows, in graph order."""
        for _ in self.launches(T, R, choose):
            pass

    def launches(self, T, R, choose=True):
        """Issues the step's launches in graph order, each step by its kind's entry of STEPS,
        as a generator: it stops before each all_reduce and all_gather (yielding the step), so
        a tensor group can put its barrier between the ranks' partial sums or slices and their
        reduction or gathering (group.py)."""
        self._stage_inputs(T)
        if self._fed:
            B = self.buffers
            self._launch(choice.feed_tokens(), (1,), B["argmax"], B["feed"], B["tokens"], T)
        long = self.mma and T >= self.choice.mma_min_tokens
        self._x16 = {"mma": None, "norm": None}
        for i, op in enumerate(self.steps):
            if R == 0 and "R" in op.outputs[0].shape:
                continue        # a step that samples no row (a prompt's chunk before its last)
            if op.kind not in ("matmul", "reshape"):
                self._x16 = {"mma": None, "norm": None}     # an op writes: x16s are stale
            issued = STEPS[op.kind].issue(self, op, T, R, i, long)
            if issued is not None:
                yield from issued
        if choose:
            self._edit(R)
            self._greedy(R)

    # -- each kind of step: STEPS's issue methods (op, T, R, its index, long) ------------------
    def _embedding(self, op, T, R, i, long):
        table, ids = op.inputs
        self._launch(ops.embedding(table.dtype, "scale" in op.attrs), (T,),
                     *self._weight_planes(table), self._buffer(ids), self._buffer(op.output),
                     table.shape[1], *([op.attrs["scale"]] if "scale" in op.attrs else []))

    def _softcap(self, op, T, R, i, long):
        n = int(np.prod(self._shape(op.output, T, R)))
        self._launch(softcap.softcap(op.attrs["cap"]), (-(-n // ops.WG),),
                     self._buffer(op.inputs[0]), self._buffer(op.output), n)

    def _scale(self, op, T, R, i, long):
        n = int(np.prod(self._shape(op.output, T, R)))
        self._launch(ops.scale(), (-(-n // ops.WG),), self._buffer(op.inputs[0]),
                     self._buffer(op.output), n, op.attrs["scale"])

    def _rms_norm(self, op, T, R, i, long):
        shape = self._shape(op.inputs[0], T, R)
        B = self._buffer
        self._launch(rms_norm_kernel(self, op), (int(np.prod(shape[:-1])),),
                     *map(B, op.inputs), B(op.output), shape[-1], op.attrs["eps"])

    def _matmul(self, op, T, R, i, long):
        """On the tensor cores in a long step where the weight runs there (_launch_tiled),
        else the matvec (a router's making its experts' x16 where their launch chooses the
        routes: expert_steps.router)."""
        n = self._shape(op.x, T, R)[0]
        if long and self.choice.mma_launch(self.choice.tiled_weight(op), n):
            self._x16["mma"] = self._launch_tiled(op, T, R, self._x16["mma"],
                                                  next_matmul(self.steps, i))
            return
        dtype = None if long else expert_steps.router_normed_out(self, self.steps, i, T)
        if dtype is not None:
            expert_steps.router(self, op, n, dtype)
            return
        B, w = self._buffer, op.weight
        rows, cols = w.shape
        planes_ = self._weight_planes(w) + (self._weight_planes(op.up) if op.up else [])
        norm = None if op.norm is None else (B(op.norm), op.eps)
        residual = [] if op.residual is None else [B(op.residual)]
        parts = self.stacked.get(w.name, (w, (w,)))[1]
        splits = [int(s) for s in np.cumsum([p.shape[0] for p in parts])[:-1]]
        self._x16["norm"] = self._launch_matvec(
            w, n, op.variant, planes_, B(op.x),
            (*map(B, op.outputs), *residual, rows, cols, n, *splits), norm, self._x16["norm"])

    def _elementwise(self, op, T, R, i, long):
        """add (its second input broadcast over the first) and glu."""
        B = self._buffer
        n = int(np.prod(self._shape(op.output, T, R)))
        nb = int(np.prod(self._shape(op.inputs[1], T, R)))
        self._launch(ops.elementwise(op.kind, op.attrs.get("activation")), (-(-n // ops.WG),),
                     B(op.inputs[0]), B(op.inputs[1]), B(op.output), n, nb)

    def _rope(self, op, T, R, i, long):
        B = self._buffer
        x, positions, inv_freq = op.inputs
        if self._uses[x.name] != 1 or B(x) != B(op.output):
            raise RuntimeError("rope runs in place on a value used only by it")
        _, heads, hd = x.shape
        pairs = inv_freq.shape[0]
        self._launch(ops.rope(op.attrs["style"], op.attrs["scale"]),
                     (-(-T * heads * pairs // ops.WG),),
                     B(x), B(positions), B(inv_freq), T, heads, hd, pairs)

    def _store_kv(self, op, T, R, i, long):
        B = self._buffer
        k, v, kc, vc, positions, seq_rows, tables_t = op.inputs
        words = kc.shape[2] * self.model.config.head_dim // 2
        self._launch(ops.store_kv(), (-(-T * words // ops.WG),), B(k), B(v), B(kc), B(vc),
                     B(positions), B(seq_rows), B(tables_t), T, words, self.table_width,
                     self.block_size)

    def _rope_store_kv(self, op, T, R, i, long):
        """One thread a word of two dims; with the heads' norms, one subgroup a head; none
        where the attention after it does its work (_folds_rope)."""
        B = self._buffer
        q, k, v, kc, vc, positions, seq_rows, tables_t, inv_freq = op.inputs[:9]
        if self._uses[q.name] != 1 or B(q) != B(op.output):
            raise RuntimeError("rope_store_kv rotates q in place: q is used only by it")
        if i + 1 < len(self.steps) and self._folds_rope(i + 1, T, R):
            return
        _, heads, hd = q.shape
        kv_heads = k.shape[1]
        kernel = rope_store_kv_kernel(self, op)
        if "eps" in op.attrs:
            grid = -(-T * (heads + kv_heads) // (ops.WG // self.device.subgroup_size))
            norms, eps = [B(w) for w in op.inputs[9:]], [op.attrs["eps"]]
        else:
            grid, norms, eps = -(-T * (heads + kv_heads) * hd // 2 // ops.WG), [], []
        self._launch(kernel, (grid,), B(q), B(k), B(v), B(kc), B(vc), B(positions),
                     B(seq_rows), B(tables_t), B(inv_freq), *norms, T, heads, kv_heads, hd,
                     inv_freq.shape[0], self.table_width, self.block_size, *eps)

    def _attention(self, op, T, R, i, long):
        """Split along the context for a long decode (_splits_attention); in a step with
        prompt tokens, the tiles of one sequence's tokens on the tensor cores and the other
        tokens (if any) one by one; else one workgroup a token and head (or heads sharing a
        KV head), or a token and KV head on the tensor cores (choice.attention_decode)."""
        B, sg, head_dim = self._buffer, self.device.subgroup_size, self.model.config.head_dim
        q, kc, vc, positions, seq_rows, tables_t = op.inputs
        out = op.output
        heads, kv_heads = q.shape[1], kc.shape[2]
        cache = (B(kc), B(vc), B(positions), B(seq_rows), B(tables_t), heads,
                 kv_heads, self.table_width, self.block_size, op.attrs["scale"])
        shared, mods = self.choice.attention_heads(T, heads, kv_heads), attention_mods(op)
        rounds = self.choice.attention_rounds(T, kv_heads)
        tiles = self.choice.attention_tiles(heads, kv_heads, **mods)
        if self._splits_attention(T):
            splits, partials = self.attention_splits, self.buffers["attention_partials"]
            self._launch(ops.attention_split(sg, head_dim, shared, **mods),
                         (T * heads // shared, splits),
                         B(q), partials, *cache, self.split_tokens)
            self._launch(ops.attention_combine(head_dim), (T * heads,), partials, B(out), splits)
        elif T > R and tiles and any(taken := self._tiled_tokens(T)):
            self._launch(tiles, self.choice.attention_tiles_grid(T, heads, kv_heads),
                         B(q), B(out), *cache, T)
            if not all(taken):
                decode = self.choice.attention_decode(T, heads, kv_heads, True, **mods)
                self._launch(decode or ops.attention(sg, head_dim, shared, untiled=True, **mods),
                             (T * (kv_heads if decode else heads // shared),), B(q), B(out),
                             *cache, T)
        elif rope := self._folds_rope(i, T, R):
            q, k, v, inv_freq, *norms = (rope.inputs[j] for j in (0, 1, 2, 8, 9, 10)
                                         if j < len(rope.inputs))
            self._launch(ops.attention(sg, head_dim, shared, rope=rope_of(rope), rounds=rounds,
                                       **mods),
                         (T * heads // shared,), B(q), B(out), *cache, B(k), B(v), B(inv_freq),
                         *map(B, norms), inv_freq.shape[0],
                         *([rope.attrs["eps"]] if norms else []))
        else:
            decode = self.choice.attention_decode(T, heads, kv_heads, **mods)
            self._launch(decode or ops.attention(sg, head_dim, shared, rounds=rounds, **mods),
                         (T * (kv_heads if decode else heads // shared),), B(q), B(out), *cache)

    def _folds_rope(self, i, T, R):
        """The rope_store_kv step before attention step i that the attention does itself
        (ops.attention's rope), or None: in a step of sampled tokens whose every sequence is at
        one position (StepBatch.one_position_each), where the one-pass kernel runs (not the
        split, nor the tensor cores' decode kernel)."""
        rope = rope_before(self.steps, i)
        if rope is None or T != R or not self._one_position or self._splits_attention(T):
            return None
        op = self.steps[i]
        decode = self.choice.attention_decode(T, op.inputs[0].shape[1], op.inputs[1].shape[2],
                                              **attention_mods(op))
        return None if decode else rope

    def _gather(self, op, T, R, i, long):
        """The sampled rows' hidden states (indices count from the step's first token)."""
        x, index = op.inputs
        self._launch(ops.gather_rows(), (R,), self._buffer(x), self._buffer(index),
                     self._buffer(op.output), x.shape[-1])

    def _reshape(self, op, T, R, i, long):
        """Nothing to launch: the output shares its input's slot."""

    def _reduce(self, op, T, R, i, long):
        """A tensor group's all_reduce (_all_reduce); what it leaves in an x16 buffer is the
        next matmul's."""
        held = yield from self._all_reduce(op, T, R, normed_after(self.steps, i), long)
        self._x16["mma" if long else "norm"] = held

    def _gather_slices(self, op, T, R, i, long):
        return self._all_gather(op, T, R)

    def _launch_tiled(self, op, T, R, rounded, after=None):
        """A matmul step on the tensor cores (mma_tiled): x rounded to the operand beforehand
        where the pipeline reads x16 (mma_x16; tiled_norm_x16 where the step's norm is folded
        in), unless `rounded` says the buffer holds it already; then the tile launch, and where
        it is split or a SwiGLU, the split_sum, which also makes the x16 of `after` (the
        matmul step next) where _makes_x16 says so. Returns what the x16 buffer holds after."""
        B = self._buffer
        w, variant = self.choice.tiled_weight(op), self.choice.tiled_variant(op)
        rows, cols = w.shape
        n = self._shape(op.x, T, R)[0]
        launch = self.choice.mma_launch(w, n)
        x = B(op.x)
        if variant.get("x16"):
            x = self.buffers["mma_x16"]
            held = (op.x.name, None if op.norm is None else op.norm.name,
                    matmul.mma_operand(w.dtype))
            if rounded == (*held, "mma_units_x16"):     # the gated unit's tiles stored it
                x = self.buffers["mma_units_x16"]
            elif rounded != held:
                rounded = held
                if op.norm is None:
                    self._launch(matmul.mma_x16(w.dtype), (-(-n * cols // (4 * ops.WG)),),
                                 B(op.x), x, n * cols)
                else:
                    self._launch(tiled_norm_x16(w.dtype), (n,), B(op.x), B(op.norm), x, cols,
                                 op.eps)
        planes = self._weight_planes(w)
        if self.choice.dequantizes(op, n):
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
        kernels = self.choice.mma_kernels(op, launch, after, n)
        grid = launch.grid(rows, n)
        if self.choice.stores_unit(op, launch, n):       # 64 units of gate's and up's a tile
            unit = self.choice.unit_x16(op, after)
            out = outs[0] if unit is None else self.buffers["mma_units_x16"]
            self._launch(kernels[0], launch.unit_grid(rows, n), *planes, x, out, rows, cols, n)
            return rounded if unit is None else (after.x.name, None,
                                                 matmul.mma_operand(unit), "mma_units_x16")
        if len(kernels) == 1:
            self._launch(kernels[0], grid, *planes, x, *outs, *residual, rows, cols, n, *starts)
            return rounded
        tile, add = kernels
        partials = self.buffers["mma_partials"]
        self._launch(tile, grid, *planes, x, partials, rows, cols, n, launch.split_cols)
        if self.choice.makes_x16(op, after, launch) is not None:
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
                    matmul.mma_operand(self.choice.tiled_weight(after).dtype))
        if op.up is not None:
            half = rows // 2
            self._launch(add, (-(-n * half // matmul.WORKGROUP),), partials, *outs,
                         n * half, launch.splits, half)
        else:
            self._launch(add, (-(-n * rows // matmul.WORKGROUP),), partials, *outs, *residual,
                         n * rows, launch.splits, *([rows, *starts] if starts else []))
        return rounded

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

    def _launch_matvec(self, w, n, variant, planes, x, rest, norm=None, normed=None):
        """The matvec of weight w (its variant) over n tokens: the smallest token group that
        holds them, further launches along grid y for more. Its arguments: the weight planes,
        x, (norm's gain,) `rest` (outputs, residual and the scalars but eps) (, eps), `norm`
        being (gain, eps) for a norm variant. A norm variant on mma_vec reads x from norm_x16,
        launched first unless `normed` says its buffer holds that x already. Returns what the
        buffer holds after: (x, gain, norm_x16 kernel) or `normed`."""
        kernel, grid, prep = self.choice.matvec(w, self.choice.group_of(w, n), variant)
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

    def _sum_x16(self, after, rows, long):
        """Where a sum's launch (all_reduce, expert_sum) makes the x16 of `after`, the matmul
        next that reads the sum through a norm (normed_after): (the weight format whose x16
        it makes, the buffer, what _x16 then holds), else None. In a long step where `after`
        runs mma_tiled, mma_x16's words; in a short one where its matvec is mma_vec's,
        norm_x16's."""
        if after is None:
            return None
        if long:
            w = self.choice.tiled_weight(after)
            if not self.choice.mma_launch(w, rows):
                return None
            return (tiled_x16_format(w.dtype), self.buffers["mma_x16"],
                    (after.x.name, after.norm.name, matmul.mma_operand(w.dtype)))
        prep = self.choice.matvec(after.weight, self.choice.group_of(after.weight, rows),
                                  after.variant)[2]
        if prep is None:
            return None
        return (after.weight.dtype, self.buffers["norm_x16"],
                (self._buffer(after.x), self._buffer(after.norm), prep.name))

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
            made = self._sum_x16(after, rows, long)
            if made is None:
                self._launch(kernel, (-(-n // (4 * ops.WG)),), *parts, *rest, 0, n)
                return None
            dtype, x16, held = made
            self._launch(mma_vec.reduce_norm_x16(dtype, len(parts)), (rows,), *parts, *rest,
                         self._buffer(after.norm), x16, cols, after.eps)
            return held
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
        if t.name in self.choice.part_of:
            whole, row = self.choice.part_of[t.name]
            return [self.device.view(self.buffers[f"{whole.name}:{p}"],
                                     row * r.row_words(p, t.shape[1]) * 4)
                    for p in r.plane_names]
        return [self.buffers[f"{t.name}:{p}"] for p in r.plane_names]

    def time_kernels(self):
        """Device timing from now on (--device-timing): every step launches kernel by kernel,
        each timed by the device, totals kept in kernel_times. Recordings are not used."""
        if "timing" not in self.device.features:
            raise ValueError(f"{self.backend}: the device has no per-kernel timing")
        self.kernel_times = {}

    def _set_long(self, length):
        """Whether a step whose longest sequence holds `length` tokens splits its attention."""
        self.long = self.attention_splits > 1 and length > self.split_tokens
        return self.long

    # what StepRunner.run asks of the device
    def _can_capture(self):
        return "capture" in self.device.features

    def _capture(self, issue):
        return self.device.capture(issue)

    def _replay(self, graph):
        self.device.replay(graph)

    def _output_name(self):
        return f"arena.{self._slot_of[self.graph.outputs['logits'].name]}"

    def _hidden_name(self):
        """The buffer of the step's "last_hidden" rows (what embeddings are made of)."""
        return f"arena.{self._slot_of[self.graph.outputs['last_hidden'].name]}"

    @property
    def hidden_size(self):
        return self.graph.outputs["last_hidden"].shape[-1]


@dataclass(frozen=True)
class StepKind:
    """How the runner runs one kind of lowered step: every kernel it may launch (the programs
    built once, and what the capability check reads), and the method that issues it."""
    kernels: Callable       # (runner, steps, i, long) -> [Kernel] of steps[i]
    issue: Callable         # DeviceRunner method (op, T, R, i, long); collectives: a generator


def _reduce_kernels(runner, steps, i, long):
    """all_reduce, and the reduce_norm_x16 that makes the next matmul's x16 where it reads the
    sum through a norm (DeviceRunner._all_reduce)."""
    op = steps[i]
    world = op.attrs["world"]
    return [ops.all_reduce(world, op.attrs["residual"])] + [
        mma_vec.reduce_norm_x16(dtype, world)
        for dtype in sum_x16_formats(runner.choice, steps, i, long)]


def rms_norm_kernel(runner, op):
    """An rms_norm step's kernel: with a residual add where the lowering folded one in."""
    return ops.rms_norm(runner.device.subgroup_size, op.attrs.get("residual", False))


def rope_store_kv_kernel(runner, op):
    """A rope_store_kv step's kernel: with the heads' norms folded in where it has them."""
    style, scale = op.attrs["style"], op.attrs["scale"]
    if "eps" in op.attrs:
        return ops.norm_rope_store_kv(style, runner.device.subgroup_size, scale)
    return ops.rope_store_kv(style, scale)


def rope_of(op):
    """ops.attention's `rope` of a rope_store_kv step: (style, scale, whether it norms)."""
    return op.attrs["style"], op.attrs["scale"], "eps" in op.attrs


def _attention_kernels(runner, steps, i, long):
    """Every kernel an attention step may launch (KernelChoice.attention_kernels), with the
    one-pass kernels that fold in the rope_store_kv before it where there is one."""
    op, rope = steps[i], rope_before(steps, i)
    return runner.choice.attention_kernels(op, runner.attention_splits > 1,
                                           None if rope is None else rope_of(rope))


def _one(make):
    """The kernels entry of a step kind that launches one kernel, made from the step."""
    return lambda runner, steps, i, long: [make(runner, steps[i])]


STEPS = {
    "embedding": StepKind(_one(lambda r, op: ops.embedding(op.inputs[0].dtype,
                                                           "scale" in op.attrs)),
                          DeviceRunner._embedding),
    "softcap": StepKind(_one(lambda r, op: softcap.softcap(op.attrs["cap"])),
                        DeviceRunner._softcap),
    "rms_norm": StepKind(_one(rms_norm_kernel), DeviceRunner._rms_norm),
    "matmul": StepKind(lambda r, steps, i, long: r.choice.matmul_kernels(
        steps[i], long, next_matmul(steps, i)) + expert_steps.router_kernels(r, steps, i, long),
        DeviceRunner._matmul),
    "add": StepKind(_one(lambda r, op: ops.elementwise("add")), DeviceRunner._elementwise),
    "scale": StepKind(_one(lambda r, op: ops.scale()), DeviceRunner._scale),
    "glu": StepKind(_one(lambda r, op: ops.elementwise("glu", op.attrs["activation"])),
                    DeviceRunner._elementwise),
    "rope": StepKind(_one(lambda r, op: ops.rope(op.attrs["style"], op.attrs["scale"])),
                     DeviceRunner._rope),
    "store_kv": StepKind(_one(lambda r, op: ops.store_kv()), DeviceRunner._store_kv),
    "rope_store_kv": StepKind(_one(rope_store_kv_kernel), DeviceRunner._rope_store_kv),
    "attention": StepKind(_attention_kernels, DeviceRunner._attention),
    "gather": StepKind(_one(lambda r, op: ops.gather_rows()), DeviceRunner._gather),
    "all_reduce": StepKind(_reduce_kernels, DeviceRunner._reduce),
    "all_gather": StepKind(_one(lambda r, op: ops.all_gather(op.attrs["world"])),
                           DeviceRunner._gather_slices),
    "reshape": StepKind(lambda r, steps, i, long: [], DeviceRunner._reshape),
    "route": StepKind(expert_steps.route_kernels, expert_steps.route),
    "expert_matmul": StepKind(expert_steps.matvec_kernels, expert_steps.matvec),
    "expert_sum": StepKind(expert_steps.sum_kernels, expert_steps.expert_sum),
}
