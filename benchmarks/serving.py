"""What `kiln serve` costs and what its batching gains, against in-process runs.

Overhead: the latency of one tritonclient request (HTTP with binary tensors, and gRPC) at
concurrency 1 against ``InferenceSession.run`` of the same model, backend and input in this
process; the three alternate in blocks, so load on the machine hits all of them. Prints
p50/p99 of each and the server's overhead (p50 minus in-process p50).

Throughput: C client threads (each its own tritonclient HTTP client, batch-1 requests)
for ``--seconds`` per level, against in-process runs of the same rows in batches of the
server's max batch size; the ratio at 16 is the issue's target (>= 0.8x).

Ray Serve (``--ray``): the same throughput through Ray Serve's proxy with 1 and 2
replicas of the same app on a local Ray cluster.

    python benchmarks/serving.py [--models digits,resnet18] [--backend numpy]
        [--rounds 5] [--runs 40] [--seconds 5] [--levels 1,4,16,64] [--ray]

Needs the serve extra and tritonclient (not in any extra: see docs/serving.md).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "src" / "kiln" / "data" / "digits_cnn.onnx"


def _model_path(name: str) -> Path:
    if name == "digits":
        return DIGITS
    import kiln.zoo
    return kiln.zoo.path(name)


def _start(repo: str, backend: str, max_batch: int) -> tuple[subprocess.Popen, str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]))
    proc = subprocess.Popen([sys.executable, "-m", "kiln", "serve", "--model-repository", repo,
                             "--http-port", "0", "--grpc-port", "0", "--backend", backend,
                             "--max-batch-size", str(max_batch), "--max-queue-size", "1024"],
                            stderr=subprocess.PIPE, text=True, env=env)
    for line in proc.stderr:
        m = re.search(r"HTTP on ([\d.]+:\d+), gRPC on ([\d.]+:\d+)", line)
        if m:
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, m.group(1), m.group(2)
    raise RuntimeError("kiln serve did not start")


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs) * 1e3, q))


def overhead(name: str, sess, http_url: str, grpc_url: str, rounds: int, runs: int) -> dict:
    """p50/p99 milliseconds of in-process, HTTP and gRPC, alternating blocks."""
    import tritonclient.grpc as tg
    import tritonclient.http as th

    inp = sess.get_inputs()[0]
    shape = [1] + [d if isinstance(d, int) else 1 for d in inp.shape[1:]]
    x = np.random.default_rng(0).random(shape, dtype=np.float32)
    hc, gc = th.InferenceServerClient(http_url), tg.InferenceServerClient(grpc_url)
    hin = th.InferInput(inp.name, shape, "FP32")
    hin.set_data_from_numpy(x)
    gin = tg.InferInput(inp.name, shape, "FP32")
    gin.set_data_from_numpy(x)
    calls = {"in-process": lambda: sess.run(None, {inp.name: x}),
             "http": lambda: hc.infer(name, [hin]), "grpc": lambda: gc.infer(name, [gin])}
    for f in calls.values():  # warm up every path and shape
        for _ in range(3):
            f()
    times: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(rounds):
        for k, f in calls.items():
            for _ in range(runs):
                t = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t)
    return {k: (_pct(v, 50), _pct(v, 99)) for k, v in times.items()}


def throughput(name: str, sess, http_url: str, level: int, seconds: float) -> float:
    """Requests (rows) per second with ``level`` client threads sending batch-1 requests."""
    import tritonclient.http as th

    inp = sess.get_inputs()[0]
    shape = [1] + [d if isinstance(d, int) else 1 for d in inp.shape[1:]]
    x = np.random.default_rng(1).random(shape, dtype=np.float32)
    done, errors = [0] * level, []
    stop = time.perf_counter() + seconds

    def client(i: int) -> None:
        c = th.InferenceServerClient(http_url, connection_timeout=120, network_timeout=120)
        t_in = th.InferInput(inp.name, shape, "FP32")
        t_in.set_data_from_numpy(x)
        while time.perf_counter() < stop:
            try:
                c.infer(name, [t_in])
                done[i] += 1
            except Exception as e:  # noqa: BLE001 - counted, the run goes on
                errors.append(e)

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(level)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        print(f"    {len(errors)} failed requests, e.g. {errors[0]}", file=sys.stderr)
    return sum(done) / (time.perf_counter() - start)


def in_process_batched(sess, batch: int, seconds: float) -> float:
    """Rows per second of in-process runs in batches of ``batch``."""
    inp = sess.get_inputs()[0]
    shape = [batch] + [d if isinstance(d, int) else 1 for d in inp.shape[1:]]
    x = np.random.default_rng(2).random(shape, dtype=np.float32)
    sess.run(None, {inp.name: x})
    rows, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        sess.run(None, {inp.name: x})
        rows += batch
    return rows / (time.perf_counter() - start)


def ray_serve(names: list[str], backend: str, level: int, seconds: float,
              max_batch: int) -> None:
    """Throughput through Ray Serve's HTTP proxy with 1 and 2 replicas."""
    import socket

    import ray
    from ray import serve

    import kiln
    from kiln.serving import ModelConfig
    from kiln.serving.ray import application

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for n in names:
            sess = kiln.InferenceSession(str(_model_path(n)), backend=backend)
            for replicas in (1, 2):
                with tempfile.TemporaryDirectory() as repo:
                    (Path(repo) / n / "1").mkdir(parents=True)
                    os.symlink(_model_path(n), Path(repo) / n / "1" / "model.onnx")
                    cfg = ModelConfig(backend=backend, max_batch_size=max_batch)
                    serve.run(application(model_repository=repo, config=cfg,
                                          num_replicas=replicas, num_cpus=0.5),
                              route_prefix="/")
                    throughput(n, sess, f"127.0.0.1:{port}", 2, 2)  # warm up
                    rps = throughput(n, sess, f"127.0.0.1:{port}", level, seconds)
                    print(f"{n} ({backend}) on Ray Serve, {replicas} replica(s), concurrency "
                          f"{level}: {rps:.1f} req/s", flush=True)
                    serve.delete("default")
    finally:
        serve.shutdown()
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="digits,resnet18")
    ap.add_argument("--backend", default="numpy")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--levels", default="1,4,16,64")
    ap.add_argument("--max-batch-size", type=int, default=16)
    ap.add_argument("--ray", action="store_true", help="Ray Serve with 1 and 2 replicas")
    args = ap.parse_args(argv)
    import kiln

    if args.ray:
        ray_serve(args.models.split(","), args.backend, 16, args.seconds, args.max_batch_size)
        return 0

    names = args.models.split(",")
    with tempfile.TemporaryDirectory() as repo:
        for n in names:
            (Path(repo) / n / "1").mkdir(parents=True)
            os.symlink(_model_path(n), Path(repo) / n / "1" / "model.onnx")
        proc, http_url, grpc_url = _start(repo, args.backend, args.max_batch_size)
        try:
            for n in names:
                sess = kiln.InferenceSession(str(_model_path(n)), backend=args.backend)
                r = overhead(n, sess, http_url, grpc_url, args.rounds, args.runs)
                base = r["in-process"][0]
                print(f"{n} ({args.backend}) latency at concurrency 1, ms p50/p99: " + ", ".join(
                    f"{k} {p50:.2f}/{p99:.2f}" for k, (p50, p99) in r.items()))
                print(f"  server overhead p50: http {r['http'][0] - base:.2f} ms, "
                      f"grpc {r['grpc'][0] - base:.2f} ms", flush=True)
                batched = in_process_batched(sess, args.max_batch_size, args.seconds)
                print(f"  in-process batch {args.max_batch_size}: {batched:.1f} rows/s",
                      flush=True)
                for level in map(int, args.levels.split(",")):
                    rps = throughput(n, sess, http_url, level, args.seconds)
                    print(f"  concurrency {level:>2}: {rps:8.1f} req/s "
                          f"({rps / batched:.2f}x in-process batched)", flush=True)
        finally:
            proc.terminate()
            proc.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
