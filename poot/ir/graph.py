"""The graph IR: a model's forward step as a flat list of typed operations.

A `Graph` names its step inputs (token ids, positions, KV bookkeeping), its weights (each in the
storage dtype of the model file, e.g. Q4_1), its state (the paged KV cache) and a list of `Op`s
in execution order. Shapes are tuples of ints and symbolic sizes: "T" (tokens in the step),
"S" (sequences in the step), "R" (sampled rows), "B" (KV blocks per sequence row), "NB" (KV
blocks in the cache). Every backend lowers the same graph; `reference.py` interprets it in
numpy. This module builds and describes graphs; it computes nothing.
"""
from dataclasses import dataclass, field

import numpy as np

# The operations a graph may use, with what each computes (the reference interpreter is the
# executable definition).
OPS = {
    "embedding":  "out[t] = table[ids[t]] * scale   (scale 1 unless given: Gemma's sqrt(d_model))",
    "rms_norm":   "out = x / sqrt(mean(x*x, last axis) + eps) * weight",
    "matmul":     "out[n, m] = sum_k x[n, k] * w[m, k]   (w in its storage dtype)",
    "add":        "out = a + b   (b broadcast over leading axes)",
    "reshape":    "out = x viewed with another shape",
    "rope":       "rotate pairs of x[t, h, :] by positions[t] * inv_freq (normal or neox pairing), "
                  "the rotated pairs times scale",
    "store_kv":   "write k, v of each token into its paged cache slot",
    "attention":  "causal attention of q over the paged cache of its sequence, grouped KV heads; "
                  "optionally only the last `window` positions, scores soft-capped at `softcap`",
    "glu":        "out = activation(gate) * up (silu: SwiGLU, gelu_tanh: GeGLU)",
    "gather":     "out[r] = x[index[r]]",
    "top_k":      "out[t] = the indices (i32) of the k largest x[t], largest first, ties to the "
                  "lower index",
    "route_weights": "out[t, j] = softmax(logits[t])[ids[t, j]], divided by its sum over j "
                     "where normalize",
    "expert_matmul": "out[t, j, m] = sum_k x[t, k] * w[ids[t, j], m, k]   (x [T, K] or "
                     "[T, k, K]: then x[t, j, k]; w [experts, M, K] in its storage dtype)",
    "expert_sum": "out[t] = sum_j weights[t, j] * y[t, j]",
    "softcap":    "out = tanh(x / cap) * cap   (Gemma 2's final logits)",
    "scale":      "out = x * scale   (Granite's residual and logit multipliers)",
    "all_reduce": "out = the sum of x over the devices of a group (each holds a partial sum)",
    "all_gather": "out = the concatenation along the last axis of x over the devices of a group, "
                  "in the group's order (each holds a slice, the slices' lengths may differ)",
}
ACTIVATIONS = ("silu", "gelu_tanh")      # of glu: ir/reference.py and kernels/activations.py


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple
    dtype: str      # "f32", "i32" for values; a storage dtype ("F16", "Q4_K", ...) for weights
    kind: str       # "input", "weight", "const", "state" or "value"


@dataclass(frozen=True)
class FileSlice:
    """The part of a model file's tensor that a graph weight is: rows and columns as (start,
    stop), None for all of them."""
    tensor: str
    rows: tuple = None
    cols: tuple = None


@dataclass(frozen=True)
class Op:
    kind: str
    inputs: tuple
    output: Tensor
    attrs: dict = field(default_factory=dict)

    @property
    def outputs(self):
        return (self.output,)


class Graph:
    """Built op by op; the builder methods return the output tensor of the op they add."""

    def __init__(self):
        self.inputs, self.weights, self.consts, self.state = {}, {}, {}, {}
        self.slices = {}        # weight name -> FileSlice, where it is not a whole tensor
        self.ops = []
        self.outputs = {}
        self._count = 0

    # -- declarations ---------------------------------------------------------------------------
    def input(self, name, shape, dtype="i32"):
        return self._declare(self.inputs, Tensor(name, tuple(shape), dtype, "input"))

    def weight(self, name, shape, dtype, rows=None, cols=None, tensor=None):
        """A weight read from the file's tensor `tensor` (by default the one called `name`) of
        the file's `shape`; `rows` / `cols` ((start, stop) or None) declare the slice of it this
        graph reads, which is then the weight's shape. Several weights may read slices of one
        tensor (a fused q/k/v projection read as q, k and v)."""
        tensor = tensor or name
        if (tensor, rows, cols) != (name, None, None):
            self.slices[name] = FileSlice(tensor, rows, cols)
            shape = tuple(n if s is None else s[1] - s[0] for n, s in zip(shape, (rows, cols)))
        return self._declare(self.weights, Tensor(name, tuple(shape), dtype, "weight"))

    def file_slice(self, name):
        """The file tensor a weight reads and the slice of it."""
        return self.slices.get(name) or FileSlice(name)

    def read(self, name, file_array):
        """A weight's values: its slice of the array `file_array(tensor name)` gives for its
        file tensor (the whole tensor, as the file holds it)."""
        s = self.file_slice(name)
        array = file_array(s.tensor)
        if s.rows is not None:
            array = array[s.rows[0]:s.rows[1]]
        if s.cols is not None:
            array = array[:, s.cols[0]:s.cols[1]]
        return array

    def const(self, name, array):
        array = np.ascontiguousarray(array, dtype=np.float32)
        tensor = self._declare(self.consts, Tensor(name, array.shape, "f32", "const"))
        self.consts[name] = (tensor, array)
        return tensor

    def state_tensor(self, name, shape):
        return self._declare(self.state, Tensor(name, tuple(shape), "f32", "state"))

    def output(self, name, tensor):
        self.outputs[name] = tensor

    def _declare(self, table, tensor):
        if tensor.name in table:
            raise ValueError(f"graph already declares {tensor.name!r}")
        table[tensor.name] = tensor
        return tensor

    def weight_tensors(self):
        return list(self.weights.values())

    # -- operations -----------------------------------------------------------------------------
    def _op(self, kind, inputs, shape, attrs=None, name=None, dtype="f32"):
        self._count += 1
        out = Tensor(name or f"%{self._count}.{kind}", tuple(shape), dtype, "value")
        self.ops.append(Op(kind, tuple(inputs), out, dict(attrs or {})))
        return out

    def embedding(self, table, ids, scale=1.0):
        """Rows of `table`; a `scale` other than 1 multiplies them (an attribute only then)."""
        attrs = {} if scale == 1.0 else {"scale": float(scale)}
        return self._op("embedding", (table, ids), (ids.shape[0], table.shape[1]), attrs)

    def rms_norm(self, x, weight, eps):
        if x.shape[-1] != weight.shape[0]:
            raise ValueError(f"rms_norm: {x.shape} against weight {weight.shape}")
        return self._op("rms_norm", (x, weight), x.shape, {"eps": float(eps)})

    def matmul(self, x, w):
        if x.shape[-1] != w.shape[1]:
            raise ValueError(f"matmul: x {x.shape} against w {w.name} {w.shape}")
        return self._op("matmul", (x, w), (x.shape[0], w.shape[0]))

    def add(self, a, b):
        if a.shape[-len(b.shape):] != b.shape:
            raise ValueError(f"add: {a.shape} + {b.shape}")
        return self._op("add", (a, b), a.shape)

    def reshape(self, x, shape):
        return self._op("reshape", (x,), shape, {"shape": tuple(shape)})

    def rope(self, x, positions, inv_freq, style, scale=1.0):
        """`scale` multiplies the rotated dims (cos and sin), as LongRoPE's attention factor."""
        if style not in ("normal", "neox"):
            raise ValueError(f"rope style {style!r}")
        if 2 * inv_freq.shape[0] > x.shape[-1]:
            raise ValueError("rope: more frequencies than head dimensions")
        return self._op("rope", (x, positions, inv_freq), x.shape,
                        {"style": style, "scale": float(scale)})

    def store_kv(self, k, v, k_cache, v_cache, positions, seq_rows, block_tables):
        """Writes k and v into the caches; returns k_cache so later ops depend on the write."""
        op = Op("store_kv", (k, v, k_cache, v_cache, positions, seq_rows, block_tables), k_cache)
        self.ops.append(op)
        return k_cache

    def attention(self, q, k_cache, v_cache, positions, seq_rows, block_tables, scale,
                  window=0, softcap=0.0):
        """`window` > 0: a token at position p attends to positions p - window + 1 .. p only
        (sliding-window layers); `softcap` > 0: each scaled score s becomes
        tanh(s / softcap) * softcap before the softmax. Either is an attribute only when used."""
        attrs = {"scale": float(scale)}
        if window:
            attrs["window"] = int(window)
        if softcap:
            attrs["softcap"] = float(softcap)
        return self._op("attention", (q, k_cache, v_cache, positions, seq_rows, block_tables),
                        q.shape, attrs)

    def glu(self, gate, up, activation):
        """A gated linear unit: activation(gate) * up, of an activation in ACTIVATIONS."""
        if activation not in ACTIVATIONS:
            raise ValueError(f"glu: activation {activation!r} (one of {', '.join(ACTIVATIONS)})")
        return self._op("glu", (gate, up), gate.shape, {"activation": activation})

    def gather(self, x, index):
        return self._op("gather", (x, index), (index.shape[0],) + x.shape[1:])

    # -- mixture of experts: route each token to k experts, run theirs, sum them weighted --------
    def top_k(self, x, k):
        """The ids (i32) of each row's k largest values, e.g. a router's chosen experts."""
        if not 1 <= k <= x.shape[-1]:
            raise ValueError(f"top_k: k={k} of {x.shape[-1]} values")
        return self._op("top_k", (x,), (x.shape[0], int(k)), {"k": int(k)}, dtype="i32")

    def route_weights(self, logits, ids, normalize):
        """The chosen experts' router probabilities (softmax over every expert), renormalised to
        sum to one over the chosen where `normalize`."""
        if ids.dtype != "i32" or ids.shape[0] != logits.shape[0]:
            raise ValueError(f"route_weights: ids {ids.shape} {ids.dtype} for {logits.shape}")
        return self._op("route_weights", (logits, ids), ids.shape, {"normalize": bool(normalize)})

    def expert_matmul(self, x, w, ids):
        """Each token's product with each of its chosen experts' matrices: x [T, K] (the same
        row for every expert) or [T, k, K] (a row per chosen expert), w [experts, M, K]."""
        if len(w.shape) != 3 or x.shape[-1] != w.shape[2] or ids.dtype != "i32" or (
                len(x.shape) == 3 and x.shape[1] != ids.shape[1]):
            raise ValueError(f"expert_matmul: x {x.shape} against w {w.name} {w.shape}, "
                             f"ids {ids.shape}")
        return self._op("expert_matmul", (x, w, ids), (x.shape[0], ids.shape[1], w.shape[1]))

    def expert_sum(self, y, weights):
        """Each token's chosen experts' outputs y [T, k, M] summed with their weights [T, k]."""
        if y.shape[:2] != weights.shape:
            raise ValueError(f"expert_sum: y {y.shape} with weights {weights.shape}")
        return self._op("expert_sum", (y, weights), (y.shape[0], y.shape[2]))
    def softcap(self, x, cap):
        return self._op("softcap", (x,), x.shape, {"cap": float(cap)})

    def scale(self, x, scale):
        return self._op("scale", (x,), x.shape, {"scale": float(scale)})

    def all_reduce(self, x, world):
        return self._op("all_reduce", (x,), x.shape, {"world": int(world)})

    def all_gather(self, x, world, width):
        """x is this device's slice of the last axis, of the whole's `width`."""
        return self._op("all_gather", (x,), x.shape[:-1] + (int(width),), {"world": int(world)})
