"""The HTML report in a real headless Chromium (Debian's ``chromium`` and
``chromium-driver``, installed by scripts/install_test_deps.sh): no console errors, one
``.layer`` box per node after the page's script ran, clicking a box fills the side panel,
and a screenshot is taken. (The README's picture comes from scripts/report_screenshot.py.)
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper
from test_cli import tiny_cnn

import kiln
from conftest import LIGHT_DIR, make_model
from kiln import tools

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed "
                                "(pip install -e '.[test]')")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1400,900"]

pytestmark = [
    pytest.mark.skipif(CHROMIUM is None or CHROMEDRIVER is None,
                       reason="Chromium and chromedriver are not installed; run "
                              "scripts/install_test_deps.sh (apt: chromium chromium-driver)"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
]


@pytest.fixture(scope="module")
def browser():
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    for f in FLAGS:
        opts.add_argument(f)
    profile = tempfile.mkdtemp(prefix="kiln-chromium-")
    opts.add_argument(f"--user-data-dir={profile}")
    opts.binary_location = CHROMIUM
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # An explicit driver path: Selenium must not try to download one (no network in CI).
    driver = webdriver.Chrome(options=opts, service=Service(CHROMEDRIVER))
    driver.set_page_load_timeout(120)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


def open_report(browser, path: Path) -> None:
    browser.get(path.resolve().as_uri())
    browser.get_log("browser")  # drop anything from earlier pages


def console_errors(browser) -> list[dict]:
    return [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]


def layer_count(browser) -> int:
    return browser.execute_script("return document.querySelectorAll('.layer').length")


def click_layer(browser, index: int) -> str:
    browser.execute_script(
        "document.querySelectorAll('g.node')[arguments[0]]"
        ".dispatchEvent(new MouseEvent('click', {bubbles: true}))", index)
    return browser.find_element("id", "panel").text


def test_tiny_model_report(browser, tmp_path):
    """Profiled when the kernels exist (layers colored by time), else as the file is."""
    src = tmp_path / "tiny.onnx"
    onnx.save(tiny_cnn(), str(src))
    profiled = not tools.inspect(str(src)).unsupported
    page = tmp_path / "tiny.html"
    tools.report(str(src), page, profile=profiled, runs=2)
    graph = (kiln.InferenceSession(str(src)).model if profiled else kiln.load(str(src))).graph
    open_report(browser, page)
    assert browser.execute_script("return document.body.dataset.ready") == str(len(graph.nodes))
    assert layer_count(browser) == len(graph.nodes)
    assert browser.execute_script("return document.querySelectorAll('.edge').length") > 0
    text = click_layer(browser, 0)
    assert graph.nodes[0].name in text and "attributes" in text
    if profiled:
        assert "ms" in text and "% of run" in text
        bars = browser.execute_script("return document.querySelectorAll('.bars .bar').length")
        assert bars == len({n.op_type for n in graph.nodes})
    # search: type an op name and press Enter -> that layer is selected and shown
    box = browser.find_element("id", "search")
    box.send_keys(graph.nodes[-1].op_type + "\n")
    sel = browser.execute_script("return document.querySelector('g.node.selected')"
                                 ".getAttribute('data-index')")
    assert graph.nodes[int(sel)].op_type == graph.nodes[-1].op_type
    browser.find_element("id", "zoom-out").click()
    assert console_errors(browser) == []
    shot = tmp_path / "report.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000


def test_few_hundred_nodes_report(browser, tmp_path):
    """A 237-node model (Inception v1, unprofiled: no kernel needed) loads cleanly and the
    graph scrolls inside its pane."""
    src = os.path.join(LIGHT_DIR, "light_inception_v1.onnx")
    if not os.path.exists(src):
        pytest.skip("onnx's light models are not installed")
    n_nodes = len(onnx.load(src).graph.node)
    page = tmp_path / "inception.html"
    tools.report(src, page)
    open_report(browser, page)
    assert layer_count(browser) == n_nodes
    scroll = browser.execute_script(
        "var s = document.getElementById('graph-scroll');"
        "return [s.scrollHeight, s.clientHeight, getComputedStyle(s).overflowY];")
    assert scroll[0] > scroll[1] and scroll[2] == "auto"
    text = click_layer(browser, n_nodes - 1)
    assert "outputs" in text
    assert console_errors(browser) == []
    assert browser.save_screenshot(str(tmp_path / "inception.png"))


def relu_chain(n: int) -> onnx.ModelProto:
    """x -> Relu x ``n`` -> Softmax: one op type with many layers, so a long count."""
    names = ["x", *[f"r{i}" for i in range(n)]]
    nodes = [helper.make_node("Relu", [a], [b], name=f"relu{i}")
             for i, (a, b) in enumerate(zip(names, names[1:]))]
    nodes.append(helper.make_node("Softmax", [names[-1]], ["y"], name="softmax", axis=-1))
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 256])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64, 256])])


# Every text of the bar charts as the browser laid it out: (text, left, right) in the
# chart's own coordinates, the chart's drawn width, and the chart's box against the
# column it sits in (on the page, in CSS pixels).
_CHART_GEOMETRY = """
var out = [];
document.querySelectorAll('svg.bars').forEach(function (svg) {
  var vb = svg.viewBox.baseVal;
  var left = vb && vb.width ? vb.x : 0;
  var right = vb && vb.width ? vb.x + vb.width : svg.width.baseVal.value;
  var texts = [];
  svg.querySelectorAll('text').forEach(function (t) {
    var b = t.getBBox();
    texts.push([t.textContent, b.x, b.x + b.width]);
  });
  var box = svg.getBoundingClientRect(), col = svg.parentElement.getBoundingClientRect();
  out.push({left: left, right: right, texts: texts, box: [box.left, box.right],
            column: [col.left, col.right]});
});
return out;
"""


@pytest.mark.parametrize("window", [(1400, 900), (900, 900)], ids=["wide", "narrow"])
def test_bar_chart_labels_fit(browser, tmp_path, window):
    """The "time by op type" value texts ("0.422 ms · 74.9% · ×117") are drawn whole: every
    text of the chart lies inside the chart's drawing, and the chart inside its column.
    (The text after the longest bar was cut at the chart's edge, "×17" shown as "×1";
    117 layers make the count long enough to be cut whatever the font.)"""
    src = tmp_path / "relus.onnx"
    onnx.save(relu_chain(117), str(src))
    if tools.inspect(str(src)).unsupported:
        pytest.skip("Relu/Softmax kernels are missing")
    page = tmp_path / "relus.html"
    tools.report(str(src), page, profile=True, runs=2, optimize=False)  # keep every Relu
    browser.set_window_size(*window)
    try:
        open_report(browser, page)
        charts = browser.execute_script(_CHART_GEOMETRY)
    finally:
        browser.set_window_size(1400, 900)
    assert len(charts) == 1
    chart = charts[0]
    values = [t for t in chart["texts"] if "×" in t[0]]
    assert any(t[0].endswith("×117") for t in values), values
    for text, lo, hi in chart["texts"]:
        assert chart["left"] <= lo and hi <= chart["right"] + 0.5, \
            f"{text!r} spans {lo:.1f}..{hi:.1f}, the chart {chart['left']}..{chart['right']}"
    assert chart["column"][0] - 0.5 <= chart["box"][0] and \
        chart["box"][1] <= chart["column"][1] + 0.5, chart
    assert console_errors(browser) == []
