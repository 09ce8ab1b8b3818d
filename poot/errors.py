"""The one error hierarchy of poot.

Every error a person can act on is a `PootError` carrying the facts needed to act, raised where
the fact is known. `exit_status` is the process exit status the CLI turns it into (the table in
docs/backends.md); the message is one line.
"""


class PootError(Exception):
    exit_status = 1


class UsageError(PootError):
    """A flag, argument or value is malformed."""
    exit_status = 2


class NoSuchDevice(UsageError):
    """A device ordinal that the backend's driver does not list (it lists others)."""


class BackendUnavailable(PootError):
    """The named (or every probed) backend cannot open."""
    exit_status = 3


class ModelRefused(PootError):
    """An operation of the model needs a capability the device lacks."""
    exit_status = 4


class PlacementRefused(PootError):
    """A device group on a backend that cannot run one, or device timing over a group."""
    exit_status = 5


class CapacityError(PootError):
    """No serving shape fits the device memory, or the free memory is unknown."""
    exit_status = 6


class PlanMismatch(CapacityError):
    """After allocating, the device's own accounting disagrees with the memory plan beyond the
    allocator's granularity: the plan cannot be trusted, so nothing is served."""


class ModelFileError(PootError):
    """A model file is unreadable or invalid; names the file and, where known, tensor and offset."""
    exit_status = 7

    def __init__(self, path, reason, tensor=None, offset=None):
        self.path, self.reason, self.tensor, self.offset = str(path), reason, tensor, offset
        where = self.path
        if tensor is not None:
            where += f", tensor {tensor!r}"
        if offset is not None:
            where += f", offset {offset}"
        super().__init__(f"{where}: {reason}")


class ServingFailed(PootError):
    """While serving, the engine could serve no more (its device lost to a sticky driver
    error, or a fault outside any step): the server drained and stopped, for a supervisor to
    start it again."""
    exit_status = 8


class TemplateError(PootError):
    """A chat template could not be rendered (bad template, or messages it rejects)."""
    exit_status = 2
