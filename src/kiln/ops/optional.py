"""Optional ops. An empty optional is None and a non-empty one is its value itself, so
these ops mostly pass values through."""

from __future__ import annotations

import numpy as np

from kiln.ops.registry import op


@op("Optional", 15)
def optional(x=None, *, type=None):
    return x


@op("OptionalHasElement", 15)
def optional_has_element(x=None):
    return np.array(x is not None)


@op("OptionalGetElement", 15)
def optional_get_element(x):
    if x is None:
        raise ValueError("OptionalGetElement on an empty optional")
    return x
