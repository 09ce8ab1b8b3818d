"""The memory plan: the serving shape a device can hold, chosen before anything is allocated.

A Candidate is a serving shape: sequences decoded at once, tokens of context each, the prefill
chunk (the most tokens one engine step runs), and the KV blocks the sequences share. Its
Footprint is the device runner's own allocation list (DeviceRunner.allocations(), which a runner
reports before touching device memory), each buffer rounded by the device's allocation rule
(Device.allocation_bytes): weights counted once, the arenas every step reuses, and the state
(the paged KV cache). `plan` takes the largest shape that fits the free memory (and whose every
buffer fits the device's limit for one buffer): the longest context, then the most sequences,
then the larger chunk; its KV cache takes the memory left, up to a full context for every
sequence and at least one full context. Sequences take blocks as they grow, so 64 sequences of a
128k-token context share what memory there is rather than each reserving 128k; when the blocks
run out the scheduler preempts the latest arrival. A model's sliding-window layers keep a ring a
sequence instead (kvcache.Ring: the window and a chunk), so the blocks counted are the global
layers' and the rings a fixed part of the state: a Gemma's context costs its global layers only.
The chosen candidate's runner allocates exactly the list that was counted, and `verify` then
compares the device's own accounting with the plan.

A device group (engine/group.py) is planned the same way per device: a candidate's footprint on
each device is that device's own runner's list (its weights, arenas and share of the KV cache),
and a candidate fits only if it fits on every device (`plan_group`, GroupPlan); the
post-allocation check runs on each device.

Not here: where the free memory comes from (serve/cli.py reads the driver's figure, capped by
--memory-limit), and the reference backend, which plans nothing against host memory.
"""
import gc
from contextlib import contextmanager
from dataclasses import dataclass

from ..errors import CapacityError, ModelRefused, PlanMismatch
from .device_runner import DeviceRunner
from .kvcache import ring_for

BLOCK_SIZE = 16                         # tokens per KV block
MAX_SEQS = (1, 2, 4, 8, 16, 32, 64)     # sequences at once, unless --max-seqs pins one
MIN_CONTEXT = 512                       # the shortest context offered (the model's if shorter)
STEP_TOKENS = (128, 512, 2048)          # prefill chunks (at least max_seqs: a decode step)
KINDS = ("weights", "arenas", "state")


@dataclass(frozen=True)
class Candidate:
    max_seqs: int
    context: int
    step_tokens: int
    kv_blocks: int = 0          # 0: a full context for every sequence
    rings: bool = False         # the model's window layers keep a ring a sequence (ring_of)

    def __post_init__(self):
        if not self.kv_blocks:
            object.__setattr__(self, "kv_blocks", self.full_blocks)

    @property
    def full_blocks(self):
        """KV blocks for every sequence holding a full context at once (more would idle)."""
        return self.max_seqs * blocks_for(self.context)

    @property
    def least_blocks(self):
        """The fewest KV blocks it serves with: one full context, and a block a sequence."""
        return max(blocks_for(self.context), self.max_seqs)

    def sharing(self, kv_blocks):
        return Candidate(self.max_seqs, self.context, self.step_tokens, kv_blocks, self.rings)

    @property
    def rank(self):
        """Shapes are ordered by their context (a request longer than the context cannot be
        served at all), then by sequences at once (more waiting their turn otherwise), then by
        the prefill chunk; the KV blocks are the memory left, not a preference."""
        return (self.context, self.max_seqs, self.step_tokens)

    def __str__(self):
        shared = "" if self.kv_blocks == self.full_blocks else \
            f", sharing {self.kv_blocks * BLOCK_SIZE} tokens of KV cache"
        rings = ", window layers in rings" if self.rings else ""
        return (f"{self.max_seqs} sequence{'s' if self.max_seqs > 1 else ''} x {self.context} "
                f"tokens, prefill chunk {self.step_tokens}{shared}{rings}")


def blocks_for(tokens):
    return -(-tokens // BLOCK_SIZE)


@dataclass(frozen=True)
class Footprint:
    weights: int
    arenas: int
    state: int
    total: int
    largest: int = 0            # the largest single buffer, in bytes
    largest_name: str = ""


@dataclass(frozen=True)
class Plan:
    """Every candidate's footprint against the free memory, and the one chosen (None: none
    fits, or the free memory is unknown)."""
    device: str
    free: object                # bytes, or None when the driver reports no budget
    source: str                 # where `free` comes from
    max_buffer: object          # the device's limit for one buffer in bytes, or None
    table: tuple                # ((Candidate, Footprint), ...), smallest rank first
    chosen: object              # index into table, or None

    @property
    def candidate(self):
        return self.table[self.chosen][0]

    @property
    def footprint(self):
        return self.table[self.chosen][1]

    def require(self):
        """The plan itself, or the CapacityError that shows the smallest footprint beside the
        free memory."""
        if self.chosen is not None:
            return self
        candidate, need = min(self.table, key=lambda row: row[1].total)
        if fits(need, self.free, None):     # it fits, but one of its buffers is too large
            raise ModelRefused(
                f"{self.device}: no serving shape fits: even the smallest, {candidate}, has a "
                f"buffer of {need.largest} bytes ({need.largest_name}), over the device's limit "
                f"for one buffer ({self.max_buffer} bytes)")
        free = "an unknown amount" if self.free is None else size(self.free)
        raise CapacityError(
            f"{self.device}: no serving shape fits: the smallest, {candidate}, needs "
            f"{size(need.total)} (weights {size(need.weights)}, arenas {size(need.arenas)}, "
            f"state {size(need.state)}); {free} free ({self.source})")

    def describe(self):
        """The chosen plan as /health shows it."""
        c, f = self.candidate, self.footprint
        return {"max_seqs": c.max_seqs, "context": c.context, "step_tokens": c.step_tokens,
                "kv_blocks": c.kv_blocks, "kv_block_size": BLOCK_SIZE, "window_rings": c.rings,
                "footprint": {"weights": f.weights, "arenas": f.arenas, "state": f.state,
                              "total": f.total},
                "memory_free": self.free, "memory_source": self.source}

    def lines(self):
        """Every candidate as a table row, the chosen one marked."""
        out = [f"{'seqs':>5} {'context':>8} {'chunk':>6} {'KV tokens':>10} {'weights':>12} "
               f"{'arenas':>12} {'state':>12} {'total':>12}"]
        for i, (c, f) in enumerate(self.table):
            over = self.free is not None and f.total > self.free
            too_large = self.max_buffer is not None and f.largest > self.max_buffer
            mark = ("  <- chosen" if i == self.chosen else "  over" if over
                    else "  buffer over the device's limit" if too_large else "")
            out.append(f"{c.max_seqs:>5} {c.context:>8} {c.step_tokens:>6} "
                       f"{c.kv_blocks * BLOCK_SIZE:>10} {size(f.weights):>12} "
                       f"{size(f.arenas):>12} {size(f.state):>12} {size(f.total):>12}{mark}")
        free = "unknown" if self.free is None else size(self.free)
        out.append(f"free: {free} ({self.source})")
        return out


@dataclass(frozen=True)
class Check:
    """The post-allocation check: what the device's accounting says the allocation took."""
    planned: int                # the footprint's total
    measured: int               # the growth of what the device holds
    requested: int              # the bytes of the buffers themselves, unrounded
    granularity: int            # the allocator's smallest allocation
    source: str                 # where `measured` comes from

    def describe(self):
        return {"planned": self.planned, "measured": self.measured, "source": self.source}


def size(nbytes):
    """Bytes for people: MiB with one decimal (GiB from 10 GiB on)."""
    if nbytes >= 10 << 30:
        return f"{nbytes / (1 << 30):,.1f} GiB"
    return f"{nbytes / (1 << 20):,.1f} MiB"


def candidates(model_context, max_seqs=None, context=None, step_tokens=None):
    """Every candidate, smallest rank first: contexts doubling from MIN_CONTEXT up to the
    model's own, sequences from MAX_SEQS, prefill chunks from STEP_TOKENS; a pinned --max-seqs,
    --ctx or --prefill-chunk is the only value of its axis."""
    if context is not None:
        contexts = [context]
    else:
        contexts, c = [], MIN_CONTEXT
        while c < model_context:
            contexts.append(c)
            c *= 2
        contexts.append(model_context)
    seqs = [max_seqs] if max_seqs is not None else MAX_SEQS
    chunks = [step_tokens] if step_tokens is not None else STEP_TOKENS
    shapes = {Candidate(s, c, max(t, s)) for s in seqs for c in contexts for t in chunks}
    return sorted(shapes, key=lambda c: c.rank)


def ring_of(model, candidate):
    """The window layers' ring of a candidate that takes them (None: it does not, the model
    has no window layers, or a ring would save nothing): a ring for each of its sequences,
    holding the window and a prefill chunk."""
    if not candidate.rings:
        return None
    return ring_for(model.window, BLOCK_SIZE, candidate.max_seqs, candidate.step_tokens,
                    min(candidate.context, model.context_length))


def variants(model, shape):
    """A shape's ways of keeping the cache: every layer in the shared blocks, and, where the
    model has window layers, those in rings. Rings are reserved whole for every sequence while
    shared blocks are taken as sequences grow, so which leaves more KV blocks depends on the
    shape and the memory: the plan takes the one that does (the shared blocks where equal: they
    keep the prefix cache)."""
    ringed = Candidate(shape.max_seqs, shape.context, shape.step_tokens, shape.kv_blocks, True)
    return [shape, ringed] if ring_of(model, ringed) is not None else [shape]


def runner_for(model, device, candidate, check=True):
    """The device runner of a candidate, nothing allocated (it has read the device's caps, and
    with `check` refused a model whose kernels need what the device lacks)."""
    return DeviceRunner(model, device, candidate.kv_blocks, BLOCK_SIZE, candidate.step_tokens,
                        candidate.max_seqs, check=check, context=candidate.context,
                        ring=ring_of(model, candidate))


def footprint(runner):
    """The device memory of a runner's allocation list, by kind, each buffer rounded by the
    device's allocation rule."""
    return Scaling.of(runner.allocations(), runner.num_blocks,
                      runner.device.allocation_bytes).at(runner.num_blocks)


@dataclass(frozen=True)
class Scaling:
    """An allocation list's footprint at any count of KV blocks: the cache's buffers ("state")
    grow by the same bytes with every block, the others stay as they are."""
    fixed: dict                 # kind -> rounded bytes of the buffers that do not scale
    largest: tuple              # (bytes, name) of the largest buffer that does not scale
    per_block: tuple            # (bytes a block, name) of each cache buffer
    rounded: object             # the device's allocation rule

    @classmethod
    def of(cls, allocations, blocks, rounded):
        """(A ring's state buffers, Allocation.per_block false, are fixed.)"""
        fixed = dict.fromkeys(KINDS, 0)
        scales = [a for a in allocations if a.kind == "state" and a.per_block]
        others = [a for a in allocations if not (a.kind == "state" and a.per_block)]
        for a in others:
            fixed[a.kind] += rounded(a.nbytes)
        largest = max(((a.nbytes, a.name) for a in others), default=(0, ""))
        per_block = tuple((a.nbytes // blocks, a.name) for a in scales)
        if any(n * blocks != a.nbytes for (n, _), a in zip(per_block, scales)):
            raise ValueError("a KV cache buffer is not a whole number of bytes a block")
        return cls(fixed, largest, per_block, rounded)

    def at(self, blocks):
        state = self.fixed["state"] + sum(self.rounded(n * blocks) for n, _ in self.per_block)
        largest = max([self.largest] + [(n * blocks, name) for n, name in self.per_block])
        return Footprint(self.fixed["weights"], self.fixed["arenas"], state,
                         self.fixed["weights"] + self.fixed["arenas"] + state, *largest)


def most_blocks(candidate, scalings, frees, max_buffers):
    """The most KV blocks, from the candidate's least to its full count, at which every
    device's footprint fits its free memory; None where even the least does not."""
    def fit(blocks):
        return all(fits(s.at(blocks), free, limit)
                   for s, free, limit in zip(scalings, frees, max_buffers))
    low, high = candidate.least_blocks, candidate.full_blocks
    if not fit(low):
        return None
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fit(middle) else (low, middle - 1)
    return low


def best_variant(rows):
    """(candidate, footprints) of the variant with the most KV blocks that fit, the first where
    equal; rows: (blocks that fit or 0, candidate, footprints)."""
    most = max(blocks for blocks, _, _ in rows)
    return next((c, f) for blocks, c, f in rows if blocks == most)


def fits(footprint, free, max_buffer):
    """Within the free memory, and every buffer within the device's limit for one buffer."""
    return (free is not None and footprint.total <= free
            and (max_buffer is None or footprint.largest <= max_buffer))


@contextmanager
def _collected_after():
    """The garbage collector held off until the block ends: a plan's runners (one for each of a
    hundred-odd candidates) make many short-lived objects, and collecting them as they go,
    each time walking the loaded model's long-lived ones, took half an 8B plan's 2 s."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def plan(model, device, free, source, max_seqs=None, context=None, step_tokens=None):
    """Every shape's footprint against `free` bytes (None when unknown), with the most KV blocks
    that fit (the least where none do), and the largest that fits chosen; Plan.require() stops
    when none does."""
    table = []
    # the kernels' needs are checked once, on the first candidate (they are the same kernels)
    with _collected_after():
        for i, shape in enumerate(candidates(model.context_length, max_seqs, context,
                                             step_tokens)):
            rows = []
            for variant in variants(model, shape):
                least = variant.sharing(variant.least_blocks)
                scaling = Scaling.of(runner_for(model, device, least, check=i == 0)
                                     .allocations(), least.kv_blocks, device.allocation_bytes)
                blocks = most_blocks(variant, [scaling], [free], [device.max_buffer])
                chosen = variant.sharing(blocks or least.kv_blocks)
                rows.append((blocks or 0, chosen, scaling.at(chosen.kv_blocks)))
            table.append(best_variant(rows))
    fitting = [i for i, (_, f) in enumerate(table) if fits(f, free, device.max_buffer)]
    return Plan(f"{device.backend}: {device.name}", free, source, device.max_buffer,
                tuple(table), fitting[-1] if fitting else None)


def verify(device, footprint, runner, before):
    """Checks what the allocation took against the planned `footprint` (the chosen candidate's
    on this device): `before` is device.held()[0] read just before runner.allocate(). The
    growth must lie between the buffers' own bytes and the plan's rounded total, give or take
    one granule of the allocator; otherwise PlanMismatch (exit status 6) stops the server
    before it serves."""
    after, source = device.held()
    check = Check(planned=footprint.total, measured=after - before,
                  requested=sum(a.nbytes for a in runner.allocations()),
                  granularity=device.allocation_bytes(1), source=source)
    low, high = check.requested - check.granularity, check.planned + check.granularity
    if not low <= check.measured <= high:
        raise PlanMismatch(
            f"{device.backend}: {device.name}: the allocation took {check.measured} bytes by "
            f"{source}, but the plan counted {check.planned} ({check.requested} requested, "
            f"allocator granularity {check.granularity}): the plan cannot be trusted, so "
            "nothing is served")
    return check


@dataclass(frozen=True)
class GroupPlan:
    """A device group's plan: per candidate, one footprint per device; a candidate fits only if
    every device holds its own footprint."""
    devices: tuple              # "ptx: name" of each device
    free: tuple                 # bytes free on each device
    source: str
    table: tuple                # ((Candidate, (Footprint per device)), ...), smallest first
    chosen: object

    @property
    def candidate(self):
        return self.table[self.chosen][0]

    @property
    def footprints(self):
        return self.table[self.chosen][1]

    @property
    def footprint(self):
        """The whole group's footprint, summed over its devices."""
        return Footprint(*(sum(getattr(f, k) for f in self.footprints)
                           for k in ("weights", "arenas", "state", "total")))

    def require(self):
        if self.chosen is not None:
            return self
        candidate, needs = min(self.table, key=lambda row: max(f.total for f in row[1]))
        each = "; ".join(f"{name} needs {size(f.total)} (weights {size(f.weights)}, arenas "
                         f"{size(f.arenas)}, state {size(f.state)}), {size(free)} free"
                         for name, f, free in zip(self.devices, needs, self.free))
        raise CapacityError(f"no serving shape fits the group: the smallest, {candidate}: "
                            f"{each} ({self.source})")

    def describe(self):
        c = self.candidate
        return {"max_seqs": c.max_seqs, "context": c.context, "step_tokens": c.step_tokens,
                "kv_blocks": c.kv_blocks, "kv_block_size": BLOCK_SIZE, "window_rings": c.rings,
                "devices": [{"device": name, "memory_free": free,
                             "footprint": {"weights": f.weights, "arenas": f.arenas,
                                           "state": f.state, "total": f.total}}
                            for name, f, free in zip(self.devices, self.footprints, self.free)],
                "memory_source": self.source}

    def lines(self):
        out = [f"{'seqs':>5} {'context':>8} {'chunk':>6} {'KV tokens':>10} " + " ".join(
            f"{'device ' + str(i):>12}" for i in range(len(self.devices)))]
        for i, (c, fs) in enumerate(self.table):
            over = any(f.total > free for f, free in zip(fs, self.free))
            mark = "  <- chosen" if i == self.chosen else "  over" if over else ""
            out.append(f"{c.max_seqs:>5} {c.context:>8} {c.step_tokens:>6} "
                       f"{c.kv_blocks * BLOCK_SIZE:>10} "
                       + " ".join(f"{size(f.total):>12}" for f in fs) + mark)
        for i, (name, free) in enumerate(zip(self.devices, self.free)):
            out.append(f"device {i}: {name}: {size(free)} free ({self.source})")
        return out


def plan_group(model, group, kind, frees, source, max_seqs=None, context=None,
               step_tokens=None):
    """plan() for a group: every shape's footprint on each device against that device's free
    bytes, with the most KV blocks that fit on all of them; the largest shape that fits on all
    of them chosen."""
    from .group import GroupRunner
    table = []
    limits = [d.max_buffer for d in group.devices]
    with _collected_after():
        for i, shape in enumerate(candidates(model.context_length, max_seqs, context,
                                             step_tokens)):
            rows = []
            for variant in variants(model, shape):
                least = variant.sharing(variant.least_blocks)
                runner = GroupRunner(model, group, kind, least.kv_blocks, BLOCK_SIZE,
                                     shape.step_tokens, shape.max_seqs, check=i == 0,
                                     context=shape.context,      # as plan(): checked once
                                     ring=ring_of(model, variant))
                scalings = [Scaling.of(share.allocations(), least.kv_blocks,
                                       share.device.allocation_bytes)
                            for share in runner.shares()]
                blocks = most_blocks(variant, scalings, frees, limits)
                chosen = variant.sharing(blocks or least.kv_blocks)
                rows.append((blocks or 0, chosen, tuple(s.at(chosen.kv_blocks)
                                                        for s in scalings)))
            table.append(best_variant(rows))
    fitting = [i for i, (_, fs) in enumerate(table)
               if all(fits(f, free, limit) for f, free, limit in zip(fs, frees, limits))]
    return GroupPlan(tuple(f"{d.backend}: {d.name}" for d in group.devices), tuple(frees),
                     source, tuple(table), fitting[-1] if fitting else None)


def group_runner_for(model, group, kind, candidate):
    from .group import GroupRunner
    return GroupRunner(model, group, kind, candidate.kv_blocks, BLOCK_SIZE,
                       candidate.step_tokens, candidate.max_seqs, context=candidate.context,
                       ring=ring_of(model, candidate))


def verify_group(group, plan, runner, before):
    """verify() on each device of the group, against its own footprint."""
    return [verify(device, f, share, held_before) for device, f, share, held_before
            in zip(group.devices, plan.footprints, runner.shares(), before)]
