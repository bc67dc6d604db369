"""kiln serve's app on Ray Serve, on a real local Ray cluster: two replicas answer the Open
Inference Protocol through Ray's HTTP proxy; outputs equal onnxruntime's."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import urllib.error
import urllib.request

import numpy as np
import pytest

from serve_process import DIGITS

ray = pytest.importorskip("ray", reason='ray is not installed: pip install "ray[serve]"')
serve = pytest.importorskip(
    "ray.serve", reason='ray[serve] is not installed: pip install "ray[serve]"'
)
pytest.importorskip(
    "starlette", reason='kiln serve needs the serve extra: pip install -e ".[serve]"'
)
ort = pytest.importorskip("onnxruntime")

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)


def test_two_replicas_on_ray_serve_answer_the_protocol():
    from kiln.serving.ray import application

    port = _free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(application([str(DIGITS)], num_replicas=2, num_cpus=0.5), route_prefix="/")
        base = f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(f"{base}/v2/models/digits_cnn", timeout=60) as r:
            assert json.load(r)["inputs"][0]["shape"] == [-1, 1, 8, 8]
        rng = np.random.default_rng(5)
        xs = [rng.random((2, 1, 8, 8), dtype=np.float32) for _ in range(16)]
        ref = ort.InferenceSession(str(DIGITS))

        def infer(x):
            body = {
                "inputs": [
                    {
                        "name": "image",
                        "datatype": "FP32",
                        "shape": [2, 1, 8, 8],
                        "data": x.reshape(-1).tolist(),
                    }
                ]
            }
            return _post(f"{base}/v2/models/digits_cnn/infer", body)

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(infer, xs))
        for x, a in zip(xs, answers):
            out = a["outputs"][0]
            np.testing.assert_allclose(
                np.array(out["data"]).reshape(2, 10),
                ref.run(None, {"image": x})[0],
                rtol=1e-4,
                atol=1e-5,
            )
        status = serve.status().applications["default"].deployments["kiln"]
        assert status.status == "HEALTHY" and sum(status.replica_states.values()) == 2
    finally:
        serve.shutdown()
        ray.shutdown()


def test_a_replica_killed_under_load_fails_no_request_silently():
    """Every request sent while one of two replicas is killed either answers correctly or
    fails visibly (an error status) within its timeout; none hangs or comes back wrong,
    and the deployment serves again afterwards."""
    import time

    from kiln.serving.ray import application

    port = _free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(application([str(DIGITS)], num_replicas=2, num_cpus=0.5), route_prefix="/")
        url = f"http://127.0.0.1:{port}/v2/models/digits_cnn/infer"
        x = np.random.default_rng(6).random((1, 1, 8, 8), dtype=np.float32)
        want = ort.InferenceSession(str(DIGITS)).run(None, {"image": x})[0]
        body = {
            "inputs": [
                {
                    "name": "image",
                    "datatype": "FP32",
                    "shape": [1, 1, 8, 8],
                    "data": x.reshape(-1).tolist(),
                }
            ]
        }
        outcomes: list[str] = []
        stop = time.monotonic() + 8

        def client():
            while time.monotonic() < stop:
                try:
                    out = _post(url, body)["outputs"][0]
                except urllib.error.HTTPError as e:
                    outcomes.append(f"status {e.code}")
                    continue
                except OSError as e:  # connection reset: also a failure the client sees
                    outcomes.append(type(e).__name__)
                    continue
                got = np.array(out["data"], np.float32).reshape(1, 10)
                outcomes.append("ok" if np.allclose(got, want, rtol=1e-4, atol=1e-5) else "WRONG")

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(client) for _ in range(4)]
            time.sleep(3)
            names = [
                a["name"]
                for a in ray.util.list_named_actors(all_namespaces=True)
                if "SERVE_REPLICA" in a["name"]
            ]
            assert len(names) == 2, names
            ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
            for f in futures:
                f.result(timeout=120)  # no client hangs
        assert "WRONG" not in outcomes and outcomes.count("ok") > 0, outcomes
        deadline = time.monotonic() + 90
        while True:  # the controller replaces the replica; the deployment serves again
            try:
                out = _post(url, body)["outputs"][0]
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(1)
        assert np.allclose(
            np.array(out["data"], np.float32).reshape(1, 10), want, rtol=1e-4, atol=1e-5
        )
    finally:
        serve.shutdown()
        ray.shutdown()
