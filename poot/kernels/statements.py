"""The kernel language's statements: what a Kernel's body is made of (lang.py builds them,
the renderers in codegen/ read them). Plain data: each holds the Values (lang.Value) and names
it works on."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Let:
    """value `id` of `dtype` = op(args...), with constant attributes."""
    id: int
    op: str
    dtype: DType
    args: tuple = ()
    attrs: tuple = ()    # (key, value) pairs

    def attr(self, key, default=None):
        return dict(self.attrs).get(key, default)


@dataclass(frozen=True)
class Store:
    target: str          # a buffer param or a shared array name
    shared: bool
    index: Value
    values: tuple        # `width` consecutive elements from index (index a multiple of width)


@dataclass(frozen=True)
class Assign:
    var: int
    value: Value


@dataclass
class If:
    cond: Value
    then: list = field(default_factory=list)
    orelse: list = field(default_factory=list)


@dataclass
class For:
    """for index in range(start, stop, step): body  (i32 index; step positive: an int or a
    Value defined before the loop)."""
    index: Value
    start: Value
    stop: Value
    step: object
    body: list = field(default_factory=list)
    unroll: bool = False


@dataclass(frozen=True)
class Barrier:
    """Every thread of the workgroup arrives; shared memory written before is visible after."""


@dataclass(frozen=True)
class CopyAsync:
    """Starts copying 4 u32 words from buffer `source` at `source_index` into shared array
    `target` at `index`; zeros are written, and nothing read, where `inside` (a bool Value, or
    None: always) is false."""
    target: str
    index: Value
    source: str
    source_index: Value
    inside: object = None


@dataclass(frozen=True)
class CopyCommit:
    """The copies this thread started since its last commit form one batch."""


@dataclass(frozen=True)
class CopyWait:
    """This thread waits until at most `pending` of its batches are still copying."""
    pending: int


@dataclass(frozen=True)
class AsyncProxyFence:
    """This thread's shared-memory writes so far are visible to what reads shared memory
    asynchronously after the next barrier (wgmma)."""


@dataclass(frozen=True)
class WgmmaFence:
    """Orders this warpgroup's register writes before the wgmma that follow (needed before the
    first of them and after any other write to their accumulators)."""


@dataclass(frozen=True)
class Wgmma:
    """accumulators (Vars `accs`, f32) += A B, asynchronously: A 64 x 16 and B 16 x n of
    `operand` (f16 or bf16), both read from shared memory through descriptors (u64 Values)."""
    operand: str
    n: int
    desc_a: object
    desc_b: object
    accs: tuple


@dataclass(frozen=True)
class WgmmaCommit:
    """The wgmma this warpgroup issued since its last commit form one group."""


@dataclass(frozen=True)
class WgmmaWait:
    """Waits until at most `pending` of this warpgroup's committed groups are running: the
    accumulators of the others may be read, their shared operands overwritten."""
    pending: int


@dataclass(frozen=True)
class BarrierInit:
    """Sets up transaction barrier `target`[index] for `count` arrivals a phase."""
    target: str
    index: Value
    count: int


@dataclass(frozen=True)
class BarrierExpect:
    """Arrives at transaction barrier `target`[index], raising the bytes its phase waits for
    by `nbytes`."""
    target: str
    index: Value
    nbytes: int


@dataclass(frozen=True)
class BarrierWait:
    """Waits for the phase of `parity` of transaction barrier `target`[index] to complete."""
    target: str
    index: Value
    parity: Value


@dataclass(frozen=True)
class TensorLoad:
    """Starts copying the box of tensor map `map` at (row, col) into shared `target` from
    element `index`, completing bytes of transaction barrier `barrier`[barrier_index]."""
    map: str
    target: str
    index: Value
    col: Value
    row: Value
    barrier: str
    barrier_index: Value


@dataclass(frozen=True)
class Return:
    """This thread stops (no barrier may follow for threads that returned)."""


@dataclass(frozen=True)
class VarDecl:
    id: int
    dtype: DType
    init: Value


def walk(body):
    """Every statement of a body, depth first, in program order."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, If):
            yield from walk(stmt.then)
            yield from walk(stmt.orelse)
        elif isinstance(stmt, For):
            yield from walk(stmt.body)
