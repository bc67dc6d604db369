"""Kiln's exception types: every error a user can cause is one of these, with a message
that says what went wrong and what to do about it."""


class KilnError(Exception):
    """Base class of every error Kiln raises on purpose."""


class ModelLoadError(KilnError):
    """The model file or bytes could not be read: malformed, truncated, or inconsistent."""


class ExternalDataError(ModelLoadError):
    """An external-data reference is refused (outside the model's folder) or unreadable."""


class UnsupportedOpError(KilnError):
    """The model uses operators Kiln cannot run; ``ops`` lists every one of them."""

    def __init__(self, message: str, ops: list[tuple[str, str, int]]):
        super().__init__(message)
        self.ops = ops


class InputError(KilnError):
    """A feed given to ``run`` does not match the model: unknown or missing name,
    wrong dtype, rank or dimension."""


class ShapeError(KilnError):
    """Shapes of values are inconsistent with what an operator requires."""


class KernelError(KilnError):
    """An operator failed while running; the message names the layer."""
