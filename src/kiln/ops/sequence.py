"""Sequence ops. A sequence value is a Python list of arrays; every op returns a new list
so no value a graph still holds is ever mutated."""

from __future__ import annotations

import numpy as np

from kiln.ops._array import axis as norm_axis
from kiln.ops.registry import op


def _index(position) -> int:
    return int(np.asarray(position).reshape(-1)[0])


def _position(position, n: int, *, insert: bool = False) -> int:
    """A position in a sequence of length ``n``, negatives counting from the back; insert
    positions may also be ``n`` (append)."""
    p = _index(position)
    q = p + n if p < 0 else p
    if not 0 <= q < n + insert:
        raise IndexError(f"position {p} is out of range for a sequence of length {n}")
    return q


@op("SequenceConstruct", 11)
def sequence_construct(*inputs):
    return list(inputs)


@op("SequenceEmpty", 11)
def sequence_empty(*, dtype=1):
    return []


@op("SequenceLength", 11)
def sequence_length(seq):
    return np.array(len(seq), dtype=np.int64)


@op("SequenceAt", 11)
def sequence_at(seq, position):
    return seq[_position(position, len(seq))]


@op("SequenceInsert", 11)
def sequence_insert(seq, tensor, position=None):
    out = list(seq)
    if position is None:
        out.append(tensor)
    else:
        out.insert(_position(position, len(seq), insert=True), tensor)
    return out


@op("SequenceErase", 11)
def sequence_erase(seq, position=None):
    out = list(seq)
    del out[-1 if position is None else _position(position, len(seq))]
    return out


@op("SplitToSequence", 11)
def split_to_sequence(x, split=None, *, axis=0, keepdims=1):
    x = np.asarray(x)
    ax = norm_axis(axis, x.ndim)
    size = x.shape[ax]
    if split is None:
        parts = np.split(x, size, axis=ax) if size else []
        return [np.squeeze(p, axis=ax) for p in parts] if not keepdims else parts
    split = np.asarray(split)
    if split.ndim == 0:
        step = int(split)
        bounds = list(range(step, size, step))
    else:
        bounds = np.cumsum(split.astype(np.int64))[:-1].tolist()
    return np.split(x, bounds, axis=ax)


@op("ConcatFromSequence", 11)
def concat_from_sequence(seq, *, axis=None, new_axis=0):
    if not seq:
        raise ValueError("ConcatFromSequence needs a non-empty sequence")
    rank = np.ndim(seq[0])
    if new_axis:
        return np.stack(seq, axis=norm_axis(axis, rank + 1))
    return np.concatenate(seq, axis=norm_axis(axis, rank))


@op("SequenceMap", 17)
def sequence_map(ctx, seq, *additional, body):
    """Runs ``body`` once per element; sequence inputs contribute their i-th element,
    tensor inputs the whole tensor."""
    outs: list[list] = [[] for _ in range(ctx.num_outputs)]
    for i in range(len(seq)):
        args = [seq[i]] + [a[i] if isinstance(a, list) else a for a in additional]
        for acc, y in zip(outs, ctx.run(body, args)):
            acc.append(y)
    return tuple(outs) if ctx.num_outputs != 1 else outs[0]
