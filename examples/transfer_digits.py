"""Transfer learning through ONNX: a small CNN trained (in PyTorch) on digits 0-5 and
exported; Kiln imports it, cuts off its classifier (SINGA's ``last_layers``), attaches a
new 4-way head for digits 6-9 and trains it on 20 images per class (the head alone, then
everything). The baseline is the same network trained from scratch on the same 80 images
with the same epoch budget. Every seed repeats the whole experiment (pretraining, the 80
images drawn, initializations); the table gives each seed and the mean and standard
deviation. scikit-learn's bundled digits, offline.

    python examples/transfer_digits.py [--epochs 30] [--seeds 5] [--out digits_6to9.onnx]

300 images of 6-9 are set aside once as the test set; each seed draws its 80 training
images from the others. The settings (pretraining length and its one-pixel shifts, one
learning rate, the epoch split) were chosen on the remaining images with other seeds,
never on the test set (docs/training.md). Both arms: Adam at lr 1e-3, batch 16,
``--epochs`` passes over the 80 images; the transferred arm spends the first half on the
head alone and the second half on everything.
"""

from __future__ import annotations

import argparse
import io
import statistics

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn

import kiln
from kiln.tools.progress import progress_bar

LR, BATCH, PER_CLASS, TEST_IMAGES = 1e-3, 16, 20, 300


def cnn(classes: int) -> nn.Sequential:
    """The network both arms use; only the number of classes differs from the 0-5 one."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(),
        nn.Linear(64, classes))


def fit(model: nn.Module, params, x, y, epochs: int, desc: str, batch: int = BATCH,
        shift: bool = False) -> None:
    """``epochs`` passes of Adam over (x, y) in shuffled batches; ``shift`` moves each batch
    by up to one pixel each way (the pretraining's augmentation)."""
    opt = torch.optim.Adam(params, lr=LR)
    bar = progress_bar(epochs, desc, unit="epoch")
    for _ in range(epochs):
        model.train()
        for idx in torch.randperm(len(x)).split(batch):
            xb = x[idx]
            if shift:
                xb = torch.roll(xb, torch.randint(-1, 2, (2,)).tolist(), (2, 3))
            opt.zero_grad()
            nn.functional.cross_entropy(model(xb), y[idx]).backward()
            opt.step()
        bar.update(1)
    bar.close()


def accuracy(model: nn.Module, x, y) -> float:
    """Fraction of ``x`` classified as ``y`` in eval mode."""
    model.eval()
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def pretrained_onnx(x, y, epochs: int) -> bytes:
    """The 'published' model: the CNN trained on digits 0-5 in PyTorch, as ONNX bytes."""
    base = cnn(6)
    fit(base, base.parameters(), x, y, epochs, "pretrain on 0-5", batch=32, shift=True)
    buf = io.BytesIO()
    torch.onnx.export(base.eval(), (x[:1],), buf, dynamo=False, input_names=["image"],
                      output_names=["logits"], dynamic_axes={"image": {0: "b"}, "logits": {0: "b"}})
    return buf.getvalue()


def test_images(target: np.ndarray) -> np.ndarray:
    """The indices of the 300 images of 6-9 no seed trains on (nor chose the settings on)."""
    return np.random.default_rng(12345).choice(np.flatnonzero(target >= 6), TEST_IMAGES,
                                               replace=False)


def one_seed(seed: int, x, y, epochs: int, pretrain_epochs: int) -> dict:
    """Both arms for one seed: the same 80 training images and the same test images."""
    torch.manual_seed(seed)
    low = (y < 6).numpy()
    onnx_bytes = pretrained_onnx(x[low], y[low], pretrain_epochs)
    rng = np.random.default_rng(seed)
    target = y.numpy()
    test = test_images(target)
    rest = np.setdiff1d(np.flatnonzero(target >= 6), test)
    picked = np.concatenate([rng.choice(rest[target[rest] == c], PER_CLASS, replace=False)
                             for c in range(6, 10)])
    x_tr, y_tr, x_te, y_te = x[picked], y[picked] - 6, x[test], y[test] - 6
    half = epochs // 2
    # transfer: the imported body without its classifier (Gemm, Relu, Gemm), i.e. the
    # conv features after Flatten, and a new linear head
    body = kiln.to_torch(onnx_bytes, last_layers=-3)
    body.requires_grad_(False)
    model = nn.Sequential(body, nn.Linear(32 * 4 * 4, 4))
    fit(model, model[1].parameters(), x_tr, y_tr, half, f"seed {seed}: head")
    head_only = accuracy(model, x_te, y_te)
    body.requires_grad_(True)
    fit(model, model.parameters(), x_tr, y_tr, epochs - half, f"seed {seed}: all")
    transfer = accuracy(model, x_te, y_te)
    # seeded apart, so the baseline does not depend on how long pretraining drew numbers
    torch.manual_seed(seed + 1000)
    scratch = cnn(4)
    fit(scratch, scratch.parameters(), x_tr, y_tr, epochs, f"seed {seed}: scratch")
    return {"head_only": head_only, "transfer": transfer, "scratch": accuracy(scratch, x_te, y_te),
            "model": model, "x_te": x_te, "y_te": y_te}


def main(argv: list[str] | None = None) -> dict:
    """Run every seed, print the table, save seed 0's transferred model and check it."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=30, help="epoch budget of each arm")
    ap.add_argument("--seeds", type=int, default=5, help="independent repetitions")
    ap.add_argument("--pretrain-epochs", type=int, default=100, help="epochs on digits 0-5")
    ap.add_argument("--out", default="digits_6to9.onnx")
    args = ap.parse_args(argv)
    d = load_digits()
    x = torch.from_numpy((d.images / 16.0).astype(np.float32)[:, None])
    y = torch.from_numpy(d.target)
    runs = [one_seed(s, x, y, args.epochs, args.pretrain_epochs) for s in range(args.seeds)]
    first = runs[0]
    kiln.save(first["model"], args.out)
    import onnxruntime as ort

    sess = ort.InferenceSession(args.out, providers=["CPUExecutionProvider"])
    logits = sess.run(None, {"image": first["x_te"].numpy()})[0]
    ort_acc = float((logits.argmax(1) == first["y_te"].numpy()).mean())
    keys = ("head_only", "transfer", "scratch")
    half = args.epochs // 2
    print(f"\n80 training images of digits 6-9 (20 per class); test accuracy on "
          f"{len(first['y_te'])} other images of 6-9, set aside")
    print(f"{'seed':>6}  {f'head only ({half} ep)':>18}  "
          f"{f'then all ({args.epochs - half} ep)':>18}  {f'scratch ({args.epochs} ep)':>18}")
    for s, r in enumerate(runs):
        print(f"{s:>6}  " + "  ".join(f"{r[k]:>18.4f}" for k in keys))
    summary = {k: [r[k] for r in runs] for k in keys}
    spread = {k: statistics.stdev(v) if len(v) > 1 else 0.0 for k, v in summary.items()}
    print(f"{'mean':>6}  " + "  ".join(f"{statistics.fmean(summary[k]):>18.4f}" for k in keys))
    print(f"{'std':>6}  " + "  ".join(f"{spread[k]:>18.4f}" for k in keys))
    print(f"saved {args.out} (seed 0): body's original nodes + the head's Gemm; onnxruntime "
          f"accuracy {ort_acc:.4f} on {len(first['y_te'])} test images")
    return {**summary, "ort_accuracy": ort_acc}


if __name__ == "__main__":
    main()
