"""Kiln's model optimizer: small passes over the IR.

Each pass is one module (its docstring says what it does and why), a :class:`Pass`
subclass with a ``name`` that ``kiln.optimize(..., disable=[name])`` switches off.
Rewriting passes are :class:`RulePass` objects: sets of rewrite rules
(:mod:`kiln.passes.rewrite`) that ``kiln.optimize`` (src/kiln/optimizer.py) runs through one
worklist engine; analyses (shape inference, host pinning) run where needed.
"""

from kiln.passes.base import OptimizeReport, Pass, PassRecord, RulePass, clone_model
from kiln.passes.cse import CommonSubexpressionElimination
from kiln.passes.dce import DeadCodeElimination
from kiln.passes.fix_shapes import FixInputShapes
from kiln.passes.fold_constants import FoldConstants
from kiln.passes.fold_pad import FoldPad
from kiln.passes.freeze import Freeze
from kiln.passes.fuse_activation import FuseActivation
from kiln.passes.fuse_attention import FuseAttention
from kiln.passes.fuse_batchnorm import FuseBatchNorm
from kiln.passes.fuse_gelu import FuseGelu
from kiln.passes.fuse_integer_ops import FuseIntegerOps
from kiln.passes.fuse_layernorm import FuseLayerNorm
from kiln.passes.fuse_quant import FuseQuant, RoundTrips
from kiln.passes.fuse_rope import FuseRoPE
from kiln.passes.fuse_shuffle import FuseChannelShuffle
from kiln.passes.identities import Identities
from kiln.passes.infer_shapes import InferShapes
from kiln.passes.merge_matmuls import MergeMatMuls
from kiln.passes.pin_host import PinHost
from kiln.passes.rewrite import Rewriter, Rule, run_rules
from kiln.passes.simplify import Simplify

__all__ = ["CommonSubexpressionElimination", "DeadCodeElimination", "FixInputShapes",
           "FoldConstants", "FoldPad", "Freeze", "FuseActivation", "FuseAttention", "FuseBatchNorm",
           "FuseChannelShuffle", "FuseGelu", "FuseIntegerOps", "FuseLayerNorm", "FuseQuant",
           "FuseRoPE", "Identities", "InferShapes", "MergeMatMuls",
           "OptimizeReport", "Pass", "PassRecord", "PinHost", "Rewriter", "Rule", "RulePass",
           "RoundTrips", "Simplify", "clone_model", "run_rules"]
