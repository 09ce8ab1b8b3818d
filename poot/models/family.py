"""What every family's forward pass shares: how it declares the weights it reads, and what it
raises when a file's weights do not fit its config."""
from ..ir.graph import FileSlice


class MissingWeight(KeyError):
    """A weight the forward pass reads is not in the file."""

    def __init__(self, name, shape):
        super().__init__(name)
        self.name, self.shape = name, shape


class WrongShape(ValueError):
    """A weight's shape is not the one the config implies."""

    def __init__(self, name, expected, found):
        super().__init__(f"tensor {name} has shape {found}, the config implies {expected}")
        self.name, self.expected, self.found = name, expected, found


def weight_reader(g, weights):
    """The function a forward pass declares its weights with, on graph `g` of a file whose
    tensors `weights` maps to (shape, dtype): w(name, *shape, rows=, cols=, tensor=) is the
    graph's weight `name`, read from the file tensor `tensor` (by default the one called
    `name`), which must have `shape`; `rows` / `cols` ((start, stop)) the slice of it this
    graph reads (a tensor group's shard, or one part of a fused tensor). A weight read twice
    must be read with the same slice."""
    def w(name, *shape, rows=None, cols=None, tensor=None):
        tensor = tensor or name
        if name not in g.weights:
            if tensor not in weights:
                raise MissingWeight(tensor, shape)
            have, dtype = weights[tensor]
            if tuple(have) != shape:
                raise WrongShape(tensor, shape, tuple(have))
            g.weight(name, shape, dtype, rows=rows, cols=cols, tensor=tensor)
        elif g.file_slice(name) != FileSlice(tensor, rows, cols):
            raise ValueError(f"{name} is read with two slices (a tied head is not split)")
        return g.weights[name]
    return w


def step_inputs(g):
    """The inputs every family's step graph reads, declared on `g`: tokens, positions and
    seq_rows [T], block_tables [S, B] and sample_tokens [R]."""
    return (g.input("tokens", ("T",)), g.input("positions", ("T",)),
            g.input("seq_rows", ("T",)), g.input("block_tables", ("S", "B")),
            g.input("sample_tokens", ("R",)))


# The Hugging Face names of the tensors outside the layers: the same in every family here.
HF_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
            "output_norm.weight", "lm_head.weight": "output.weight"}


def layer_tensor(hf_name):
    """(layer index, the rest of the name) of a Hugging Face layer tensor name
    (model.layers.N.rest), or None for a name outside the layers."""
    parts = hf_name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"]:
        return parts[2], parts[3]
    return None


def gguf_name_by(hf_name, layer_names):
    """The GGUF name of a Hugging Face tensor name by a family's table of its layer tensors'
    names (the rest of model.layers.N.rest -> its name in blk.N.), or None for tensors the model
    does not use."""
    if hf_name in HF_NAMES:
        return HF_NAMES[hf_name]
    layer = layer_tensor(hf_name)
    if layer is not None and layer[1] in layer_names:
        return f"blk.{layer[0]}.{layer_names[layer[1]]}"
    return None
