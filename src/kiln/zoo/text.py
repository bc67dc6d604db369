"""Small transformer models for the zoo, built from ``transformers`` configs (no hub access).

Each factory wraps a Hugging Face model in a module whose ``forward`` takes the ONNX inputs
positionally and returns a plain tuple of tensors, which both ONNX exporters handle. Weights
come from the global torch RNG (seed first); LayerNorm affine params are randomised too.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["VOCAB", "bert", "gpt2", "roberta"]

VOCAB = 8192  # vocabulary size shared by the three text models
_COMMON = dict(attn_implementation="eager")


def _randomize_ln(model: nn.Module) -> None:
    """Randomise LayerNorm weight/bias only (keep the HF std-0.02 init of the linear layers)."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0.0, 0.1)


class _BertQA(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, token_type_ids):  # noqa: D102
        out = self.model(
            input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
        )
        return out.start_logits, out.end_logits


class _MaskedLogits(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):  # noqa: D102
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits


def bert() -> nn.Module:
    """BertForQuestionAnswering: 4 layers, hidden 256, 4 heads, vocab 8192 (~5.3M params)."""
    from transformers import BertConfig, BertForQuestionAnswering

    cfg = BertConfig(
        vocab_size=VOCAB, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=1024, max_position_embeddings=512, **_COMMON,
    )
    model = BertForQuestionAnswering(cfg)
    _randomize_ln(model)
    return _BertQA(model).eval()


def roberta() -> nn.Module:
    """RobertaForSequenceClassification (3 labels): 4 layers, hidden 256, 4 heads, vocab 8192.

    Position ids are derived from ``input_ids != pad_token_id`` (CumSum in the graph).
    """
    from transformers import RobertaConfig, RobertaForSequenceClassification

    cfg = RobertaConfig(
        vocab_size=VOCAB, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=1024, max_position_embeddings=514, type_vocab_size=1,
        pad_token_id=1, num_labels=3, **_COMMON,
    )
    model = RobertaForSequenceClassification(cfg)
    _randomize_ln(model)
    return _MaskedLogits(model).eval()


def gpt2() -> nn.Module:
    """GPT2LMHeadModel (causal LM, no KV cache): 4 layers, n_embd 256, 4 heads, vocab 8192."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=VOCAB, n_positions=512, n_embd=256, n_layer=4, n_head=4, use_cache=False,
        bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1,
        **_COMMON,
    )
    model = GPT2LMHeadModel(cfg)
    model.config.use_cache = False
    _randomize_ln(model)
    return _MaskedLogits(model).eval()
