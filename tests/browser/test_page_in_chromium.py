"""Step 10 - the server's live page in a real browser: headless Chromium opens it while the
course's load generator runs against `python -m tinyllm serve`; the slots and blocks it draws
equal /metrics' at the same step; it is closed and opened again; the server restarts, and the
page says the engine is gone, then draws the new one. A screenshot of it serving is kept.

    make browser-check     # needs Debian's chromium and chromium-driver, and selenium (dev extra)

Not part of `make test`: it needs a browser the course's other tests do without.
"""

import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port, python_lines, run_serve

CHROMIUM, DRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
FLAGS = [  # headless, and quiet: this closed network refuses every connection it would open
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1360,1280",
]
SERVE = ["--kv", "paged", "--prefix-cache", "--slots", "16", "--max-step-tokens", "96"]

# waits for the page's next frame, then reads what it drew and asks /metrics from the page
NEXT_FRAME = """
const done = arguments[arguments.length - 1];
const root = document.getElementById("engine"), before = root.dataset.step;
const watch = new MutationObserver(async () => {
  if (root.dataset.step === before) return;
  watch.disconnect();
  const drawn = document.querySelectorAll("#slots .slot:not(.free)").length;
  const page = Object.assign({drawn}, root.dataset);
  done({page, metrics: await (await fetch("/metrics")).text()});
});
watch.observe(root, {attributes: true, attributeFilter: ["data-step"]});
setTimeout(() => { watch.disconnect(); done(null); }, 3000);
"""


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """Headless Chromium through selenium, with a fresh profile."""
    missing = [str(p) for p in (CHROMIUM, DRIVER) if not p.exists()]
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        missing.append("selenium (pip install -e '.[dev]')")
    if missing:
        why = f"needs {', '.join(missing)} (apt-get install -y chromium chromium-driver)"
        if os.environ.get("CI"):
            pytest.fail(f"CI runs the browser check, but it {why}")
        pytest.skip(why)
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in FLAGS + [f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(str(DRIVER)), options=options)
    yield driver
    driver.quit()


class Serving:
    """`python -m tinyllm serve` on port, until stop() (Ctrl-C, as a terminal sends it)."""

    def __init__(self, port: int):
        self.port, self.proc, self.lines = port, run_serve([*SERVE, "--port", str(port)]), []
        while not (self.lines and self.lines[-1].startswith("serving")):
            line = self.proc.stdout.readline()
            assert line, f"serve ended before it served: {''.join(self.lines)}"
            self.lines.append(line)
        self.base = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            out = self.proc.communicate(timeout=60)[0]
            assert "Traceback" not in out, out


def loadgen(base: str, workload: str, rate: str, requests: int):
    """The course's load generator against base, in a process of its own, its output read as
    it comes (into proc.lines): a pipe nobody reads fills, and the generator stops sending."""
    args = ["--url", f"{base}/v1", "--workload", workload, "--rate", rate]
    proc = python_lines(["-m", "tinyllm", "loadgen", *args, "--requests", str(requests)])
    proc.lines = []
    threading.Thread(target=proc.lines.extend, args=(proc.stdout,), daemon=True).start()
    return proc


def metric(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def open_page(browser, url: str) -> None:
    """The page in a tab of its own."""
    browser.switch_to.new_window("tab")
    browser.get(url)


def close_page(browser) -> None:
    """The page's tab closed, as a person closes it."""
    browser.close()
    browser.switch_to.window(browser.window_handles[0])


def page_state(browser) -> dict:
    """The page's data- attributes: its status, step, busy slots and counted blocks."""
    return browser.execute_script("return {...document.getElementById('engine').dataset}")


def wait_until(browser, condition, timeout=30.0) -> dict:
    """The page's state once condition(state) holds; fails after timeout seconds."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        state = page_state(browser)
        if condition(state):
            return state
        time.sleep(0.1)
    pytest.fail(f"the page did not get there in {timeout:.0f} s: {page_state(browser)}")


def drawn_against_metrics(browser, wanted: int = 5, timeout: float = 60.0) -> list[dict]:
    """Pairs of (what the page drew, /metrics) taken as each frame is drawn, until `wanted`
    pairs of a busy engine at the same step; a pair at the same step must agree."""
    browser.set_script_timeout(10)
    met, t0 = [], time.time()
    while len(met) < wanted and time.time() - t0 < timeout:
        got = browser.execute_async_script(NEXT_FRAME)
        if got is None:
            continue
        page, text = got["page"], got["metrics"]
        if int(page["step"]) != metric(text, "tinyllm_engine_steps") or not page["drawn"]:
            continue  # the engine stepped between the frame and /metrics: ask again
        at = f"at step {page['step']}: the page drew {page}"
        assert page["drawn"] == int(page["slotsBusy"]), at
        assert page["drawn"] == metric(text, "tinyllm_requests_running"), at
        assert int(page["blocksHeld"]) == metric(text, 'tinyllm_kv_blocks{state="held"}'), at
        assert int(page["blocksCached"]) == metric(text, 'tinyllm_kv_blocks{state="cached"}'), at
        met.append(page)
    assert len(met) >= wanted, f"only {len(met)} frames met /metrics at their step"
    return met


def test_the_live_page_draws_the_engine_as_metrics_sees_it(browser, tmp_path):
    """The page, open while the load generator runs, draws the busy slots and the held and
    cached blocks that /metrics counts at the same step; a screenshot of it is kept; closed,
    the engine builds no more frames, and opened again it is live; the server restarts on its
    port, the page says the engine is gone, then draws the new engine."""
    port = free_port()
    server = Serving(port)
    loads = []
    try:
        open_page(browser, server.base + "/")
        wait_until(browser, lambda s: s["status"] == "live")
        loads = [loadgen(server.base, "longtail", "8", 480)]  # a minute of arrivals
        wait_until(browser, lambda s: int(s["step"]) > 300)
        # requests that share a prefix, all at once: they fill the slots and share blocks
        # however fast the machine serves them (at a rate, a fast one serves them one by one)
        loads.append(loadgen(server.base, "shared-prefix", "inf", 48))
        wait_until(browser, lambda s: int(s["slotsBusy"]) >= 4 and int(s["blocksShared"]) > 0)
        drawn_against_metrics(browser)  # each frame that meets /metrics at its step agrees
        shot = tmp_path / "live-page.png"
        browser.save_screenshot(str(shot))
        if os.environ.get("LIVE_SCREENSHOT"):
            shutil.copy(shot, os.environ["LIVE_SCREENSHOT"])

        # closed: the engine stops building frames; opened again: live, and drawing
        close_page(browser)
        time.sleep(1.0)
        frames = metric(httpx.get(server.base + "/metrics").text, "tinyllm_live_frames")
        time.sleep(1.0)
        assert metric(httpx.get(server.base + "/metrics").text, "tinyllm_live_frames") == frames
        open_page(browser, server.base + "/engine")
        wait_until(browser, lambda s: s["status"] == "live" and int(s["step"]) > 0)
        for proc in loads:
            proc.wait(timeout=120)
        wait_until(browser, lambda s: s["slotsBusy"] == "0")

        # restarted: the page says the engine is gone, then draws the new one
        steps = int(page_state(browser)["step"])
        server.stop()
        wait_until(browser, lambda s: s["status"] == "gone", timeout=15)
        server = Serving(port)
        wait_until(browser, lambda s: s["status"] == "live" and int(s["step"]) < steps, 30)
        loads = [loadgen(server.base, "longtail", "inf", 4)]
        loads[0].wait(timeout=60)
        wait_until(browser, lambda s: int(s["step"]) > 0)
    finally:
        for proc in loads:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
        server.stop()
