"""Writing trained modules back to ONNX: a KilnModule is its own graph with the current
weights; any other ``nn.Module`` holding one (``nn.Sequential(body, head)``, a user's
``class MyModel(nn.Module)`` with a body and a head) is exported with
``torch.onnx.export``, in which each KilnModule writes its own ONNX nodes
(:mod:`kiln.train.replay`) and the torch layers around it are traced."""

from __future__ import annotations

import io

import torch
from torch import nn

from kiln.errors import InputError
from kiln.ir import Model, plain_shape
from kiln.onnxio import load
from kiln.ops.torch.arrays import TORCH_OF
from kiln.train.module import KilnModule


def module_to_model(obj) -> Model | None:
    """The Model :func:`kiln.save` writes for ``obj``, or None when ``obj`` is not a module
    built on kiln.to_torch."""
    if isinstance(obj, KilnModule):
        return obj.kiln_model()
    if not isinstance(obj, nn.Module):
        return None
    bodies = [m for m in obj.modules() if isinstance(m, KilnModule)]
    if not bodies:
        return None
    if isinstance(obj, nn.Sequential) and len(obj) == 1:
        return bodies[0].kiln_model()
    return _traced(obj, bodies[0], max(b.kiln_graph_model.opset for b in bodies))


def _traced(obj: nn.Module, body: KilnModule, opset: int) -> Model:
    """``obj`` exported on inputs shaped as ``body``'s (the module must take those)."""
    sample, names, dynamic = [], [], {}
    for v in body.kiln_graph_model.graph.inputs:
        shape = plain_shape(v.type.shape) if v.type is not None and \
            getattr(v.type, "shape", None) is not None else None
        if shape is None:
            raise InputError(f"the shape of the Kiln module's input {v.name!r} is unknown, so "
                             f"{type(obj).__name__} cannot be traced for export; give the "
                             "model's inputs fixed or symbolic shapes")
        t = torch.zeros([d if isinstance(d, int) else 2 for d in shape],
                        dtype=TORCH_OF.get(getattr(v.type, "dtype", None), torch.float32))
        sample.append(t.to(next(body.buffers(), next(body.parameters(), t)).device))
        names.append(v.name)
        axes = {i: f"{v.name}_{i}" for i, d in enumerate(shape) if not isinstance(d, int)}
        if axes:
            dynamic[v.name] = axes
    modes = {m: m.training for m in obj.modules()}
    obj.eval()
    try:
        with torch.no_grad():
            out = obj(*sample)
        n_out = len(out) if isinstance(out, (tuple, list)) else 1
        outs = ["y"] if n_out == 1 else [f"y{i}" for i in range(n_out)]
        if any(0 in a for a in dynamic.values()):  # a batch dimension stays one
            dynamic.update({o: {0: "batch"} for o in outs})
        buf = io.BytesIO()
        torch.onnx.export(obj, tuple(sample), buf, dynamo=False, input_names=names,
                          output_names=outs, opset_version=max(opset, 7),
                          dynamic_axes=dynamic or None, do_constant_folding=False,
                          training=torch.onnx.TrainingMode.PRESERVE)
    except (TypeError, RuntimeError) as e:
        raise InputError(f"kiln.save traces {type(obj).__name__} on the Kiln module's inputs "
                         f"{names} and that failed ({type(e).__name__}: {e}); a module to save "
                         "must take the Kiln module's inputs and return tensors") from e
    finally:
        for m, was in modes.items():
            m.train(was)
    return load(buf.getvalue())
