"""The tools people look at: ``inspect`` a model, ``profile`` it layer by layer,
``bench`` it (optionally against onnxruntime), an HTML ``report``, and ``tune`` it (the
fastest way to run it here within an accuracy budget). Each returns a
data object; the ``kiln`` command line only formats them."""

from kiln.tools.benchmark import BenchResult, Stats, bench
from kiln.tools.html_report import HtmlReport, report
from kiln.tools.profiling import LayerTime, OpTotal, Profile, profile
from kiln.tools.summary import LayerInfo, ModelSummary, TensorInfo, inspect
from kiln.tools.tune import TuneResult, tune

__all__ = ["BenchResult", "HtmlReport", "LayerInfo", "LayerTime", "ModelSummary", "OpTotal",
           "Profile", "Stats", "TensorInfo", "TuneResult", "bench", "inspect", "profile",
           "report", "tune"]
