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


def test_whisper_export_cross_attention_matches_onnxruntime(tmp_path):
    """An encoder-decoder export (Whisper's shape: self- and cross-attention, SDPA): every
    attention fuses, the cross-attention's key and value projections of the encoder output
    merge into one product, and both backends match onnxruntime as lengths change."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.WhisperConfig(
        vocab_size=120, d_model=32, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=16, max_target_positions=16,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    model = transformers.WhisperModel(cfg).eval()

    class Hidden(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, feats, dec):
            return self.model(input_features=feats, decoder_input_ids=dec).last_hidden_state

    path = str(tmp_path / "whisper.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Hidden(), (torch.randn(2, 8, 32), torch.randint(0, 120, (2, 5))),
                          path, input_names=["feats", "dec"], output_names=["out"],
                          dynamic_axes={"feats": {0: "b"}, "dec": {0: "b", 1: "t"}},
                          opset_version=17, dynamo=False)
    rng = np.random.default_rng(1)
    for backend in ("numpy", "torch"):
        m = kiln.optimize(path, backend=backend)
        assert sum(n.op_type == "Attention" for n in m.graph.nodes) == 3
        # q/k/v of both self-attentions, k/v of the cross-attention: one product each
        assert sum(n.op_type == "Split" for n in m.graph.nodes) == 3
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sess = kiln.InferenceSession(path, backend=backend)
        for b, t in ((1, 3), (2, 6), (1, 3)):
            feed = {"feats": rng.normal(0, 1, (b, 8, 32)).astype(np.float32),
                    "dec": rng.integers(0, 120, (b, t)).astype(np.int64)}
            (want,) = ort_run(path, feed)
            (got,) = sess.run(None, feed)
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=backend)
