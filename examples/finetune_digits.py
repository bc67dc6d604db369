"""Fine-tune an imported ONNX model with plain PyTorch: the shipped digits CNN, its weights
damaged, trained back on scikit-learn's bundled 8x8 digits (offline), saved as ONNX and
re-checked in onnxruntime.

    python examples/finetune_digits.py [--epochs 4] [--out digits_finetuned.onnx]
"""

from __future__ import annotations

import argparse
from importlib import resources

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

import kiln
from kiln.tools.progress import progress_bar

MODEL = resources.files("kiln") / "data" / "digits_cnn.onnx"


def split():
    """The split the shipped model was trained on (examples/train_digits.py)."""
    d = load_digits()
    x = (d.images / 16.0).astype(np.float32)[:, None]
    return train_test_split(x, d.target, test_size=0.25, random_state=0, stratify=d.target)


def accuracy(model: nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    model.eval()
    with torch.no_grad():
        return float((model(torch.from_numpy(x)).argmax(1).numpy() == y).mean())


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--out", default="digits_finetuned.onnx")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    x_tr, x_te, y_tr, y_te = split()
    with resources.as_file(MODEL) as path:
        model = kiln.to_torch(path)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # damage: every weight scaled by N(1, 0.6) noise
        for p in model.parameters():
            p.mul_(1 + 0.6 * torch.randn(p.shape, generator=gen))
    rows = [(0, float("nan"), accuracy(model, x_te, y_te))]
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.epochs)
    xt, yt = torch.from_numpy(x_tr), torch.from_numpy(y_tr)
    for epoch in range(1, args.epochs + 1):
        model.train()
        batches = torch.randperm(len(xt)).split(32)
        # a bar on a terminal only (None in a pipe or log: the table below says it all)
        bar = progress_bar(len(batches), f"epoch {epoch}/{args.epochs}", enabled=None,
                           unit="batch")
        total = 0.0
        for idx in batches:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(xt[idx]), yt[idx])
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        sched.step()
        rows.append((epoch, total / len(xt), accuracy(model, x_te, y_te)))
    kiln.save(model, args.out)
    import onnxruntime as ort

    sess = ort.InferenceSession(args.out, providers=["CPUExecutionProvider"])
    ort_acc = float((sess.run(None, {"image": x_te})[0].argmax(1) == y_te).mean())
    print(f"\n{'epoch':>5}  {'train loss':>10}  {'held-out acc':>12}")
    for epoch, loss, acc in rows:
        print(f"{epoch:>5}  {loss:>10.4f}  {acc:>12.4f}")
    print(f"saved {args.out}; onnxruntime held-out accuracy {ort_acc:.4f} "
          f"({len(y_te)} images)")
    return {"rows": rows, "ort_accuracy": ort_acc}


if __name__ == "__main__":
    main()
