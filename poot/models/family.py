"""What a family's forward pass raises when a file's weights do not fit its config."""


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
