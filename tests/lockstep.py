"""The kernel language run by numpy, one workgroup at a time, its threads in lockstep: where a
kernel's logic (indices, masks, loops, the fragment layouts lang.py documents) can be checked
without a GPU, the matrix operations included, which no renderer here runs on the CPU.

A value is an array over the workgroup's threads; If and For run their bodies under a mask of
the threads inside. What it cannot see: races (asynchronous copies complete at once, and a
barrier only checks that every live thread reaches it together), and the hardware's own
rounding (mma sums in f32 from the f16 operands, exp2 is numpy's). An index outside its array
in a live thread raises OutOfBounds. Enough of the language for the attention kernels and a
tiny model's whole ptx runner (LockstepDevice); an op it lacks raises TypeError.
"""
import numpy as np

from poot.kernels.lang import (AsyncProxyFence, Assign, Barrier, CopyAsync, CopyCommit, CopyWait,
                               For, If, Let, Return, Store, VarDecl)

NUMPY = {"f32": np.float32, "f16": np.float16, "i32": np.int32, "u32": np.uint32,
         "bool": np.bool_, "i64": np.int64, "u64": np.uint64}
BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "min": np.minimum,
          "max": np.maximum, "and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor,
          "shl": np.left_shift, "shr": np.right_shift}
COMPARE = {"lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal,
           "eq": np.equal, "ne": np.not_equal}
UNARY = {"not": np.invert, "neg": np.negative, "abs": np.abs, "exp": np.exp, "exp2": np.exp2,
         "log": np.log, "log2": np.log2, "sqrt": np.sqrt, "tanh": np.tanh, "floor": np.floor,
         "rsqrt": lambda x: 1 / np.sqrt(x), "sin": np.sin, "cos": np.cos}
REDUCE = {"subgroup_add": np.sum, "subgroup_min": np.min, "subgroup_max": np.max}
NO_OP = (CopyCommit, CopyWait, AsyncProxyFence)
LANE = np.arange(32)
G, Q = LANE // 4, LANE % 4          # a lane's row group and column pair in mma's layouts


class OutOfBounds(IndexError):
    pass


def run(kernel, grid, *args, only=None):
    """Runs `kernel` over `grid` on numpy arrays (buffers, written in place: their dtypes those
    of the parameters) and Python numbers (scalars), in parameter order; `only`: just these
    workgroups ((x, y, z) ids) of the grid."""
    grid = tuple(grid) + (1,) * (3 - len(grid))
    if kernel.workgroup[1:] != (1, 1):
        raise TypeError("lockstep runs one-dimensional workgroups")
    buffers, scalars = {}, {}
    for param, arg in zip(kernel.params, args, strict=True):
        if param.kind == "buffer":
            if arg.dtype != NUMPY[param.dtype.name]:
                raise TypeError(f"{param.name}: {arg.dtype}, not {param.dtype}")
            buffers[param.name] = arg.reshape(-1)
        else:
            scalars[param.name] = arg
    for z in range(grid[2]):
        for y in range(grid[1]):
            for x in range(grid[0]):
                if only is None or (x, y, z) in only:
                    _Workgroup(kernel, (x, y, z), grid, buffers, scalars).block(
                        kernel.body, np.ones(kernel.workgroup[0], bool))


class Memory:
    """A device buffer of LockstepDevice: bytes a launch sees as its parameter's dtype."""

    def __init__(self, data):
        self.data = data


class LockstepDevice:
    """A CUDA device as a device runner sees it (backends.Device's contract, without the
    optional features but views), whose launches `run` executes: the ptx runner's own plan,
    kernels and arguments, the tensor-core paths included, run end to end on the CPU. Small
    models only: every workgroup is interpreted."""
    backend, name, ordinal, subgroup_size, target = "ptx", "lockstep", 0, 32, "sm_90"
    max_buffer, memory_source, multiprocessors = None, "lockstep", 132
    features = frozenset({"views"})
    step_staging = False

    def __init__(self, caps):
        self.caps, self.allocated, self.launched, self._programs = caps, 0, [], {}

    def memory(self):
        return 1 << 32, 1 << 32

    def held(self):
        return self.allocated, self.memory_source

    def allocation_bytes(self, nbytes):
        return -(-nbytes // 256) * 256

    def alloc(self, nbytes):
        self.allocated += nbytes
        return Memory(np.zeros(max(nbytes, 4), np.uint8))

    def free(self, buffer):
        self.allocated -= buffer.data.size

    def write(self, buffer, array, offset=0):
        data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        buffer.data[offset:offset + data.size] = data

    def read(self, buffer, nbytes=None, offset=0):
        end = buffer.data.size if nbytes is None else offset + nbytes
        return buffer.data[offset:end].tobytes()

    def copy(self, dst, src, nbytes):
        dst.data[:nbytes] = src.data[:nbytes]

    def view(self, buffer, offset):
        return Memory(buffer.data[offset:])

    def program(self, kernel):
        return kernel

    def require(self, kernel, limits=()):
        kernel.require(self.caps, "the device", "lockstep: ")

    def launch(self, program, kernel, grid, args):
        call = []
        for param, arg in zip(kernel.params, args, strict=True):
            if param.kind == "buffer":
                dtype = np.dtype(NUMPY[param.dtype.name])
                arg = arg.data[:arg.data.size // dtype.itemsize * dtype.itemsize].view(dtype)
            call.append(arg)
        self.launched.append(kernel.name)
        run(kernel, grid, *call)

    def synchronize(self):
        pass


class _Workgroup:
    def __init__(self, kernel, block, grid, buffers, scalars):
        self.kernel, self.block_id, self.grid = kernel, block, grid
        self.buffers, self.scalars = buffers, scalars
        self.n = kernel.workgroup[0]
        self.values, self.vars = {}, {}
        self.shared = {s.name: np.zeros(s.size, NUMPY[s.dtype.name]) for s in kernel.shared}
        self.live = np.ones(self.n, bool)               # threads that have not returned

    def block(self, body, mask):
        for stmt in body:
            inside = mask & self.live
            if isinstance(stmt, Let):
                self.values[stmt.id] = self.let(stmt, inside)
            elif isinstance(stmt, Store):
                self.store(stmt, inside)
            elif isinstance(stmt, VarDecl):
                self.vars[stmt.id] = np.array(self.values[stmt.init.id])
            elif isinstance(stmt, Assign):
                old = self.vars[stmt.var]
                self.vars[stmt.var] = np.where(inside, self.values[stmt.value.id], old).astype(
                    old.dtype)
            elif isinstance(stmt, If):
                cond = self.values[stmt.cond.id]
                if np.any(inside & cond):
                    self.block(stmt.then, inside & cond)
                if np.any(inside & ~cond):
                    self.block(stmt.orelse, inside & ~cond)
            elif isinstance(stmt, For):
                self.loop(stmt, inside)
            elif isinstance(stmt, Barrier):
                if not np.array_equal(inside, self.live):
                    raise AssertionError(f"{self.kernel.name}: a barrier some threads skip")
            elif isinstance(stmt, CopyAsync):
                self.copy_async(stmt, inside)
            elif isinstance(stmt, Return):
                self.live = self.live & ~inside
            elif not isinstance(stmt, NO_OP):
                raise TypeError(f"lockstep runs no {type(stmt).__name__}")

    def loop(self, stmt, mask):
        index = np.broadcast_to(self.values[stmt.start.id], (self.n,)).astype(np.int32)
        stop = self.values[stmt.stop.id]
        step = stmt.step if isinstance(stmt.step, int) else self.values[stmt.step.id]
        while True:
            inside = mask & self.live & (index < stop)
            if not inside.any():
                return
            self.values[stmt.index.id] = index
            self.block(stmt.body, inside)
            index = np.where(inside, index + step, index).astype(np.int32)

    # -- memory ----------------------------------------------------------------------------------
    def where(self, name, shared, index, mask, width=1):
        """(the array, each thread's index: 0 where it is outside `mask`)."""
        array = self.shared[name] if shared else self.buffers[name]
        index = np.broadcast_to(index, (self.n,)).astype(np.int64)
        bad = mask & ((index < 0) | (index + width > array.size))
        if bad.any():
            raise OutOfBounds(f"{self.kernel.name}: {name}[{index[bad][0]}] of {array.size}")
        return array, np.where(mask, index, 0)

    def store(self, stmt, mask):
        array, index = self.where(stmt.target, stmt.shared, self.values[stmt.index.id], mask,
                                  len(stmt.values))
        for i, value in enumerate(stmt.values):
            value = np.broadcast_to(self.values[value.id], (self.n,))
            array[index[mask] + i] = value[mask].astype(array.dtype)

    def copy_async(self, stmt, mask):
        reads = mask if stmt.inside is None else mask & self.values[stmt.inside.id]
        target, to = self.where(stmt.target, True, self.values[stmt.index.id], mask, 4)
        source, at = self.where(stmt.source, False, self.values[stmt.source_index.id], reads, 4)
        for t in np.nonzero(mask)[0]:
            target[to[t]:to[t] + 4] = source[at[t]:at[t] + 4] if reads[t] else 0

    # -- values ----------------------------------------------------------------------------------
    def let(self, let, mask):
        op, dtype = let.op, NUMPY.get(let.dtype.name)
        a = [self.values[x.id] for x in let.args]
        with np.errstate(all="ignore"):
            if op in ("const", "param"):
                value = let.attr("value") if op == "const" else self.scalars[let.attr("name")]
                return np.full(self.n, value, dtype)
            if op in ("thread_id", "lane_id", "subgroup_id"):
                tid = np.arange(self.n, dtype=np.int32)
                return {"thread_id": tid, "lane_id": tid & 31, "subgroup_id": tid >> 5}[op]
            if op in ("block_id", "num_blocks"):
                ids = self.block_id if op == "block_id" else self.grid
                return np.full(self.n, ids[let.attr("axis")], np.int32)
            if op == "var_get":
                return self.vars[let.attr("var")].copy()
            if op == "load":
                width = let.attr("width", 1)
                array, index = self.where(let.attr("target"), let.attr("shared"), a[0], mask,
                                          width)
                return array[index] if width == 1 else tuple(array[index + i]
                                                             for i in range(width))
            if op == "extract":
                return a[0][let.attr("lane")]
            if op in BINARY:
                return BINARY[op](*a).astype(dtype)
            if op in ("div", "rem"):
                return self.divide(op, *a).astype(dtype)
            if op in COMPARE:
                return COMPARE[op](*a)
            if op in UNARY:
                return UNARY[op](a[0]).astype(dtype)
            if op == "select":
                return np.where(*a).astype(dtype)
            if op == "fma":
                return (a[0].astype(np.float64) * a[1] + a[2]).astype(dtype)
            if op == "cast":
                return a[0].astype(dtype)
            if op == "bitcast":
                return np.ascontiguousarray(a[0]).view(dtype)
            if op == "unpack_half2":
                word = a[0].astype(np.uint32)
                return tuple((h & np.uint32(0xFFFF)).astype(np.uint16).view(np.float16)
                             .astype(np.float32) for h in (word, word >> np.uint32(16)))
            if op == "half2":                   # each f16 half, f32 arithmetic rounded once
                halves = [np.stack([(w & np.uint32(0xFFFF)), w >> np.uint32(16)])
                          .astype(np.uint16).view(np.float16).astype(np.float32)
                          for w in (x.astype(np.uint32) for x in a)]
                arith = let.attr("arith")
                value = (halves[0] - halves[1] if arith == "sub" else halves[0] * halves[1]
                         if arith == "mul" else halves[0] * halves[1] + halves[2])
                bits = value.astype(np.float16).view(np.uint16).astype(np.uint32)
                return bits[0] | (bits[1] << np.uint32(16))
            if op == "pack_half2":
                lo, hi = (x.astype(np.float16).view(np.uint16).astype(np.uint32) for x in a)
                return lo | (hi << np.uint32(16))
            if op in REDUCE:
                return np.repeat(REDUCE[op](a[0].reshape(-1, 32), axis=1), 32).astype(dtype)
            if op == "shuffle_xor":
                return a[0].reshape(-1, 32)[:, LANE ^ let.attr("mask")].reshape(-1)
            if op == "fragment_load":
                return self.fragment_load(let, a[0], mask)
            if op == "mma":
                return self.mma(a)
        raise TypeError(f"lockstep runs no {op}")

    @staticmethod
    def divide(op, x, y):
        """C's integer division (toward zero) and remainder; floats as IEEE."""
        if x.dtype.kind == "f":
            return x / y if op == "div" else np.fmod(x, y)
        y = np.where(y == 0, 1, y).astype(np.int64)
        quotient = np.abs(x.astype(np.int64)) // np.abs(y) * np.sign(x) * np.sign(y)
        return quotient if op == "div" else x - y * quotient

    def fragment_load(self, let, index, mask):
        """lang.fragment_load: lane l names row l % 8 of matrix l // 8; word j of lane l holds
        elements 2q, 2q + 1 of row g of matrix j (trans: rows 2q, 2q + 1 of column g)."""
        warps = mask.reshape(-1, 32)
        if not np.array_equal(warps.all(axis=1), warps.any(axis=1)):
            raise AssertionError(f"{self.kernel.name}: a fragment_load of part of a subgroup")
        halves = self.shared[let.attr("target")].view(np.uint16)
        start = index.reshape(-1, 32).astype(np.int64) * 2
        if (warps & ((start < 0) | (start + 8 > halves.size))).any():
            raise OutOfBounds(f"{self.kernel.name}: a fragment_load outside {let.attr('target')}")
        start = np.where(warps, start, 0)
        words = []
        for j in range(4):
            if let.attr("trans"):       # rows 2q, 2q + 1 of matrix j, column g
                lo = halves[start[:, 8 * j + 2 * Q] + G]
                hi = halves[start[:, 8 * j + 2 * Q + 1] + G]
            else:                           # row g of matrix j, columns 2q, 2q + 1
                lo = halves[start[:, 8 * j + G] + 2 * Q]
                hi = halves[start[:, 8 * j + G] + 2 * Q + 1]
            words.append((lo.astype(np.uint32) | (hi.astype(np.uint32) << np.uint32(16)))
                         .reshape(-1))
        return tuple(words)

    def mma(self, args):
        """lang.mma: D = A B + C of each subgroup, from its lanes' words as lang.py lays them."""
        a, b, c = args[:4], args[4:6], args[6:]
        warps = self.n // 32

        def half(word, high):
            bits = word.reshape(warps, 32) >> np.uint32(16 * high) & np.uint32(0xFFFF)
            return bits.astype(np.uint16).view(np.float16).astype(np.float32)
        A, B, C = (np.zeros((warps, *shape), np.float32) for shape in ((16, 16), (16, 8), (16, 8)))
        for j in range(4):
            for high in (0, 1):
                A[:, G + 8 * (j % 2), 2 * Q + 8 * (j // 2) + high] = half(a[j], high)
            C[:, G + 8 * (j // 2), 2 * Q + j % 2] = c[j].reshape(warps, 32)
        for j in range(2):
            for high in (0, 1):
                B[:, 2 * Q + 8 * j + high, G] = half(b[j], high)
        D = A @ B + C
        return tuple(D[:, G + 8 * (j // 2), 2 * Q + j % 2].reshape(-1) for j in range(4))
