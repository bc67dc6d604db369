"""Screenshot of a `kiln report` page in headless Chromium (the picture in the README).

    python scripts/report_screenshot.py [MODEL] [-o docs/images/report.png] [--click N]

MODEL defaults to the zoo's shufflenetv2 (built on demand); the report is profiled.
Needs selenium, Debian's chromium and chromium-driver (scripts/install_test_deps.sh).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service

import kiln.tools

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1400,900", "--hide-scrollbars"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="shufflenetv2")
    ap.add_argument("-o", "--output", default="docs/images/report.png")
    ap.add_argument("--click", type=int, default=6, help="layer to select (panel shown)")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kiln-shot-"))
    page = work / "report.html"
    kiln.tools.report(args.model, page, profile=True, runs=args.runs)
    opts = webdriver.ChromeOptions()
    for f in FLAGS + [f"--user-data-dir={work / 'profile'}"]:
        opts.add_argument(f)
    opts.binary_location = shutil.which("chromium") or "chromium"
    driver = webdriver.Chrome(options=opts, service=Service(shutil.which("chromedriver")))
    try:
        driver.get(page.as_uri())
        driver.execute_script(
            "document.querySelectorAll('g.node')[arguments[0]]"
            ".dispatchEvent(new MouseEvent('click', {bubbles: true}))", args.click)
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(args.output)
    finally:
        driver.quit()
        shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
