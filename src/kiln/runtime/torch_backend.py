"""The PyTorch backend: runs plans on torch tensors, on the CPU or a CUDA device.

For each node the plan prepares, in this order (see :meth:`TorchBackend.candidates`):

1. the op's torch kernel (``OpDef.kernels["torch"]``);
2. its shared array-API kernel, when the op's reference kernel is generic;
3. the CPU fallback: the reference NumPy kernel, tensor inputs downloaded and outputs
   uploaded. Such nodes are named in a warning when the session is created and listed by
   ``session.placement()``.

A kernel that returns NotImplemented for a call (a dtype it does not cover) hands that
call to the next one. Values of element types torch lacks (strings, uint16/32/64, float8,
int4) stay NumPy arrays; a node that receives one runs the next kernel that takes them.
Values the optimizer marks host-resident (``Value.meta["host"]``, shape arithmetic) live
on the host as CPU tensors, never copied to the device and back.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from kiln.errors import KilnError, OptionError
from kiln.ir import DType, TensorType
from kiln.ops import registry
from kiln.ops.registry import KernelContext, Mode, OpDef, Target
from kiln.ops.torch.arrays import DTYPE_OF, TORCH_OF, to_numpy, to_torch
from kiln.ops.torch.conv import native_on_cpu
from kiln.ops.torch.rnn import NUMPY_LOOPS
from kiln.runtime import compile_cache
from kiln.runtime.backend import (
    BLAS_THREADS,
    Backend,
    Candidate,
    Link,
    OneThread,
    host_feed,
    measured_threads,
    usable_cores,
)
from kiln.runtime.executor import Program
from kiln.runtime.placement import LayerPlacement, RunStats
from kiln.runtime.segments import MIN_SEGMENT, Report, split, worth_compiling
from kiln.runtime.specialize import CompileFailed, CompileWarning, Specializer
from kiln.runtime.threads import default_threads

# Converting a read-only NumPy array (a constant, np.broadcast_to) is zero-copy and safe
# here: no kernel writes to its inputs.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")

_ND = np.ndarray
_TENSOR = torch.Tensor
PRECISIONS = {"fp32": None, "tf32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
__all__ = ["CompileWarning", "FallbackWarning", "PrecisionWarning", "TorchBackend",
           "as_torch"]


class FallbackWarning(UserWarning):
    """Some layers run on the CPU fallback (named in the message)."""


class PrecisionWarning(UserWarning):
    """The precision asked for has no native arithmetic on this CPU: it runs, slowly."""


class TorchBackend(Backend):
    """Runs plans with torch. Options:

    ``device``: "cpu", "cuda" or "cuda:N". ``precision``: "fp32", "bf16" or "fp16" —
    matmul/conv compute in that type (depthwise convolutions on the CPU excepted: faster in
    fp32), their inputs and outputs stay fp32; a type this CPU has no native arithmetic for
    runs, many times slower, with a ``PrecisionWarning``; on CUDA, "fp32"
    keeps cuDNN and cuBLAS off TF32 during runs (torch's default convolutions use it) and
    "tf32" puts both on it (10-bit products, fp32 values). ``compile``:
    run the main graph as compiled programs, one per input shape (AOTInductor,
    cached on disk; torch.compile with CUDA graphs on GPU); layers that cannot be
    compiled (If, Loop, NumPy fallbacks) run eagerly between programs compiled for the
    runs of layers around them, and a warning names them. ``threads``:
    ``torch.set_num_threads`` (process-wide; default: at most the usable cores).
    ``channels_last``: run 2-D convolutions in NHWC (default on CPU).
    """

    name = "torch"
    array_type = torch.Tensor
    module = False
    """Set on the backend of a kiln.train module: kernels declining a mix of float types
    under torch.autocast get fp32 inputs instead of the NumPy fallback."""

    @property
    def training(self) -> bool:
        """Set by kiln.train's modules before each run: BatchNormalization then uses batch
        statistics (updating its running ones) and Dropout drops (kernels read it from
        their :class:`Target`'s ``mode``)."""
        return self.mode.training

    @training.setter
    def training(self, on: bool) -> None:
        self.mode.training = on

    def __init__(self, device: str = "cpu", precision: str = "fp32", compile: bool = False,
                 threads: int | None = None, channels_last: bool | None = None,
                 warn: bool = True):
        registry.load_backend(self.name)
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError):
            dev = None
        if dev is None or dev.type not in ("cpu", "cuda"):
            raise OptionError(f"unsupported device {device!r}; use 'cpu', 'cuda' or 'cuda:N'")
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise KilnError(f"device {device!r} asked for but torch sees no CUDA device "
                                f"(torch {torch.__version__}); use device='cpu'")
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
        if precision not in PRECISIONS:
            raise OptionError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
        if precision == "tf32" and dev.type != "cuda":
            raise OptionError("precision 'tf32' is for NVIDIA GPUs (device='cuda'); on the CPU "
                              "use 'fp32', 'bf16' or 'fp16'")
        self.tdevice = dev
        self.device = str(dev)
        self.is_cuda = dev.type == "cuda"
        self.precision = precision
        self.compute_dtype = PRECISIONS[precision]
        if dev.type == "cpu" and self.compute_dtype is not None \
                and not native_on_cpu(self.compute_dtype):
            other = "'bf16' or 'fp32'" if native_on_cpu(torch.bfloat16) else "'fp32'"
            warnings.warn(f"precision={precision!r}: this CPU has no native {precision} "
                          "arithmetic (oneDNN reports none), so torch's reference kernels "
                          "run it, many times slower than fp32 (fp16 took 9-192x fp32's "
                          f"time on zoo models on an AVX-512 CPU); use {other} here",
                          PrecisionWarning, stacklevel=5)
        self.compile = bool(compile)
        self.channels_last = (not self.is_cuda) if channels_last is None else channels_last
        self.warn = warn
        if threads is not None:
            torch.set_num_threads(int(threads))
        else:  # never oversubscribe: the usable cores other processes leave free
            torch.set_num_threads(default_threads(min(torch.get_num_threads(),
                                                      usable_cores())))
        # While a specialized program is traced, kernels must use plain traceable ops.
        self.tracing = False
        self.mode = Mode()
        self._tls = threading.local()
        self._last: RunStats | None = None
        self.cache_folder: Path | None = None  # of compiled programs; specialize sets it
        self.compile_log: list[str] = []
        """With compile=True: per program, "loaded PATH" (from the disk cache) or
        "compiled PATH" (and stored there)."""

    def tracer(self) -> TorchBackend:
        """A backend with these options whose kernels trace (for torch.compile)."""
        with warnings.catch_warnings():  # the session said it already
            warnings.simplefilter("ignore", PrecisionWarning)
            t = TorchBackend(self.device, self.precision, compile=False,
                             channels_last=self.channels_last, warn=False)
        t.tracing = True
        return t

    def target(self) -> Target:
        return Target(self.name, self.tdevice, self.compute_dtype, self.tracing,
                      self.channels_last, self.module, self.from_numpy, self.to_numpy,
                      self.mode)

    # -- arrays in and out -------------------------------------------------------------

    def from_numpy(self, x):
        """NumPy -> torch tensor on the device (zero-copy on CPU); element types torch
        lacks stay NumPy. Lists (sequences) convert element-wise."""
        if isinstance(x, list):
            return [self.from_numpy(e) for e in x]
        if x is None or x.__class__ is _TENSOR:
            return x
        t = to_torch(x if isinstance(x, _ND) else np.asarray(x))
        if t is None:
            return x
        return t.to(self.tdevice, non_blocking=True) if self.is_cuda else t

    def to_numpy(self, x):
        if isinstance(x, list):
            return [self.to_numpy(e) for e in x]
        return to_numpy(x) if isinstance(x, _TENSOR) else x

    def constant(self, v):
        if v.meta.get("host"):
            t = to_torch(v.const)
            return v.const if t is None else t
        return self.from_numpy(v.const)

    def normalize(self, x):
        if x.__class__ is _TENSOR or x is None or isinstance(x, (list, _TENSOR)):
            return x
        return self.from_numpy(np.asarray(x))

    def accept_feed(self, x, dtype: DType):
        if isinstance(x, _TENSOR):
            if x.device != self.tdevice:  # a non-blocking copy only towards the device
                x = x.to(self.tdevice, non_blocking=self.is_cuda and x.device.type == "cpu")
            return x
        if isinstance(x, _ND):
            return self.from_numpy(host_feed(x, dtype))
        if hasattr(x, "__dlpack__") and not isinstance(x, (list, tuple)):
            try:
                return self.accept_feed(torch.from_dlpack(x), dtype)
            except (RuntimeError, TypeError, BufferError):
                pass
        return self.from_numpy(host_feed(x, dtype))

    def dtype_of(self, x) -> DType:
        if isinstance(x, _TENSOR):
            return DTYPE_OF.get(x.dtype, DType.UNDEFINED)
        return DType.from_numpy(x.dtype)

    # -- moving values for fallback nodes ------------------------------------------------

    def stats(self) -> RunStats:
        st = getattr(self._tls, "stats", None)
        if st is None:
            st = self._tls.stats = RunStats()
        return st

    def download(self, x, st: RunStats | None):
        """Tensor -> NumPy for a NumPy kernel; a transfer only when it leaves a device."""
        if isinstance(x, list):
            return [self.download(e, st) for e in x]
        if isinstance(x, tuple):  # a host parameter the plan gave as Python numbers
            return np.asarray(x)
        if isinstance(x, _TENSOR):
            if st is not None and x.device.type != "cpu":
                st.transfers += 1
            return to_numpy(x)
        return x

    def upload(self, x, st: RunStats | None, host: bool = False):
        """A NumPy kernel's result -> tensor (on the host when ``host``); a transfer only
        when it goes to a device."""
        if isinstance(x, list):
            return [self.upload(e, st, host) for e in x]
        if x is None or isinstance(x, _TENSOR):
            return x
        t = to_torch(x if isinstance(x, _ND) else np.asarray(x))
        if t is None:
            return x
        if self.is_cuda and not host:
            if st is not None:
                st.transfers += 1
            return t.to(self.tdevice, non_blocking=True)
        return t

    # -- choosing kernels ----------------------------------------------------------------

    def candidates(self, opdef: OpDef):
        out = []
        own = opdef.kernels.get(self.name)
        if own is not None:
            out.append(("torch", own, "torch kernel"))
        if opdef.generic:
            out.append(("torch-generic", opdef.reference, "array-API kernel on torch tensors"))
        out.append(("cpu-fallback", opdef.reference,
                    "no torch or generic kernel: NumPy kernel, inputs downloaded, "
                    "outputs uploaded"))
        return out

    def chain(self, chain: list[Candidate], node, host_inputs: frozenset[int] = frozenset()
              ) -> Link:
        """Where every input is known to arrive as a tensor, the step calls the first
        kernel as it is and hands the calls it declines (NotImplemented) to the rest;
        elsewhere each kernel is guarded (NumPy inputs, CUDA moves) and hands on to the
        next. The last is the NumPy fallback behind conversions, unless the plan moves the
        values itself (:meth:`transfers`)."""
        host = _host_step(node)
        first = chain[0]
        where = "cpu" if first.how == "cpu-fallback" else \
            "host" if host and self.is_cuda else self.device
        why = first.why + ("; host-resident outputs" if host and self.is_cuda
                           and first.how != "cpu-fallback" else "")
        layer = LayerPlacement.of(node, where, first.how, why)
        if self._planned_fallback(chain):
            return Link(first.fn, False, layer)
        ctx = any(c.wants_ctx for c in chain)
        fns = [_with_ctx(c.fn, c.wants_ctx) if ctx else c.fn for c in chain]
        if chain[-1].how == "cpu-fallback":
            fns[-1] = self._fallback(fns[-1], ctx, host)
        # host parameters as Python numbers for torch's and the shared kernels (which
        # read them through int_list); the NumPy fallback's conversion makes them arrays
        params = first.how != "cpu-fallback"
        if len(fns) > 1 and self._all_tensors(node):
            return Link(fns[0], ctx, layer, self._link(fns[1:], ctx, node, host_inputs),
                        params)
        return Link(self._link(fns, ctx, node, host_inputs), ctx, layer, None, params)

    def _link(self, fns: list[Callable], ctx: bool, node, host_inputs) -> Callable:
        run = fns[-1]
        for fn in reversed(fns[:-1]):
            run = self._guarded(fn, run, ctx, node, host_inputs)
        return run

    def _all_tensors(self, node) -> bool:
        """Whether every input of ``node`` is known to arrive as a CPU tensor: of a dtype
        torch has (feeds, constants, kernel and fallback outputs are converted), on the CPU
        (no moves), not traced, not in a kiln.train module (autocast retries)."""
        return not (self.is_cuda or self.tracing or self.module) and all(
            v is None or (isinstance(v.type, TensorType) and v.type.dtype in TORCH_OF)
            for v in node.inputs)

    def _planned_fallback(self, chain: list[Candidate]) -> bool:
        """Whether the node runs its NumPy kernel alone, with its inputs and outputs moved
        by explicit transfers in the plan (a kernel taking a context, and the modules of
        kiln.train, which check gradients on the way, keep the converting wrapper)."""
        return len(chain) == 1 and chain[0].how == "cpu-fallback" and \
            not chain[0].wants_ctx and not self.module and not self.tracing

    def transfers(self, chain: list[Candidate], node) -> tuple[Callable, Callable] | None:
        """For a node planned on the NumPy fallback: (to host, back) — the first applied
        to each input, the second to the kernel's result (a tuple for several outputs)."""
        if not self._planned_fallback(chain):
            return None
        host, backend = _host_step(node), self

        def down(x):
            return backend.download(x, backend.stats())

        def up(r):
            st = backend.stats()
            st.fallback_calls += 1
            if isinstance(r, tuple):
                return tuple(backend.upload(x, st, host) for x in r)
            return backend.upload(r, st, host)
        return down, up

    def _guarded(self, fn: Callable, nxt: Callable, ctx: bool, node, host_inputs) -> Callable:
        move = self._cuda_mover(node, host_inputs) if self.is_cuda else None
        # Traced for compile=True every value is a tensor (checked before the program
        # runs): no per-input type test for the tracer to guard on.
        nd = _NeverMatches if self.tracing else _ND
        ni = NotImplemented
        if ctx:
            def run_ctx(c, *args):
                for a in args:
                    if a.__class__ is nd:
                        return nxt(c, *args)
                r = fn(c, *(move(args) if move else args))
                return nxt(c, *args) if r is ni else r
            return run_ctx

        def run(*args):
            for a in args:
                if a.__class__ is nd:
                    return nxt(*args)
            r = fn(*(move(args) if move else args))
            if r is ni and self.module:
                r = _under_autocast(fn, args)
            return nxt(*args) if r is ni else r
        return run

    def _cuda_mover(self, node, params: frozenset[int]) -> Callable | None:
        """On CUDA: CPU tensors at data positions move to the device (counted); host
        parameters stay; for host-resident steps data moves to the host instead."""
        if node.op_type in ("Shape", "Size"):
            return None  # reads metadata only
        dev, host, backend = self.tdevice, _host_step(node), self
        # Host constants (kept there for shape arithmetic) that a device step reads go to
        # the device once, now, not on every run.
        fixed = {} if host else {
            i: t.to(dev) for i, v in enumerate(node.inputs)
            if i not in params and v is not None and v.const is not None and
            v.meta.get("host") and not v.meta.get("overridable") and
            (t := to_torch(v.const)) is not None}

        def move(args):
            out = list(args)
            for i, a in enumerate(out):
                if i in fixed:
                    out[i] = fixed[i]
                elif isinstance(a, _TENSOR) and i not in params:
                    if host and a.is_cuda:
                        backend.stats().transfers += 1
                        out[i] = a.cpu()
                    elif not host and not a.is_cuda:
                        backend.stats().transfers += 1
                        out[i] = a.to(dev, non_blocking=True)
            return out
        return move

    def _fallback(self, k: Callable, ctx: bool, host: bool) -> Callable:
        """The NumPy kernel behind conversions (its ctx runs subgraphs on NumPy values)."""
        backend = self

        def convert(args, st):
            st.fallback_calls += 1
            if torch.is_grad_enabled() and any(isinstance(a, _TENSOR) and a.requires_grad
                                               for a in args):
                # NumPy would silently cut the gradient here
                raise RuntimeError("its NumPy kernel would run on a tensor that needs "
                                   "gradients (no torch kernel took this call: "
                                   f"{_dtypes(args)}), which cuts the gradient")
            return [backend.download(a, st) for a in args]

        def finish(r, st):
            if isinstance(r, tuple):
                return tuple(backend.upload(x, st, host) for x in r)
            return backend.upload(r, st, host)

        if ctx:
            def run_ctx(c, *args):
                st = backend.stats()
                fctx = _FallbackContext(c.num_outputs, c.opset, c.env, c.node)
                fctx.owner = backend
                return finish(k(fctx, *convert(args, st)), st)
            return run_ctx

        def run(*args):
            st = backend.stats()
            return finish(k(*convert(args, st)), st)
        return run

    # -- running ------------------------------------------------------------------------

    def run_context(self, plan=None, inputs: list | None = None):
        if self.is_cuda:
            return _cuda_run("tf32" if self.precision == "tf32" else "ieee")
        if plan is None or inputs is None or torch.get_num_threads() == 1:
            return torch.inference_mode()
        n = torch.get_num_threads()
        trial = self.thread_trial(plan, inputs, n)
        if trial.settled(n):  # on the threads as they are: nothing to set or time
            return torch.inference_mode()
        if trial.pools is None:
            # BLAS too when layers run on the NumPy kernels (NumPy fallbacks, the GRU
            # and RNN step loops): their products run on it. Only then: setting BLAS's
            # count and back (through threadpoolctl, for each OpenBLAS loaded) costs about
            # as much as a wake-word head's layers
            fallback = any(s.placement == "cpu-fallback" or s.node.op_type in NUMPY_LOOPS
                           and s.node.domain == "" for s in plan.walk())
            trial.pools = (_TORCH_THREADS, BLAS_THREADS) if fallback else (_TORCH_THREADS,)
        return measured_threads(trial, trial.pools, torch.inference_mode())

    def compiled_context(self, programs, inputs: list):
        """Compiled programs get their own thread trial: a small model's programs and the
        eager layers between them (silero VAD, the wake-word models) ran faster on one
        thread than on two, as its eager plan does (docs/performance.md)."""
        n = torch.get_num_threads()
        if self.is_cuda or n == 1 or self.cache_folder is None:
            # torch.compile's programs (the cache off) are built for the thread count they
            # first ran on and guarded on it: another count would recompile them
            return contextlib.nullcontext()
        return measured_threads(self.thread_trial(programs, inputs, n),
                                (_TORCH_THREADS, BLAS_THREADS), contextlib.nullcontext())

    def start_run(self) -> RunStats:
        st = self._tls.stats = RunStats()
        return st

    def end_run(self, token: RunStats) -> None:
        self._last = token

    def finish(self, plan) -> None:
        """Constants that only host-side readers use stay on the host (CUDA)."""
        if not self.is_cuda:
            return
        readers: dict = {}
        for s in plan.steps:
            host = s.placement != "function" and _host_step(s.node)
            for i, v in enumerate(s.inputs):
                if v in plan.consts:
                    readers.setdefault(v, []).append(host or i in s.host_inputs)
        for v, flags in readers.items():
            t = plan.consts[v]
            if all(flags) and isinstance(t, _TENSOR) and t.is_cuda:
                plan.consts[v] = t.cpu()

    def specialize(self, plan, opsets: dict, functions: dict) -> None:
        """Name the fallback layers in a warning; with compile=True set up programs."""
        fb = [s for s in plan.walk() if s.placement == "cpu-fallback"]
        if fb and self.warn:
            ops: dict[str, int] = {}
            for s in fb:
                ops[s.node.op_type] = ops.get(s.node.op_type, 0) + 1
            names = ", ".join(f"{k} (x{n})" if n > 1 else k for k, n in ops.items())
            warnings.warn(
                f"torch backend ({self.device}): {len(fb)} layer(s) run on the CPU fallback "
                f"(NumPy kernel; inputs downloaded, outputs uploaded): {names}. "
                "session.placement() lists them and counts the transfers per run.",
                FallbackWarning, stacklevel=5)
        if not self.compile:
            return
        why = _compile_blockers(plan)
        if why and not worth_compiling(plan, _blocker):
            plan.compile_status = f"no: running eagerly because of {why}, with no run of " \
                f"{MIN_SEGMENT} layers or more between to compile"
            warnings.warn(f"compile=True: the model cannot run as one torch program ({why}) "
                          f"and has no run of {MIN_SEGMENT} layers or more to compile; "
                          "running eagerly instead", CompileWarning, stacklevel=5)
            return
        plan.specializer = Specializer(plan, opsets, functions, self._compile_plan,
                                       _signature)
        # CUDA keeps torch.compile: its CUDA graphs are worth more than a disk cache.
        cache = self.cache_folder = None if self.is_cuda else compile_cache.folder()
        plan.compile_status = (
            f"yes: AOTInductor programs per input shape (frozen weights), kept in {cache}"
            if cache else "yes: torch.compile programs per input shape (inductor, frozen "
            "weights" + (", CUDA graphs" if self.is_cuda else "") + ")")
        if why:
            plan.compile_status = (
                "yes, in parts: " + plan.compile_status.removeprefix("yes: ")
                + f"; the layers that cannot be compiled ({why}) run eagerly between "
                "them (the first run says which)")

    def _compile_plan(self, plan) -> Callable[[list], list]:
        """``plan`` (traced by a tracer backend) as one compiled program or, when some
        layers cannot be compiled, as compiled runs with those layers eager between them
        (:mod:`kiln.runtime.segments`; the result's ``report`` says which)."""
        if not _compile_blockers(plan):
            return self._whole(plan)
        return self._in_parts(plan, Report())

    def _in_parts(self, plan, report: Report) -> Callable[[list], list]:
        prog = split(plan, _blocker, self._program, report)
        if not report.programs:
            raise CompileFailed(f"no run of {MIN_SEGMENT} layers or more between the layers "
                                f"that cannot be compiled ({report.blocked()})")

        def run(inputs: list) -> list:
            with torch.no_grad():
                return prog(*inputs)
        run.report = report  # type: ignore[attr-defined]
        return run

    def _whole(self, plan) -> Callable[[list], list]:
        """``plan`` as one program; if a layer's kernel cannot be traced (it reads a value
        on the host, say), that layer runs eagerly between programs for the rest."""
        whole = self._program(plan)
        state: list = []

        def run(inputs: list) -> list:
            if state:
                return state[0](inputs)
            try:
                out = whole(inputs)
            except CompileFailed as e:
                if e.step is None:
                    raise
                report = Report(forced={e.step: "its kernel cannot be traced"},
                                failed=[str(e)])
                part = self._in_parts(plan, report)
                run.report = report  # type: ignore[attr-defined]
                state.append(part)
                return part(inputs)
            state.append(whole)
            return out
        return run

    def _program(self, plan) -> Callable[[list], list]:
        """``plan`` (or a run of its layers) as one AOTInductor program (torch.compile
        where the disk cache is off, and on CUDA)."""
        prog = Program(plan, module=True)
        mod = type("KilnProgram", (torch.nn.Module,), {"forward": prog.fn})()
        for k, t in prog.constants.items():
            mod.register_buffer(k, t, persistent=False)
        mod.kiln_source = prog.source
        cache = self.cache_folder  # chosen once, in specialize
        if cache is not None:
            params = {k: v for k, v in prog.globals.items() if k[:1] == "p" and k[1:].isdigit()}
            options = f"{self.device}|{self.precision}|{self.channels_last}"
            return _naming_layer(prog, compile_cache.program(
                mod, plan, prog.source, params, prog.constants, options, cache,
                self.compile_log))
        import torch._inductor.config as inductor_config  # seconds: not for cached programs

        fn = torch.compile(mod.eval(), dynamic=False)
        options = {"freezing": True}
        if self.is_cuda:
            options["triton.cudagraphs"] = True
            # Tensors a prepared kernel holds (linear's weight view, a cast copy) reach
            # dynamo as closure inputs, which CUDA graphs copy into place before every
            # replay unless marked static (dozens of copies a run in GPT-2).
            for s in plan.steps:
                for t in _held_tensors(s.fn):
                    if t.is_cuda:
                        torch._dynamo.mark_static_address(t)
        compiled = [False]
        cuda = self.is_cuda

        def run(inputs: list) -> list:
            # Freezing needs no_grad (not inference_mode) to fold and prepack weights.
            # Programs are keyed by input signature already, so once one has run, dynamo's
            # guard checks (over all the weights) are redundant. The options are read
            # only while compiling: patching them on every run would cost more.
            try:
                if compiled[0]:
                    with torch.no_grad(), torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                        out = fn(*inputs)
                else:
                    with torch.no_grad(), inductor_config.patch(options):
                        out = fn(*inputs)
            except Exception as e:
                if compiled[0]:
                    raise
                msg = str(e).strip().splitlines()
                failed = CompileFailed(_at_layer(prog, e) + f"torch.compile failed ("
                                       f"{type(e).__name__}: {msg[0] if msg else ''})")
                failed.step = prog.failing_step(e)
                raise failed from e
            compiled[0] = True
            if cuda:  # CUDA-graph outputs are overwritten by the next replay
                return [o.clone() if isinstance(o, _TENSOR) else o for o in out]
            return list(out)
        return run

    def last_run_stats(self) -> RunStats | None:
        """Stats of this thread's last run (any thread's, if this one has not run)."""
        return getattr(self._tls, "stats", None) or self._last


# -- helpers -------------------------------------------------------------------------------

class _NeverMatches:
    """A class no value is an instance of."""


class _FallbackContext(KernelContext):
    """The ctx a NumPy kernel sees on the torch backend: NumPy in, NumPy out, also for the
    subgraphs it runs (which themselves run on torch)."""

    __slots__ = ("owner",)

    def run(self, subgraph, inputs: list) -> list:
        be = self.owner
        st = be.stats()
        outs = subgraph.run([be.upload(x, st) for x in inputs], outer=self.env)
        return [be.download(x, st) for x in outs]


def _under_autocast(fn: Callable, args: tuple):
    """Under torch.autocast, a kernel that declined mixed float types (a bf16 activation,
    fp32 weights) runs again on fp32 inputs: the torch ops autocast lowers (conv, linear,
    matmul) still compute in the low type, the others in fp32, as in a PyTorch module."""
    floats = {a.dtype for a in args if isinstance(a, _TENSOR) and a.is_floating_point()}
    if len(floats) < 2 or not any(isinstance(a, _TENSOR) and torch.is_autocast_enabled(
            a.device.type) for a in args):
        return NotImplemented
    return fn(*(a.float() if isinstance(a, _TENSOR) and a.dtype in (torch.bfloat16,
                                                                    torch.float16) else a
                for a in args))


def _dtypes(args) -> str:
    return ", ".join(str(a.dtype).removeprefix("torch.") if hasattr(a, "dtype") else
                     type(a).__name__ for a in args)


_SWITCHES = {"lock": threading.Lock(), "runs": 0, "saved": []}
"""torch's TF32 switches for cuDNN and cuBLAS are process-wide: runs in flight share them,
and the caller's settings come back when the last one ends."""


def _switches() -> list[tuple[object, str]]:
    """(namespace, attribute) of each switch a CUDA run sets, in the API family the caller
    uses: torch refuses to read the older TF32 switches once the newer ones were set."""
    dnn, mm = torch.backends.cudnn, torch.backends.cuda.matmul
    out: list[tuple[object, str]] = []
    for older, newer in (((dnn, "allow_tf32"), [(dnn.conv, "fp32_precision"),
                                                 (dnn.rnn, "fp32_precision")]),
                         ((mm, "allow_tf32"), [(mm, "fp32_precision")])):
        try:
            getattr(*older)
            out.append(older)
        except RuntimeError:  # the per-operator switches (torch >= 2.9) are in use
            out += newer
    return out


def _wanted(attr: str, mode: str):
    """A switch's value for float32 products in ``mode``."""
    return mode if attr == "fp32_precision" else mode == "tf32"


_TORCH_THREADS = OneThread(torch.get_num_threads, torch.set_num_threads)
"""torch's intra-op threads, process-wide."""


@contextlib.contextmanager
def _cuda_run(mode: str):
    """A run on CUDA: inference mode, float32 products in ``mode`` ("ieee" or "tf32")."""
    with _SWITCHES["lock"]:
        found = _switches()
        if _SWITCHES["runs"] == 0:
            _SWITCHES["saved"] = [(ns, a, getattr(ns, a)) for ns, a in found]
        _SWITCHES["runs"] += 1
        for ns, a in found:
            setattr(ns, a, _wanted(a, mode))
    try:
        with torch.inference_mode():
            yield
    finally:
        with _SWITCHES["lock"]:
            _SWITCHES["runs"] -= 1
            if _SWITCHES["runs"] == 0:
                for ns, a, v in _SWITCHES["saved"]:
                    setattr(ns, a, v)


def _at_layer(prog: Program, e: BaseException) -> str:
    """"layer 'NAME' (OpType): " for the step of ``prog`` whose kernel raised ``e`` while
    it was traced (a value read on the host, say), or "" when no step's line did."""
    step = prog.failing_step(e)
    if step is None:
        return ""
    why = " reads a value computed from the data on the host" \
        if "DataDependent" in type(e).__name__ else ""
    return f"layer {step.node.name or '(unnamed)'!r} ({step.node.op_type}){why}: "


def _naming_layer(prog: Program, run: Callable[[list], list]) -> Callable[[list], list]:
    """``run`` whose compile failure names the layer it failed at, when one did."""
    def named(inputs: list) -> list:
        try:
            return run(inputs)
        except CompileFailed as e:
            where = "" if e.__cause__ is None else _at_layer(prog, e.__cause__)
            if not where:
                raise
            failed = CompileFailed(where + str(e))
            failed.step = prog.failing_step(e.__cause__)
            raise failed from e.__cause__
    return named


def _with_ctx(fn: Callable, wants_ctx: bool) -> Callable:
    return fn if wants_ctx else (lambda ctx, *args: fn(*args))


def _host_step(node) -> bool:
    outs = [v for v in node.outputs if v is not None]
    return bool(outs) and all(v.meta.get("host") for v in outs)


def _held_tensors(fn, depth: int = 6) -> list:
    """The tensors a prepared kernel keeps: those in its closure, in the closures of the
    functions it keeps, and in lists, tuples and dicts of them."""
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()

    def walk(x, d: int) -> None:
        if isinstance(x, _TENSOR):
            found[id(x)] = x
        elif d == 0 or id(x) in seen:
            return
        elif isinstance(x, (list, tuple)):
            seen.add(id(x))
            for y in x:
                walk(y, d - 1)
        elif isinstance(x, dict):
            seen.add(id(x))
            for y in x.values():
                walk(y, d - 1)
        elif getattr(x, "__closure__", None):
            seen.add(id(x))
            for cell in x.__closure__:
                try:
                    walk(cell.cell_contents, d - 1)
                except ValueError:  # a cell not filled yet
                    pass
    walk(fn, depth)
    return list(found.values())


def _signature(inputs: list) -> tuple | None:
    if not all(isinstance(x, _TENSOR) for x in inputs):
        return None
    return tuple((tuple(x.shape), x.dtype, x.device) for x in inputs)


_CONTROL = "control flow, decided on the host; its subgraphs are compiled in parts"

_AFTER_CONVT = ("a constant applied to a ConvTranspose's output: inductor's freezing "
                "folds it into the ConvTranspose's weights along the input channels")
_FOLDED_BY_INDUCTOR = frozenset({"Add", "Sub", "Mul", "Div", "BatchNormalization"})


def _after_conv_transpose(step, consts: dict) -> bool:
    """Whether ``step`` applies a constant to a ConvTranspose's output. Inductor's binary
    folding (with frozen weights) folds such an Add/Sub/Mul/Div into the convolution as if
    it were a plain one, along the weights' first axis, which for a transposed convolution
    is the input channels: an error when the channel counts differ ("expected bias to be
    1-dimensional", PaddleOCR's detector) and silently wrong results when they do not (a
    per-channel Mul). Run eagerly, the step reads the ConvTranspose's output as a program
    output, which nothing folds."""
    node = step.node
    if node.op_type not in _FOLDED_BY_INDUCTOR or node.domain not in ("", "ai.onnx"):
        return False
    ins = [v for v in step.inputs if v is not None]
    return any(v in consts for v in ins) and any(
        v not in consts and v.producer is not None and
        v.producer.op_type == "ConvTranspose" for v in ins)


def _blocker(step, consts: dict) -> str:
    """Why ``step`` cannot be part of a compiled program ("" when it can)."""
    if step.subplans:
        return _CONTROL if step.node.op_type in ("If", "Loop", "Scan") else \
            f"{step.placement} (its body is compiled in parts)"
    if step.placement not in ("torch", "torch-generic") or step.transfers is not None:
        return f"no torch kernel ({step.placement})"
    if _after_conv_transpose(step, consts):
        return _AFTER_CONVT
    for v in (*step.inputs, *step.outputs):
        if v is None:
            continue
        if v in consts and not isinstance(consts[v], _TENSOR):
            return "a constant of a type torch lacks"
        if not isinstance(v.type, TensorType) or v.type.dtype not in TORCH_OF:
            return "values of a type torch lacks (sequences, strings)"
    return ""


def _compile_blockers(plan) -> str:
    """Why ``plan`` cannot be one torch program ("" when it can)."""
    blockers = sorted({f"{s.node.op_type} ({s.placement})" for s in plan.steps
                       if s.placement not in ("torch", "torch-generic") or s.subplans})
    blockers += sorted({f"{s.node.op_type} after a ConvTranspose" for s in plan.steps
                        if _after_conv_transpose(s, plan.consts)})
    numpy_consts = [v.name for v, t in plan.consts.items() if not isinstance(t, _TENSOR)]
    return ", ".join(blockers + [f"constant {n} has a type torch lacks"
                                 for n in numpy_consts[:3]])


def as_torch(x):
    """An output as a torch tensor (as is when it already is one); values of types torch
    lacks (strings...) stay NumPy."""
    if isinstance(x, list):
        return [as_torch(e) for e in x]
    if x is None or isinstance(x, _TENSOR):
        return x
    t = to_torch(np.asarray(x))
    return np.asarray(x) if t is None else t
