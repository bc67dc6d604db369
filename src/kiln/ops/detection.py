"""Detection ops: NonMaxSuppression, RoiAlign, MaxRoiPool."""

from __future__ import annotations

import math

import numpy as np

from kiln.ops.conv import work_dtype
from kiln.ops.registry import op


def _scalar(v, default):
    return default if v is None or np.size(v) == 0 else np.asarray(v).reshape(-1)[0].item()


def _corners(boxes, center_point_box):
    """(y1, x1, y2, x2) with y1 <= y2 and x1 <= x2, as float64 columns."""
    b = boxes.astype(np.float64)
    if center_point_box:
        xc, yc, w, h = b[:, 0], b[:, 1], b[:, 2], b[:, 3]
        return yc - h / 2, xc - w / 2, yc + h / 2, xc + w / 2
    y1, x1, y2, x2 = b[:, 0], b[:, 1], b[:, 2], b[:, 3]
    return np.minimum(y1, y2), np.minimum(x1, x2), np.maximum(y1, y2), np.maximum(x1, x2)


def _nms_one(corners, scores, limit, iou_threshold, score_threshold):
    """Greedy NMS of one batch item and class: the kept box indices, best first."""
    y1, x1, y2, x2 = corners
    area = (y2 - y1) * (x2 - x1)
    cand = np.nonzero(scores > score_threshold)[0] if score_threshold is not None else \
        np.arange(scores.size)
    order = cand[np.argsort(-scores[cand], kind="stable")]
    keep = []
    while order.size and len(keep) < limit:
        i = order[0]
        keep.append(int(i))
        rest = order[1:]
        ih = np.clip(np.minimum(y2[i], y2[rest]) - np.maximum(y1[i], y1[rest]), 0, None)
        iw = np.clip(np.minimum(x2[i], x2[rest]) - np.maximum(x1[i], x1[rest]), 0, None)
        inter = ih * iw
        union = area[i] + area[rest] - inter
        with np.errstate(invalid="ignore", divide="ignore"):
            iou = np.where(union > 0, inter / union, 0.0)
        order = rest[~(iou > iou_threshold)]
    return keep


@op("NonMaxSuppression", 10, host_inputs=(2, 3, 4), differentiable=False)
def non_max_suppression(boxes, scores, max_output_boxes_per_class=None, iou_threshold=None,
                        score_threshold=None, *, center_point_box=0):
    limit = int(_scalar(max_output_boxes_per_class, 0))
    iou_t = float(_scalar(iou_threshold, 0.0))
    score_t = None if score_threshold is None else float(_scalar(score_threshold, 0.0))
    rows = []
    if limit > 0:
        for b in range(scores.shape[0]):
            corners = _corners(boxes[b], center_point_box)
            for c in range(scores.shape[1]):
                s = scores[b, c].astype(np.float64)
                rows += [(b, c, i) for i in _nms_one(corners, s, limit, iou_t, score_t)]
    return np.array(rows, dtype=np.int64).reshape(-1, 3)


def _axis_samples(start, size, bins, grid, extent):
    """Sample coordinates along one axis of an RoI and their bilinear neighbours: low and
    high indices, their weights, and which samples fall inside the map."""
    step = size / bins
    pos = (start + np.arange(bins)[:, None] * step
           + (np.arange(grid)[None, :] + 0.5) * step / grid).reshape(-1)
    valid = (pos >= -1.0) & (pos <= extent)
    pos = np.maximum(pos, 0.0)
    low = np.floor(pos).astype(np.int64)
    edge = low >= extent - 1
    low = np.where(edge, extent - 1, low)
    high = np.where(edge, extent - 1, low + 1)
    pos = np.where(edge, low, pos)
    frac = pos - low
    return low, high, 1 - frac, frac, valid


def _roi_align_one(fmap, roi, out_h, out_w, sampling_ratio, half_pixel, mode):
    """RoiAlign of one RoI over one (C, H, W) map."""
    h, w = fmap.shape[1:]
    # RoI geometry in the map's precision: the adaptive grid size (a ceil) depends on it.
    one = fmap.dtype.type(1)
    x1, y1, x2, y2 = roi - fmap.dtype.type(0.5 if half_pixel else 0)
    rh, rw = y2 - y1, x2 - x1
    if not half_pixel:
        rh, rw = max(rh, one), max(rw, one)
    gh = sampling_ratio if sampling_ratio > 0 else math.ceil(rh / fmap.dtype.type(out_h))
    gw = sampling_ratio if sampling_ratio > 0 else math.ceil(rw / fmap.dtype.type(out_w))
    x1, y1, rh, rw = float(x1), float(y1), float(rh), float(rw)
    ylo, yhi, wyl, wyh, vy = _axis_samples(y1, rh, out_h, gh, h)
    xlo, xhi, wxl, wxh, vx = _axis_samples(x1, rw, out_w, gw, w)
    valid = (vy[:, None] & vx[None, :]).astype(fmap.dtype)
    c = fmap.shape[0]
    if mode == "max":
        corners = [fmap[:, ya][:, :, xa] * (wy[:, None] * wx[None, :] * valid)
                   for ya, wy in ((ylo, wyl), (yhi, wyh)) for xa, wx in ((xlo, wxl), (xhi, wxh))]
        val = np.maximum(np.maximum(corners[0], corners[1]), np.maximum(corners[2], corners[3]))
        return val.reshape(c, out_h, gh, out_w, gw).max(axis=(2, 4))
    rows = fmap[:, ylo] * wyl[:, None] + fmap[:, yhi] * wyh[:, None]  # (C, Sy, W)
    val = rows[:, :, xlo] * wxl + rows[:, :, xhi] * wxh
    val *= valid
    return val.reshape(c, out_h, gh, out_w, gw).sum(axis=(2, 4)) / max(gh * gw, 1)


def _roi_align(x, rois, batch_indices, coordinate_transformation_mode, mode, output_height,
               output_width, sampling_ratio, spatial_scale):
    if isinstance(mode, bytes):
        mode = mode.decode()
    if isinstance(coordinate_transformation_mode, bytes):
        coordinate_transformation_mode = coordinate_transformation_mode.decode()
    wd = work_dtype(x.dtype)
    xw = x.astype(wd, copy=False)
    half = coordinate_transformation_mode == "half_pixel"
    y = np.zeros((rois.shape[0], x.shape[1], output_height, output_width), wd)
    for r in range(rois.shape[0]):
        roi = rois[r].astype(wd) * wd.type(spatial_scale)
        y[r] = _roi_align_one(xw[int(batch_indices[r])], roi, output_height, output_width,
                              sampling_ratio, half, mode)
    return y.astype(x.dtype, copy=False)


@op("RoiAlign", 10, host_inputs=(2,))
def roi_align_10(x, rois, batch_indices, *, mode="avg", output_height=1, output_width=1,
                 sampling_ratio=0, spatial_scale=1.0):
    """Opset 10: coordinates without the half-pixel shift."""
    return _roi_align(x, rois, batch_indices, "output_half_pixel", mode, output_height,
                      output_width, sampling_ratio, spatial_scale)


@op("RoiAlign", 16, host_inputs=(2,))
def roi_align(x, rois, batch_indices, *, coordinate_transformation_mode="half_pixel",
              mode="avg", output_height=1, output_width=1, sampling_ratio=0,
              spatial_scale=1.0):
    return _roi_align(x, rois, batch_indices, coordinate_transformation_mode, mode,
                      output_height, output_width, sampling_ratio, spatial_scale)


def _round_half_away(v: float) -> int:
    return int(math.floor(v + 0.5)) if v >= 0 else -int(math.floor(-v + 0.5))


@op("MaxRoiPool", 1)
def max_roi_pool(x, rois, *, pooled_shape=None, spatial_scale=1.0):
    """Max over each of pooled_shape bins of the rounded RoI (Fast R-CNN RoI pooling);
    empty bins give 0."""
    ph_n, pw_n = pooled_shape
    h, w = x.shape[2:]
    y = np.zeros((rois.shape[0], x.shape[1], ph_n, pw_n), x.dtype)
    for r, roi in enumerate(rois.astype(np.float64)):
        b = int(roi[0])
        xs, ys, xe, ye = (_round_half_away(v * spatial_scale) for v in roi[1:])
        bh = max(ye - ys + 1, 1) / ph_n
        bw = max(xe - xs + 1, 1) / pw_n
        for i in range(ph_n):
            h0 = min(max(math.floor(i * bh) + ys, 0), h)
            h1 = min(max(math.ceil((i + 1) * bh) + ys, 0), h)
            for j in range(pw_n):
                w0 = min(max(math.floor(j * bw) + xs, 0), w)
                w1 = min(max(math.ceil((j + 1) * bw) + xs, 0), w)
                if h1 > h0 and w1 > w0:
                    y[r, :, i, j] = x[b, :, h0:h1, w0:w1].max(axis=(1, 2))
    return y
