"""Transformers models exported with their default attention (PyTorch's
scaled_dot_product_attention, written by torch.onnx with a NaN guard after the softmax)
get Kiln's fused attention, and Llama's RMS normalization one op. Oracle: onnxruntime on
the exported file."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import kiln
from conftest import ort_run


def _export(path: str, kind: str) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "bert":
        model = transformers.BertModel(transformers.BertConfig(
            vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, attn_implementation="sdpa")).eval()
    else:
        model = transformers.LlamaModel(transformers.LlamaConfig(
            vocab_size=120, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            attn_implementation="sdpa")).eval()

    class Hidden(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, ids, mask):
            return self.model(input_ids=ids, attention_mask=mask).last_hidden_state

    ids = torch.randint(0, 120, (2, 7))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Hidden(), (ids, torch.ones_like(ids)), path,
                          input_names=["ids", "mask"], output_names=["out"],
                          dynamic_axes={n: {0: "b", 1: "s"} for n in ("ids", "mask", "out")},
                          opset_version=17, dynamo=False)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("kind", ["bert", "llama"])
def test_sdpa_export_fuses_attention_and_matches_onnxruntime(tmp_path, backend, kind):
    path = str(tmp_path / f"{kind}_sdpa.onnx")
    _export(path, kind)
    m = kiln.optimize(path, backend=backend)
    atts = [n for n in m.graph.nodes if n.op_type == "Attention"]
    assert len(atts) == 2 and all(a.attrs.get("zero_nan") == 1 for a in atts)
    if kind == "bert":  # Llama's rotary embedding sits between its head split and attention
        assert all(a.attrs.get("num_heads") == 4 for a in atts)
    else:  # two norms per layer and the final one; rotary embedding on q and k
        assert sum(n.op_type == "RMSNorm" for n in m.graph.nodes) == 5
        assert sum(n.op_type == "RoPE" for n in m.graph.nodes) == 4
    rng = np.random.default_rng(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sess = kiln.InferenceSession(path, backend=backend)
    for b, s in ((2, 5), (3, 9)):
        mask = np.ones((b, s), np.int64)
        mask[0, s // 2:] = 0
        mask[1] = 0  # nothing to attend to: the exported graph's NaN guard gives zeros
        feed = {"ids": rng.integers(0, 120, (b, s)).astype(np.int64), "mask": mask}
        (want,) = ort_run(path, feed)
        (got,) = sess.run(None, feed)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
