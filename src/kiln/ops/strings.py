"""String ops on NumPy object arrays of Python ``str``, and TfIdfVectorizer (n-gram counts
over integer or string tokens)."""

from __future__ import annotations

import functools
import re
import string

import numpy as np

from kiln.ops.registry import op


def _strings(x) -> np.ndarray:
    return np.asarray(x, dtype=object)


_UPPER = str.maketrans(string.ascii_lowercase, string.ascii_uppercase)
_LOWER = str.maketrans(string.ascii_uppercase, string.ascii_lowercase)


def _ascii_case(s: str, upper: bool) -> str:
    """The C and POSIX locales' case change (onnxruntime's there): ASCII letters only."""
    return s.translate(_UPPER if upper else _LOWER)


def _simple_case(s: str, upper: bool) -> str:
    """Unicode's one-character case mapping, as onnxruntime's per-character towupper and
    towlower give it in a UTF-8 locale: "ß" stays "ß" (Python's full mapping makes "SS"),
    "İ" lowers to "i" (Python's makes "i" and a combining dot)."""
    out = s.upper() if upper else s.lower()
    if len(out) == len(s):
        return out
    chars = []
    for c in s:
        m = c.upper() if upper else c.lower()
        if len(m) != 1:  # no one-character mapping but the titlecase one, if any
            t = c.title() if upper else m[0]
            m = t if len(t) == 1 else c
        chars.append(m)
    return "".join(chars)


@op("StringNormalizer", 10, differentiable=False)
def string_normalizer(x, *, case_change_action="NONE", is_case_sensitive=0, locale="",
                      stopwords=None):
    """Drops stop words from a [C] or [1, C] tensor, then changes case."""
    x = _strings(x)
    row = x.reshape(-1)
    if stopwords:
        if is_case_sensitive:
            stop = set(stopwords)
            keep = [s for s in row if s not in stop]
        else:
            stop = {w.casefold() for w in stopwords}
            keep = [s for s in row if s.casefold() not in stop]
    else:
        keep = list(row)
    if case_change_action in ("LOWER", "UPPER"):
        change = _ascii_case if locale in ("C", "POSIX") else _simple_case
        keep = [change(s, case_change_action == "UPPER") for s in keep]
    if not keep:
        keep = [""]
    y = np.empty(len(keep), dtype=object)
    y[:] = keep
    return y.reshape(1, -1) if x.ndim == 2 else y


@op("StringConcat", 20, differentiable=False)
def string_concat(x, y):
    x, y = _strings(x), _strings(y)
    out = np.empty(np.broadcast_shapes(x.shape, y.shape), dtype=object)
    out[...] = x + y  # object arrays add elementwise with str.__add__
    return out


@op("StringSplit", 20, differentiable=False)
def string_split(x, *, delimiter=None, maxsplit=None):
    """Splits each string; the substrings are padded with "" to the longest split."""
    x = _strings(x)
    sep = delimiter or None  # unset or "": split on runs of whitespace, Python-style
    limit = -1 if maxsplit is None else int(maxsplit)
    # An empty string has no substrings (Python's "".split(sep) would give [""]).
    parts = [(s.split(sep, limit) if sep else s.strip().split(None, limit)) if s else []
             for s in x.reshape(-1)]
    counts = np.array([len(p) for p in parts], dtype=np.int64).reshape(x.shape)
    width = max((len(p) for p in parts), default=0)
    y = np.full((len(parts), width), "", dtype=object)
    for i, p in enumerate(parts):
        y[i, :len(p)] = p
    return y.reshape(x.shape + (width,)), counts


_POSIX_CLASSES = {
    "alnum": "0-9A-Za-z", "alpha": "A-Za-z", "ascii": "\\x00-\\x7f", "blank": "\\t ",
    "cntrl": "\\x00-\\x1f\\x7f", "digit": "0-9", "graph": "!-~", "lower": "a-z",
    "print": " -~", "punct": "!-/:-@\\[-`{-~", "space": "\\t\\n\\v\\f\\r ", "upper": "A-Z",
    "word": "0-9A-Za-z_", "xdigit": "0-9A-Fa-f",
}


@functools.lru_cache(maxsize=64)
def _compile_re2(pattern: str) -> re.Pattern:
    """Compile an RE2 pattern with Python's ``re``. RE2's ASCII-only ``\\w \\d \\s \\b``
    map to re.ASCII; ``\\z``, ``\\Q...\\E`` and POSIX ``[[:name:]]`` classes are rewritten.
    RE2 rejects backreferences and lookaround, which Python would accept."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            nxt = pattern[i + 1]
            if nxt == "z":
                out.append("\\Z")
            elif nxt == "Q":
                end = pattern.find("\\E", i + 2)
                end = len(pattern) if end < 0 else end
                out.append(re.escape(pattern[i + 2:end]))
                i = end + 2
                continue
            else:
                out.append(pattern[i:i + 2])
            i += 2
            continue
        if in_class and pattern.startswith("[:", i):
            end = pattern.find(":]", i + 2)
            name = pattern[i + 2:end] if end > 0 else ""
            if name.lstrip("^") in _POSIX_CLASSES:
                if name.startswith("^"):
                    raise ValueError("negated POSIX classes [[:^name:]] are not supported")
                out.append(_POSIX_CLASSES[name])
                i = end + 2
                continue
        if c == "[" and not in_class:
            in_class = True
            out.append(c)
            # a ']' right after '[' or '[^' is a literal member
            j = i + 1 + (pattern[i + 1:i + 2] == "^")
            if pattern[j:j + 1] == "]":
                out.append(pattern[i + 1:j] + "\\]")
                i = j + 1
                continue
        elif c == "]" and in_class:
            in_class = False
            out.append(c)
        else:
            out.append(c)
        i += 1
    return re.compile("".join(out), re.ASCII)


@op("RegexFullMatch", 20, differentiable=False)
def regex_full_match(x, *, pattern=None):
    rx = _compile_re2(pattern or "")
    x = _strings(x)
    y = np.fromiter((rx.fullmatch(s) is not None for s in x.reshape(-1)), dtype=np.bool_,
                    count=x.size)
    return y.reshape(x.shape)


def _gram_table(pool, ngram_counts, ngram_indexes):
    """Per n: the pool's n-grams as an [P, n] array and their output coordinates."""
    pool = np.asarray(pool)
    starts = list(ngram_counts) + [len(pool)]
    table, k = {}, 0
    for n, (lo, hi) in enumerate(zip(starts[:-1], starts[1:]), start=1):
        grams = pool[lo:hi].reshape(-1, n)
        table[n] = (grams, np.arange(k, k + len(grams)))
        k += len(grams)
    return table


@op("TfIdfVectorizer", 9, differentiable=False)
def tfidf_vectorizer(x, *, mode=None, ngram_indexes=None, ngram_counts=None,
                     max_skip_count=None, min_gram_length=None, max_gram_length=None,
                     pool_int64s=None, pool_strings=None, weights=None):
    """Counts each pool n-gram (n in [min, max], gaps of 0..max_skip_count tokens between
    items) per row, then weights the counts by mode (TF, IDF, TFIDF)."""
    x = np.asarray(x)
    rows = x.reshape(1, -1) if x.ndim < 2 else x.reshape(x.shape[0], -1)
    pool = pool_strings if pool_strings is not None else pool_int64s
    pool_arr = np.asarray(pool, dtype=object if pool_strings is not None else np.int64)
    out_index = np.asarray(ngram_indexes, dtype=np.int64)
    width = int(out_index.max()) + 1 if out_index.size else 0
    counts = np.zeros((rows.shape[0], len(out_index)), dtype=np.float64)
    # Tokens become ids into the pool's vocabulary (-1: not in any pool n-gram), so
    # n-grams of both kinds compare as integer rows.
    vocab, pool_ids = np.unique(pool_arr, return_inverse=True)
    tok = _token_ids(rows, vocab)
    table = _gram_table(pool_ids.reshape(-1), ngram_counts, ngram_indexes)
    for n in range(max(min_gram_length, 1), max_gram_length + 1):
        if n not in table or not len(table[n][0]):
            continue
        grams, slots = table[n]
        for skip in range(max_skip_count + 1 if n > 1 else 1):
            span = (n - 1) * (skip + 1) + 1
            if span > tok.shape[1]:
                break
            starts = np.arange(tok.shape[1] - span + 1)
            windows = tok[:, starts[:, None] + np.arange(n) * (skip + 1)]  # [R, S, n]
            _count(windows.reshape(-1, n), grams, slots, rows.shape[0], counts)
    if mode in ("IDF", "TFIDF"):
        w = np.ones(len(out_index)) if weights is None else np.asarray(weights, np.float64)
        counts = (np.minimum(counts, 1) if mode == "IDF" else counts) * w
    y = np.zeros((rows.shape[0], width), dtype=np.float32)
    np.add.at(y, (slice(None), out_index), counts.astype(np.float32))
    return y[0] if x.ndim < 2 else y


def _token_ids(rows: np.ndarray, vocab: np.ndarray) -> np.ndarray:
    if vocab.dtype == object:
        lookup = {v: i for i, v in enumerate(vocab)}
        flat = [lookup.get(t, -1) for t in rows.reshape(-1)]
        return np.asarray(flat, dtype=np.int64).reshape(rows.shape)
    vals = rows.astype(np.int64)
    pos = np.clip(np.searchsorted(vocab, vals), 0, max(len(vocab) - 1, 0))
    hit = vocab[pos] == vals if len(vocab) else np.zeros(vals.shape, bool)
    return np.where(hit, pos, -1)


def _count(found: np.ndarray, grams: np.ndarray, slots: np.ndarray, num_rows: int,
           counts: np.ndarray) -> None:
    """Add, per row, how often each pool n-gram (``grams``) occurs among ``found``
    (row-major [R * S, n] windows)."""
    per_row = len(found) // num_rows
    keep = (found >= 0).all(axis=1)
    if not keep.any():
        return
    both = np.concatenate([grams, found[keep]])
    _, inv = np.unique(both, axis=0, return_inverse=True)
    inv = inv.reshape(-1)
    gram_of_key = np.full(inv.max() + 1, -1, dtype=np.int64)
    gram_of_key[inv[:len(grams)]] = np.arange(len(grams))
    which = gram_of_key[inv[len(grams):]]
    row = np.nonzero(keep)[0] // per_row
    hit = which >= 0
    np.add.at(counts, (row[hit], slots[which[hit]]), 1)
