"""How a model is divided over a device group: which part of the step each device computes.

A `Part` names one device's share: a contiguous range of layers (pipeline), or every layer with
a slice of its attention heads and feed-forward columns (tensor), whether the device embeds the
tokens (`first`) and computes the final norm and output head (`last`, over its `vocab` rows of
the head), and its `rank` in a tensor group (rank 0 keeps the logits and samples).
`models/llama.py` builds the step graph of a part; this module only decides the parts.

pipeline: stages of contiguous layers, balanced by the bytes each stage holds (its layers'
weights and KV cache, the embedding table on the first stage, the output head on the last).

tensor: KV heads split as evenly as whole heads allow (each KV head takes its query heads with
it), so heads that do not divide evenly give uneven shards rather than padding; a group larger
than the KV heads is refused. The feed-forward columns are split in whole quantisation blocks of
the down projection. Every rank embeds the tokens (the table is replicated). The output head's
rows (the vocabulary) are split evenly: every rank computes the logits of its rows, and rank 0
gathers them (an all_gather) and samples. A model with tied embeddings, whose head is the
embedding table every rank holds whole, keeps its head whole on rank 0 alone: a graph declares
each weight once, with one slice, and the table's slice for the embedding is all of it.
"""
from dataclasses import dataclass

from ..errors import PlacementRefused
from ..formats.quants import QUANTS


@dataclass(frozen=True)
class Part:
    layers: tuple               # (start, stop)
    first: bool = True          # embeds the tokens; else reads the input "hidden"
    last: bool = True           # final norm and output head; else writes the output "hidden"
    kv_heads: tuple = None      # (start, stop) of the KV heads held (tensor); None: all
    ff: tuple = None            # (start, stop) of the feed-forward columns (tensor); None: all
    vocab: tuple = None         # (start, stop) of the output head's rows (tensor); None: all
    world: int = 1              # devices whose partial sums are reduced after each block
    rank: int = 0               # in a tensor group; rank 0 keeps the (gathered) logits

    @property
    def logits(self):
        """Whether the device ends the step with the whole vocabulary's logits."""
        return self.last and self.rank == 0

    def describe(self):
        out = {"layers": list(self.layers), "embeds": self.first, "logits": self.logits}
        if self.kv_heads is not None:
            out.update(kv_heads=list(self.kv_heads), ff_columns=list(self.ff))
        if self.vocab is not None:
            out.update(vocab_rows=list(self.vocab))
        return out


def whole(cfg):
    return Part((0, cfg.n_layers))


def even(n, parts, unit=1):
    """[(start, stop)] splitting n (a multiple of `unit`) into `parts` runs of whole units, the
    first ones one unit longer where it does not divide."""
    units = n // unit
    base, extra = divmod(units, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + (base + (i < extra)) * unit
        out.append((start, stop))
        start = stop
    return out


def tensor_parts(cfg, weights, world):
    """The tensor-parallel part of each of `world` ranks. `weights` maps GGUF names to (shape,
    dtype), for the block alignment of the column-split projections."""
    if "blk.0.ffn_gate_inp.weight" in weights:          # a router: a mixture of experts
        raise PlacementRefused("tensor placement: a mixture of experts is not split over "
                               "devices by columns (a pipeline placement splits its layers)")
    if world > cfg.n_kv_heads:
        raise PlacementRefused(f"tensor placement over {world} devices: the model has "
                               f"{cfg.n_kv_heads} KV heads, and each device needs at least one")
    group = cfg.n_heads // cfg.n_kv_heads
    heads = even(cfg.n_kv_heads, world)
    down_block = QUANTS[weights["blk.0.ffn_down.weight"][1]].block_elems
    out_block = QUANTS[weights["blk.0.attn_output.weight"][1]].block_elems
    for start, _ in heads:
        if start * group * cfg.head_dim % out_block:
            raise PlacementRefused(
                f"tensor placement over {world} devices: the attention output projection is "
                f"stored in blocks of {out_block} columns, and the split at KV head {start} "
                f"falls inside a block")
    if cfg.d_ff % down_block:
        raise PlacementRefused(f"tensor placement: the feed-forward size {cfg.d_ff} is not a "
                               f"whole number of blocks of {down_block}")
    if cfg.d_ff // down_block < world:
        raise PlacementRefused(f"tensor placement over {world} devices: the feed-forward "
                               f"columns hold only {cfg.d_ff // down_block} blocks")
    ff = even(cfg.d_ff, world, down_block)
    if cfg.tied_embeddings:
        return [Part((0, cfg.n_layers), last=rank == 0, kv_heads=heads[rank], ff=ff[rank],
                     world=world, rank=rank) for rank in range(world)]
    vocab = even(cfg.vocab_size, world)
    return [Part((0, cfg.n_layers), kv_heads=heads[rank], ff=ff[rank], vocab=vocab[rank],
                 world=world, rank=rank) for rank in range(world)]


def pipeline_parts(cfg, stages, layer_bytes, first_bytes, last_bytes):
    """Contiguous layer ranges, one per stage, that minimise the largest stage's bytes: each
    layer holds `layer_bytes`, the first stage also `first_bytes`, the last `last_bytes`."""
    n = cfg.n_layers
    if stages > n:
        raise PlacementRefused(f"pipeline placement over {stages} devices: the model has "
                               f"{n} layers, and each stage needs at least one")

    def cost(stage, start, stop):
        return ((stop - start) * layer_bytes + (first_bytes if stage == 0 else 0)
                + (last_bytes if stage == stages - 1 else 0))

    # best[s][i]: the smallest largest-stage bytes placing layers 0..i on stages 0..s
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages)]
    cut = [[0] * (n + 1) for _ in range(stages)]
    for i in range(1, n + 1):
        best[0][i] = cost(0, 0, i)
    for s in range(1, stages):
        for i in range(s + 1, n + 1):
            for j in range(s, i):
                value = max(best[s - 1][j], cost(s, j, i))
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    bounds, stop = [], n
    for s in range(stages - 1, 0, -1):
        start = cut[s][stop]
        bounds.append((start, stop))
        stop = start
    bounds.append((0, stop))
    bounds.reverse()
    return [Part(b, first=s == 0, last=s == stages - 1) for s, b in enumerate(bounds)]
