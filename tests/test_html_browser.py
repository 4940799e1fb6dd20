"""The HTML report in a real headless browser (Chromium from the distribution's packages): the page
renders, its occupancy plot is drawn (pixels, not only markup), and it loads nothing from the network.

Chromium is driven through its own DevTools protocol over ``--remote-debugging-pipe`` (file
descriptors 3 and 4, NUL-separated JSON; no Playwright, no websocket library). The network check
reads the page's own requests (``Network.requestWillBeSent`` in the page's session): the browser's
background traffic (its clock, sign-in and component checks, which a logging proxy also sees and
cannot tell from the page's) is not the page's. A proxy that refuses everything and a host resolver
that resolves nothing keep even a failing page off the real network. Skipped, saying why, where no
Chromium is installed (``apt-get install chromium``; ``.ci/run`` installs it and runs ``-m browser``).
"""

import base64
import fcntl
import io
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
from cli_helpers import invoke

from kvaudit.reports.html_report import COLOURS

pytestmark = pytest.mark.browser

DATA = os.path.join(os.path.dirname(__file__), "data", "report")
BROWSER = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
needs_browser = pytest.mark.skipif(BROWSER is None, reason="no Chromium found (apt-get install chromium)")
FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
         "--no-default-browser-check", "--disable-extensions", "--disable-background-networking",
         "--proxy-server=127.0.0.1:9", "--proxy-bypass-list=<-loopback>", "--host-resolver-rules=MAP * ~NOTFOUND",
         "--remote-debugging-pipe"]
# runs the browser with the given pipe ends as its fds 3 and 4 (not sh's redirections: dash takes one-digit fds only)
ON_FDS_3_AND_4 = ("import os, sys; r, w = map(int, sys.argv[1:3]); os.dup2(r, 3); os.dup2(w, 4); os.close(r); "
                  "os.close(w); os.execv(sys.argv[3], sys.argv[3:])")
TIMEOUT_S = 10.0  # per page: start, load, evaluate, screenshot


class DevTools:
    """One Chromium over its DevTools pipe: ``call`` sends a command and returns its result; the
    events received meanwhile are kept in ``events`` as (sessionId, method, params)."""

    def __init__(self, user_data_dir: str):
        self._log = os.path.join(user_data_dir, "stderr.log")
        to_browser, self._w = os.pipe()
        self._r, from_browser = os.pipe()
        # the browser reads commands on fd 3 and writes replies and events on fd 4: the pipe ends go
        # to fds 10+ first, so that moving one to 3 or 4 cannot overwrite the other
        ends = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in (to_browser, from_browser)]
        os.close(to_browser)
        os.close(from_browser)
        with open(self._log, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", ON_FDS_3_AND_4, *map(str, ends),
                 BROWSER, *FLAGS, f"--user-data-dir={user_data_dir}", "about:blank"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, pass_fds=ends,
                start_new_session=True)  # its own process group: the renderers go with it
        for fd in ends:
            os.close(fd)
        self.deadline = time.monotonic() + TIMEOUT_S
        self.events: list[tuple] = []
        self._buf = b""
        self._id = 0

    def _message(self) -> dict:
        while b"\0" not in self._buf:
            left = self.deadline - time.monotonic()
            if left <= 0 or not select.select([self._r], [], [], left)[0]:
                raise TimeoutError(f"Chromium did not answer within {TIMEOUT_S} s{self._stderr()}")
            chunk = os.read(self._r, 1 << 20)
            if not chunk:
                raise RuntimeError(f"Chromium closed its DevTools pipe (exit {self.proc.poll()}){self._stderr()}")
            self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        return json.loads(raw)

    def _stderr(self) -> str:
        with open(self._log, errors="replace") as fh:
            return "; its stderr ends:\n" + "".join(fh.readlines()[-5:])

    def call(self, method: str, session: str | None = None, **params) -> dict:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params, **({"sessionId": session} if session else {})}
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        while True:
            m = self._message()
            if m.get("id") == self._id:
                assert "error" not in m, (method, m["error"])
                return m["result"]
            if "method" in m:
                self.events.append((m.get("sessionId"), m["method"], m.get("params", {})))

    def wait_for(self, session: str, method: str) -> dict:
        while True:
            for s, meth, params in self.events:
                if s == session and meth == method:
                    return params
            m = self._message()
            if "method" in m:
                self.events.append((m.get("sessionId"), m["method"], m.get("params", {})))

    def close(self):
        try:
            self.call("Browser.close")
        except (TimeoutError, RuntimeError, OSError, AssertionError):
            pass
        os.close(self._w)
        os.close(self._r)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


# what the page shows: its title and headline, and per plot its drawn marks and box on the page
PAGE_FACTS = """JSON.stringify({
  title: document.title,
  h1: document.querySelector('h1') && document.querySelector('h1').innerText,
  verdict: document.querySelector('.verdict') && document.querySelector('.verdict').innerText,
  plots: [...document.querySelectorAll('figure.plot svg')].map(svg => {
    const r = svg.getBoundingClientRect();
    return {x: r.left + scrollX, y: r.top + scrollY, width: r.width, height: r.height,
            marks: [...svg.querySelectorAll('path, rect, polygon, polyline, line')]
                   .filter(e => { const b = e.getBBox(); return b.width > 0 || b.height > 0; }).length};
  })})"""


def open_in_browser(path) -> dict:
    """Load ``path`` in a fresh headless Chromium: returns the page facts (PAGE_FACTS), ``requests``
    (every URL the page asked for, itself included) and ``plot_png`` (a screenshot of its first plot,
    or None). The browser profile is a temporary directory, removed after."""
    with tempfile.TemporaryDirectory(prefix="kvaudit-chromium-") as profile:
        browser = DevTools(profile)
        try:
            target = browser.call("Target.createTarget", url="about:blank")["targetId"]
            session = browser.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
            browser.call("Network.enable", session)
            browser.call("Page.enable", session)
            browser.call("Emulation.setDeviceMetricsOverride", session, width=1200, height=900,
                         deviceScaleFactor=1, mobile=False)
            browser.call("Page.navigate", session, url="file://" + os.path.abspath(path))
            browser.wait_for(session, "Page.loadEventFired")
            value = browser.call("Runtime.evaluate", session, expression=PAGE_FACTS, returnByValue=True)
            facts = json.loads(value["result"]["value"])
            facts["requests"] = [p["request"]["url"] for s, m, p in browser.events
                                 if s == session and m == "Network.requestWillBeSent"]
            facts["plot_png"] = None
            if facts["plots"]:
                box = {k: facts["plots"][0][k] for k in ("x", "y", "width", "height")}
                shot = browser.call("Page.captureScreenshot", session, format="png", captureBeyondViewport=True,
                                    clip={**box, "scale": 1})
                facts["plot_png"] = base64.b64decode(shot["data"])
        finally:
            browser.close()
    return facts


def network_loads(facts, path) -> list[str]:
    """The URLs the page requested other than its own file (inline ``data:`` URLs are no load)."""
    me = "file://" + os.path.abspath(path)
    return [u for u in facts["requests"] if u != me and not u.startswith("data:")]


def pixel_shares(png: bytes) -> dict[str, float]:
    """The share of the screenshot's pixels that are not white, and that have each plot colour
    (kvaudit.reports.html_report.COLOURS, exactly: the filled areas; edges are anti-aliased)."""
    import numpy as np
    from PIL import Image

    pixels = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).reshape(-1, 3)
    shares = {"not white": float((pixels != 255).any(axis=1).mean())}
    for term, hexcolour in COLOURS.items():
        rgb = np.array([int(hexcolour[i:i + 2], 16) for i in (1, 3, 5)])
        shares[term] = float((pixels == rgb).all(axis=1).mean())
    return shares


def assert_drawn(facts):
    """The first plot is on the page with its marks and, in pixels, its leaked band (a leak report's
    plot: far more than the legend's swatch of that colour), not a blank box."""
    assert facts["plots"], "no plot in the page"
    plot = facts["plots"][0]
    assert plot["width"] > 300 and plot["height"] > 100, plot
    assert plot["marks"] > 20, plot  # axes, ticks, the stacked areas, the lines
    shares = pixel_shares(facts["plot_png"])
    assert shares["not white"] > 0.05 and shares["leaked"] > 0.02, shares


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """The HTML report `kvaudit report --html` writes for the recorded hisparse leak (two findings,
    each with its occupancy timeline)."""
    out = tmp_path_factory.mktemp("browser") / "report.html"
    r = invoke("report", os.path.join(DATA, "hisparse-prebuilt-skip-finish.json"), "--html", str(out))
    assert r.exit_code == 0, r.output
    return out


@needs_browser
def test_the_report_renders_draws_its_plot_and_loads_nothing(report):
    facts = open_in_browser(report)
    assert facts["h1"] == "kvaudit report"
    assert facts["title"] == "kvaudit report: pd-decode-hisparse, 2 finding(s)"
    assert facts["verdict"].startswith("2 finding(s). First: ")
    assert len(facts["plots"]) == 2  # one per finding
    assert_drawn(facts)
    assert facts["requests"] == ["file://" + os.path.abspath(report)]  # the page saw its own load
    assert network_loads(facts, report) == []


@needs_browser
def test_the_checks_fail_on_a_page_that_loads_from_the_network_or_hides_its_plot(report, tmp_path):
    page = report.read_text()
    planted = tmp_path / "planted.html"
    planted.write_text(page.replace("<body>", '<body><img src="http://example.com/x.png">', 1))
    assert network_loads(open_in_browser(planted), planted) == ["http://example.com/x.png"]
    hidden = tmp_path / "hidden.html"
    hidden.write_text(page.replace("</style>", ".plot svg { visibility: hidden; }</style>", 1))
    facts = open_in_browser(hidden)
    with pytest.raises(AssertionError):
        assert_drawn(facts)  # its markup is all there; its pixels are not
    assert facts["plots"][0]["marks"] > 20
