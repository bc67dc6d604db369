"""The tools people look at: ``inspect`` a model, ``profile`` it layer by layer,
``bench`` it (optionally against onnxruntime), and an HTML ``report``. Each returns a
data object; the ``kiln`` command line only formats them."""

from kiln.tools.benchmark import BenchResult, Stats, bench
from kiln.tools.html_report import HtmlReport, report
from kiln.tools.profiling import LayerTime, OpTotal, Profile, profile
from kiln.tools.summary import LayerInfo, ModelSummary, TensorInfo, inspect

__all__ = ["BenchResult", "HtmlReport", "LayerInfo", "LayerTime", "ModelSummary", "OpTotal",
           "Profile", "Stats", "TensorInfo", "bench", "inspect", "profile", "report"]
