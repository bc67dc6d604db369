"""What `kiln serve` costs and what its batching gains, against in-process runs.

Overhead: the latency of one tritonclient request (HTTP with binary tensors, HTTP with JSON
tensors for inputs up to 64 kB, and gRPC) at concurrency 1 against ``InferenceSession.run``
of the same model, backend and input in this process; the paths alternate in blocks, so
load on the machine hits all of them. Prints
p50/p99 of each and the server's overhead (p50 minus in-process p50). For a model with one
input and one ``[batch, K]`` output (the digits CNN, ResNet-18) it splits the overhead:
the same request to a twin model served beside it that only slices its input down to the
output's size (the request path: client, sockets, server; its run is microseconds), and
to a bare socket server that answers every request with a canned response without parsing
it (what tritonclient and the kernel cost, which no server can remove), and to the same
bare server running the model once before each reply (one thread, nothing between the
socket and the run: the floor of any server of this model on this machine, since after a
long run the client and the server wake on cold caches); and the server's own mean run
time (its statistics extension) against the in-process mean.

Throughput: C client threads (each its own tritonclient HTTP client, batch-1 requests with
binary tensors) for ``--seconds`` per level, alternating round by round with in-process
runs of the same rows in batches of the server's max batch size; the ratio at 16 is the
issue's target (>= 0.8x). Beside each figure, the CPU seconds per row that the server and
this process (the clients) used, read from /proc: on a shared machine the wall-clock ratio
follows the share of the cores each phase got, the CPU per row does not.

Ray Serve (``--ray``): the same throughput through Ray Serve's proxy with 1 and 2
replicas of the same app on a local Ray cluster.

    python benchmarks/serving.py [--models digits,resnet18,bert] [--backend torch]
        [--rounds 5] [--runs 40] [--seconds 5] [--levels 1,4,16,64] [--seq 128] [--ray]
        [--threads N]

Needs the serve extra (it has tritonclient). Text models (BERT) get ``--seq`` tokens.
"""

from __future__ import annotations

import argparse
import json
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


def _start(
    repo: str, backend: str, max_batch: int, window_us: int = 0, threads: int | None = None
) -> tuple[subprocess.Popen, str, str]:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
        ),
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kiln",
            "serve",
            "--model-repository",
            repo,
            "--http-port",
            "0",
            "--grpc-port",
            "0",
            "--backend",
            backend,
            "--max-batch-size",
            str(max_batch),
            "--max-queue-size",
            "1024",
            "--max-queue-delay-microseconds",
            str(window_us),
            *(["--threads", str(threads)] if threads else []),
        ],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    for line in proc.stderr:
        m = re.search(r"HTTP on ([\d.]+:\d+), gRPC on ([\d.]+:\d+)", line)
        if m:
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, m.group(1), m.group(2)
    raise RuntimeError("kiln serve did not start")


def _twin(sess, path: Path) -> bool:
    """Write to ``path`` a model with ``sess``'s one input and one ``[batch, K]`` output
    whose run only flattens and slices the input; False when ``sess`` has another shape."""
    import onnx
    from onnx import TensorProto, helper

    ins, outs = sess.get_inputs(), sess.get_outputs()
    if len(ins) != 1 or len(outs) != 1:
        return False
    (i,), (o,) = ins, outs
    if i.type != "tensor(float)" or len(o.shape) != 2 or not isinstance(o.shape[1], int):
        return False
    k = o.shape[1]
    graph = helper.make_graph(
        [
            helper.make_node("Flatten", [i.name], ["flat"], axis=1),
            helper.make_node("Slice", ["flat", "zero", "k", "one"], [o.name]),
        ],
        "request_path_twin",
        [helper.make_tensor_value_info(i.name, TensorProto.FLOAT, ["batch", *i.shape[1:]])],
        [helper.make_tensor_value_info(o.name, TensorProto.FLOAT, ["batch", k])],
        [
            helper.make_tensor("zero", TensorProto.INT64, [1], [0]),
            helper.make_tensor("k", TensorProto.INT64, [1], [k]),
            helper.make_tensor("one", TensorProto.INT64, [1], [1]),
        ],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return True


# A bare HTTP/1.1 server (its own process): reads each request by its Content-Length and
# answers with one canned binary-tensor response, argv[1]: the output's JSON header. Given
# argv[2:5] (a model, a backend, threads or ""), it first runs that model on one fixed
# input for every request: a one-thread server with nothing between the socket and the run.
BARE = r"""
import json, socket, sys
run = lambda: None
if len(sys.argv) > 2:
    import numpy as np, kiln
    opts = {"threads": int(sys.argv[4])} if sys.argv[4] else {}
    sess = kiln.InferenceSession(sys.argv[2], backend=sys.argv[3], **opts)
    i = sess.get_inputs()[0]
    x = {i.name: np.random.default_rng(0).random([1, *i.shape[1:]], dtype=np.float32)}
    run = lambda: sess.run(None, x)
    for _ in range(5):
        run()
head = sys.argv[1].encode()
size = json.loads(head)["outputs"][0]["parameters"]["binary_data_size"]
body = head + bytes(size)
reply = (b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\n"
         b"inference-header-content-length: %d\r\ncontent-length: %d\r\n\r\n"
         % (len(head), len(body))) + body
s = socket.socket()
s.bind(("127.0.0.1", 0))
s.listen(8)
print(s.getsockname()[1], flush=True)
while True:
    c, _ = s.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = b""
    while True:
        while b"\r\n\r\n" not in buf and (more := c.recv(1 << 22)):
            buf += more
        if b"\r\n\r\n" not in buf:
            break
        top, _, buf = buf.partition(b"\r\n\r\n")
        n = next(int(h.split(b":")[1]) for h in top.split(b"\r\n")
                 if h.lower().startswith(b"content-length:"))
        while len(buf) < n and (more := c.recv(1 << 22)):
            buf += more
        buf = buf[n:]
        run()
        c.sendall(reply)
    c.close()
"""


def _bare(name: str, out, run: tuple[str, str, str] = ()) -> tuple[subprocess.Popen, str]:
    """The bare server for ``name``'s one ``[1, K]`` float output, running ``run`` (a
    model, a backend, threads or "") before each reply; (process, address)."""
    k = out.shape[1]
    head = {
        "model_name": name,
        "model_version": "1",
        "outputs": [
            {
                "name": out.name,
                "datatype": "FP32",
                "shape": [1, k],
                "parameters": {"binary_data_size": 4 * k},
            }
        ],
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", BARE, json.dumps(head), *run],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(
                [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
        ),
    )
    return proc, f"127.0.0.1:{int(proc.stdout.readline())}"


def _mean_run_ms(http_url: str, name: str) -> tuple[int, float]:
    """(runs, total ms of their compute_infer) the server has counted for ``name``."""
    import urllib.request

    url = f"http://{http_url}/v2/models/{name}/stats"
    stats = json.loads(urllib.request.urlopen(url, timeout=60).read())
    infer = stats["model_stats"][0]["inference_stats"]["compute_infer"]
    return int(infer["count"]), int(infer["ns"]) / 1e6


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs) * 1e3, q))


TRITON_TYPES = {
    np.dtype(np.float32): "FP32",
    np.dtype(np.int64): "INT64",
    np.dtype(np.int32): "INT32",
}


def _feed(sess, rows: int, seq: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A batch of ``rows`` for every input of ``sess``: free dims after the first are
    ``seq``; token ids random below 1000, attention masks ones, token types zeros."""
    rng = np.random.default_rng(seed)
    feed = {}
    for i in sess.get_inputs():
        shape = [rows] + [d if isinstance(d, int) else seq for d in i.shape[1:]]
        if i.type == "tensor(int64)":
            if "mask" in i.name:
                feed[i.name] = np.ones(shape, np.int64)
            elif "type" in i.name:
                feed[i.name] = np.zeros(shape, np.int64)
            else:
                feed[i.name] = rng.integers(0, 1000, shape, dtype=np.int64)
        else:
            feed[i.name] = rng.random(shape, dtype=np.float32)
    return feed


def _inputs(client_module, feed: dict[str, np.ndarray], binary: bool = True) -> list:
    ins = []
    for name, arr in feed.items():
        t = client_module.InferInput(name, list(arr.shape), TRITON_TYPES[arr.dtype])
        if binary:
            t.set_data_from_numpy(arr)
        else:  # JSON "data" (HTTP only)
            t.set_data_from_numpy(arr, binary_data=False)
        ins.append(t)
    return ins


# inputs up to this many bytes are also timed as JSON over HTTP (a 600 kB image as JSON
# text measures the client's float formatting, not the server)
JSON_BYTES = 1 << 16


def _cpu(pid: int) -> float:
    """CPU seconds (user + system, all threads) process ``pid`` has used."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def overhead(
    name: str,
    sess,
    http_url: str,
    grpc_url: str,
    rounds: int,
    runs: int,
    seq: int,
    twin: str | None = None,
    floor: tuple[str, str, str] = (),
) -> dict:
    """p50/p99 milliseconds of in-process, HTTP and gRPC (and, given the ``twin`` model's
    name, the twin over both and the bare server over HTTP; given ``floor``, the model,
    backend and threads of ``sess``, the bare server running it), alternating blocks; under
    "means", the in-process and the server's mean run in ms."""
    import tritonclient.grpc as tg
    import tritonclient.http as th

    feed = _feed(sess, 1, seq)
    hc, gc = th.InferenceServerClient(http_url), tg.InferenceServerClient(grpc_url)
    hin, gin = _inputs(th, feed), _inputs(tg, feed)
    calls = {
        "in-process": lambda: sess.run(None, feed),
        "http": lambda: hc.infer(name, hin),
        "grpc": lambda: gc.infer(name, gin),
    }
    if sum(a.nbytes for a in feed.values()) <= JSON_BYTES:
        jin = _inputs(th, feed, binary=False)
        jout = [th.InferRequestedOutput(o.name, binary_data=False) for o in sess.get_outputs()]
        calls["http json"] = lambda: hc.infer(name, jin, outputs=jout)
    bares = []
    if twin is not None:
        bares.append(_bare(twin, sess.get_outputs()[0]))
        bc = th.InferenceServerClient(bares[-1][1])
        calls |= {
            "http path": lambda: hc.infer(twin, hin),
            "grpc path": lambda: gc.infer(twin, gin),
            "http bare": lambda: bc.infer(twin, hin),
        }
        if floor:
            bares.append(_bare(twin, sess.get_outputs()[0], floor))
            rc = th.InferenceServerClient(bares[-1][1])
            calls["http bare+run"] = lambda: rc.infer(twin, hin)
    try:
        for f in calls.values():  # warm up every path and shape
            for _ in range(3):
                f()
        runs0, ms0 = _mean_run_ms(http_url, name)
        times: dict[str, list[float]] = {k: [] for k in calls}
        for _ in range(rounds):
            for k, f in calls.items():
                for _ in range(runs):
                    t = time.perf_counter()
                    f()
                    times[k].append(time.perf_counter() - t)
        runs1, ms1 = _mean_run_ms(http_url, name)
    finally:
        for bare, _ in bares:
            bare.kill()
            bare.wait()
    out: dict = {k: (_pct(v, 50), _pct(v, 99)) for k, v in times.items()}
    out["means"] = (
        float(np.mean(times["in-process"])) * 1e3,
        (ms1 - ms0) / max(runs1 - runs0, 1),
    )
    return out


def throughput(
    name: str,
    feed: dict[str, np.ndarray],
    http_url: str,
    level: int,
    seconds: float,
    server_pid: int | None = None,
) -> tuple[float, float, float]:
    """(requests per second, server CPU seconds per request, client CPU seconds per
    request) with ``level`` client threads sending ``feed`` (one row) over and over."""
    import tritonclient.http as th

    done, errors = [0] * level, []
    stop = time.perf_counter() + seconds

    def client(i: int) -> None:
        c = th.InferenceServerClient(http_url, connection_timeout=120, network_timeout=120)
        ins = _inputs(th, feed)
        while time.perf_counter() < stop:
            try:
                c.infer(name, ins)
                done[i] += 1
            except Exception as e:  # noqa: BLE001 - counted, the run goes on
                errors.append(e)

    cpu0 = _cpu(server_pid) if server_pid else 0.0
    me0 = _cpu(os.getpid())
    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(level)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    n = max(sum(done), 1)
    server_cpu = (_cpu(server_pid) - cpu0) / n if server_pid else float("nan")
    client_cpu = (_cpu(os.getpid()) - me0) / n
    if errors:
        print(f"    {len(errors)} failed requests, e.g. {errors[0]}", file=sys.stderr)
    return sum(done) / wall, server_cpu, client_cpu


def in_process_batched(sess, feed: dict[str, np.ndarray], seconds: float) -> tuple[float, float]:
    """(rows per second, CPU seconds per row) of in-process runs of ``feed``."""
    batch = len(next(iter(feed.values())))
    sess.run(None, feed)
    rows, cpu0, start = 0, _cpu(os.getpid()), time.perf_counter()
    while time.perf_counter() - start < seconds:
        sess.run(None, feed)
        rows += batch
    return rows / (time.perf_counter() - start), (_cpu(os.getpid()) - cpu0) / rows


def _rows_and_runs(http_url: str, name: str) -> tuple[float, float]:
    """Rows and runs the server has counted for ``name`` (its /metrics)."""
    import urllib.request

    text = urllib.request.urlopen(f"http://{http_url}/metrics", timeout=60).read().decode()

    def value(metric: str) -> float:
        m = re.search(rf'^{metric}{{model="{name}"}} (\S+)$', text, re.M)
        return float(m.group(1)) if m else 0.0

    return value("kiln_batch_size_sum"), value("kiln_batch_size_count")


def _load() -> str:
    return open("/proc/loadavg").read().split()[0]


def ray_serve(
    names: list[str], backend: str, level: int, seconds: float, max_batch: int, seq: int
) -> None:
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
            feed = _feed(sess, 1, seq)
            for replicas in (1, 2):
                with tempfile.TemporaryDirectory() as repo:
                    (Path(repo) / n / "1").mkdir(parents=True)
                    os.symlink(_model_path(n), Path(repo) / n / "1" / "model.onnx")
                    cfg = ModelConfig(backend=backend, max_batch_size=max_batch)
                    serve.run(
                        application(
                            model_repository=repo, config=cfg, num_replicas=replicas, num_cpus=0.5
                        ),
                        route_prefix="/",
                    )
                    throughput(n, feed, f"127.0.0.1:{port}", 2, 2)  # warm up
                    rps = throughput(n, feed, f"127.0.0.1:{port}", level, seconds)[0]
                    print(
                        f"{n} ({backend}) on Ray Serve, {replicas} replica(s), concurrency "
                        f"{level}: {rps:.1f} req/s",
                        flush=True,
                    )
                    serve.delete("default")
    finally:
        serve.shutdown()
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="digits,resnet18,bert")
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--rounds", type=int, default=5, help="latency blocks per path")
    ap.add_argument("--runs", type=int, default=40, help="requests per latency block")
    ap.add_argument("--seconds", type=float, default=5.0, help="per throughput measurement")
    ap.add_argument(
        "--throughput-rounds",
        type=int,
        default=2,
        help="alternating in-process / server rounds per concurrency level",
    )
    ap.add_argument("--levels", default="1,4,16,64")
    ap.add_argument("--seq", type=int, default=128, help="tokens per row of a text model")
    ap.add_argument("--max-batch-size", type=int, default=16)
    ap.add_argument("--max-queue-delay-microseconds", type=int, default=0)
    ap.add_argument("--no-latency", action="store_true", help="throughput only")
    ap.add_argument(
        "--threads",
        type=int,
        help="the torch backend's threads, server and in-process alike (default: each "
        "picks its own, and on a busy machine the two can pick differently)",
    )
    ap.add_argument("--ray", action="store_true", help="Ray Serve with 1 and 2 replicas")
    args = ap.parse_args(argv)
    import kiln

    if args.ray:
        ray_serve(
            args.models.split(","), args.backend, 16, args.seconds, args.max_batch_size, args.seq
        )
        return 0

    names = args.models.split(",")
    twins = {}
    with tempfile.TemporaryDirectory() as repo:
        for n in names:
            (Path(repo) / n / "1").mkdir(parents=True)
            os.symlink(_model_path(n), Path(repo) / n / "1" / "model.onnx")
            (Path(repo) / f"{n}_path" / "1").mkdir(parents=True)
            sess = kiln.InferenceSession(str(_model_path(n)), backend="numpy")
            if _twin(sess, Path(repo) / f"{n}_path" / "1" / "model.onnx"):
                twins[n] = f"{n}_path"
            else:
                (Path(repo) / f"{n}_path" / "1").rmdir()
                (Path(repo) / f"{n}_path").rmdir()
        proc, http_url, grpc_url = _start(
            repo,
            args.backend,
            args.max_batch_size,
            args.max_queue_delay_microseconds,
            args.threads,
        )
        try:
            for n in names:
                opts = {"threads": args.threads} if args.threads else {}
                sess = kiln.InferenceSession(str(_model_path(n)), backend=args.backend, **opts)
                if not args.no_latency:
                    r = overhead(
                        n,
                        sess,
                        http_url,
                        grpc_url,
                        args.rounds,
                        args.runs,
                        args.seq,
                        twins.get(n),
                        (str(_model_path(n)), args.backend, str(args.threads or "")),
                    )
                    base = r["in-process"][0]
                    local, served = r.pop("means")
                    print(
                        f"{n} ({args.backend}) latency at concurrency 1, ms p50/p99: "
                        + ", ".join(f"{k} {p50:.2f}/{p99:.2f}" for k, (p50, p99) in r.items())
                        + f"  (load {_load()})"
                    )
                    json_p50 = (
                        f", http json {r['http json'][0] - base:.2f} ms" if "http json" in r else ""
                    )
                    floor_p50 = (
                        f"; the bare server running it: {r['http bare+run'][0] - base:.2f} ms"
                        if "http bare+run" in r
                        else ""
                    )
                    print(
                        f"  server overhead p50: http {r['http'][0] - base:.2f} ms, "
                        f"grpc {r['grpc'][0] - base:.2f} ms{json_p50}{floor_p50}; mean run: "
                        f"in-process {local:.2f} ms, in the server {served:.2f} ms",
                        flush=True,
                    )
                one, batch = _feed(sess, 1, args.seq), _feed(sess, args.max_batch_size, args.seq)
                throughput(n, one, http_url, 2, 1.0)  # warm the server's batch shapes
                for level in [int(c) for c in args.levels.split(",") if c]:
                    for rnd in range(args.throughput_rounds):
                        ip, ip_cpu = in_process_batched(sess, batch, args.seconds)
                        rows0, runs0 = _rows_and_runs(http_url, n)
                        rps, s_cpu, c_cpu = throughput(
                            n, one, http_url, level, args.seconds, proc.pid
                        )
                        rows1, runs1 = _rows_and_runs(http_url, n)
                        per_run = (rows1 - rows0) / max(runs1 - runs0, 1)
                        print(
                            f"{n} ({args.backend}) concurrency {level:>2} round {rnd}: "
                            f"{rps:8.1f} req/s vs in-process batch {args.max_batch_size} "
                            f"{ip:8.1f} rows/s = {rps / ip:.2f}x; {per_run:.1f} rows a server "
                            f"run; CPU ms per row: server "
                            f"{s_cpu * 1e3:.1f} + clients {c_cpu * 1e3:.1f} vs in-process "
                            f"{ip_cpu * 1e3:.1f} (load {_load()})",
                            flush=True,
                        )
        finally:
            proc.terminate()
            proc.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
