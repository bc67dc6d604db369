"""The PyTorch backend: runs a plan on torch tensors, on the CPU or a CUDA device.

Each node gets, in order of preference (see :meth:`TorchBackend.bind`):

1. a torch kernel (``kiln.ops.torch``, or one attached with ``backend_kernel("torch", ...)``);
2. the op's generic kernel (written against the array-API namespace, so it runs on torch
   tensors as is);
3. the CPU fallback: the NumPy kernel, its tensor inputs downloaded to NumPy and its
   outputs uploaded back. Each such node is named in a warning when the session is
   created, listed by ``session.placement()``, and every value it moves is counted.

Values of element types torch lacks (strings, uint16/32/64, float8, int4) stay NumPy
arrays; a node that receives one runs its NumPy kernel for that call. Values the optimizer
marks host-resident (``Value.meta["host"]``, e.g. shape arithmetic) live on the host as
CPU tensors and are never copied to the device and back.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kiln.errors import KilnError
from kiln.ir import DType
from kiln.ops import torch as torch_ops
from kiln.ops.registry import KernelContext, OpDef
from kiln.runtime.backend import Backend
from kiln.runtime.placement import LayerPlacement, PlacementReport, RunStats

# Converting a read-only NumPy array (a constant, np.broadcast_to) is zero-copy and safe
# here: no kernel writes to its inputs.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")

_ND = np.ndarray
_TENSOR = torch.Tensor

_NP_TO_TORCH: dict[np.dtype, torch.dtype] = {
    np.dtype(np.bool_): torch.bool, np.dtype(np.uint8): torch.uint8,
    np.dtype(np.int8): torch.int8, np.dtype(np.int16): torch.int16,
    np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64,
    np.dtype(np.float16): torch.float16, np.dtype(np.float32): torch.float32,
    np.dtype(np.float64): torch.float64, np.dtype(np.complex64): torch.complex64,
    np.dtype(np.complex128): torch.complex128,
}
_TORCH_TO_DTYPE: dict[torch.dtype, DType] = {
    t: DType.from_numpy(n) for n, t in _NP_TO_TORCH.items()}
_TORCH_TO_DTYPE[torch.bfloat16] = DType.BFLOAT16
_BF16_NP = DType.BFLOAT16.numpy

class FallbackWarning(UserWarning):
    """Some layers run on the CPU fallback (named in the message)."""


class CompileWarning(UserWarning):
    """compile=True could not be honoured; the session runs eagerly."""


PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class _FallbackContext(KernelContext):
    """The ctx a NumPy kernel sees on the torch backend: NumPy in, NumPy out, also for the
    subgraphs it runs (which themselves run on torch)."""

    __slots__ = ("owner",)

    def run(self, subgraph, inputs: list) -> list:
        be = self.owner
        st = be.stats()
        ups = [be.upload(x, st) for x in inputs]
        outs = subgraph.run(ups, outer=self.env)
        return [be.download(x, st) for x in outs]


_NUMPY_BACKEND = Backend()

# Inputs that are parameters read on the host (shapes, axes, pads...) rather than data;
# on CUDA they are left where they are instead of being moved to the device.
HOST_PARAM_INPUTS: dict[str, frozenset[int]] = {
    k: frozenset(v) for k, v in {
        "Reshape": {1}, "Expand": {1}, "Tile": {1}, "Slice": {1, 2, 3, 4}, "Pad": {1, 3},
        "Resize": {1, 2, 3}, "Upsample": {1}, "Unsqueeze": {1}, "Squeeze": {1},
        "TopK": {1}, "ConstantOfShape": {0}, "Range": {0, 1, 2}, "Split": {1},
        "OneHot": {1}, "CumSum": {1}, "Trilu": {1}, "ReduceSum": {1}, "ReduceMean": {1},
        "ReduceMax": {1}, "ReduceMin": {1}, "ReduceProd": {1}, "ReduceL1": {1},
        "ReduceL2": {1}, "ReduceLogSum": {1}, "ReduceLogSumExp": {1},
        "ReduceSumSquare": {1}, "CenterCropPad": {1}, "Col2Im": {1, 2},
    }.items()}


class TorchBackend(Backend):
    """Runs plans with torch. Options:

    ``device``: "cpu", "cuda" or "cuda:N". ``precision``: "fp32", "bf16" or "fp16" —
    matmul/conv compute in that type, their inputs and outputs stay fp32. ``compile``:
    turn the main graph into one ``torch.compile`` program (CUDA graphs on GPU) when every
    op allows it, else run eagerly with a warning. ``threads``: ``torch.set_num_threads``
    (process-wide). ``channels_last``: run 2-D convolutions in NHWC (default on CPU).
    """

    name = "torch"

    def __init__(self, device: str = "cpu", precision: str = "fp32", compile: bool = False,
                 threads: int | None = None, channels_last: bool | None = None,
                 warn: bool = True):
        torch_ops.install()
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError):
            dev = None
        if dev is None or dev.type not in ("cpu", "cuda"):
            raise ValueError(f"unsupported device {device!r}; use 'cpu', 'cuda' or 'cuda:N'")
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise KilnError(f"device {device!r} asked for but torch sees no CUDA device "
                                f"(torch {torch.__version__}); use device='cpu'")
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
        self.tdevice = dev
        self.device = str(dev)
        self.is_cuda = dev.type == "cuda"
        self.precision = precision
        self.compute_dtype = PRECISIONS[precision]
        self.compile = bool(compile)
        self.channels_last = (not self.is_cuda) if channels_last is None else channels_last
        self.warn = warn
        if threads is not None:
            torch.set_num_threads(int(threads))
        self.layers: list[LayerPlacement] = []
        self._tls = threading.local()
        self._last: RunStats | None = None
        self.compiled_program = None  # set by the session when compile=True succeeds
        self.compile_status = ""
        # While the compiled program is traced, kernels must use plain traceable ops.
        self.tracing = False
        self.shared_consts: dict | None = None
        self.eager_program: Callable | None = None
        self._main_graph = None

    # -- arrays in and out -------------------------------------------------------------

    def from_numpy(self, x):
        """NumPy -> torch tensor on the device (zero-copy on CPU); element types torch
        lacks stay NumPy. Lists (sequences) convert element-wise."""
        if isinstance(x, list):
            return [self.from_numpy(e) for e in x]
        if x is None or x.__class__ is _TENSOR:
            return x
        if not isinstance(x, _ND):
            x = np.asarray(x)
        t = _np_to_torch(x)
        if t is None:
            return x
        return t.to(self.tdevice, non_blocking=True) if self.is_cuda else t

    def to_numpy(self, x):
        if isinstance(x, list):
            return [self.to_numpy(e) for e in x]
        if isinstance(x, _TENSOR):
            return tensor_to_numpy(x)
        return x

    def constant(self, v):
        shared = self.shared_consts
        if shared is not None and v in shared:
            return shared[v]
        x = v.const
        if v.meta.get("host"):
            t = _np_to_torch(x)
            return x if t is None else t
        return self.from_numpy(x)

    def normalize(self, x):
        if x.__class__ is _TENSOR or x is None or isinstance(x, list):
            return x
        if isinstance(x, _TENSOR):  # subclasses
            return x
        return self.from_numpy(np.asarray(x))

    def accept_feed(self, x, dtype: DType):
        if isinstance(x, _TENSOR):
            if x.device != self.tdevice:  # a non-blocking copy only towards the device
                x = x.to(self.tdevice, non_blocking=self.is_cuda and x.device.type == "cpu")
            return x
        if isinstance(x, _ND):
            return self.from_numpy(x)
        if hasattr(x, "__dlpack__") and not isinstance(x, (list, tuple)):
            try:
                return self.accept_feed(torch.from_dlpack(x), dtype)
            except (RuntimeError, TypeError, BufferError):
                pass
        if hasattr(x, "__array__") and not isinstance(x, (list, tuple)):
            return self.from_numpy(np.asarray(x))
        return self.from_numpy(np.asarray(x, dtype=dtype.numpy))

    def dtype_of(self, x) -> DType:
        if isinstance(x, _TENSOR):
            return _TORCH_TO_DTYPE.get(x.dtype, DType.UNDEFINED)
        return DType.from_numpy(x.dtype)

    # -- moving values for fallback nodes (counted) -------------------------------------

    def stats(self) -> RunStats:
        st = getattr(self._tls, "stats", None)
        if st is None:
            st = self._tls.stats = RunStats()
        return st

    def download(self, x, st: RunStats | None, count: bool = True):
        """Tensor -> NumPy for a NumPy kernel (counted as a transfer when ``count``)."""
        if isinstance(x, list):
            return [self.download(e, st, count) for e in x]
        if isinstance(x, _TENSOR):
            if count and st is not None:
                st.transfers += 1
            return tensor_to_numpy(x)
        return x

    def upload(self, x, st: RunStats | None, count: bool = True, host: bool = False):
        """A NumPy kernel's result -> tensor (on the host when ``host``)."""
        if isinstance(x, list):
            return [self.upload(e, st, count, host) for e in x]
        if x is None or isinstance(x, _TENSOR):
            return x
        if not isinstance(x, _ND):
            x = np.asarray(x)
        t = _np_to_torch(x)
        if t is None:
            return x
        if count and st is not None:
            st.transfers += 1
        return t.to(self.tdevice, non_blocking=True) if self.is_cuda and not host else t

    # -- picking kernels ----------------------------------------------------------------

    def bind(self, opdef: OpDef, node, opset: int, attrs: dict):
        host = _host_step(node)
        where = "host" if host and self.is_cuda else self.device
        fallback = self._fallback(opdef, node, attrs, host)
        alt, alt_ctx, how, why = fallback, opdef.wants_ctx, "cpu-fallback", \
            "no torch or generic kernel: NumPy kernel, inputs downloaded, outputs uploaded"
        if opdef.generic:
            alt = self._generic(opdef, attrs, fallback, opdef.wants_ctx, node)
            how, why = "torch-generic", "array-API kernel on torch tensors"
        native = self._native(opdef, node, opset, attrs)
        if native is not None:
            fn, wants_ctx, note = native
            fn = self._guarded(fn, wants_ctx, alt, alt_ctx, node, fallback)
            how, why = "torch", note or "torch kernel"
            wants_ctx = wants_ctx or alt_ctx
        else:
            fn, wants_ctx = alt, alt_ctx
        if how == "cpu-fallback":
            where = "cpu"
        elif host:
            why += "; host-resident outputs" if self.is_cuda else ""
        self.layers.append(LayerPlacement(node.name or f"({node.op_type})", node.op_type,
                                          where, how, why))
        return fn, {}, wants_ctx, how

    def _native(self, opdef: OpDef, node, opset: int, attrs: dict):
        """(callable taking positional inputs, wants ctx, note) or None."""
        user = opdef.backend_kernels.get("torch")
        if user is not None and not torch_ops.is_builtin(user):
            od = OpDef(opdef.domain, opdef.op_type, opdef.since, opdef.until, user)
            return _bind_attrs(user, od.call_attrs(attrs)), od.wants_ctx, "registered torch kernel"
        tk = torch_ops.find(opdef.domain, opdef.op_type, opset)
        if tk is None:
            return None
        if not tk.build:
            od = tk.opdef
            return _bind_attrs(tk.fn, od.call_attrs(attrs)), od.wants_ctx, ""
        site = torch_ops.Site(node, opset, attrs, self)
        fn = tk.fn(site)
        if fn is None:
            return None
        return fn, site.wants_ctx, "; ".join(site.notes)

    def _generic(self, opdef: OpDef, attrs: dict, fallback: Callable, wants_ctx: bool, node):
        k = _bind_attrs(opdef.kernel, opdef.call_attrs(attrs))
        return self._guarded(k, wants_ctx, fallback, wants_ctx, node, fallback)

    def _guarded(self, fn: Callable, fn_ctx: bool, alt: Callable, alt_ctx: bool, node,
                 fallback: Callable):
        """``fn`` on tensors; ``alt`` for calls with NumPy-only inputs or that ``fn``
        declines (returns NotImplemented); the NumPy ``fallback`` for calls ``fn`` hands
        to it (returns ``kiln.ops.torch.USE_NUMPY``; ``alt`` and ``fallback`` take ctx
        when ``alt_ctx``). The result takes ctx when either does."""
        cuda_move = self._cuda_mover(node) if self.is_cuda else None
        # Traced for compile=True every value is a tensor (checked before the program
        # runs): no per-input type test for the tracer to guard on.
        nd = _NeverMatches if self.tracing else _ND
        ni, use_np = NotImplemented, torch_ops.USE_NUMPY

        if fn_ctx or alt_ctx:
            def run_ctx(ctx, *args):
                for a in args:
                    if a.__class__ is nd:
                        return alt(ctx, *args) if alt_ctx else alt(*args)
                if cuda_move is not None:
                    args = cuda_move(args)
                r = fn(ctx, *args) if fn_ctx else fn(*args)
                if r is ni:
                    return alt(ctx, *args) if alt_ctx else alt(*args)
                if r is use_np:
                    return fallback(ctx, *args) if alt_ctx else fallback(*args)
                return r
            return run_ctx

        def run(*args):
            for a in args:
                if a.__class__ is nd:
                    return alt(*args)
            if cuda_move is not None:
                args = cuda_move(args)
            r = fn(*args)
            if r is ni:
                return alt(*args)
            if r is use_np:
                return fallback(*args)
            return r
        return run

    def _cuda_mover(self, node) -> Callable:
        """On CUDA: CPU tensors at data positions move to the device (counted); host
        parameters stay; for host-resident steps data moves to the host instead."""
        params = HOST_PARAM_INPUTS.get(node.op_type, frozenset())
        if node.op_type in ("Shape", "Size"):
            return lambda args: args  # reads metadata only
        dev = self.tdevice
        host = _host_step(node)
        backend = self

        def move(args):
            out = list(args)
            for i, a in enumerate(out):
                if isinstance(a, _TENSOR) and i not in params:
                    if host and a.is_cuda:
                        backend.stats().transfers += 1
                        out[i] = a.cpu()
                    elif not host and not a.is_cuda:
                        backend.stats().transfers += 1
                        out[i] = a.to(dev, non_blocking=True)
            return out
        return move

    def _fallback(self, opdef: OpDef, node, attrs: dict, host: bool) -> Callable:
        """The NumPy kernel behind conversions. Inputs that are host-resident values are
        not counted as transfers (they never were on the device)."""
        k = _bind_attrs(opdef.kernel, opdef.call_attrs(attrs))
        host_in = tuple(v is not None and bool(v.meta.get("host")) for v in node.inputs)
        host_out = host
        backend = self

        def convert(args, st):
            return [backend.download(a, st, not (i < len(host_in) and host_in[i]))
                    for i, a in enumerate(args)]

        def finish(r, st):
            if isinstance(r, tuple):
                return tuple(backend.upload(x, st, not host_out, host_out) for x in r)
            return backend.upload(r, st, not host_out, host_out)

        if opdef.wants_ctx:
            def run_ctx(ctx, *args):
                st = backend.stats()
                st.fallback_calls += 1
                fctx = _FallbackContext(ctx.num_outputs, ctx.opset, ctx.env, ctx.runner,
                                        ctx.node, _NUMPY_BACKEND)
                fctx.owner = backend
                return finish(k(fctx, *convert(args, st)), st)
            return run_ctx

        def run(*args):
            st = backend.stats()
            st.fallback_calls += 1
            return finish(k(*convert(args, st)), st)
        return run

    # -- running ------------------------------------------------------------------------

    def execute(self, plan, inputs: list, overrides: dict | None = None) -> list:
        st = self._tls.stats = RunStats()
        try:
            prog = self.compiled_program
            if prog is not None and not overrides and prog.ready_for(inputs):
                out = prog(inputs)
                if out is not None:
                    st.compiled = True
                    return out
            with torch.inference_mode():
                prog = self.eager_program
                if prog is not None and not overrides and plan.graph is self._main_graph:
                    try:
                        return prog(*inputs)
                    except Exception:  # noqa: BLE001 - re-run for the error naming the layer
                        st.transfers = st.fallback_calls = 0
                return plan.run(inputs, None, overrides)
        finally:
            self._last = st

    def prepare(self, plan, graph, opsets: dict, functions: dict) -> None:
        """After the plan is built: name the fallback layers in a warning, keep constants
        that only host-resident layers read on the host, and set up compiled mode."""
        fb = [lp for lp in self.layers if lp.how == "cpu-fallback"]
        if fb and self.warn:
            ops: dict[str, int] = {}
            for lp in fb:
                ops[lp.op_type] = ops.get(lp.op_type, 0) + 1
            names = ", ".join(f"{k} (x{n})" if n > 1 else k for k, n in ops.items())
            warnings.warn(
                f"torch backend ({self.device}): {len(fb)} layer(s) run on the CPU fallback "
                f"(NumPy kernel; inputs downloaded, outputs uploaded): {names}. "
                "session.placement() lists them and counts the transfers per run.",
                FallbackWarning, stacklevel=4)
        if self.is_cuda:
            self._host_constants(plan)
        if plan.graph is graph:
            self.eager_program = eager_program(plan)
            self._main_graph = graph
        if self.compile:
            self._setup_compile(plan, graph, opsets, functions)

    def _host_constants(self, plan) -> None:
        readers: dict = {}
        for s in plan.steps:
            host = s.placement != "function" and _host_step(s.node)
            for i, v in enumerate(s.inputs):
                if v in plan.consts:
                    param = i in HOST_PARAM_INPUTS.get(s.node.op_type, ())
                    readers.setdefault(v, []).append(host or param)
        for v, flags in readers.items():
            t = plan.consts[v]
            if all(flags) and isinstance(t, _TENSOR) and t.is_cuda:
                plan.consts[v] = t.cpu()

    def _setup_compile(self, plan, graph, opsets, functions) -> None:
        why = _compile_blockers(plan)
        if why:
            self.compile_status = f"no: running eagerly because of {why}"
            warnings.warn(f"compile=True: the model cannot run as one torch program ({why}); "
                          "running eagerly instead", CompileWarning, stacklevel=4)
            return
        self.compiled_program = CompiledProgram(self, graph, opsets, functions)
        self.compile_status = ("yes: torch.compile programs per input shape (inductor, "
                               "frozen weights" + (", CUDA graphs" if self.is_cuda else "") + ")")

    def last_run_stats(self) -> RunStats | None:
        """Stats of this thread's last run (any thread's, if this one has not run)."""
        return getattr(self._tls, "stats", None) or self._last

    def report(self) -> PlacementReport:
        return PlacementReport(self.name, self.device, list(self.layers),
                               self.last_run_stats(), self.compile_status)


# -- helpers -------------------------------------------------------------------------------

class _NeverMatches:
    """A class no value is an instance of."""


def _host_step(node) -> bool:
    outs = [v for v in node.outputs if v is not None]
    return bool(outs) and all(v.meta.get("host") for v in outs)


def _bind_attrs(fn: Callable, attrs: dict) -> Callable:
    if not attrs:
        return fn
    return lambda *args: fn(*args, **attrs)


def _np_to_torch(x: np.ndarray):
    """A CPU tensor sharing ``x``'s memory where possible; None for dtypes torch lacks."""
    dt = x.dtype
    td = _NP_TO_TORCH.get(dt)
    if td is None:
        if dt == _BF16_NP:
            return _np_to_torch(x.view(np.int16)).view(torch.bfloat16)
        return None
    if not dt.isnative:
        x = x.astype(dt.newbyteorder("="))
    try:
        return torch.from_numpy(x)
    except ValueError:  # negative strides
        return torch.from_numpy(np.ascontiguousarray(x))


def tensor_to_numpy(t: torch.Tensor) -> np.ndarray:
    """A tensor's values as NumPy (zero-copy for CPU tensors where possible)."""
    if t.requires_grad:
        t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.is_conj():
        t = t.resolve_conj()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(_BF16_NP)
    if t.is_neg():
        t = t.resolve_neg()
    return t.numpy()


def as_torch(x):
    """An output as a torch tensor (as is when it already is one); values of types torch
    lacks (strings...) stay NumPy."""
    if isinstance(x, list):
        return [as_torch(e) for e in x]
    if x is None or isinstance(x, _TENSOR):
        return x
    t = _np_to_torch(np.asarray(x))
    return np.asarray(x) if t is None else t


class CompiledProgram:
    """The main graph as straight-line torch programs compiled by ``torch.compile``
    (inductor with frozen weights; CUDA graphs on GPU), one per input signature: at the
    first run with new input shapes the model is re-optimized for exactly those shapes
    (so all shape arithmetic folds away), traced and compiled. A failure turns that
    signature over to eager execution with a warning."""

    MAX_PROGRAMS = 8

    def __init__(self, backend: TorchBackend, graph, opsets: dict, functions: dict):
        self.backend = backend
        self.graph, self.opsets, self.functions = graph, dict(opsets), functions
        self.programs: dict[tuple, Any] = {}  # signature -> (compiled module, input order)
        self.failed: str | None = None
        self._lock = threading.Lock()
        self.options: dict[str, Any] = {"freezing": True}
        if backend.is_cuda:
            self.options["triton.cudagraphs"] = True

    def ready_for(self, inputs: list) -> bool:
        return self.failed is None and all(isinstance(x, _TENSOR) for x in inputs)

    def __call__(self, inputs: list) -> list | None:
        import torch._inductor.config as inductor_config
        key = tuple((tuple(x.shape), x.dtype, x.device) for x in inputs)
        with self._lock:
            prog = self.programs.get(key, False)
            if prog is False:
                prog = self.programs[key] = self._build(inputs)
        if prog is None:
            return None
        fn, order, ok = prog
        try:
            # Freezing needs no_grad (not inference_mode) to fold and prepack weights.
            # Programs are keyed by input signature already, so once one has run, dynamo's
            # guard checks (~0.2 ms over all the weights) are redundant.
            with torch.no_grad(), inductor_config.patch(self.options), \
                    torch.compiler.set_stance(skip_guard_eval_unsafe=ok):
                out = fn(*[inputs[i] for i in order])
        except Exception as e:  # noqa: BLE001 - a failure to compile means: run eagerly
            if not ok:
                self._give_up(key, e)
            return None
        if not ok:
            self.programs[key] = (fn, order, True)
        if self.backend.is_cuda:  # CUDA-graph outputs are overwritten by the next replay
            return [o.clone() if isinstance(o, _TENSOR) else o for o in out]
        return list(out)

    def _build(self, inputs: list):
        if len(self.programs) > self.MAX_PROGRAMS:
            self._note(f"more than {self.MAX_PROGRAMS} input signatures; new ones run eagerly")
            return None
        from kiln.ir import Model
        from kiln.optimize import optimize
        from kiln.runtime.plan import compile_model

        be = self.backend
        shapes = {v.name: list(x.shape) for v, x in zip(self.graph.inputs, inputs)}
        try:
            model = optimize(Model(self.graph, dict(self.opsets), dict(self.functions)),
                             input_shapes=shapes, backend=be.name)
            tracer = TorchBackend(be.device, be.precision, compile=False,
                                  channels_last=be.channels_last, warn=False)
            tracer.tracing = True
            plan = compile_model(model.graph, model.opset_imports, model.functions, tracer)
        except Exception as e:  # noqa: BLE001
            self._note(f"re-optimizing for shapes {shapes} failed: {type(e).__name__}: {e}")
            return None
        why = _compile_blockers(plan)
        if why:
            self._note(f"for shapes {shapes} the model has {why}")
            return None
        pos = {v.name: i for i, v in enumerate(self.graph.inputs)}
        order = [pos[v.name] for v in plan.graph.inputs]
        module = _program_module(plan)
        return torch.compile(module, dynamic=False), order, False

    def _give_up(self, key, e: Exception) -> None:
        msg = str(e).strip().splitlines()
        self.programs[key] = None
        self._note(f"torch.compile failed ({type(e).__name__}: {msg[0] if msg else ''})")

    def _note(self, why: str) -> None:
        self.backend.compile_status = f"partly: {why}; running eagerly for these inputs"
        warnings.warn(f"compile=True: {why}; running eagerly for these inputs",
                      CompileWarning, stacklevel=6)


def _compile_blockers(plan) -> str:
    """Why ``plan`` cannot be one torch program ("" when it can)."""
    blockers = sorted({f"{s.node.op_type} ({s.placement})" for s in plan.steps
                       if s.placement not in ("torch", "torch-generic")
                       or any(True for _ in s.node.subgraphs())})
    numpy_consts = [v.name for v, t in plan.consts.items() if not isinstance(t, _TENSOR)]
    return ", ".join(blockers + [f"constant {n} has a type torch lacks"
                                 for n in numpy_consts[:3]])


def _straight_line(plan, module: bool) -> tuple[str, dict, dict]:
    """Python source running ``plan``'s steps in order on local variables: no environment
    dict, no per-step bookkeeping. ``module``: a ``forward(self, ...)`` reading constants
    from buffers (for torch.compile); else ``run(...)`` with constants as globals, results
    normalized and intermediates deleted after their last use. Returns (source, globals,
    constants by name)."""
    names: dict = {}
    glb: dict[str, Any] = {"_one": _one, "_n": plan.backend.normalize}
    lines: list[str] = []
    for i, v in enumerate(plan.graph.inputs):
        names[v] = f"x{i}"
    used = {v for s in plan.steps for v in s.inputs if v is not None} | set(plan.graph.outputs)
    params = _param_constants(plan)
    consts = {}
    for i, (v, t) in enumerate(plan.consts.items()):
        if v in params:  # read as ints by torch kernels: plain Python, nothing to trace
            names[v] = f"p{i}"
            glb[f"p{i}"] = params[v]
        elif v in used:
            consts[f"c{i}"] = t
            names[v] = f"c{i}"
            if module:
                lines.append(f"    c{i} = self.c{i}")
    glb.update({} if module else consts)
    wrap = "{}" if module else "_n({})"
    for j, s in enumerate(plan.steps):
        glb[f"f{j}"] = s.fn
        args = ", ".join("None" if v is None else names[v] for v in s.inputs)
        if s.wants_ctx:  # facts only (no subgraphs here): one context per step, made now
            glb[f"k{j}"] = KernelContext(len(s.outputs), s.opset, {}, plan, s.node,
                                         plan.backend)
            args = f"k{j}, {args}" if args else f"k{j}"
        if s.attrs:
            glb[f"a{j}"] = s.attrs
            args += f", **a{j}"
        outs = list(s.outputs)
        if len(outs) == 1:
            names[outs[0]] = f"v{j}_0"
            lines.append(f"    v{j}_0 = " + wrap.format(f"_one(f{j}({args}))"))
        else:
            lines.append(f"    r{j} = f{j}({args})")
            for k, v in enumerate(outs):
                if v is not None:
                    names[v] = f"v{j}_{k}"
                    lines.append(f"    v{j}_{k} = " + wrap.format(f"r{j}[{k}]"))
        if not module:
            dead = [names[v] for v in s.frees if v in names and not v.is_const]
            if dead:
                lines.append(f"    del {', '.join(dead)}")
    ins = ", ".join((["self"] if module else []) + [names[v] for v in plan.graph.inputs])
    outs = ", ".join(names[v] for v in plan.graph.outputs)
    head = "forward" if module else "run"
    src = f"def {head}({ins}):\n" + "\n".join(lines) + f"\n    return [{outs}]\n"
    exec(compile(src, f"<kiln {'compiled' if module else 'eager'} plan>", "exec"), glb)
    return src, glb, consts


def _param_constants(plan) -> dict:
    """Constants that only torch kernels read, and only as host parameters (shapes, axes,
    split sizes, resize scales): as tuples of Python numbers."""
    readers: dict = {}
    for s in plan.steps:
        params = HOST_PARAM_INPUTS.get(s.node.op_type, ())
        for i, v in enumerate(s.inputs):
            if v is not None and v in plan.consts:
                readers.setdefault(v, []).append(s.placement == "torch" and i in params)
    out = {}
    for v, ok in readers.items():
        c = v.const
        if all(ok) and v not in plan.graph.outputs and c.dtype.kind in "iuf" and c.ndim <= 1:
            cast = float if c.dtype.kind == "f" else int
            out[v] = tuple(cast(x) for x in c.reshape(-1))
    return out


def _program_module(plan) -> torch.nn.Module:
    """An nn.Module whose forward runs ``plan``'s steps in order, its constants buffers
    (so that inductor's freezing can fold them)."""
    src, glb, consts = _straight_line(plan, module=True)
    mod = type("KilnProgram", (torch.nn.Module,), {"forward": glb["forward"]})()
    for k, t in consts.items():
        mod.register_buffer(k, t, persistent=False)
    mod.kiln_source = src
    return mod.eval()


def eager_program(plan) -> Callable | None:
    """The main plan as one straight-line function (see :func:`_straight_line`), or None
    when a step runs subgraphs (If, Loop, Scan need the environment)."""
    if any(s.fn is None or any(True for _ in s.node.subgraphs()) for s in plan.steps):
        return None
    src, glb, _ = _straight_line(plan, module=False)
    fn = glb["run"]
    fn.kiln_source = src
    return fn


def _one(r):
    return r[0] if isinstance(r, tuple) else r
