"""Default threads on a busy machine: how much slower than one thread?

    python benchmarks/busy_threads.py --models gpt2,resnet18 --burners 2 --seq 128

For each model, a fresh process per setting runs Kiln's torch backend and onnxruntime with
their default threads and with 1 thread, alternating, median of the runs; first with the
machine as it is, then with ``--burners`` processes spinning on the CPU (a busy machine,
made on purpose so the figure is reproducible). Settings: Kiln as shipped (default threads
follow the load when the session is made, short OpenMP spin), and Kiln with
``KILN_THREADS_FOLLOW_LOAD=0 KILN_OMP_SPIN=default`` (default threads fixed at the usable
cores, OpenMP's own long spin-wait: what torch does unless told otherwise).
Prints default-threads time / 1-thread time per engine: the issue's goal is that a busy
machine with default threads is not several times slower than with 1 thread.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time

CHILD = r"""
import json, sys, time, numpy as np
name, rounds, seq = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
import kiln, onnxruntime as ort, torch
from kiln import zoo
feed, _, _ = zoo.load_reference(name)
if seq:  # text models: batch 1 at this sequence length
    feed = {k: np.resize(v, (1, seq)) if v.dtype == np.int64 and v.ndim == 2 else v
            for k, v in feed.items()}
path = str(zoo.path(name, progress=False))
so1 = ort.SessionOptions(); so1.intra_op_num_threads = 1
engines = {"kiln": kiln.InferenceSession(path, backend="torch")}
default_threads = torch.get_num_threads()  # what the default session chose
engines.update({
           "kiln 1t": kiln.InferenceSession(path, backend="torch", threads=1),
           "ort": ort.InferenceSession(path, providers=["CPUExecutionProvider"]),
           "ort 1t": ort.InferenceSession(path, so1, providers=["CPUExecutionProvider"])})
times = {k: [] for k in engines}
for _ in range(rounds):
    for k, s in engines.items():
        if k.startswith("kiln"):  # threads are per process: give each session its own
            torch.set_num_threads(1 if k.endswith("1t") else default_threads)
        s.run(None, feed)
        t0 = time.perf_counter(); s.run(None, feed); times[k].append(time.perf_counter() - t0)
print(json.dumps({k: float(np.median(v)) for k, v in times.items()}))
"""


def _burn() -> None:
    while True:
        pass


def measure(name: str, rounds: int, seq: int, env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, name, str(rounds), str(seq)], env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt2,resnet18")
    ap.add_argument("--burners", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128, help="text models: batch 1 at this length")
    args = ap.parse_args()
    settings = {"kiln as shipped": {},
                "fixed threads, torch's spin": {"KILN_OMP_SPIN": "default",
                                                "KILN_THREADS_FOLLOW_LOAD": "0"}}
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, load {os.getloadavg()[0]:.1f}, "
          f"{os.cpu_count()} cores; default-threads time / 1-thread time (medians)")
    for busy in (False, True):
        burners = [mp.Process(target=_burn, daemon=True)
                   for _ in range(args.burners if busy else 0)]
        for b in burners:
            b.start()
        try:
            for name in args.models.split(","):
                for label, extra in settings.items():
                    r = measure(name, args.rounds, args.seq, {**os.environ, **extra})
                    print(f"{'busy' if busy else 'as is'} ({len(burners)} burners) {name:10s} "
                          f"{label:28s} kiln {r['kiln'] * 1e3:7.1f} ms = "
                          f"{r['kiln'] / r['kiln 1t']:.2f}x 1 thread | onnxruntime "
                          f"{r['ort'] * 1e3:7.1f} ms = {r['ort'] / r['ort 1t']:.2f}x 1 thread",
                          flush=True)
        finally:
            for b in burners:
                b.terminate()


if __name__ == "__main__":
    main()
