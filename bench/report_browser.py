"""A release report in a real browser: headless Chromium (Debian's ``chromium``) loads ``report.html`` and this
prints, as JSON, what the page gave: its console errors and uncaught exceptions, every image with whether it
decoded and its size, the number of tables, the section headings, and the model-card block.

    .venv/bin/python bench/report_browser.py runs/tiny/eval/report.html [--screenshot bench/report_screenshot.png]
        [--plots bench/report_plots.png]

``--screenshot`` keeps a PNG of the top of the page (title, model card, headline) at 1280 pixels wide, and
``--plots`` one of its first plots: the pictures the README shows. Playwright drives the browser (``executable_path``: no browser download); the page is opened from
its file, with no network. ``tests/test_report_browser.py`` runs this script.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

# Flags for a root, network-less, headless start (Debian's chromium tries background connections otherwise).
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]
WIDTH, SHOT_HEIGHT, PLOTS_HEIGHT = 1280, 1500, 1100

_IMAGES = """async () => Promise.all([...document.images].map(async (img) => {
    let decoded = true;
    try { await img.decode(); } catch (e) { decoded = false; }
    return {alt: img.alt, decoded: decoded && img.naturalWidth > 0, width: img.naturalWidth, height: img.naturalHeight};
}))"""


def inspect(page_path: Path, chromium: str, screenshot: Path | None = None, plots: Path | None = None) -> dict:
    from playwright.sync_api import sync_playwright

    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=FLAGS)
        page = browser.new_page(viewport={"width": WIDTH, "height": 900})
        page.on("console", lambda m: errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
        page.goto(page_path.resolve().as_uri(), wait_until="load")
        found = {
            "title": page.title(),
            "images": page.evaluate(_IMAGES),
            "tables": page.evaluate("() => document.querySelectorAll('table').length"),
            "headings": page.evaluate("() => [...document.querySelectorAll('h2')].map(h => h.textContent)"),
            "card": page.evaluate("() => { const c = document.querySelector('pre.card'); return c && c.textContent }"),
        }
        if screenshot is not None:
            page.set_viewport_size({"width": WIDTH, "height": SHOT_HEIGHT})
            page.screenshot(path=str(screenshot), clip={"x": 0, "y": 0, "width": WIDTH, "height": SHOT_HEIGHT})
        if plots is not None:  # the first figures, from the first one's top
            top = page.evaluate("() => document.querySelector('figure').getBoundingClientRect().top + window.scrollY")
            page.screenshot(path=str(plots), full_page=True,
                            clip={"x": 0, "y": top - 10, "width": WIDTH, "height": PLOTS_HEIGHT})
        browser.close()
    return {"errors": errors, **found}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("page", type=Path)
    parser.add_argument("--screenshot", type=Path)
    parser.add_argument("--plots", type=Path, help="a PNG of the first plots")
    parser.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    args = parser.parse_args()
    if not Path(args.chromium).is_file():
        sys.exit(f"report_browser: no chromium at {args.chromium} (apt-get install chromium)")
    print(json.dumps(inspect(args.page, args.chromium, args.screenshot, args.plots), indent=1))


if __name__ == "__main__":
    main()
