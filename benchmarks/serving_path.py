"""The HTTP app's own cost for one binary-tensor inference request, without sockets: the
ResNet-18-sized twin of benchmarks/serving.py (its run only slices the 602 kB input down to
1000 floats) called through the Starlette app (``build_app``, as Ray Serve runs it) and
through ``kiln serve``'s app (``serving_app``, inference POSTs before Starlette's
machinery), in one process, rounds alternating, each round ``--requests`` calls; the
metrics work queued after each response runs before the next call. Both apps must give the
same ASGI messages. Prints microseconds a request per app and the median of the per-round
ratios.

    python benchmarks/serving_path.py [--requests 2000] [--rounds 12] [--backend torch]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import _twin  # noqa: E402

from kiln.serving.http import build_app, serving_app  # noqa: E402
from kiln.serving.models import ModelConfig, Repository  # noqa: E402
from kiln.serving.service import Service  # noqa: E402


def _twin_repository(folder: Path) -> None:
    def io(**kw):
        return types.SimpleNamespace(**kw)

    sess = types.SimpleNamespace(
        get_inputs=lambda: [io(name="data", type="tensor(float)", shape=[1, 3, 224, 224])],
        get_outputs=lambda: [io(name="out", shape=[1, 1000])],
    )
    (folder / "twin" / "1").mkdir(parents=True)
    assert _twin(sess, folder / "twin" / "1" / "model.onnx")


def _request() -> tuple[dict, bytes]:
    x = np.random.default_rng(0).standard_normal((1, 3, 224, 224), dtype=np.float32)
    head = json.dumps({
        "inputs": [{"name": "data", "shape": [1, 3, 224, 224], "datatype": "FP32",
                    "parameters": {"binary_data_size": x.nbytes}}],
        "outputs": [{"name": "out", "parameters": {"binary_data": True}}],
    }).encode()
    body = head + x.tobytes()
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v2/models/twin/infer",
        "raw_path": b"/v2/models/twin/infer", "query_string": b"", "root_path": "",
        "headers": [(b"host", b"127.0.0.1"), (b"user-agent", b"geventhttpclient"),
                    (b"inference-header-content-length", str(len(head)).encode()),
                    (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 5), "server": ("127.0.0.1", 8000),
    }
    return scope, body


async def _main(args: argparse.Namespace, folder: Path) -> None:
    service = Service(Repository([], str(folder), ModelConfig(backend=args.backend)))
    apps = {"starlette": build_app(service), "kiln serve": serving_app(service)}
    scope, body = _request()
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    async def calls(app, n: int) -> None:
        for _ in range(n):
            sent.clear()
            await app(dict(scope), receive, send)
            await asyncio.sleep(0)  # the metrics queued after the response

    answers = {}
    for name, app in apps.items():
        await calls(app, 200)
        answers[name] = [dict(m) for m in sent]
    first, second = answers.values()
    assert first == second and first[0]["status"] == 200, "the two apps answered differently"
    us: dict[str, list[float]] = {name: [] for name in apps}
    for r in range(args.rounds):
        for name, app in (list(apps.items()) if r % 2 == 0 else reversed(apps.items())):
            t = time.perf_counter()
            await calls(app, args.requests)
            us[name].append((time.perf_counter() - t) / args.requests * 1e6)
    for name, v in us.items():
        print(f"{name}: min {min(v):.1f} us, median {np.median(v):.1f} us a request")
    ratio = np.median(np.array(us["kiln serve"]) / np.array(us["starlette"]))
    print(f"kiln serve / starlette, median of per-round ratios: {ratio:.3f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--backend", default="torch")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        _twin_repository(Path(d))
        asyncio.run(_main(args, Path(d)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
