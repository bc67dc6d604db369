"""Kiln's exception types: every error a user can cause is one of these, with a message
that says what went wrong and what to do about it."""


class KilnError(Exception):
    """Base class of every error Kiln raises on purpose."""


class ModelLoadError(KilnError):
    """The model file or bytes could not be read: malformed, truncated, or inconsistent."""


class InvalidAttributeError(ModelLoadError):
    """A node's attribute has a value its op does not define: outside an enumeration, a
    flag other than 0 or 1, an axis outside its input's rank. ``node``, ``attribute`` and
    ``allowed`` say which and what would be accepted."""

    def __init__(self, message: str, node: str = "", attribute: str = "", allowed: str = ""):
        super().__init__(message)
        self.node, self.attribute, self.allowed = node, attribute, allowed


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


class MissingDependencyError(KilnError, ImportError):
    """An optional package Kiln needs for what was asked is not installed.

    ``module`` is the package that failed to import and ``install`` the command that
    installs it (``pip install -e ".[zoo]"``); the message names both in one line. It is
    also an ``ImportError``, so code that treats a missing import as "not available" keeps
    working.
    """

    def __init__(self, module: str, install: str, needed_for: str):
        super().__init__(f"{needed_for} needs {module}, which is not installed: {install}")
        self.module = module
        self.name = module  # ImportError's own attribute for the module that is missing
        self.install = install
        self.needed_for = needed_for


class SaveError(KilnError, OSError):
    """A file could not be written (disk full, no permission, no such folder); the message
    says what to do, and a file that was at the path before is unchanged. Also an
    ``OSError`` with the system's ``errno``."""

    def __init__(self, message: str, errno: int | None = None):
        super().__init__(message)
        self.errno = errno


class OptionError(KilnError, ValueError):
    """An option that is not valid: an unknown backend, a device or precision the backend
    does not offer. The message says which values are accepted."""


class RunCancelledError(KilnError):
    """A run stopped before it finished because its caller asked it to: ``terminate`` was
    set on its ``RunOptions`` (from any thread), or it passed its time limit."""
