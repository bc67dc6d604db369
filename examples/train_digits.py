"""Train the demo model: a small CNN on scikit-learn's bundled 8x8 digits (no network),
export it to ONNX with a symbolic batch dim, and save the held-out split beside it.

    python examples/train_digits.py      # writes src/kiln/data/digits_cnn.onnx + digits_test.npz
"""

from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

OUT = Path(__file__).resolve().parents[1] / "src" / "kiln" / "data"


def model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Dropout(0.2), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))


def main() -> None:
    torch.manual_seed(0)
    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[:, None]  # (n, 1, 8, 8) in [0, 1]
    x_tr, x_te, y_tr, y_te = train_test_split(x, digits.target, test_size=0.25, random_state=0,
                                              stratify=digits.target)
    net = model()
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    xt, yt = torch.from_numpy(x_tr), torch.from_numpy(y_tr)
    for _epoch in range(30):
        net.train()
        for idx in torch.randperm(len(xt)).split(64):
            opt.zero_grad()
            nn.functional.cross_entropy(net(xt[idx]), yt[idx]).backward()
            opt.step()
    net.eval()
    with torch.no_grad():
        acc = (net(torch.from_numpy(x_te)).argmax(1).numpy() == y_te).mean()
    print(f"held-out accuracy (torch): {acc:.4f}")
    OUT.mkdir(parents=True, exist_ok=True)
    torch.onnx.export(net, (torch.from_numpy(x_te[:1]),), OUT / "digits_cnn.onnx", dynamo=False,
                      input_names=["image"], output_names=["logits"], opset_version=17,
                      dynamic_axes={"image": {0: "batch"}, "logits": {0: "batch"}})
    np.savez_compressed(OUT / "digits_test.npz", images=x_te, labels=y_te.astype(np.int64))


if __name__ == "__main__":
    main()
