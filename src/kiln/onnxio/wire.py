"""The main graph's initializer bytes, found in a serialized ModelProto without parsing it.

Parsing a whole file holds the weights three times at once: the file's bytes, protobuf's
copy of them, and the arrays made from that. :func:`split_initializers` walks the protobuf
wire format instead (ModelProto.graph, GraphProto.initializer, TensorProto.raw_data) and
returns the model without those raw bytes, plus where each one lies in the buffer, so the
importer parses only the small rest and reads each initializer straight into its array.
"""

from __future__ import annotations

_GRAPH = 7  # ModelProto.graph
_INITIALIZER = 5  # GraphProto.initializer
_RAW_DATA = 9  # TensorProto.raw_data
_LEN = 2  # wire type of length-delimited fields


class Malformed(Exception):
    """The buffer is not well-formed protobuf (the caller parses it normally and reports)."""


def split_initializers(buf) -> tuple[bytes, list[tuple[int, int] | None]]:
    """``(rest, raw)``: ``buf`` (bytes or an mmap) without the ``raw_data`` of the main
    graph's initializers, and ``raw[i]``, the ``(offset, length)`` in ``buf`` of the
    ``raw_data`` of initializer ``i`` (None where it has none). Initializers are numbered in
    file order, which is the order a parser gives them even when the graph field is split
    in several pieces (protobuf merges them). Raises :class:`Malformed`."""
    raw: list[tuple[int, int] | None] = []

    def graph(body: int, stop: int) -> bytes:
        return _rewrite(buf, body, stop, _INITIALIZER, "initializer",
                        lambda b, e: _tensor(buf, b, e, raw))
    return _rewrite(buf, 0, len(buf), _GRAPH, "graph", graph), raw


def _rewrite(buf, start: int, end: int, field: int, name: str, inner) -> bytes:
    """The message in ``buf[start:end]`` with each length-delimited ``field`` replaced by
    ``inner(payload start, field end)``; the other fields are copied as they are."""
    out: list[bytes] = []
    copied = start
    for number, wire, at, body, stop in _fields(buf, start, end):
        if number == field:
            if wire != _LEN:
                raise Malformed(f"{name} field of the wrong wire type")
            out.append(buf[copied:at])
            out.append(_message(field, inner(body, stop)))
            copied = stop
    out.append(buf[copied:end])
    return b"".join(out)


def _tensor(buf, start: int, end: int, raw: list) -> bytes:
    out: list[bytes] = []
    copied = start
    where = None
    for field, wire, at, body, stop in _fields(buf, start, end):
        if field == _RAW_DATA:
            if wire != _LEN:
                raise Malformed("raw_data field of the wrong wire type")
            out.append(buf[copied:at])
            copied = stop
            where = (body, stop - body)  # a repeated scalar field: the last one counts
    out.append(buf[copied:end])
    raw.append(where)
    return b"".join(out)


def _fields(buf, pos: int, end: int):
    """``(field number, wire type, field start, payload start, field end)`` of each field
    of the message in ``buf[pos:end]``."""
    while pos < end:
        start = pos
        key, pos = _varint(buf, pos, end)
        wire = key & 7
        body = pos
        if wire == 0:
            _, pos = _varint(buf, pos, end)
        elif wire == 1:
            pos += 8
        elif wire == _LEN:
            n, body = _varint(buf, pos, end)
            pos = body + n
        elif wire == 5:
            pos += 4
        else:  # groups (long deprecated) and invalid wire types
            raise Malformed(f"wire type {wire}")
        if pos > end or key >> 3 == 0:
            raise Malformed("field runs past its message")
        yield key >> 3, wire, start, body, pos


def _varint(buf, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise Malformed("truncated varint")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7


def _message(field: int, payload: bytes) -> bytes:
    return _encode((field << 3) | _LEN) + _encode(len(payload)) + payload


def _encode(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)
