"""The numpy interpreter of the graph IR: the oracle every backend is tested against.

Float32 math, written to be read: each op is a few lines of numpy that say what the op means.
Weights are dequantised to float32 once, on first use, from the model file's own bytes. This
module knows nothing of devices, scheduling or sampling.
"""
import numpy as np


class ReferenceInterpreter:
    """Runs a Graph on numpy arrays.

    `weights(name) -> np.ndarray float32` supplies each weight dequantised (called once per
    weight); `state` maps state tensor names to arrays the interpreter updates in place.
    """

    def __init__(self, graph, weights, state):
        self.graph = graph
        self._weight_source = weights
        self._weights = {}
        self.state = state
        for name, tensor in graph.state.items():
            if name not in state:
                raise ValueError(f"no array for state tensor {name!r}")

    def weight(self, name):
        array = self._weights.get(name)
        if array is None:
            array = np.ascontiguousarray(self._weight_source(name), dtype=np.float32)
            self._weights[name] = array
        return array

    def run(self, inputs):
        """The graph's outputs for one step's inputs (a graph with all_reduce or all_gather
        runs as a group of one: its partial sums are the whole sums, its slice the whole)."""
        return run_group([self], [inputs])[0]

    def steps(self, inputs):
        """Runs the graph as a generator: at each all_reduce or all_gather it yields the op and
        its partial sum or slice, and continues with the combined value it is sent; returns the
        outputs."""
        env = dict(inputs)
        for name, (tensor, array) in self.graph.consts.items():
            env[name] = array
        for name in self.graph.state:
            env[name] = self.state[name]
        for op in self.graph.ops:
            args = [self._value(env, t) for t in op.inputs]
            if op.kind in COLLECTIVES:
                env[op.output.name] = yield op, args[0]
            else:
                env[op.output.name] = KERNELS[op.kind](*args, **op.attrs)
        return {name: env[t.name] for name, t in self.graph.outputs.items()}

    def _value(self, env, tensor):
        if tensor.kind == "weight":
            return self.weight(tensor.name)
        return env[tensor.name]


def run_group(interpreters, inputs):
    """Runs the graphs of a tensor-parallel group in lockstep: at each all_reduce the partial
    sums of every graph are added, at each all_gather their slices concatenated, and the result
    goes to all. [outputs] in the group's order."""
    runs = [it.steps(inp) for it, inp in zip(interpreters, inputs)]
    results, combined = [None] * len(runs), [None] * len(runs)
    while True:
        reached = {}
        for i, run in enumerate(runs):
            if results[i] is None:
                try:
                    reached[i] = run.send(combined[i])
                except StopIteration as done:
                    results[i] = done.value
        if not reached:
            return results
        kinds = {op.kind for op, _ in reached.values()}
        if len(reached) != len(runs) or len(kinds) != 1:
            raise ValueError("the group's graphs reach different sequences of all_reduce and "
                             "all_gather ops")
        value = COLLECTIVES[kinds.pop()]([part for _, part in reached.values()])
        combined = [value] * len(runs)


def all_reduce(parts):
    return sum(parts)


def all_gather(parts):
    return np.concatenate(parts, axis=-1)


COLLECTIVES = {"all_reduce": all_reduce, "all_gather": all_gather}


def embedding(table, ids, scale=1.0):
    return table[ids] * np.float32(scale)


def rms_norm(x, weight, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def matmul(x, w):
    return x @ w.T


def add(a, b):
    return a + b


def reshape(x, shape):
    return x.reshape(tuple(x.shape[0] if d == "T" or d == "R" else d for d in shape))


def rope(x, positions, inv_freq, style, scale=1.0):
    """Rotates the first 2*len(inv_freq) dims of each head, times `scale`; the rest pass
    through.

    normal: dims (2i, 2i+1) form a pair (GGUF llama layout); neox: dims (i, i + n/2) do (the
    Hugging Face layout and GGUF qwen2/qwen3).
    """
    n = 2 * inv_freq.shape[0]
    angle = positions.astype(np.float32)[:, None] * inv_freq[None, :]        # [T, n/2]
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]          # [T, 1, n/2]
    if scale != 1.0:
        cos, sin = cos * np.float32(scale), sin * np.float32(scale)
    out = x.copy()
    if style == "normal":
        a, b = x[..., 0:n:2], x[..., 1:n:2]
        out[..., 0:n:2] = a * cos - b * sin
        out[..., 1:n:2] = a * sin + b * cos
    else:
        a, b = x[..., : n // 2], x[..., n // 2: n]
        out[..., : n // 2] = a * cos - b * sin
        out[..., n // 2: n] = a * sin + b * cos
    return out


def cache_slots(positions, seq_rows, block_tables, block_size):
    """The flat cache slot of each token: its block from the table, then its offset in it."""
    blocks = block_tables[seq_rows, positions // block_size]
    return blocks.astype(np.int64) * block_size + positions % block_size


def store_kv(k, v, k_cache, v_cache, positions, seq_rows, block_tables):
    block_size = k_cache.shape[1]
    slots = cache_slots(positions, seq_rows, block_tables, block_size)
    k_cache.reshape(-1, *k_cache.shape[2:])[slots] = k
    v_cache.reshape(-1, *v_cache.shape[2:])[slots] = v
    return k_cache


def attention(q, k_cache, v_cache, positions, seq_rows, block_tables, scale, window=0,
              softcap=0.0):
    """Each token attends to positions 0..its own of its sequence (with a `window`, only the
    last `window` of them); KV heads serve H/Hkv heads; a `softcap` bounds the scaled scores
    smoothly to (-softcap, softcap)."""
    n_tokens, n_heads, head_dim = q.shape
    block_size, n_kv = k_cache.shape[1], k_cache.shape[2]
    group = n_heads // n_kv
    out = np.empty_like(q)
    for row in np.unique(seq_rows):
        mine = np.nonzero(seq_rows == row)[0]
        length = int(positions[mine].max()) + 1
        blocks = block_tables[row, : (length + block_size - 1) // block_size]
        keys = k_cache[blocks].reshape(-1, n_kv, head_dim)[:length]          # [L, Hkv, D]
        values = v_cache[blocks].reshape(-1, n_kv, head_dim)[:length]
        keys = np.repeat(keys, group, axis=1).transpose(1, 2, 0)             # [H, D, L]
        values = np.repeat(values, group, axis=1).transpose(1, 0, 2)         # [H, L, D]
        scores = (q[mine].transpose(1, 0, 2) @ keys) * scale                # [H, t, L]
        if softcap:
            scores = capped(scores, softcap)
        causal = np.arange(length)[None, :] > positions[mine][:, None]       # [t, L]
        if window:
            causal |= np.arange(length)[None, :] <= positions[mine][:, None] - window
        scores[:, causal] = -np.inf
        scores -= scores.max(axis=-1, keepdims=True)
        weights = np.exp(scores)
        weights /= weights.sum(axis=-1, keepdims=True)
        out[mine] = (weights @ values).transpose(1, 0, 2)
    return out


ACTIVATIONS = {
    "silu": lambda x: x * (0.5 * (1.0 + np.tanh(0.5 * x))),  # x / (1 + exp(-x)), no overflow
    "gelu_tanh": lambda x: 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi)
                                                    * (x + 0.044715 * x ** 3))),
}


def glu(gate, up, activation):
    return ACTIVATIONS[activation](gate) * up


def gather(x, index):
    return x[index]


def top_k(x, k):
    """A stable sort of the negated values: largest first, equal values by lower index."""
    return np.argsort(-x, axis=-1, kind="stable")[:, :k].astype(np.int32)


def route_weights(logits, ids, normalize):
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    chosen = np.take_along_axis(shifted / shifted.sum(axis=-1, keepdims=True), ids, axis=-1)
    return chosen / chosen.sum(axis=-1, keepdims=True) if normalize else chosen


def expert_matmul(x, w, ids):
    """Each expert's rows gathered, multiplied by its matrix and scattered back."""
    n_tokens, k = ids.shape
    rows = np.broadcast_to(x[:, None, :] if x.ndim == 2 else x, (n_tokens, k, x.shape[-1]))
    out = np.empty((n_tokens, k, w.shape[1]), np.float32)
    for expert in np.unique(ids):
        mine = ids == expert
        out[mine] = rows[mine] @ w[expert].T
    return out


def expert_sum(y, weights):
    return np.einsum("tjm,tj->tm", y, weights)


def capped(x, cap):
    return (np.tanh(x / cap) * cap).astype(np.float32)


def scaled(x, scale):
    return (x * np.float32(scale)).astype(np.float32)


KERNELS = {
    "embedding": embedding, "rms_norm": rms_norm, "matmul": matmul, "add": add,
    "reshape": reshape, "rope": rope, "store_kv": store_kv, "attention": attention,
    "glu": glu, "gather": gather, "softcap": capped, "scale": scaled, "top_k": top_k,
    "route_weights": route_weights, "expert_matmul": expert_matmul, "expert_sum": expert_sum,
}
