"""kiln serve's app on Ray Serve, on a real local Ray cluster: two replicas answer the Open
Inference Protocol through Ray's HTTP proxy; outputs equal onnxruntime's."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import urllib.request

import numpy as np
import pytest

from serve_process import DIGITS

ray = pytest.importorskip("ray", reason='ray is not installed: pip install "ray[serve]"')
serve = pytest.importorskip("ray.serve", reason='ray[serve] is not installed: pip install '
                            '"ray[serve]"')
pytest.importorskip("starlette", reason='kiln serve needs the serve extra: pip install -e '
                    '".[serve]"')
ort = pytest.importorskip("onnxruntime")

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)


def test_two_replicas_on_ray_serve_answer_the_protocol():
    from kiln.serve.ray import application

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
            body = {"inputs": [{"name": "image", "datatype": "FP32", "shape": [2, 1, 8, 8],
                                "data": x.reshape(-1).tolist()}]}
            return _post(f"{base}/v2/models/digits_cnn/infer", body)

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(infer, xs))
        for x, a in zip(xs, answers):
            out = a["outputs"][0]
            np.testing.assert_allclose(np.array(out["data"]).reshape(2, 10),
                                       ref.run(None, {"image": x})[0], rtol=1e-4, atol=1e-5)
        status = serve.status().applications["default"].deployments["kiln"]
        assert status.status == "HEALTHY" and sum(status.replica_states.values()) == 2
    finally:
        serve.shutdown()
        ray.shutdown()
