"""Transfer learning through ONNX: a small CNN trained (in PyTorch) on digits 0-5 and
exported; Kiln imports it, cuts off its classifier (SINGA's ``last_layers``), attaches a
new 4-way head for digits 6-9 and trains the head on 20 images per class, then
everything. The same network trained from scratch on those 80 images for the same number
of epochs is the baseline. scikit-learn's bundled
digits, offline.

    python examples/transfer_digits.py [--epochs 30] [--out digits_6to9.onnx]
"""

from __future__ import annotations

import argparse
import io

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn

import kiln
from kiln.tools.progress import progress_bar


def cnn(classes: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(),
        nn.Linear(64, classes))


def fit(model: nn.Module, params, x, y, epochs: int, desc: str, lr: float = 2e-3) -> None:
    opt = torch.optim.Adam(params, lr=lr)
    bar = progress_bar(epochs, desc, unit="epoch")
    for _ in range(epochs):
        model.train()
        for idx in torch.randperm(len(x)).split(32):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
        bar.update(1)
    bar.close()


def accuracy(model: nn.Module, x, y) -> float:
    model.eval()
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=30, help="epochs on the 80 images")
    ap.add_argument("--out", default="digits_6to9.onnx")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    d = load_digits()
    x = torch.from_numpy((d.images / 16.0).astype(np.float32)[:, None])
    y = torch.from_numpy(d.target)
    low, high = y < 6, y >= 6
    # 1. the "pretrained" model: digits 0-5, in PyTorch, exported to ONNX
    base = cnn(6)
    fit(base, base.parameters(), x[low], y[low], 8, "pretrain on 0-5")
    buf = io.BytesIO()
    torch.onnx.export(base.eval(), (x[:1],), buf, dynamo=False, input_names=["image"],
                      output_names=["logits"], dynamic_axes={"image": {0: "b"}, "logits": {0: "b"}})
    # 2. 20 training images per class of 6-9; the rest of 6-9 is the test set
    rng = np.random.default_rng(0)
    picked = np.concatenate([rng.choice(np.flatnonzero(d.target == c), 20, replace=False)
                             for c in range(6, 10)])
    test = np.setdiff1d(np.flatnonzero(high.numpy()), picked)
    x_tr, y_tr = x[picked], y[picked] - 6
    x_te, y_te = x[test], y[test] - 6
    # 3. transfer: the imported body without its classifier (Gemm, Relu, Gemm): the conv
    # features after Flatten; a new linear head
    body = kiln.to_torch(buf.getvalue(), last_layers=-3)
    body.requires_grad_(False)
    model = nn.Sequential(body, nn.Linear(32 * 4 * 4, 4))
    half = args.epochs // 2
    fit(model, model[1].parameters(), x_tr, y_tr, half, "head on 6-9", lr=1e-2)
    head_only = accuracy(model, x_te, y_te)
    # then everything, for the rest of the same epoch budget
    body.requires_grad_(True)
    fit(model, model.parameters(), x_tr, y_tr, args.epochs - half, "all on 6-9", lr=5e-4)
    transfer = accuracy(model, x_te, y_te)
    # 4. the same network from scratch on the same 80 images
    torch.manual_seed(0)
    scratch = cnn(4)
    fit(scratch, scratch.parameters(), x_tr, y_tr, args.epochs, "scratch on 6-9")
    baseline = accuracy(scratch, x_te, y_te)
    kiln.save(model, args.out)
    import onnxruntime as ort

    sess = ort.InferenceSession(args.out, providers=["CPUExecutionProvider"])
    ort_acc = float((sess.run(None, {"image": x_te.numpy()})[0].argmax(1) == y_te.numpy())
                    .mean())
    print(f"\n{'model (80 training images, digits 6-9)':<42}  {'test accuracy':>13}")
    print(f"{f'imported 0-5 CNN, cut, new head: {half} epochs':<42}  {head_only:>13.4f}")
    print(f"{f'  then everything: {args.epochs - half} more epochs':<42}  {transfer:>13.4f}")
    print(f"{f'same CNN from scratch: {args.epochs} epochs':<42}  {baseline:>13.4f}")
    print(f"saved {args.out}: body's original nodes + the head's Gemm; onnxruntime accuracy "
          f"{ort_acc:.4f} on {len(test)} test images")
    return {"head_only": head_only, "transfer": transfer, "scratch": baseline,
            "ort_accuracy": ort_acc}


if __name__ == "__main__":
    main()
