"""`kiln serve` as a real process on 127.0.0.1, spoken to with raw HTTP (always) and
with the real tritonclient HTTP and gRPC clients (where installed); every output is
compared with onnxruntime's run of the same model file."""

from __future__ import annotations

import concurrent.futures
import json
import re
import shutil
import time

import numpy as np
import pytest

from serve_process import DIGITS, ServeProcess

SERVE_EXTRA = 'kiln serve needs the serve extra: pip install -e ".[serve]"'
for _module in ("starlette", "uvicorn", "grpc", "prometheus_client"):
    pytest.importorskip(_module, reason=SERVE_EXTRA)
ort = pytest.importorskip("onnxruntime")
# the real Triton clients (in the serve and test extras)
th = pytest.importorskip("tritonclient.http", reason=SERVE_EXTRA)
tg = pytest.importorskip("tritonclient.grpc", reason=SERVE_EXTRA)
CLIENTS = {"http": th, "grpc": tg}


def _reference(x: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(str(DIGITS)).run(None, {"image": x})[0]


def _json_infer(x: np.ndarray) -> dict:
    return {
        "inputs": [
            {
                "name": "image",
                "datatype": "FP32",
                "shape": list(x.shape),
                "data": x.reshape(-1).tolist(),
            }
        ]
    }


def _reshaper(path) -> str:
    """A model whose run fails for a shape the request chooses (Reshape's target)."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["y"])],
        "reshaper",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4]),
            helper.make_tensor_value_info("shape", TensorProto.INT64, [2]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return str(path)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    reshaper = _reshaper(tmp_path_factory.mktemp("models") / "reshaper.onnx")
    s = ServeProcess(str(DIGITS), reshaper, "--max-request-size", "200000")
    s.reshaper = reshaper
    yield s
    assert s.stop() == 0


def test_health_and_metadata_over_raw_http(server):
    assert server.request("GET", "/v2/health/live")[0] == 200
    status, _, body = server.request("GET", "/v2/health/ready")
    assert status == 200 and json.loads(body) == {"ready": True}
    meta = json.loads(server.request("GET", "/v2/models/digits_cnn")[2])
    assert meta["inputs"] == [{"name": "image", "datatype": "FP32", "shape": [-1, 1, 8, 8]}]
    assert meta["outputs"] == [{"name": "logits", "datatype": "FP32", "shape": [-1, 10]}]
    assert (
        json.loads(server.request("GET", "/v2/models/digits_cnn/versions/1/ready")[2])["ready"]
        is True
    )


def test_json_infer_over_raw_http_matches_onnxruntime(server):
    x = np.random.default_rng(0).random((3, 1, 8, 8), dtype=np.float32)
    status, _, body = server.request(
        "POST", "/v2/models/digits_cnn/infer", {**_json_infer(x), "id": "r1"}
    )
    assert status == 200, body
    resp = json.loads(body)
    assert resp["id"] == "r1" and resp["model_name"] == "digits_cnn"
    (out,) = resp["outputs"]
    assert out["shape"] == [3, 10] and out["datatype"] == "FP32"
    np.testing.assert_allclose(
        np.array(out["data"]).reshape(3, 10), _reference(x), rtol=1e-4, atol=1e-5
    )


@pytest.mark.parametrize(
    "body, status, words",
    [
        (b"{not json", 400, "not valid JSON"),
        (
            {
                "inputs": [
                    {
                        "name": "pixels",
                        "datatype": "FP32",
                        "shape": [1, 1, 8, 8],
                        "data": [0.0] * 64,
                    }
                ]
            },
            400,
            "no input 'pixels'",
        ),
        (
            {
                "inputs": [
                    {"name": "image", "datatype": "INT32", "shape": [1, 1, 8, 8], "data": [0] * 64}
                ]
            },
            400,
            "is FP32, the request sent INT32",
        ),
        (
            {
                "inputs": [
                    {"name": "image", "datatype": "FP32", "shape": [1, 1, 8, 7], "data": [0.0] * 56}
                ]
            },
            400,
            "the request sent [1, 1, 8, 7]",
        ),
        (
            {
                "inputs": [
                    {"name": "image", "datatype": "FP32", "shape": [1, 1, 8, 8], "data": [0.0] * 3}
                ]
            },
            400,
            "holds 3 values",
        ),
        (
            {
                "inputs": [
                    {"name": "image", "datatype": "FP32", "shape": [1, 1, 8, 8], "data": [0.0] * 64}
                ],
                "outputs": [{"name": "probs"}],
            },
            400,
            "no output",
        ),
        (b"x" * 300000, 413, "at most 200000"),
    ],
)
def test_bad_requests_get_kserve_errors_and_the_server_keeps_serving(server, body, status, words):
    got, _, text = server.request("POST", "/v2/models/digits_cnn/infer", body)
    assert got == status and words in json.loads(text)["error"]
    x = np.ones((1, 1, 8, 8), np.float32)
    assert server.request("POST", "/v2/models/digits_cnn/infer", _json_infer(x))[0] == 200


def _logged(s: ServeProcess, event: str, model: str, timeout: float = 20.0) -> list[dict]:
    """The JSON log lines about ``model`` the server wrote to stderr, once one of them is
    ``event`` (a thread reads the server's stderr, so a line can arrive a moment late)."""
    deadline = time.monotonic() + timeout
    while True:
        events = [json.loads(line) for line in list(s.log) if line.startswith("{")]
        mine = [e for e in events if e.get("model") == model]
        if any(e.get("event") == event for e in mine) or time.monotonic() > deadline:
            return mine
        time.sleep(0.05)


def test_a_failing_run_is_a_500_naming_the_layer_and_the_server_keeps_serving(server):
    def reshape(target):
        return server.request(
            "POST",
            "/v2/models/reshaper/infer",
            {
                "inputs": [
                    {"name": "x", "datatype": "FP32", "shape": [2, 4], "data": list(range(8))},
                    {"name": "shape", "datatype": "INT64", "shape": [2], "data": target},
                ]
            },
        )

    status, _, body = reshape([3, 3])
    assert status == 500 and "Reshape" in json.loads(body)["error"]
    status, _, body = reshape([4, 2])
    assert status == 200
    out = json.loads(body)["outputs"][0]
    assert out["shape"] == [4, 2] and out["data"] == list(range(8))
    # the failure is logged as one JSON object on a line of the server's stderr
    failed = [
        e for e in _logged(server, "infer_failed", "reshaper") if e["event"] == "infer_failed"
    ]
    assert failed and "Reshape" in failed[-1]["error"] and failed[-1]["protocol"] == "http"


def test_unknown_model_and_version_are_404(server):
    x = np.ones((1, 1, 8, 8), np.float32)
    status, _, body = server.request("POST", "/v2/models/resnet/infer", _json_infer(x))
    assert status == 404 and "'resnet' is not loaded" in json.loads(body)["error"]
    status, _, body = server.request("GET", "/v2/models/digits_cnn/versions/7")
    assert status == 404 and "no version '7'" in json.loads(body)["error"]
    # the inference routes as kiln serve answers them before Starlette's router, and
    # what that lean path leaves to the router: another method, a longer path
    status, _, body = server.request("POST", "/v2/models/digits_cnn/versions/7/infer",
                                     _json_infer(x))
    assert status == 404 and "no version '7'" in json.loads(body)["error"]
    status, _, body = server.request("POST", "/v2/models/digits_cnn/versions/1/infer",
                                     _json_infer(x))
    assert status == 200 and json.loads(body)["model_version"] == "1"
    status, _, body = server.request("GET", "/v2/models/digits_cnn/infer")
    assert status == 405 and "/v2/..." in json.loads(body)["error"]
    status, _, body = server.request("POST", "/v2/models/digits_cnn/infer/more", _json_infer(x))
    assert status == 404 and "/v2/..." in json.loads(body)["error"]


def test_tritonclient_http_binary_and_json(server):
    client = th.InferenceServerClient(server.http)
    assert client.is_server_live() and client.is_model_ready("digits_cnn")
    x = np.random.default_rng(1).random((5, 1, 8, 8), dtype=np.float32)
    for binary in (True, False):
        inp = th.InferInput("image", list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=binary)
        out = th.InferRequestedOutput("logits", binary_data=binary)
        got = client.infer("digits_cnn", [inp], outputs=[out]).as_numpy("logits")
        np.testing.assert_allclose(got, _reference(x), rtol=1e-4, atol=1e-5)
    bad = th.InferInput("image", [1, 1, 4, 4], "FP32")
    bad.set_data_from_numpy(np.zeros((1, 1, 4, 4), np.float32))
    with pytest.raises(th.InferenceServerException) as e:
        client.infer("digits_cnn", [bad])
    assert e.value.status() == "400" and "the request sent [1, 1, 4, 4]" in e.value.message()


def test_tritonclient_grpc(server):
    client = tg.InferenceServerClient(server.grpc)
    assert client.is_server_live() and client.is_model_ready("digits_cnn")
    meta = client.get_model_metadata("digits_cnn", as_json=True)
    assert meta["inputs"][0]["shape"] == ["-1", "1", "8", "8"]
    x = np.random.default_rng(2).random((4, 1, 8, 8), dtype=np.float32)
    inp = tg.InferInput("image", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    for compression in (None, "gzip", "deflate"):  # gRPC's own message compression
        got = client.infer("digits_cnn", [inp], compression_algorithm=compression)
        np.testing.assert_allclose(got.as_numpy("logits"), _reference(x), rtol=1e-4, atol=1e-5)
    bad = tg.InferInput("image", [1, 1, 8, 8], "FP64")
    bad.set_data_from_numpy(np.zeros((1, 1, 8, 8)))
    with pytest.raises(tg.InferenceServerException) as e:
        client.infer("digits_cnn", [bad])
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT" and "FP64" in e.value.message()
    with pytest.raises(tg.InferenceServerException) as e:
        client.get_model_metadata("nope")
    assert e.value.status() == "StatusCode.NOT_FOUND"


def _metric(text: str, name: str, model: str) -> float:
    m = re.search(rf'^{name}{{model="{model}"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_dynamic_batching_merges_concurrent_requests():
    s = ServeProcess(
        str(DIGITS), "--max-batch-size", "16", "--max-queue-delay-microseconds", "200000"
    )
    try:
        rng = np.random.default_rng(3)
        xs = [rng.random((1 + i % 3, 1, 8, 8), dtype=np.float32) for i in range(12)]
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            answers = list(
                pool.map(
                    lambda x: s.request("POST", "/v2/models/digits_cnn/infer", _json_infer(x)), xs
                )
            )
        for x, (status, _, body) in zip(xs, answers):
            assert status == 200, body
            out = json.loads(body)["outputs"][0]
            np.testing.assert_allclose(
                np.array(out["data"]).reshape(out["shape"]), _reference(x), rtol=1e-4, atol=1e-5
            )
        text = s.request("GET", "/metrics")[2].decode()
        runs = _metric(text, "kiln_batch_size_count", "digits_cnn")
        rows = _metric(text, "kiln_batch_size_sum", "digits_cnn")
        assert rows == sum(len(x) for x in xs)
        assert runs < len(xs), f"{len(xs)} requests ran in {runs} runs: nothing was merged"
        # every request counted by model, protocol and status; queue and compute timed
        from prometheus_client.parser import text_string_to_metric_families

        counted = {
            tuple(sorted(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "kiln_requests_total"
        }
        key = (("code", "200"), ("model", "digits_cnn"), ("protocol", "http"))
        assert counted == {key: len(xs)}, counted
        assert _metric(text, "kiln_queue_seconds_count", "digits_cnn") == len(xs)
        assert _metric(text, "kiln_compute_seconds_count", "digits_cnn") == runs
    finally:
        assert s.stop() == 0


def test_full_queue_answers_503_with_retry_after_and_the_queued_finish():
    # a 2 s window holds the first requests in the queue, so the rest find it full
    s = ServeProcess(
        str(DIGITS),
        "--max-queue-size",
        "2",
        "--max-batch-size",
        "64",
        "--max-queue-delay-microseconds",
        "2000000",
    )
    try:
        x = np.ones((1, 1, 8, 8), np.float32)

        def send(_):
            return s.request("POST", "/v2/models/digits_cnn/infer", _json_infer(x))

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(send, range(6)))
        codes = sorted(a[0] for a in answers)
        assert codes == [200, 200, 503, 503, 503, 503], codes
        refused = [a for a in answers if a[0] == 503][0]
        assert refused[1].get("retry-after") == "1"
        assert "queued" in json.loads(refused[2])["error"]
        client = tg.InferenceServerClient(s.grpc)
        inp = tg.InferInput("image", [1, 1, 8, 8], "FP32")
        inp.set_data_from_numpy(x)

        def send_grpc(_):
            try:
                client.infer("digits_cnn", [inp])
                return "OK"
            except tg.InferenceServerException as e:
                return e.status()

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            statuses = sorted(pool.map(send_grpc, range(4)))
        assert statuses == ["OK", "OK", "StatusCode.UNAVAILABLE", "StatusCode.UNAVAILABLE"]
    finally:
        assert s.stop() == 0


def test_repository_config_token_load_unload_and_graceful_shutdown(tmp_path):
    for name in ("digits", "spare"):
        (tmp_path / name / "3").mkdir(parents=True)
        shutil.copy(DIGITS, tmp_path / name / "3" / "model.onnx")
    (tmp_path / "digits" / "config.json").write_text(
        json.dumps({"max_batch_size": 4, "max_queue_delay_microseconds": 1500000})
    )
    s = ServeProcess("--model-repository", str(tmp_path), env={"KILN_SERVE_TOKEN": "s3cret"})
    auth = {"Authorization": "Bearer s3cret"}
    try:
        assert s.request("GET", "/v2/health/ready")[0] == 200  # probes need no token
        status, _, body = s.request("GET", "/v2/models/digits")
        assert status == 401 and "Bearer" in json.loads(body)["error"]
        meta = json.loads(s.request("GET", "/v2/models/digits", headers=auth)[2])
        assert meta["versions"] == ["3"]
        x = np.random.default_rng(4).random((2, 1, 8, 8), dtype=np.float32)
        status, _, body = s.request("POST", "/v2/repository/models/spare/unload", b"", auth)
        assert status == 200, body
        assert s.request("GET", "/v2/models/spare", headers=auth)[0] == 404
        index = json.loads(s.request("POST", "/v2/repository/index", b"{}", auth)[2])
        assert {r["name"]: r["state"] for r in index} == {"digits": "READY", "spare": "UNAVAILABLE"}
        assert s.request("POST", "/v2/repository/models/spare/load", b"", auth)[0] == 200
        assert s.request("GET", "/v2/models/spare/ready", headers=auth)[0] == 200
        spare = [(e["event"], e.get("version")) for e in _logged(s, "load", "spare")]
        assert spare[-2:] == [("unload", None), ("load", "3")], spare
        (tmp_path / "broken" / "1").mkdir(parents=True)  # added while serving
        (tmp_path / "broken" / "1" / "model.onnx").write_bytes(b"not an onnx file")
        status, _, body = s.request("POST", "/v2/repository/models/broken/load", b"", auth)
        assert status == 400 and "not a valid ONNX model" in json.loads(body)["error"], body
        # "digits" waits 1.5 s for a batch: SIGTERM arrives while the request is in flight
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(
                s.request,
                "POST",
                "/v2/models/digits/infer",
                _json_infer(x),
                {**auth, "Content-Type": "application/json"},
            )
            time.sleep(0.5)
            assert not pending.done()
            code = s.stop()
            status, _, body = pending.result()
        assert status == 200, body
        out = json.loads(body)["outputs"][0]
        np.testing.assert_allclose(
            np.array(out["data"]).reshape(2, 10), _reference(x), rtol=1e-4, atol=1e-5
        )
        assert code == 0
    finally:
        s.stop()


def _strings(path) -> str:
    """A model over a string tensor: passes it through, compares each element with "kïln"
    and repeats it (ONNX strings are UTF-8 text)."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [
            helper.make_node("Identity", ["s"], ["same"]),
            helper.make_node("Equal", ["s", "k"], ["hit"]),
            helper.make_node("Concat", ["s", "s"], ["twice"], axis=0),
        ],
        "strings",
        [helper.make_tensor_value_info("s", TensorProto.STRING, ["n"])],
        [
            helper.make_tensor_value_info("same", TensorProto.STRING, ["n"]),
            helper.make_tensor_value_info("hit", TensorProto.BOOL, ["n"]),
            helper.make_tensor_value_info("twice", TensorProto.STRING, ["m"]),
        ],
        initializer=[helper.make_tensor("k", TensorProto.STRING, [1], ["kïln".encode()])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)]), path)
    return str(path)


@pytest.fixture(scope="module")
def repository_server(tmp_path_factory):
    """A repository of two models and a string model, behind a bearer token."""
    root = tmp_path_factory.mktemp("repo")
    for name in ("digits", "spare"):
        (root / name / "2").mkdir(parents=True)
        shutil.copy(DIGITS, root / name / "2" / "model.onnx")
    (root / "strings" / "1").mkdir(parents=True)
    _strings(root / "strings" / "1" / "model.onnx")
    (root / "digits" / "config.json").write_text(
        json.dumps({"max_batch_size": 8, "max_queue_delay_microseconds": 100, "max_queue_size": 50})
    )
    s = ServeProcess("--model-repository", str(root), env={"KILN_SERVE_TOKEN": "s3cret"})
    s.root = root
    yield s
    assert s.stop() == 0


# a copy per call: tritonclient.http adds its own headers to the dict it is given
AUTH = {"authorization": "Bearer s3cret"}


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_tritonclient_metadata_readiness_repository_and_token(repository_server, kind):
    mod = CLIENTS[kind]
    client = mod.InferenceServerClient(getattr(repository_server, kind))
    # the probes need no token; everything else does, over both protocols
    assert client.is_server_live() and client.is_server_ready()
    with pytest.raises(mod.InferenceServerException) as e:
        client.get_model_metadata("digits")
    assert e.value.status() in ("401", "StatusCode.UNAUTHENTICATED"), e.value
    assert "Bearer" in e.value.message()
    with pytest.raises(mod.InferenceServerException):
        client.get_model_metadata("digits", headers={"authorization": "Bearer wrong"})

    server = client.get_server_metadata(
        headers=dict(AUTH), **({"as_json": True} if kind == "grpc" else {})
    )
    assert server["name"] == "kiln" and "binary_tensor_data" in server["extensions"]
    meta = client.get_model_metadata(
        "digits", "2", headers=dict(AUTH), **({"as_json": True} if kind == "grpc" else {})
    )
    assert meta["versions"] == ["2"] and meta["inputs"][0]["name"] == "image"
    assert [int(d) for d in meta["inputs"][0]["shape"]] == [-1, 1, 8, 8]
    assert client.is_model_ready("digits", headers=dict(AUTH))
    assert client.is_model_ready("digits", "2", headers=dict(AUTH))
    assert not client.is_model_ready("digits", "1", headers=dict(AUTH))
    assert not client.is_model_ready("nope", headers=dict(AUTH))

    def states():
        index = client.get_model_repository_index(
            headers=dict(AUTH), **({"as_json": True} if kind == "grpc" else {})
        )
        rows = index if kind == "http" else index["models"]
        return {r["name"]: r["state"] for r in rows}

    assert states() == {"digits": "READY", "spare": "READY", "strings": "READY"}
    client.unload_model("spare", headers=dict(AUTH))
    assert states()["spare"] == "UNAVAILABLE"
    assert not client.is_model_ready("spare", headers=dict(AUTH))
    x = np.random.default_rng(6).random((2, 1, 8, 8), dtype=np.float32)
    inp = mod.InferInput("image", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    with pytest.raises(mod.InferenceServerException) as e:
        client.infer("spare", [inp], headers=dict(AUTH))
    assert e.value.status() in ("404", "StatusCode.NOT_FOUND")
    assert "'spare' is not loaded" in e.value.message()
    client.load_model("spare", headers=dict(AUTH))
    assert client.is_model_ready("spare", headers=dict(AUTH))
    got = client.infer("spare", [inp], headers=dict(AUTH)).as_numpy("logits")
    np.testing.assert_allclose(got, _reference(x), rtol=1e-4, atol=1e-5)
    with pytest.raises(mod.InferenceServerException) as e:
        client.load_model("nope", headers=dict(AUTH))
    assert "no model 'nope'" in e.value.message()


@pytest.mark.parametrize("kind, binary", [("http", True), ("http", False), ("grpc", True)])
def test_bytes_tensors_match_onnxruntime(repository_server, kind, binary):
    mod = CLIENTS[kind]
    client = mod.InferenceServerClient(getattr(repository_server, kind))
    words = np.array(["kïln", "", "ab", "kiln", "kïln ", "日本"], dtype=object)
    inp = mod.InferInput("s", [len(words)], "BYTES")
    inp.set_data_from_numpy(words, **({"binary_data": binary} if kind == "http" else {}))
    outs = [
        mod.InferRequestedOutput(n, **({"binary_data": binary} if kind == "http" else {}))
        for n in ("same", "hit", "twice")
    ]
    got = client.infer("strings", [inp], outputs=outs, headers=dict(AUTH))
    want = dict(
        zip(
            ["same", "hit", "twice"],
            ort.InferenceSession(str(repository_server.root / "strings" / "1" / "model.onnx")).run(
                None, {"s": words}
            ),
        )
    )
    for name in ("same", "twice"):
        # binary BYTES come back as bytes, JSON ones as str (tritonclient's as_numpy)
        texts = [b.decode() if isinstance(b, bytes) else b for b in got.as_numpy(name).flat]
        assert texts == list(want[name])
    np.testing.assert_array_equal(got.as_numpy("hit"), want["hit"])
    assert want["hit"].tolist() == [True, False, False, False, False, False]


def test_bytes_that_are_not_utf8_are_a_400(repository_server):
    inp = th.InferInput("s", [1], "BYTES")
    inp.set_data_from_numpy(np.array([b"\xff\xfe"], dtype=object))
    client = th.InferenceServerClient(repository_server.http)
    with pytest.raises(th.InferenceServerException) as e:
        client.infer("strings", [inp], headers=dict(AUTH))
    assert e.value.status() == "400" and "not UTF-8" in e.value.message()


@pytest.mark.parametrize("coding", ["gzip", "deflate"])
def test_compressed_requests_and_responses(server, coding):
    x = np.random.default_rng(7).random((3, 1, 8, 8), dtype=np.float32)
    client = th.InferenceServerClient(server.http)
    for binary in (True, False):
        inp = th.InferInput("image", list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=binary)
        got = client.infer(
            "digits_cnn",
            [inp],
            outputs=[th.InferRequestedOutput("logits", binary_data=binary)],
            request_compression_algorithm=coding,
            response_compression_algorithm=coding,
        ).as_numpy("logits")
        np.testing.assert_allclose(got, _reference(x), rtol=1e-4, atol=1e-5)
    # tritonclient decompresses silently: raw HTTP shows the response really is compressed
    import gzip
    import zlib

    body = json.dumps(_json_infer(x)).encode()
    packed = gzip.compress(body) if coding == "gzip" else zlib.compress(body)
    status, headers, raw = server.request(
        "POST",
        "/v2/models/digits_cnn/infer",
        packed,
        {"Content-Encoding": coding, "Accept-Encoding": f"br;q=1.0, {coding};q=0.5"},
    )
    assert status == 200 and headers.get("content-encoding") == coding
    resp = json.loads(gzip.decompress(raw) if coding == "gzip" else zlib.decompress(raw))
    np.testing.assert_allclose(
        np.array(resp["outputs"][0]["data"]).reshape(3, 10), _reference(x), rtol=1e-4, atol=1e-5
    )
    status, headers, _ = server.request(
        "POST", "/v2/models/digits_cnn/infer", body, {"Accept-Encoding": f"{coding};q=0"}
    )
    assert status == 200 and "content-encoding" not in headers
    status, _, text = server.request(
        "POST", "/v2/models/digits_cnn/infer", b"\x1f\x8bjunk", {"Content-Encoding": coding}
    )
    assert status == 400 and "does not decompress" in json.loads(text)["error"]


def test_kiln_serve_function_serves_from_python():
    """``kiln.serve(...)``, the embedding API, in its own process: the same protocol."""
    import sys

    code = (
        "import sys, kiln; kiln.serve([sys.argv[1]], http_port=0, grpc_port=0, "
        "config=kiln.serving.ModelConfig(max_batch_size=4))"
    )
    s = ServeProcess(command=[sys.executable, "-c", code, str(DIGITS)])
    try:
        x = np.random.default_rng(8).random((3, 1, 8, 8), dtype=np.float32)
        for mod, address in ((th, s.http), (tg, s.grpc)):
            inp = mod.InferInput("image", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            got = mod.InferenceServerClient(address).infer("digits_cnn", [inp])
            np.testing.assert_allclose(got.as_numpy("logits"), _reference(x), rtol=1e-4, atol=1e-5)
    finally:
        assert s.stop() == 0


def test_serves_on_uvicorns_own_protocol_where_kilns_cannot_load():
    """Kiln's HTTP connection subclasses uvicorn's httptools protocol; where a uvicorn
    release moved it (here: the module made unimportable), the server runs on uvicorn's
    own protocol and answers the same."""
    import sys

    code = (
        "import sys; sys.modules['kiln.serving.connection'] = None; import kiln; "
        "kiln.serve([sys.argv[1]], http_port=0, grpc_port=None)"
    )
    s = ServeProcess(command=[sys.executable, "-c", code, str(DIGITS)])
    try:
        x = np.random.default_rng(9).random((1, 1, 8, 8), dtype=np.float32)
        inp = th.InferInput("image", list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=True)
        got = th.InferenceServerClient(s.http).infer("digits_cnn", [inp])
        np.testing.assert_allclose(got.as_numpy("logits"), _reference(x), rtol=1e-4, atol=1e-5)
    finally:
        assert s.stop() == 0


def test_import_kiln_loads_no_server_library():
    """``kiln.serve`` is a function on ``import kiln`` without importing Starlette, uvicorn
    or grpc: Kiln without the serve extra still imports, and they load when a server starts."""
    import os
    import subprocess
    import sys

    code = (
        "import sys, kiln, inspect; print(inspect.isfunction(kiln.serve), "
        "sorted(m for m in ('starlette', 'uvicorn', 'grpc', 'prometheus_client') "
        "if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(DIGITS.parents[2])},
    )
    assert out.stdout.split() == ["True", "[]"], out


# onnxruntime's NodeArg.type -> the DataType name of Triton's model configuration
TRITON_TYPES = {
    "tensor(float)": "TYPE_FP32",
    "tensor(int64)": "TYPE_INT64",
    "tensor(bool)": "TYPE_BOOL",
    "tensor(string)": "TYPE_STRING",
}


def _as_config(got: dict, kind: str) -> dict:
    """tritonclient's answer as Triton's HTTP JSON: gRPC's ``as_json`` wraps it in
    ``config`` and writes 64-bit integers as strings."""
    if kind == "http":
        return got
    got = got["config"]
    for t in got.get("input", []) + got.get("output", []):
        t["dims"] = [int(d) for d in t.get("dims", [])]
    return got


def _ort_tensors(path, batched: bool) -> dict:
    """Inputs and outputs as Triton's config lists them, from the real onnxruntime: dims
    without the batch dimension when the model batches, -1 for a free dim."""
    sess = ort.InferenceSession(str(path))
    skip = 1 if batched else 0

    def rows(args):
        return [
            {
                "name": a.name,
                "data_type": TRITON_TYPES[a.type],
                "dims": [d if isinstance(d, int) else -1 for d in a.shape or []][skip:],
            }
            for a in args
        ]

    return {"input": rows(sess.get_inputs()), "output": rows(sess.get_outputs())}


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_model_configuration_extension_matches_onnxruntime(repository_server, server, kind):
    mod = CLIENTS[kind]
    as_json = {"as_json": True} if kind == "grpc" else {}
    client = mod.InferenceServerClient(getattr(repository_server, kind))
    meta = client.get_server_metadata(headers=dict(AUTH), **as_json)
    assert {"model_configuration", "statistics"} <= set(meta["extensions"])
    for version in ("", "2"):
        config = _as_config(
            client.get_model_config("digits", version, headers=dict(AUTH), **as_json), kind
        )
        path = repository_server.root / "digits" / "2" / "model.onnx"
        assert {k: config.get(k) for k in ("input", "output")} == _ort_tensors(path, True)
        # the values of digits/config.json
        assert config["name"] == "digits" and config["backend"] == "kiln"
        assert config["max_batch_size"] == 8
        batching = config["dynamic_batching"]
        assert int(batching["max_queue_delay_microseconds"]) == 100
        assert batching["default_queue_policy"]["max_queue_size"] == 50
        assert config["instance_group"][0]["kind"] == "KIND_CPU"
        assert config["instance_group"][0]["count"] == 1
        assert config["default_model_filename"] == "model.onnx"
    # the string model takes the server's default max batch size
    strings = _as_config(client.get_model_config("strings", headers=dict(AUTH), **as_json), kind)
    assert strings["max_batch_size"] == 32
    assert {k: strings[k] for k in ("input", "output")} == _ort_tensors(
        repository_server.root / "strings" / "1" / "model.onnx", True
    )
    with pytest.raises(mod.InferenceServerException) as e:
        client.get_model_config("digits", "1", headers=dict(AUTH))
    assert e.value.status() in ("404", "StatusCode.NOT_FOUND")
    # a model without a free first dim does not batch: max_batch_size 0, full dims
    plain = mod.InferenceServerClient(getattr(server, kind))
    reshaper = _as_config(plain.get_model_config("reshaper", **as_json), kind)
    assert reshaper.get("max_batch_size", 0) == 0 and "dynamic_batching" not in reshaper
    want = _ort_tensors(server.reshaper, False)
    assert reshaper["input"] == want["input"]
    assert [o["name"] for o in reshaper["output"]] == [o["name"] for o in want["output"]]


def _as_stats(got, kind: str) -> dict:
    """One model's statistics with integers (gRPC's ``as_json`` writes uint64 as strings
    and leaves out zeros)."""
    (stat,) = got["model_stats"]

    def ints(d):
        if isinstance(d, dict):
            return {k: v if k in ("name", "version") else ints(v) for k, v in d.items()}
        if isinstance(d, list):
            return [ints(v) for v in d]
        return int(d) if isinstance(d, str) and d.isdigit() else d

    stat = ints(stat)
    for key in ("inference_count", "execution_count", "last_inference"):
        stat.setdefault(key, 0)
    for key in ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output"):
        d = stat.setdefault("inference_stats", {}).setdefault(key, {})
        d.setdefault("count", 0)
        d.setdefault("ns", 0)
    stat.setdefault("batch_stats", [])
    return stat


def test_statistics_extension_counts_the_requests_sent():
    s = ServeProcess(
        str(DIGITS), "--max-batch-size", "16", "--max-queue-delay-microseconds", "300000"
    )
    try:
        clients = {
            "http": th.InferenceServerClient(s.http),
            "grpc": tg.InferenceServerClient(s.grpc),
        }

        def stats(kind: str, *args) -> dict:
            got = clients[kind].get_inference_statistics(
                *args, **({"as_json": True} if kind == "grpc" else {})
            )
            return _as_stats(got, kind)

        for kind in CLIENTS:
            before = stats(kind, "digits_cnn")
            assert before["name"] == "digits_cnn" and before["version"] == "1"
            assert before["inference_count"] == before["execution_count"] == 0
        started_ms = time.time() * 1000
        rng = np.random.default_rng(9)

        def send(kind: str, x: np.ndarray):
            # a client each: tritonclient.http's client is not for several threads
            client = CLIENTS[kind].InferenceServerClient(getattr(s, kind))
            inp = CLIENTS[kind].InferInput("image", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            got = client.infer("digits_cnn", [inp]).as_numpy("logits")
            np.testing.assert_allclose(got, _reference(x), rtol=1e-4, atol=1e-5)

        # one at a time: each runs alone, as batches of 1, 2 and 3 rows
        for kind, rows in (("http", 1), ("grpc", 2), ("http", 3)):
            send(kind, rng.random((rows, 1, 8, 8), dtype=np.float32))
        bad = th.InferInput("image", [1, 1, 4, 4], "FP32")
        bad.set_data_from_numpy(np.zeros((1, 1, 4, 4), np.float32))
        with pytest.raises(th.InferenceServerException):
            clients["http"].infer("digits_cnn", [bad])
        # eight at once, within the 0.3 s window: merged into fewer runs
        xs = rng.random((8, 1, 1, 8, 8), dtype=np.float32)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda i: send("grpc" if i % 2 else "http", xs[i]), range(8)))
        for kind in CLIENTS:
            st = stats(kind, "digits_cnn", "1")
            assert (
                st
                == stats(kind, "digits_cnn")
                == _as_stats(
                    clients[kind].get_inference_statistics(
                        **({"as_json": True} if kind == "grpc" else {})
                    ),
                    kind,
                )
            )
            inf = st["inference_stats"]
            assert st["inference_count"] == 1 + 2 + 3 + 8
            assert inf["success"]["count"] == 11 and inf["fail"]["count"] == 1
            assert inf["queue"]["count"] == 11
            for phase in ("compute_input", "compute_infer", "compute_output"):
                assert inf[phase]["count"] == 11
            assert inf["success"]["ns"] > inf["compute_infer"]["ns"] > 0
            # the 0.3 s window: the three sent alone and the first of the eight each
            # waited all of it (the other seven less, by when they arrived)
            assert inf["queue"]["ns"] >= 4 * 0.29e9
            assert st["last_inference"] >= started_ms - 1
            sizes = {b["batch_size"]: b["compute_infer"]["count"] for b in st["batch_stats"]}
            assert sum(sizes.values()) == st["execution_count"]
            assert sum(size * n for size, n in sizes.items()) == 14
            assert sizes.get(2) and sizes.get(3), sizes
            assert st["execution_count"] < 11, f"{st['execution_count']} runs: nothing merged"
            assert max(sizes) > 3, sizes
    finally:
        assert s.stop() == 0


def _regions(client, kind: str) -> dict:
    """Registered region name -> (key, byte size), from either client's status call."""
    if kind == "http":
        return {
            r["name"]: (r["key"], int(r["byte_size"]))
            for r in client.get_system_shared_memory_status()
        }
    got = client.get_system_shared_memory_status(as_json=True).get("regions", {})
    return {name: (r["key"], int(r["byte_size"])) for name, r in got.items()}


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_system_shared_memory_inputs_and_outputs(server, kind):
    """tritonclient's own shared memory helpers: the input is read from a region and the
    output written into one, and both match onnxruntime."""
    import os

    shm = pytest.importorskip("tritonclient.utils.shared_memory")
    mod = CLIENTS[kind]
    client = mod.InferenceServerClient(getattr(server, kind))
    assert (
        "system_shared_memory"
        in client.get_server_metadata(**({"as_json": True} if kind == "grpc" else {}))["extensions"]
    )
    x = np.random.default_rng(10).random((3, 1, 8, 8), dtype=np.float32)
    out_size = 3 * 10 * 4 + 16  # room to spare, as a client sizes a region
    keys = {
        f"in_{kind}": f"/kiln_in_{kind}_{os.getpid()}",
        f"out_{kind}": f"/kiln_out_{kind}_{os.getpid()}",
    }
    handles = {
        f"in_{kind}": shm.create_shared_memory_region(f"in_{kind}", keys[f"in_{kind}"], x.nbytes),
        f"out_{kind}": shm.create_shared_memory_region(
            f"out_{kind}", keys[f"out_{kind}"], out_size
        ),
    }
    try:
        client.register_system_shared_memory(f"in_{kind}", keys[f"in_{kind}"], x.nbytes)
        client.register_system_shared_memory(f"out_{kind}", keys[f"out_{kind}"], out_size)
        assert _regions(client, kind) == {
            f"in_{kind}": (keys[f"in_{kind}"], x.nbytes),
            f"out_{kind}": (keys[f"out_{kind}"], out_size),
        }
        inp = mod.InferInput("image", list(x.shape), "FP32")
        inp.set_shared_memory(f"in_{kind}", x.nbytes)
        out = mod.InferRequestedOutput("logits")
        out.set_shared_memory(f"out_{kind}", out_size)
        for scale in (1.0, 0.5):  # the region is read at each request, not at registration
            shm.set_shared_memory_region(handles[f"in_{kind}"], [x * scale])
            client.infer("digits_cnn", [inp], outputs=[out])
            got = shm.get_contents_as_numpy(handles[f"out_{kind}"], np.float32, [3, 10])
            np.testing.assert_allclose(got, _reference(x * scale), rtol=1e-4, atol=1e-5)
        # a region too small for the output, and one no longer registered: errors
        small = mod.InferRequestedOutput("logits")
        small.set_shared_memory(f"out_{kind}", 8)
        with pytest.raises(mod.InferenceServerException) as e:
            client.infer("digits_cnn", [inp], outputs=[small])
        assert e.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")
        assert "shared memory holds 8" in e.value.message()
        client.unregister_system_shared_memory(f"in_{kind}")
        assert list(_regions(client, kind)) == [f"out_{kind}"]
        with pytest.raises(mod.InferenceServerException) as e:
            client.infer("digits_cnn", [inp], outputs=[out])
        assert e.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")
        assert f"no shared memory region 'in_{kind}'" in e.value.message()
        with pytest.raises(mod.InferenceServerException):
            client.register_system_shared_memory("ghost", "/kiln_no_such_key", 64)
        client.unregister_system_shared_memory()
        assert _regions(client, kind) == {}
    finally:
        for h in handles.values():
            shm.destroy_shared_memory_region(h)


def test_grpc_outputs_in_and_out_of_shared_memory(repository_server):
    """One output to a region, the others in the response: tritonclient pairs the
    response's raw contents with outputs by position, so each must still read right."""
    import os

    shm = pytest.importorskip("tritonclient.utils.shared_memory")
    client = tg.InferenceServerClient(repository_server.grpc)
    words = np.array(["kïln", "ab", "kïln"], dtype=object)
    key = f"/kiln_hit_{os.getpid()}"
    handle = shm.create_shared_memory_region("hit", key, 64)
    try:
        client.register_system_shared_memory("hit", key, 64, headers=dict(AUTH))
        inp = tg.InferInput("s", [3], "BYTES")
        inp.set_data_from_numpy(words)
        hit = tg.InferRequestedOutput("hit")
        hit.set_shared_memory("hit", 64)
        outs = [hit, tg.InferRequestedOutput("same"), tg.InferRequestedOutput("twice")]
        got = client.infer("strings", [inp], outputs=outs, headers=dict(AUTH))
        path = repository_server.root / "strings" / "1" / "model.onnx"
        same, want_hit, twice = ort.InferenceSession(str(path)).run(None, {"s": words})
        assert [b.decode() for b in got.as_numpy("same").flat] == list(same)
        assert [b.decode() for b in got.as_numpy("twice").flat] == list(twice)
        np.testing.assert_array_equal(shm.get_contents_as_numpy(handle, np.bool_, [3]), want_hit)
    finally:
        client.unregister_system_shared_memory(headers=dict(AUTH))
        shm.destroy_shared_memory_region(handle)
