"""Every zoo model runs on Kiln's NumPy backend and matches onnxruntime's reference outputs
(stored beside the model when it was built) within the model's stated tolerance. Models are
built on demand by conftest's ``zoo_model`` fixture."""

import numpy as np
import pytest

zoo = pytest.importorskip("kiln.zoo")
pytest.importorskip("torch")

import kiln  # noqa: E402

# The big ones take tens of seconds to build and run on 2 cores: kept out of the CI run.
_SLOW = {"vgg16", "resnet50"}
_NAMES = [e.name for e in zoo.list_models()]


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in _SLOW else n
                                  for n in _NAMES])
@pytest.mark.parametrize("optimize", [False, True], ids=["plain", "optimized"])
def test_zoo_model_matches_onnxruntime(name, optimize, zoo_model):
    path = zoo_model(name)
    inputs, expected, meta = zoo.load_reference(name)
    sess = kiln.InferenceSession(str(path), optimize=optimize)
    names = [o.name for o in sess.get_outputs()]
    got = sess.run(None, dict(inputs))
    for n, g in zip(names, got):
        np.testing.assert_allclose(g, expected[n], err_msg=f"{name}:{n}", **meta["tolerance"])

