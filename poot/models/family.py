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
