"""The optimizer's old module name, kept so ``from kiln.optimize import ...`` still works.
The module is :mod:`kiln.optimizer`; the package attribute ``kiln.optimize`` is the
function (``kiln.optimize(model)``), which this name used to shadow."""

from kiln.optimizer import (  # noqa: F401 - re-exported under the old module name
    DEFAULT_LEVEL,
    LEVELS,
    MARK,
    PASS_NAMES,
    STAGES,
    optimize,
    optimize_for_session,
    optimize_with_report,
)
