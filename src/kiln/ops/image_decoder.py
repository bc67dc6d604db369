"""ImageDecoder. With Pillow importable (an optional dependency) every format it reads is
decoded by it; without, Kiln decodes the simple formats itself: BMP, PNM (PBM/PGM/PPM),
PNG and TIFF (uncompressed, PackBits or Deflate), to the same pixels Pillow gives for
8-bit images (16-bit grayscale is scaled to 8 bits, where Pillow saturates it). JPEG,
JPEG 2000, WebP and LZW-compressed TIFF need Pillow: without it they raise an error that
says so, rather than the empty result the spec gives for corrupt streams."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np

from kiln.ops.registry import op


class _Unsupported(Exception):
    """A format (or a variant of one) only Pillow can decode."""


@op("ImageDecoder", 20, differentiable=False)
def image_decoder(encoded_stream, *, pixel_format="RGB"):
    """Decodes to uint8 [H, W, 3] (RGB or BGR) or [H, W, 1] (Grayscale); a stream that
    cannot be decoded gives an empty [0, 0, C] tensor, as the spec asks."""
    channels = 1 if pixel_format == "Grayscale" else 3
    data = np.asarray(encoded_stream, dtype=np.uint8).tobytes()
    try:
        img = _decode_with_pillow(data, pixel_format)
        if img is None:
            img = _to_format(_decode_builtin(data), pixel_format)
    except _Unsupported as e:
        raise ValueError(f"ImageDecoder: {e}; install Pillow (pip install pillow) to decode "
                         "it (built in: BMP, PNG, PNM, uncompressed/PackBits/Deflate TIFF)"
                         ) from None
    except Exception:  # noqa: BLE001 - corrupt stream: the spec's empty result
        return np.zeros((0, 0, channels), dtype=np.uint8)
    return img


def _decode_with_pillow(data: bytes, pixel_format: str):
    try:
        from PIL import Image
    except ImportError:
        return None
    with Image.open(io.BytesIO(data)) as im:
        if pixel_format == "Grayscale":
            return np.asarray(im.convert("L"), dtype=np.uint8)[..., None]
        rgb = np.asarray(im.convert("RGB"), dtype=np.uint8)
    return np.ascontiguousarray(rgb[..., ::-1]) if pixel_format == "BGR" else rgb


def _to_format(img: np.ndarray, pixel_format: str) -> np.ndarray:
    """[H, W] gray or [H, W, 3] RGB -> the asked layout (Pillow's integer luma weights)."""
    if pixel_format == "Grayscale":
        if img.ndim == 3:
            r, g, b = (img[..., i].astype(np.uint32) for i in range(3))
            img = ((r * 19595 + g * 38470 + b * 7471 + 0x8000) >> 16).astype(np.uint8)
        return img[..., None]
    if img.ndim == 2:
        img = np.repeat(img[..., None], 3, axis=2)
    return np.ascontiguousarray(img[..., ::-1]) if pixel_format == "BGR" else img


def _decode_builtin(data: bytes) -> np.ndarray:
    if data[:2] == b"BM":
        return _bmp(data)
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return _png(data)
    if data[:1] == b"P" and data[1:2] in b"123456":
        return _pnm(data)
    if data[:4] in (b"II*\x00", b"MM\x00*"):
        return _tiff(data)
    if data[:2] == b"\xff\xd8":
        raise _Unsupported("JPEG needs a decoder Kiln does not include")
    if data[4:8] == b"jP  " or data[:4] == b"\xff\x4f\xff\x51":
        raise _Unsupported("JPEG 2000 needs a decoder Kiln does not include")
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        raise _Unsupported("WebP needs a decoder Kiln does not include")
    raise ValueError("unknown image format")


def _palette_lookup(indices: np.ndarray, palette: np.ndarray) -> np.ndarray:
    return palette[np.minimum(indices, len(palette) - 1)]


def _unpack_bits(rows: np.ndarray, bits: int, width: int) -> np.ndarray:
    """[H, row bytes] of packed ``bits``-bit samples (MSB first) -> [H, width] values."""
    if bits == 8:
        return rows[:, :width]
    shifts = np.arange(8 - bits, -1, -bits, dtype=np.uint8)
    vals = (rows[:, :, None] >> shifts) & ((1 << bits) - 1)
    return vals.reshape(rows.shape[0], -1)[:, :width]


# -- BMP --------------------------------------------------------------------------------


def _bmp(data: bytes) -> np.ndarray:
    offset, dib = struct.unpack_from("<II", data, 10)
    if dib == 12:  # OS/2 core header
        w, h, _, bpp = struct.unpack_from("<HHHH", data, 18)
        comp, ncolors, pal_entry = 0, 0, 3
    else:
        w, h, _, bpp, comp = struct.unpack_from("<iiHHI", data, 18)
        ncolors = struct.unpack_from("<I", data, 46)[0] if dib >= 40 else 0
        pal_entry = 4
    if comp not in (0, 3):
        raise _Unsupported("compressed (RLE) BMP")
    top_down = h < 0
    h = abs(h)
    stride = (bpp * w + 31) // 32 * 4
    raw = np.frombuffer(data, np.uint8, stride * h, offset).reshape(h, stride)
    if not top_down:
        raw = raw[::-1]
    if bpp <= 8:
        n = ncolors or (1 << bpp)
        pal = np.frombuffer(data, np.uint8, n * pal_entry, 14 + dib).reshape(n, pal_entry)
        img = _palette_lookup(_unpack_bits(raw, bpp, w), pal[:, 2::-1])
    elif bpp == 24:
        img = raw[:, :w * 3].reshape(h, w, 3)[..., ::-1]
    elif bpp in (16, 32):
        px = raw[:, :w * bpp // 8].copy().view("<u2" if bpp == 16 else "<u4")
        if comp == 3:
            masks = struct.unpack_from("<III", data, 54 if dib == 40 else 14 + 40)
        else:
            masks = (0x7C00, 0x03E0, 0x001F) if bpp == 16 else (0xFF0000, 0xFF00, 0xFF)
        img = np.stack([_mask_channel(px, m) for m in masks], axis=-1)
    else:
        raise _Unsupported(f"{bpp}-bit BMP")
    return np.ascontiguousarray(img, dtype=np.uint8)


def _mask_channel(px: np.ndarray, mask: int) -> np.ndarray:
    if not mask:
        return np.zeros(px.shape, np.uint8)
    shift = (mask & -mask).bit_length() - 1
    top = (mask >> shift)
    return ((px.astype(np.uint32) >> shift & top) * 255 // top).astype(np.uint8)


# -- PNM --------------------------------------------------------------------------------


def _pnm(data: bytes) -> np.ndarray:
    kind = data[1] - ord("0")
    fields, pos = [], 2
    need = 2 if kind in (1, 4) else 3
    while len(fields) < need:  # header tokens, with '#' comments to end of line
        while data[pos:pos + 1].isspace():
            pos += 1
        if data[pos:pos + 1] == b"#":
            pos = data.index(b"\n", pos)
            continue
        end = pos
        while end < len(data) and not data[end:end + 1].isspace():
            end += 1
        fields.append(int(data[pos:end]))
        pos = end
    w, h = fields[0], fields[1]
    maxval = fields[2] if need == 3 else 1
    chans = 3 if kind in (3, 6) else 1
    if kind in (1, 2, 3):  # ASCII
        if kind == 1:
            digits = [c for c in data[pos:].decode("ascii") if c in "01"]
            vals = np.array(digits[:w * h], dtype=np.uint8).reshape(h, w)
        else:
            vals = np.array(data[pos:].split()[:w * h * chans], dtype=np.int64)
    else:
        pos += 1  # the single whitespace before the raster
        if kind == 4:
            stride = (w + 7) // 8
            rows = np.frombuffer(data, np.uint8, stride * h, pos).reshape(h, stride)
            vals = _unpack_bits(rows, 1, w)
        else:
            dt = np.dtype(np.uint8) if maxval < 256 else np.dtype(">u2")
            vals = np.frombuffer(data, dt, w * h * chans, pos).astype(np.int64)
    if kind in (1, 4):  # bitmaps: 1 is black
        return np.where(vals.reshape(h, w) == 1, 0, 255).astype(np.uint8)
    vals = vals.reshape((h, w, 3) if chans == 3 else (h, w))
    if maxval != 255:
        vals = (vals * 255 + maxval // 2) // maxval
    return vals.astype(np.uint8)


# -- PNG --------------------------------------------------------------------------------

_ADAM7 = [(0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2),
          (0, 1, 1, 2)]  # (x0, y0, dx, dy) of each interlace pass


def _png(data: bytes) -> np.ndarray:
    pos, idat, palette, trns = 8, [], None, None
    while pos < len(data):
        length, kind = struct.unpack_from(">I4s", data, pos)
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            w, h, depth, ctype, _, _, interlace = struct.unpack(">IIBBBBB", body)
        elif kind == b"PLTE":
            palette = np.frombuffer(body, np.uint8).reshape(-1, 3)
        elif kind == b"tRNS":
            trns = body
        elif kind == b"IDAT":
            idat.append(body)
        elif kind == b"IEND":
            break
        pos += 12 + length
    del trns  # transparency is dropped, as Pillow's convert("RGB") does
    raw = zlib.decompress(b"".join(idat))
    samples = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}[ctype]
    if interlace:
        img = np.zeros((h, w, samples), np.uint16)
        off = 0
        for x0, y0, dx, dy in _ADAM7:
            pw, ph = (w - x0 + dx - 1) // dx, (h - y0 + dy - 1) // dy
            if pw and ph:
                part, off = _png_pass(raw, off, pw, ph, depth, samples)
                img[y0::dy, x0::dx] = part
    else:
        img, _ = _png_pass(raw, 0, w, h, depth, samples)
    if ctype == 3:
        return _palette_lookup(img[..., 0], palette)
    if depth == 16:
        img = img >> 8
    elif depth < 8:  # gray scaled to 0..255
        img = img * (255 // ((1 << depth) - 1))
    img = img.astype(np.uint8)
    return img[..., 0] if ctype in (0, 4) else img[..., :3]


def _png_pass(raw: bytes, off: int, w: int, h: int, depth: int, samples: int):
    """Unfilter one (sub-)image; returns [h, w, samples] samples and the next offset."""
    bpp = max(1, depth * samples // 8)
    stride = (w * samples * depth + 7) // 8
    rows = np.zeros((h, stride), np.uint8)
    prior = np.zeros(stride, np.uint8)
    for y in range(h):
        ftype = raw[off]
        line = np.frombuffer(raw, np.uint8, stride, off + 1)
        off += 1 + stride
        rows[y] = prior = _unfilter(ftype, line, prior, bpp)
    if depth == 16:
        vals = rows.view(">u2").astype(np.uint16)
    else:
        vals = _unpack_bits(rows, depth, w * samples).astype(np.uint16)
    return vals.reshape(h, w, samples), off


def _unfilter(ftype: int, line: np.ndarray, prior: np.ndarray, bpp: int) -> np.ndarray:
    if ftype == 0:
        return line
    if ftype == 2:  # Up
        return line + prior
    if ftype == 1:  # Sub: a running sum per byte lane, modulo 256
        n = len(line)
        pad = (-n) % bpp
        lanes = np.concatenate([line, np.zeros(pad, np.uint8)]).reshape(-1, bpp)
        return (np.cumsum(lanes, axis=0, dtype=np.uint64) % 256).astype(np.uint8).reshape(-1)[:n]
    # Average and Paeth depend on the byte just decoded: a sequential byte loop.
    out = bytearray(line.tobytes())
    up = prior.tobytes()
    if ftype == 3:
        for i in range(len(out)):
            left = out[i - bpp] if i >= bpp else 0
            out[i] = (out[i] + ((left + up[i]) >> 1)) & 0xFF
    elif ftype == 4:
        for i in range(len(out)):
            a = out[i - bpp] if i >= bpp else 0
            b = up[i]
            c = up[i - bpp] if i >= bpp else 0
            p = a + b - c
            pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
            pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
            out[i] = (out[i] + pred) & 0xFF
    else:
        raise ValueError(f"bad PNG filter type {ftype}")
    return np.frombuffer(bytes(out), np.uint8)


# -- TIFF -------------------------------------------------------------------------------


def _tiff(data: bytes) -> np.ndarray:
    end = "<" if data[:2] == b"II" else ">"
    (ifd,) = struct.unpack_from(end + "I", data, 4)
    (count,) = struct.unpack_from(end + "H", data, ifd)
    sizes = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 1, 7: 1, 8: 2, 9: 4, 10: 8, 11: 4, 12: 8, 16: 8}
    codes = {1: "B", 3: "H", 4: "I", 6: "b", 8: "h", 9: "i", 16: "Q"}
    tags: dict[int, list[int]] = {}
    for i in range(count):
        tag, typ, n = struct.unpack_from(end + "HHI", data, ifd + 2 + 12 * i)
        if typ not in codes:
            continue
        where = ifd + 2 + 12 * i + 8
        if sizes[typ] * n > 4:
            (where,) = struct.unpack_from(end + "I", data, where)
        tags[tag] = list(struct.unpack_from(end + codes[typ] * n, data, where))
    w, h = tags[256][0], tags[257][0]
    bits = tags.get(258, [1])
    spp = tags.get(277, [1])[0]
    comp = tags.get(259, [1])[0]
    photometric = tags.get(262, [1])[0]
    if tags.get(284, [1])[0] != 1:
        raise _Unsupported("planar TIFF")
    if any(b != 8 for b in bits) and not (photometric == 3 and bits[0] in (4, 8)):
        raise _Unsupported(f"{bits[0]}-bit TIFF")
    strips = [_tiff_strip(data[o:o + n], comp)
              for o, n in zip(tags[273], tags.get(279, [len(data)]))]
    raw = np.frombuffer(b"".join(strips), np.uint8)
    depth = bits[0]
    stride = (w * spp * depth + 7) // 8
    rows = raw[:stride * h].reshape(h, stride)
    if tags.get(317, [1])[0] == 2:  # horizontal differencing predictor
        lanes = rows.reshape(h, -1, spp)
        rows = (np.cumsum(lanes, axis=1, dtype=np.uint64) % 256).astype(np.uint8).reshape(h, -1)
    vals = _unpack_bits(rows, depth, w * spp).reshape(h, w, spp)
    if photometric == 3:
        cmap = np.asarray(tags[320], np.uint16).reshape(3, -1).T >> 8
        return _palette_lookup(vals[..., 0], cmap.astype(np.uint8))
    if photometric in (0, 1):
        gray = vals[..., 0]
        return 255 - gray if photometric == 0 else gray
    if photometric == 2:
        return np.ascontiguousarray(vals[..., :3])
    raise _Unsupported(f"TIFF photometric interpretation {photometric}")


def _tiff_strip(chunk: bytes, comp: int) -> bytes:
    if comp == 1:
        return chunk
    if comp in (8, 32946):
        return zlib.decompress(chunk)
    if comp == 32773:  # PackBits
        out, i = bytearray(), 0
        while i < len(chunk):
            n = chunk[i]
            if n < 128:
                out += chunk[i + 1:i + 2 + n]
                i += 2 + n
            elif n > 128:
                out += chunk[i + 1:i + 2] * (257 - n)
                i += 2
            else:
                i += 1
        return bytes(out)
    raise _Unsupported(f"TIFF compression {comp}")
