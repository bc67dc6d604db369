"""An imported model as a trainable ``torch.nn.Module``, run by the engine's own plan.

The plan is the one sessions use (op definitions, torch kernels, prepared-kernel
protocol) with one difference: every trainable initializer is marked overridable while the
kernels are prepared, so no ``prepare`` packs or transforms a weight as a constant; each
``forward`` feeds the current parameters and buffers as the plan's overrides, with
autograd on (sessions run under ``inference_mode``; this module does not). The plan is
built from a copy of the graph with only the train-safe fusions applied (:func:`fused`);
the original graph is what :meth:`KilnModule.kiln_model` returns for saving.
"""

from __future__ import annotations

import keyword
import re
import warnings
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from kiln.errors import InputError, UnsupportedOpError
from kiln.ir import DType, Model, Value, plain_shape
from kiln.ops import registry
from kiln.ops.torch.arrays import to_torch
from kiln.optimizer import PASS_NAMES, optimize
from kiln.runtime import make_backend
from kiln.runtime.executor import Program
from kiln.runtime.plan import Plan, Step, compile_model
from kiln.train import graph as graph_ops

__all__ = ["KilnModule", "NonDifferentiableWarning"]


class NonDifferentiableWarning(UserWarning):
    """Some layers have no differentiable kernel (no parameter's gradient flows through
    them, or the module would not have been created)."""


_FX_ROOT = (
    "torch.fx.symbolic_trace cannot trace a KilnModule itself: it runs ONNX nodes "
    "whose kernels are chosen by the inputs' shapes and dtypes, which fx's symbolic "
    "Proxy objects do not carry. Use torch.export.export(module, args) for a graph "
    "of its torch ops, or trace a module that holds it (it becomes one call_module "
    "node there)."
)


class KilnModule(nn.Module):
    """An imported ONNX graph as a torch module. Build it with :func:`kiln.to_torch`.

    Float initializers are ``nn.Parameter``s (0-d ones, literals an exporter lifted out of
    the code, with ``requires_grad`` off: ``requires_grad_()`` opts one in), running
    statistics and other non-float initializers buffers, registered under their
    initializer names made into attribute paths (``layer1.0.conv1.weight`` stays that;
    ``onnx::Conv_193`` becomes ``onnx__Conv_193``): :meth:`initializer_name` maps back.
    ``forward`` takes the graph's inputs positionally (or by name) and returns its output,
    or a tuple of outputs.
    """

    def __init__(self, model: Model, device: str = "cpu"):
        super().__init__()
        self.kiln_graph_model = model
        self.removed_layers = []
        g = model.graph
        opsets = model.opset_imports
        graph_ops.untie(g)
        keep = graph_ops.host_only(g, opsets)
        stats = graph_ops.statistics(g)
        self._slots: list[tuple[Value, nn.Module, str]] = []
        self._names: dict[str, str] = {}
        trainable: set[Value] = set()
        marked = []
        for name, v in g.initializers.items():
            if v in keep:
                continue
            t = to_torch(np.array(v.const))  # a copy: training writes to it
            if t is None:
                continue  # a type torch lacks (strings): stays a constant
            t = t.to(device)
            is_param = v not in stats and t.is_floating_point()
            owner, attr = self._place(name)
            if is_param:
                # A 0-d one is a literal the exporter lifted (GELU's 0.044715, a Pow's
                # exponent 3, a mask's fill value): frozen, as in the module it came from.
                # Trained, the exponent's gradient x^y ln x makes it NaN in one step.
                literal = t.dim() == 0
                owner.register_parameter(attr, nn.Parameter(t, requires_grad=not literal))
                if not literal:
                    trainable.add(v)
            else:
                owner.register_buffer(attr, t)
            self._slots.append((v, owner, attr))
            self._names[_path(self, owner, attr)] = name
            if not v.meta.get("overridable"):
                marked.append(v)
                v.meta["overridable"] = True  # prepare must not bake it in
        self._backend = make_backend("torch", device=device, channels_last=False, warn=False)
        self._backend.module = True
        try:
            run = fused(model)
            self._plan: Plan = compile_model(
                run.graph, run.opset_imports, run.functions, self._backend
            )
        finally:
            for v in marked:
                v.meta.pop("overridable", None)
        # the plan reads the fused copy's values; export writes the original's
        inits = run.graph.initializers
        self._feeds = [(inits[v.name], owner, attr) for v, owner, attr in self._slots]
        for v, _, _ in self._feeds:
            self._plan.consts.pop(v, None)  # the module's tensors replace them every run
        self._inputs = list(run.graph.inputs)
        self._run_graph, self._run_opsets, self._run_functions = (
            run.graph,
            run.opset_imports,
            run.functions,
        )
        self._programs: dict[tuple, Callable] = {}  # torch.compile's, per key
        self.non_differentiable = self._check_gradients(
            {inits[v.name] for v in trainable}, run.opset_imports
        )

    removed_layers: list[str]
    """The layers ``outputs=``/``last_layers=`` cut off, "name (OpType)" (empty: no cut)."""

    @property
    def output_shapes(self) -> list[tuple[int | str | None, ...] | None]:
        """Each output's shape, a symbolic dimension as its name (None: unknown): the cut's
        ``output_shapes[0][-1]`` is the feature width a new head takes."""
        out = []
        for v in self.kiln_graph_model.graph.outputs:
            shape = getattr(v.type, "shape", None) if v.type is not None else None
            out.append(None if shape is None else tuple(plain_shape(shape)))
        return out

    # -- names -----------------------------------------------------------------------

    def _place(self, name: str) -> tuple[nn.Module, str]:
        """The submodule and attribute holding initializer ``name`` (dotted names become
        nested containers, as in the PyTorch module the model came from)."""
        parts = [_ident(p) for p in name.split(".")]
        owner: nn.Module = self
        for p in parts[:-1]:
            sub = owner._modules.get(p)
            if sub is None:
                if hasattr(owner, p):
                    return self, self._free(_ident(name.replace(".", "_")))
                sub = nn.Module()
                owner.add_module(p, sub)
            owner = sub
        if hasattr(owner, parts[-1]) or parts[-1] in owner._modules:
            return self, self._free(_ident(name.replace(".", "_")))
        return owner, parts[-1]

    def _free(self, attr: str) -> str:
        out, i = attr, 1
        while hasattr(self, out):
            out, i = f"{attr}_{i}", i + 1
        return out

    def initializer_name(self, name: str) -> str:
        """The ONNX initializer behind parameter or buffer ``name`` (a state_dict key)."""
        return self._names[name]

    def parameter_name(self, initializer: str) -> str:
        """The state_dict key holding ONNX initializer ``initializer``."""
        for k, v in self._names.items():
            if v == initializer:
                return k
        raise KeyError(initializer)

    # -- gradients -------------------------------------------------------------------

    def _check_gradients(self, trainable: set[Value], opsets: dict[str, int]) -> list[str]:
        """Layers without a differentiable kernel, named now; raise if a parameter's
        gradient would have to flow through one."""
        lacking: dict[Step, str] = {}
        for s in self._plan.walk():
            why = _why_not_differentiable(s, opsets)
            if why:
                lacking[s] = why
        cut = [
            s
            for s in graph_ops.reached(self._plan.steps, trainable)
            if lacking.get(s, "").startswith("no differentiable kernel")
        ]
        if cut:
            names = ", ".join(f"{s.layer.name} ({s.node.op_type})" for s in cut)
            raise UnsupportedOpError(
                f"parameters' gradients would flow through layers with no differentiable torch "
                f"kernel (they run NumPy kernels): {names}. Cut the model before them "
                "(kiln.to_torch(..., outputs=[...])) or add a torch kernel for the op.",
                sorted({s.node.op_type for s in cut}),
            )
        named = [
            f"{s.layer.name} ({s.node.op_type}): {why}"
            for s, why in lacking.items()
            if why.startswith("no differentiable kernel")
        ]
        if named:
            warnings.warn(
                "layers without a differentiable kernel (no parameter's gradient "
                "flows through them): " + "; ".join(named),
                NonDifferentiableWarning,
                stacklevel=3,
            )
        return [f"{s.layer.name} ({s.node.op_type}): {why}" for s, why in lacking.items()]

    # -- running ---------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any):
        """Run the graph on its inputs (tensors or arrays; by position or name)."""
        if isinstance(args, torch.fx.Proxy):  # fx tracing this module itself: no *args
            raise TypeError(_FX_ROOT)
        proxies = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.fx.Proxy)]
        if proxies:
            return self._fx_call(proxies[0].tracer, args, kwargs)
        feeds = list(args)
        for v in self._inputs[len(feeds) :]:
            if v.name not in kwargs:
                raise InputError(
                    f"missing input {v.name!r}; the graph's inputs are "
                    f"{[x.name for x in self._inputs]}"
                )
            feeds.append(kwargs.pop(v.name))
        if kwargs or len(feeds) != len(self._inputs):
            raise InputError(
                f"the graph takes {len(self._inputs)} input(s) "
                f"{[x.name for x in self._inputs]}, got {len(args)} positional "
                f"and {sorted(kwargs)} by name"
            )
        be = self._backend
        inputs = [
            be.accept_feed(
                x, v.type.dtype if v.type is not None and hasattr(v.type, "dtype") else DType.FLOAT
            )
            for x, v in zip(feeds, self._inputs)
        ]
        if torch.onnx.is_in_onnx_export():  # its own nodes, not the kernels' torch ops
            from kiln.train.replay import exported

            out = exported(self, inputs, self._run)
            if out is not None:
                return out
        if torch.compiler.is_compiling():
            return self._traced(inputs)
        return self._run(inputs)

    def _fx_call(self, tracer: Any, args: tuple, kwargs: dict):
        """Under ``torch.fx.symbolic_trace`` of a module holding this one: one
        ``call_module`` node, as for a leaf module. The graph's ops cannot be traced into fx
        nodes: the plan picks each kernel by its inputs' shapes and dtypes, which fx's
        Proxy objects do not carry."""
        path = tracer.path_of_module(self)
        if not path:
            raise TypeError(_FX_ROOT)
        out = tracer.create_proxy("call_module", path, args, kwargs)
        n = len(self.kiln_graph_model.graph.outputs)
        # several outputs come back as a tuple, which user code unpacks
        return out if n == 1 else tuple(out[i] for i in range(n))

    def _traced(self, inputs: list):
        """The run torch.compile traces: the plan specialized to these inputs' shapes
        (shape arithmetic folded into Python ints, so no value is read on the host and the
        graph does not break), a straight-line program taking the parameters and buffers
        as arguments (no environment dict for dynamo to follow)."""
        shapes = tuple((tuple(int(d) for d in x.shape), x.dtype, x.device) for x in inputs)
        key = (shapes, self.training)
        _specialized(self, key)
        graph = self._programs[key]  # read here, where dynamo can guard it
        weights = [getattr(owner, attr) for _, owner, attr in self._feeds]
        out = graph(*inputs, *weights)
        return out[0] if len(out) == 1 else tuple(out)

    def _specialize(self, key: tuple) -> Callable:
        """The graph of torch ops dynamo traces for inputs of the shapes and dtypes and the
        train/eval mode in ``key``, made once per key.

        The plan runs once on fake tensors under ``make_fx`` (torch's pre-autograd ops, the
        level ``torch.compile`` itself records), so dynamo traces straight-line torch calls.
        Traced through the plan's kernels instead, dynamo guarded every closure cell it read
        (kernel attributes, dtype sets, code objects): thousands of guards, checked on
        every call of the compiled module."""
        got = self._programs.get(key)
        if got is not None:
            return got
        shapes, training = key
        prog, holder = self._program(tuple((s, str(d)) for s, d, _ in shapes))
        examples = [torch.empty(s, dtype=d, device=dev) for s, d, dev in shapes]
        weights = [getattr(owner, attr) for _, owner, attr in self._feeds]
        self._backend.training = training
        consts = dict(holder.named_buffers())
        n = len(examples) + len(weights)

        def run(*xs):
            return prog(SimpleNamespace(**dict(zip(consts, xs[n:]))), *xs[:n])

        # traced apart from dynamo's own fake mode, whose tensors it would mix in
        try:
            with torch._guards.tracing(None):
                gm = make_fx(run, tracing_mode="fake", pre_dispatch=True)(
                    *examples, *weights, *consts.values()
                )
        except Exception:  # a value read on the host (NonZero's count...): dynamo traces
            # the kernels themselves, guards and graph breaks included
            def kernels(*xs, _be=self._backend):
                _be.training = training
                return prog(holder, *xs)

            self._programs[key] = kernels
            return kernels
        # the constants become the graph's buffers rather than inputs
        g = gm.graph
        holders = [x for x in g.nodes if x.op == "placeholder"][n:]
        first = next(x for x in g.nodes if x.op != "placeholder")
        for (name, t), ph in zip(consts.items(), holders):
            gm.register_buffer(name, t, persistent=False)
            with g.inserting_before(first):
                ph.replace_all_uses_with(g.get_attr(name))
            g.erase_node(ph)
        # a plain GraphModule: make_fx's lazy one compiles its code on the first call, in
        # a function dynamo does not trace (a graph break)
        gm = self._programs[key] = torch.fx.GraphModule(gm, g)
        return gm

    def _program(self, key: tuple) -> tuple:
        """(program function, holder of its constants) for inputs of shapes and dtypes
        ``key``."""
        fed = {v.name for v, _, _ in self._feeds}
        for v, _, _ in self._feeds:
            v.meta["overridable"] = True  # not folded: each stays a value of its own
        try:
            shapes = {v.name: list(s) for v, (s, _) in zip(self._inputs, key)}
            spec = fused(
                Model(self._run_graph, dict(self._run_opsets), dict(self._run_functions)), shapes
            )
        finally:
            for v, _, _ in self._feeds:
                v.meta.pop("overridable", None)
        g = spec.graph
        # the parameters and buffers become inputs, after the graph's own, in _feeds' order
        for name in [v.name for v, _, _ in self._feeds]:
            v = g.initializers.pop(name, None)
            if v is None:  # no reader left for it: an input nothing reads
                v = Value(name, None)
            v.const = None
            v.meta.pop("overridable", None)
            g.inputs.append(v)
        assert fed == {v.name for v in g.inputs[len(self._inputs) :]}
        tracer = self._backend.tracer()
        tracer.module, tracer.mode = True, self._backend.mode
        plan = compile_model(g, spec.opset_imports, spec.functions, tracer)
        prog = Program(plan, module=True)
        holder = nn.Module()
        for k, t in prog.constants.items():
            holder.register_buffer(k, t, persistent=False)
        return prog.fn, holder

    def _run(self, inputs: list):
        be = self._backend
        overrides = {v: getattr(owner, attr) for v, owner, attr in self._feeds}
        be.training = self.training
        out = self._plan.run(inputs, None, overrides)
        return out[0] if len(out) == 1 else tuple(out)

    # -- export ----------------------------------------------------------------------

    def kiln_model(self) -> Model:
        """The graph with the module's current weights and statistics as its initializers
        (what :func:`kiln.save` writes)."""
        for v, owner, attr in self._slots:
            t = getattr(owner, attr).detach().cpu()
            v.const = np.ascontiguousarray(
                t.float().numpy().astype(v.const.dtype) if t.dtype == torch.bfloat16 else t.numpy()
            )
        return self.kiln_graph_model


@torch._dynamo.assume_constant_result
def _specialized(module: KilnModule, key: tuple) -> bool:
    # Run by dynamo while it traces, its result taken as a constant: building a program is
    # Python over Kiln's IR that has nothing to trace.
    module._specialize(key)
    return True


def fused(model: Model, input_shapes: dict | None = None) -> Model:
    """A copy of ``model`` with the fusions that mean the same in training: Gelu,
    LayerNormalization and attention (one differentiable torch kernel each: F.gelu,
    F.layer_norm, scaled_dot_product_attention, which save fewer tensors for backward than
    their decomposed ops), after folding the constants they match on, and linear layers
    (MatMul + bias Add on initializers: F.linear, see :func:`graph.linear_layers`).
    Initializers marked overridable (the module's parameters and buffers) are never folded,
    so each keeps its name and value; nothing else (BatchNorm, Dropout, activations into
    MatMul/Conv) changes.
    ``input_shapes`` (name -> shape) fixes the inputs' shapes first, so that the shape
    arithmetic folds to constants (the per-shape program torch.compile traces)."""
    keep = {
        "fix_input_shapes",
        "infer_shapes",
        "fold_constants",
        "dce",
        "fuse_gelu",
        "fuse_layernorm",
        "fuse_attention",
    }
    out = optimize(
        model,
        disable=[p for p in PASS_NAMES if p not in keep],
        backend="torch",
        input_shapes=input_shapes,
    )
    graph_ops.linear_layers(out)
    return out


def _why_not_differentiable(s: Step, opsets: dict[str, int]) -> str:
    if s.placement == "cpu-fallback":
        return "no differentiable kernel: runs the NumPy fallback"
    if any(_why_not_differentiable(t, opsets) for sub in s.subplans for t in sub.steps):
        return "no differentiable kernel: its subgraph or body has one without"
    d = registry.lookup(s.node.domain, s.node.op_type, s.opset)
    if d is not None and not d.differentiable_on("torch"):
        return "not differentiable (integer, boolean or index result)"
    return ""


def _ident(part: str) -> str:
    out = re.sub(r"\W", "_", part)
    if not out or out[0].isdigit() and not part.isdigit():
        out = "_" + out
    return out + "_" if keyword.iskeyword(out) else out


def _path(root: nn.Module, owner: nn.Module, attr: str) -> str:
    if owner is root:
        return attr
    for name, m in root.named_modules():
        if m is owner:
            return f"{name}.{attr}"
    raise KeyError(attr)
