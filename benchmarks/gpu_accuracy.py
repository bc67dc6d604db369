"""Every zoo model on Kiln's torch backend on a GPU, against its onnxruntime reference.

    python benchmarks/gpu_accuracy.py [--models a,b] [--json out.json]

For each model and precision (fp32, tf32, bf16, fp16) it prints the largest absolute
error, the relative L2 error (‖got − ref‖ / ‖ref‖), whether the run is within the model's
stated fp32 tolerance,
top-1 agreement on classifier outputs, NaN/Inf counts, and the placement report's
fallback layers and host<->device transfers per run. The zoo is built on demand.
Needs a CUDA device; tests/cli/test_zoo_models.py holds the asserted tolerances.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings

import numpy as np


def errors(got: np.ndarray, ref: np.ndarray) -> dict:
    """Error figures of one output against its reference."""
    g, r = got.astype(np.float64), ref.astype(np.float64)
    out = {"max_abs": float(np.abs(g - r).max()) if g.size else 0.0,
           "rel_l2": float(np.linalg.norm(g - r) / max(np.linalg.norm(r), 1e-30)),
           "nonfinite": int((~np.isfinite(got)).sum())}
    if g.ndim == 2 and g.shape[1] > 1:  # (batch, classes): a classifier's scores
        out["top1_agree"] = float((g.argmax(1) == r.argmax(1)).mean())
    return out


def check(name: str, precision: str) -> dict:
    import kiln
    from kiln import zoo

    path = zoo.path(name, progress=False)
    inputs, expected, meta = zoo.load_reference(name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        sess = kiln.InferenceSession(str(path), backend="torch", device="cuda",
                                     precision=precision)
        setup = time.perf_counter() - t0
        got = sess.run(None, dict(inputs))
    rep = sess.placement()
    names = [o.name for o in sess.get_outputs()]
    res = {"model": name, "precision": precision, "setup_s": round(setup, 2),
           "fallbacks": [lp.name for lp in rep.fallbacks],
           "transfers": rep.last_run.transfers, "fallback_calls": rep.last_run.fallback_calls,
           "warnings": sorted({str(w.message)[:160] for w in caught
                               if w.category.__module__.startswith("kiln")}),
           "outputs": {}}
    ok = True
    for n, g in zip(names, got):
        e = errors(np.asarray(g), expected[n])
        e["within_tolerance"] = bool(np.allclose(g, expected[n], **meta["tolerance"]))
        ok &= e["within_tolerance"]
        res["outputs"][n] = e
    res["within_tolerance"] = ok
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", help="comma-separated zoo names (default: all)")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args(argv)
    import torch

    from kiln import zoo
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 1
    names = args.models.split(",") if args.models else [e.name for e in zoo.list_models()]
    rows = []
    for name in names:
        for precision in ("fp32", "tf32", "bf16", "fp16"):
            try:
                r = check(name, precision)
            except Exception as e:  # noqa: BLE001 - one failing model must not hide the rest
                r = {"model": name, "precision": precision,
                     "error": f"{type(e).__name__}: {str(e)[:300]}"}
            rows.append(r)
            if "error" in r:
                print(f"{name:<22} {precision}  ERROR {r['error']}", flush=True)
                continue
            worst = max(r["outputs"].values(), key=lambda e: e["rel_l2"])
            top1 = [e["top1_agree"] for e in r["outputs"].values() if "top1_agree" in e]
            print(f"{name:<22} {precision}  rel_l2 {worst['rel_l2']:.2e}  "
                  f"max_abs {worst['max_abs']:.2e}  tol {'ok' if r['within_tolerance'] else 'NO'}"
                  f"  top1 {top1[0] if top1 else '-'}  nonfinite {worst['nonfinite']}  "
                  f"transfers {r['transfers']}  fallbacks {r['fallbacks'] or '-'}", flush=True)
            for w in r["warnings"]:
                print(f"    warning: {w}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
