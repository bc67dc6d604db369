"""The ``ai.onnx.preview.training`` domain: the optimizer steps Adagrad, Adam and Momentum,
and Gradient.

Each optimizer step updates n tensors at once; the variadic inputs are grouped per role
(all X, then all G, ...), and so are the outputs.

``Gradient(xs, zs, y)`` differentiates the graph it sits in: the part of it computing
``y`` from the values named in ``xs`` and ``zs`` (its inputs, in that order) is taken out
and run again from those inputs, and its gradient wrt ``xs`` computed. On NumPy that is
reverse mode over the vector-Jacobian products in :data:`VJPS` (an op lacking one is named
when the node first runs); the torch backend runs the same nodes through its torch kernels
under autograd (``kiln.ops.torch.training``). A ``y`` with more than one element is
differentiated as the sum of its elements (a seed of ones).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kiln.errors import InputError, UnsupportedOpError
from kiln.ir import Node, TensorType, Value
from kiln.ops import registry
from kiln.ops.registry import Kernel, KernelContext, Site, op

DOMAIN = "ai.onnx.preview.training"


def _float(x) -> float:
    return float(np.asarray(x).reshape(-1)[0])


def _groups(inputs: tuple, roles: int) -> list[tuple]:
    n = len(inputs) // roles
    return [inputs[i * n:(i + 1) * n] for i in range(roles)]


@op("Adagrad", 1, domain=DOMAIN)
def adagrad(r, t, *inputs, decay_factor=0.0, epsilon=1e-6, norm_coefficient=0.0):
    lr = _float(r) / (1.0 + _float(t) * decay_factor)
    xs, gs, hs = _groups(inputs, 3)
    new_x, new_h = [], []
    for x, g, h in zip(xs, gs, hs):
        g = norm_coefficient * x + g
        h = h + g * g
        new_x.append(x - lr * g / (np.sqrt(h) + epsilon))
        new_h.append(h)
    return tuple(new_x + new_h)


@op("Adam", 1, domain=DOMAIN)
def adam(r, t, *inputs, alpha=0.9, beta=0.999, epsilon=1e-6, norm_coefficient=0.0,
         norm_coefficient_post=0.0):
    step = _float(t)
    lr = _float(r)
    if step > 0:  # bias correction of the running averages
        lr = lr * math.sqrt(1.0 - beta ** step) / (1.0 - alpha ** step)
    xs, gs, vs, hs = _groups(inputs, 4)
    new_x, new_v, new_h = [], [], []
    for x, g, v, h in zip(xs, gs, vs, hs):
        g = norm_coefficient * x + g
        v = alpha * v + (1.0 - alpha) * g
        h = beta * h + (1.0 - beta) * g * g
        x_new = x - lr * v / (np.sqrt(h) + epsilon)
        new_x.append((1.0 - norm_coefficient_post) * x_new)
        new_v.append(v)
        new_h.append(h)
    return tuple(new_x + new_v + new_h)


@op("Momentum", 1, domain=DOMAIN)
def momentum(r, t, *inputs, alpha=None, beta=None, mode=None, norm_coefficient=None):
    """Standard or Nesterov momentum; the first step (T == 0) takes the full gradient."""
    lr = _float(r)
    b = beta if _float(t) > 0 else 1.0
    xs, gs, vs = _groups(inputs, 3)
    new_x, new_v = [], []
    for x, g, v in zip(xs, gs, vs):
        g = norm_coefficient * x + g
        v = alpha * v + b * g
        new_x.append(x - lr * (g + alpha * v) if mode == "nesterov" else x - lr * v)
        new_v.append(v)
    return tuple(new_x + new_v)


# ---------------------------------------------------------------- Gradient

@dataclass(eq=False)
class GradientSlice:
    """The nodes of the enclosing graph that compute ``y`` from the Gradient's inputs."""

    fed: list[Value]
    """The values the Gradient's inputs stand for: xs, then zs."""
    n_xs: int
    y: Value
    nodes: list[Node]
    """In graph order; each is run again by the Gradient."""
    opsets: dict[Node, int]
    constants: list[Value] = field(default_factory=list)
    """Initializers the nodes read (other than fed values)."""


def gradient_slice(node: Node, opset_of: Callable[[Node], int]) -> GradientSlice:
    """The part of ``node``'s graph that a Gradient node differentiates; ``opset_of`` gives
    the opset each node runs at (``Site.opset_of`` of the Gradient's site)."""
    g = node.graph
    names = g.values_by_name() if g is not None else {}
    xs, zs = list(node.attrs.get("xs", ())), list(node.attrs.get("zs", ()))
    y_name = node.attrs.get("y")
    missing = [n for n in xs + zs + [y_name] if n not in names]
    if missing:
        raise InputError(f"Gradient {node.name!r}: no tensor named {missing} in its graph "
                         "(y must stay a graph output for the optimizer to keep it)")
    fed = [names[n] for n in xs + zs]
    y = names[y_name]
    inputs = set(g.inputs)
    cone: set[Node] = set()
    constants: dict[Value, None] = {}
    stack, seen, reached = [y], set(), set()
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        if v in fed:
            reached.add(v)
            continue
        src = v.producer
        if src is None:
            if v.const is None or v in inputs:
                raise InputError(f"Gradient {node.name!r}: {y_name!r} depends on {v.name!r}, "
                                 "which is in neither xs nor zs")
            constants[v] = None
            continue
        if src is node:
            raise InputError(f"Gradient {node.name!r}: {y_name!r} depends on the Gradient")
        if src.graph is not g:
            raise UnsupportedOpError(f"Gradient {node.name!r}: {y_name!r} reads {v.name!r} "
                                     "of an enclosing graph; differentiating across graphs "
                                     "is not supported", ["Gradient"])
        if any(True for _ in src.subgraphs()):
            raise UnsupportedOpError(f"Gradient {node.name!r}: differentiating through "
                                     f"{src.op_type} (subgraphs) is not supported",
                                     [src.op_type])
        cone.add(src)
        stack.extend(x for x in src.inputs if x is not None)
    folded = [v.name for v in fed[:len(xs)] if v not in reached and v.const is not None]
    if folded:
        # an initializer in xs that y no longer reads: the optimizer folded the nodes
        # between them into constants, and their gradient would silently be zero
        raise InputError(f"Gradient {node.name!r}: {y_name!r} no longer depends on "
                         f"initializer(s) {folded} (constant folding computed through them); "
                         "make them graph inputs or run the model without constant folding")
    nodes = [n for n in g.nodes if n in cone]
    return GradientSlice(fed, len(xs), y, nodes, {n: opset_of(n) for n in nodes},
                         list(constants))


class _FedSite(Site):
    """A Site on which the Gradient's inputs are never constants: no kernel bakes in a
    tensor the Gradient differentiates or feeds anew."""

    fed: frozenset = frozenset()

    def const(self, i: int):
        if self.has_input(i) and self.node.inputs[i] in self.fed:
            return None
        return super().const(i)


def bind_slice(sl: GradientSlice, target: registry.Target,
               kernels: Callable[[registry.OpDef], list[Kernel]]) -> list[tuple]:
    """``(node, [run...])`` per node of the slice: each node's kernels (``kernels(opdef)``,
    best first) prepared as a plan prepares them, for ``target`` (the Gradient node's). A
    kernel that returns NotImplemented hands the call to the next."""
    out = []
    for n in sl.nodes:
        opset = sl.opsets[n]
        d = registry.lookup(n.domain, n.op_type, opset)
        cands = kernels(d) if d is not None else []
        runs = []
        for k in cands:
            site = _FedSite(n, opset, dict(n.attrs), target)
            site.fed = frozenset(sl.fed)
            bound = k.bind(site)
            if bound is None:
                continue
            fn, wants_ctx = bound
            if wants_ctx:  # node facts only: the slice holds no subgraphs
                nctx = KernelContext(len(n.outputs), opset, {}, n, target)
                fn = (lambda f, c: lambda *a: f(c, *a))(fn, nctx)
            runs.append(fn)
        if not runs:
            raise UnsupportedOpError(f"Gradient: no differentiable {target.backend}"
                                     f" kernel for layer {n.name!r} ({n.op_type})", [n.op_type])
        out.append((n, runs))
    return out


def run_slice(bound: list[tuple], env: dict) -> None:
    """Run the bound slice forward, adding every node's outputs to ``env``."""
    for n, runs in bound:
        args = [None if v is None else env[v] for v in n.inputs]
        for fn in runs:
            r = fn(*args)
            if r is not NotImplemented:
                break
        else:
            raise UnsupportedOpError(f"Gradient: no kernel took layer {n.name!r} ({n.op_type}) "
                                     "on these inputs", [n.op_type])
        for v, x in zip(n.outputs, r if isinstance(r, tuple) else (r,)):
            if v is not None:
                env[v] = x


def lazily(build: Callable[[], Callable]) -> Callable:
    """A run that builds its real run on the first call, once, under a lock: a Gradient
    whose slice cannot be differentiated says so when it runs, as before it was prepared
    from the whole graph, not when the session is made."""
    lock, built = threading.Lock(), []

    def run(*inputs):
        if not built:
            with lock:
                if not built:
                    built.append(build())
        return built[0](*inputs)

    return run


def _infer_gradient(*types, xs=(), **attrs):
    return [t if isinstance(t, TensorType) else None for t in types[:len(xs)]]


@op("Gradient", 1, domain=DOMAIN, prepare=True, infer=_infer_gradient)
def gradient(site: Site):
    """Reverse mode on NumPy over :data:`VJPS`."""

    def build():
        sl = gradient_slice(site.node, site.opset_of)
        bound = bind_slice(sl, site.target, lambda d: [d.reference])
        live = set(sl.fed[:sl.n_xs])  # values that carry a gradient
        on_path = set()
        for n, _ in bound:
            if any(v in live for v in n.inputs if v is not None):
                on_path.add(n)
                if vjp_of(n, sl.opsets[n]) is None:
                    raise UnsupportedOpError(
                        f"Gradient on NumPy: no derivative rule for layer {n.name!r} "
                        f"({n.op_type}); the torch backend differentiates it", [n.op_type])
                live.update(v for v in n.outputs if v is not None)

        def run(*inputs):
            env = {v: v.const for v in sl.constants}
            env.update(zip(sl.fed, (np.asarray(x) for x in inputs)))
            run_slice(bound, env)
            y = env[sl.y]
            grads = {sl.y: np.ones_like(y)}
            for n, _ in reversed(bound):
                gouts = [None if v is None else grads.get(v) for v in n.outputs]
                if n not in on_path or all(g is None for g in gouts):
                    continue
                ins = [None if v is None else env[v] for v in n.inputs]
                outs = [None if v is None else env[v] for v in n.outputs]
                gins = vjp_of(n, sl.opsets[n])(gouts, ins, outs, n.attrs)
                for v, gi in zip(n.inputs, gins):
                    if v is None or gi is None or v not in live:
                        continue
                    gi = _unbroadcast(np.asarray(gi), env[v].shape)
                    grads[v] = gi if v not in grads else grads[v] + gi
            return tuple(grads.get(v, np.zeros_like(x)).astype(np.asarray(x).dtype)
                         for v, x in zip(sl.fed[:sl.n_xs], inputs))

        return run

    return lazily(build)


# Vector-Jacobian products: ``vjp(output_grads, inputs, outputs, attrs)`` -> a gradient per
# input (None where none flows); gradients of broadcast inputs are summed back to shape by
# the caller.

def _unbroadcast(g: np.ndarray, shape: tuple) -> np.ndarray:
    if g.shape == tuple(shape):
        return g
    extra = g.ndim - len(shape)
    g = g.sum(axis=tuple(range(extra))) if extra > 0 else g
    axes = tuple(i for i, s in enumerate(shape) if s == 1 and g.shape[i] != 1)
    return (g.sum(axis=axes, keepdims=True) if axes else g).reshape(shape)


def _axes(ins, attrs) -> tuple | None:
    if len(ins) > 1 and ins[1] is not None:
        axes = [int(a) for a in np.asarray(ins[1]).reshape(-1)]
        return tuple(axes) if axes else None
    a = attrs.get("axes")
    return tuple(a) if a else None


def _reduce_vjp(mean: bool):
    def vjp(g, ins, outs, attrs):
        x = ins[0]
        axes = _axes(ins, attrs)
        if axes is None and attrs.get("noop_with_empty_axes", 0):
            return [g[0]]
        axes = tuple(range(x.ndim)) if axes is None else tuple(a % x.ndim for a in axes)
        gy = g[0] if attrs.get("keepdims", 1) else np.expand_dims(g[0], axes)
        n = math.prod(x.shape[a] for a in axes) if mean else 1
        return [np.broadcast_to(gy / n, x.shape)]
    return vjp


def _matmul_vjp(g, ins, outs, attrs):
    a, b = ins
    a2 = a[None, :] if a.ndim == 1 else a
    b2 = b[:, None] if b.ndim == 1 else b
    gy = g[0]
    if a.ndim == 1:
        gy = np.expand_dims(gy, -2)
    if b.ndim == 1:
        gy = np.expand_dims(gy, -1)
    ga = gy @ np.swapaxes(b2, -1, -2)
    gb = np.swapaxes(a2, -1, -2) @ gy
    ga = ga.reshape(ga.shape[:-2] + (a.shape[-1],)) if a.ndim == 1 else ga
    gb = gb.reshape(gb.shape[:-2] + (b.shape[0],)) if b.ndim == 1 else gb
    return [_unbroadcast(ga, a.shape), _unbroadcast(gb, b.shape)]


def _gemm_vjp(g, ins, outs, attrs):
    a, b = ins[0], ins[1]
    alpha, beta = attrs.get("alpha", 1.0), attrs.get("beta", 1.0)
    ta, tb = attrs.get("transA", 0), attrs.get("transB", 0)
    am, bm = (a.T if ta else a), (b.T if tb else b)
    ga, gb = alpha * g[0] @ bm.T, alpha * am.T @ g[0]
    gc = beta * g[0] if len(ins) > 2 and ins[2] is not None else None
    return [ga.T if ta else ga, gb.T if tb else gb, gc]


def _pow_vjp(g, ins, outs, attrs):
    x, e = ins
    with np.errstate(divide="ignore", invalid="ignore"):
        gx = g[0] * e * np.power(x, e - 1)
        ge = g[0] * outs[0] * np.log(np.where(x > 0, x, 1))
    return [gx.astype(x.dtype), ge.astype(e.dtype)]


def _reshaped(g, ins, outs, attrs):
    return [g[0].reshape(ins[0].shape)]


def _transpose_vjp(g, ins, outs, attrs):
    perm = attrs.get("perm") or list(range(ins[0].ndim))[::-1]
    return [np.transpose(g[0], np.argsort(perm))]


VJPS: dict[str, Callable] = {
    "Identity": lambda g, i, o, a: [g[0]],
    "Add": lambda g, i, o, a: [g[0], g[0]],
    "Sub": lambda g, i, o, a: [g[0], -g[0]],
    "Mul": lambda g, i, o, a: [g[0] * i[1], g[0] * i[0]],
    "Div": lambda g, i, o, a: [g[0] / i[1], -g[0] * o[0] / i[1]],
    "Neg": lambda g, i, o, a: [-g[0]],
    "Sum": lambda g, i, o, a: [g[0]] * len(i),
    "Relu": lambda g, i, o, a: [g[0] * (i[0] > 0)],
    "Sigmoid": lambda g, i, o, a: [g[0] * o[0] * (1 - o[0])],
    "Tanh": lambda g, i, o, a: [g[0] * (1 - o[0] * o[0])],
    "Exp": lambda g, i, o, a: [g[0] * o[0]],
    "Log": lambda g, i, o, a: [g[0] / i[0]],
    "Sqrt": lambda g, i, o, a: [g[0] / (2 * o[0])],
    "Abs": lambda g, i, o, a: [g[0] * np.sign(i[0])],
    "Pow": _pow_vjp,
    "MatMul": _matmul_vjp,
    "Gemm": _gemm_vjp,
    "ReduceSum": _reduce_vjp(mean=False),
    "ReduceMean": _reduce_vjp(mean=True),
    "Reshape": _reshaped,
    "Flatten": _reshaped,
    "Squeeze": _reshaped,
    "Unsqueeze": _reshaped,
    "Transpose": _transpose_vjp,
}
"""The ops the NumPy Gradient differentiates through (default domain, every version)."""

# What activations fused into Kiln's FusedGemm / FusedMatMul do to the gradient, from
# their output y
_ACTIVATION_GRADS: dict[str, Callable] = {
    "": lambda g, y: g,
    "Relu": lambda g, y: g * (y > 0),
    "Sigmoid": lambda g, y: g * y * (1 - y),
    "Tanh": lambda g, y: g * (1 - y * y),
}


def _fused_vjp(inner: Callable, main: int):
    """``inner`` differentiates the first ``main`` inputs; the rest are added terms."""
    def vjp(g, ins, outs, attrs):
        gz = _ACTIVATION_GRADS[attrs.get("activation", "")](g[0], outs[0])
        return list(inner([gz], ins[:main], outs, attrs)) + [gz] * (len(ins) - main)
    return vjp


def _softmax_vjp(log: bool):
    def vjp(g, ins, outs, attrs):
        ax = attrs.get("axis", -1)
        if log:
            return [g[0] - np.exp(outs[0]) * g[0].sum(axis=ax, keepdims=True)]
        y = outs[0]
        return [y * (g[0] - (g[0] * y).sum(axis=ax, keepdims=True))]
    return vjp


def _erf_vjp(g, ins, outs, attrs):
    x = ins[0]
    return [g[0] * (2 / math.sqrt(math.pi)) * np.exp(-x * x)]


def _gelu_vjp(g, ins, outs, attrs):
    x = ins[0].astype(np.float64)
    if attrs.get("approximate", "none") == "tanh":
        c = math.sqrt(2 / math.pi)
        t = np.tanh(c * (x + 0.044715 * x ** 3))
        d = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x)
    else:
        erf = np.vectorize(math.erf, otypes=[np.float64])
        d = 0.5 * (1 + erf(x / math.sqrt(2))) + x * np.exp(-x * x / 2) / math.sqrt(2 * math.pi)
    return [(g[0] * d).astype(ins[0].dtype)]


def _layer_norm_vjp(g, ins, outs, attrs):
    x = ins[0]
    scale = ins[1] if len(ins) > 1 else None
    axis = attrs.get("axis", -1) % x.ndim
    axes = tuple(range(axis, x.ndim))
    d = x - x.mean(axis=axes, keepdims=True)
    inv = 1 / np.sqrt(np.square(d).mean(axis=axes, keepdims=True) + attrs.get("epsilon", 1e-5))
    xhat = d * inv
    gx = g[0] if scale is None else g[0] * scale
    gx = inv * (gx - gx.mean(axis=axes, keepdims=True)
                - xhat * (gx * xhat).mean(axis=axes, keepdims=True))
    out = [gx, None if scale is None else g[0] * xhat]
    return out + ([g[0]] if len(ins) > 2 else [])


# Ops whose meaning changed between versions: only the versions from this opset on
_SINCE = {"Softmax": 13, "LogSoftmax": 13, "LayerNormalization": 17, "Gelu": 20}
_VERSIONED = {"Softmax": _softmax_vjp(log=False), "LogSoftmax": _softmax_vjp(log=True),
              "Erf": _erf_vjp, "Gelu": _gelu_vjp, "LayerNormalization": _layer_norm_vjp}


def vjp_of(node: Node, opset: int) -> Callable | None:
    """The vector-Jacobian product of ``node`` at ``opset`` (None where the NumPy Gradient
    has none): :data:`VJPS`; Softmax and LogSoftmax (13+), Erf, Gelu (20+) and
    LayerNormalization (17+); Kiln's Gelu and LayerNorm; Kiln's FusedGemm / FusedMatMul
    (what the optimizer makes of MatMul/Gemm + Add + activation) with no activation or
    Relu, Sigmoid or Tanh."""
    if sum(v is not None for v in node.outputs) > 1:
        return None  # LayerNormalization's mean / inverse deviation outputs: not covered
    if not node.domain:
        if node.op_type in _VERSIONED:
            ok = opset >= _SINCE.get(node.op_type, 1)
            return _VERSIONED[node.op_type] if ok else None
        return VJPS.get(node.op_type)
    if node.domain == registry.KILN_DOMAIN and node.op_type in ("Gelu", "LayerNorm"):
        return _VERSIONED["LayerNormalization" if node.op_type == "LayerNorm" else "Gelu"]
    if node.domain == registry.KILN_DOMAIN \
            and node.attrs.get("activation", "") in _ACTIVATION_GRADS:
        if node.op_type == "FusedGemm":
            return _fused_vjp(_gemm_vjp, 3)
        if node.op_type == "FusedMatMul":  # A @ B + bias + z
            return _fused_vjp(_matmul_vjp, 2)
    return None
