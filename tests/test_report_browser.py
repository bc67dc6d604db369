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

import kiln
from conftest import LIGHT_DIR
from kiln import tools
from test_cli import tiny_cnn

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
