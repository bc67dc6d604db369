"""Large binary-tensor requests over the wire, through a real `kiln serve` process: the
outputs are byte-exact against a plain ``kiln.InferenceSession`` run of the same file (and
against NumPy's negation, what the model computes), whether the body comes in one TCP
segment or several, with a Content-Length or chunked, one request or several on one
keep-alive connection; a body over the limit is still refused and the server keeps
serving."""

from __future__ import annotations

import json
import socket
import time

import numpy as np
import pytest

import kiln
from serve_process import ServeProcess

SERVE_EXTRA = 'kiln serve needs the serve extra: pip install -e ".[serve]"'
for _module in ("starlette", "uvicorn", "grpc", "prometheus_client"):
    pytest.importorskip(_module, reason=SERVE_EXTRA)
th = pytest.importorskip("tritonclient.http", reason=SERVE_EXTRA)
tg = pytest.importorskip("tritonclient.grpc", reason=SERVE_EXTRA)

LIMIT = 4_000_000  # bytes: --max-request-size of the server below


def _negate(path) -> str:
    """A model whose output is as large as its input: y = -x, x of [n, 3, 224, 224]."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Neg", ["x"], ["y"])],
        "negate",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 224, 224])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3, 224, 224])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return str(path)


@pytest.fixture(scope="module")
def negate(tmp_path_factory):
    path = _negate(tmp_path_factory.mktemp("models") / "negate.onnx")
    s = ServeProcess(path, "--max-request-size", str(LIMIT))
    s.session = kiln.InferenceSession(path)
    yield s
    assert s.stop() == 0


def _image(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 3, 224, 224), dtype=np.float32)


def _expect(s: ServeProcess, x: np.ndarray, got: np.ndarray) -> None:
    want = s.session.run(None, {"x": x})[0]
    assert got.dtype == np.float32 and got.shape == x.shape
    assert got.tobytes() == want.tobytes() == np.negative(x).tobytes()


def _binary_body(x: np.ndarray) -> tuple[bytes, int]:
    head = json.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "datatype": "FP32",
                    "shape": list(x.shape),
                    "parameters": {"binary_data_size": x.nbytes},
                }
            ],
            "parameters": {"binary_data_output": True},
        }
    ).encode()
    return head + x.tobytes(), len(head)


def _send(sock: socket.socket, head: bytes, body: bytes, pieces: int, pause: float) -> None:
    """The request's head, then its body in ``pieces`` sends ``pause`` seconds apart (with
    TCP_NODELAY each leaves as its own segments)."""
    sock.sendall(head)
    step = -(-len(body) // pieces)
    for i in range(0, len(body), step):
        time.sleep(pause)
        sock.sendall(body[i : i + step])


def _response(sock: socket.socket) -> tuple[int, dict, bytes]:
    """(status, headers, body) of one response with a Content-Length."""
    data = b""
    while b"\r\n\r\n" not in data:
        more = sock.recv(1 << 16)
        assert more, "the server closed the connection"
        data += more
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])}
    size = int(headers["content-length"])
    while len(body) < size:
        more = sock.recv(1 << 20)
        assert more, "the server closed the connection mid-body"
        body += more
    assert len(body) == size  # nothing past the response on a request-response connection
    return int(lines[0].split()[1]), headers, body


def _connect(s: ServeProcess) -> socket.socket:
    host, port = s.http.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _output(headers: dict, body: bytes) -> np.ndarray:
    n = int(headers["inference-header-content-length"])
    meta = json.loads(body[:n])["outputs"][0]
    assert meta["parameters"]["binary_data_size"] == len(body) - n
    return np.frombuffer(body[n:], np.float32).reshape(meta["shape"])


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_tritonclient_large_binary_tensors_are_byte_exact(negate, kind):
    client = th if kind == "http" else tg
    c = client.InferenceServerClient(negate.http if kind == "http" else negate.grpc)
    for n, seed in ((1, 0), (3, 1)):  # 0.6 MB and 1.8 MB each way
        x = _image(n, seed)
        t = client.InferInput("x", list(x.shape), "FP32")
        t.set_data_from_numpy(x)
        out = [client.InferRequestedOutput("y", binary_data=True)] if kind == "http" else None
        _expect(negate, x, c.infer("negate", [t], outputs=out).as_numpy("y"))


@pytest.mark.parametrize("pieces, pause", [(1, 0.0), (7, 0.02), (60, 0.0)])
def test_a_body_in_several_segments_on_one_keep_alive_connection(negate, pieces, pause):
    with _connect(negate) as sock:
        for seed in range(2):  # two requests on the connection, then a small JSON one
            x = _image(1, 10 + seed)
            body, n = _binary_body(x)
            head = (
                f"POST /v2/models/negate/infer HTTP/1.1\r\nHost: kiln\r\n"
                f"Content-Length: {len(body)}\r\nInference-Header-Content-Length: {n}\r\n\r\n"
            ).encode()
            _send(sock, head, body, pieces, pause)
            status, headers, got = _response(sock)
            assert status == 200, got[:200]
            _expect(negate, x, _output(headers, got))
        small = json.dumps(
            {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 3, 224, 1], "data": []}]}
        ).encode()
        head = f"POST /v2/models/negate/infer HTTP/1.1\r\nContent-Length: {len(small)}\r\n\r\n"
        _send(sock, head.encode(), small, 1, 0.0)
        status, _, got = _response(sock)
        assert status == 400 and "holds 0 values" in json.loads(got)["error"]


def test_a_chunked_body_without_content_length(negate):
    x = _image(1, 20)
    body, n = _binary_body(x)
    step = 100_000
    chunks = b"".join(
        f"{len(body[i : i + step]):x}\r\n".encode() + body[i : i + step] + b"\r\n"
        for i in range(0, len(body), step)
    )
    head = (
        "POST /v2/models/negate/infer HTTP/1.1\r\nTransfer-Encoding: chunked\r\n"
        f"Inference-Header-Content-Length: {n}\r\n\r\n"
    ).encode()
    with _connect(negate) as sock:
        _send(sock, head, chunks + b"0\r\n\r\n", 4, 0.01)
        status, headers, got = _response(sock)
    assert status == 200
    _expect(negate, x, _output(headers, got))


def test_bodies_over_the_limit_or_cut_short_and_the_server_keeps_serving(negate):
    x = _image(2, 30)
    body, n = _binary_body(np.concatenate([x, x, x, x]))  # 4.8 MB > LIMIT
    head = (
        f"POST /v2/models/negate/infer HTTP/1.1\r\nContent-Length: {len(body)}\r\n"
        f"Inference-Header-Content-Length: {n}\r\n\r\n"
    ).encode()
    with _connect(negate) as sock:
        sock.sendall(head + body[:100_000])
        status, _, got = _response(sock)
    assert status == 413 and f"at most {LIMIT}" in json.loads(got)["error"]
    # a client that goes away half-way through a body the server was holding
    body, n = _binary_body(x)
    with _connect(negate) as sock:
        sock.sendall(
            (
                f"POST /v2/models/negate/infer HTTP/1.1\r\nContent-Length: {len(body)}\r\n"
                f"Inference-Header-Content-Length: {n}\r\n\r\n"
            ).encode()
            + body[: len(body) // 2]
        )
    with _connect(negate) as sock:
        _send(
            sock,
            (
                f"POST /v2/models/negate/infer HTTP/1.1\r\nContent-Length: {len(body)}\r\n"
                f"Inference-Header-Content-Length: {n}\r\n\r\n"
            ).encode(),
            body,
            3,
            0.0,
        )
        status, headers, got = _response(sock)
    assert status == 200
    _expect(negate, x, _output(headers, got))
