#!/usr/bin/env python3
"""Opens the saved tutorial notebooks in JupyterLab in headless Chromium and checks what a reader sees.

    .venv-browser/bin/python scripts/browser-check.py [SCREENSHOT_DIR] [--notebook PATH ...]

Cost (this 2-core machine): a cold `scripts/setup-browser.sh` (apt-get chromium + the venv) takes
~50 s; a warm run of this check ~50 s (JupyterLab's start, then 7 notebooks x 4 views).

The notebooks are opened as they are saved (no kernel runs: their outputs were written by
`scripts/run-notebooks.py --write`) and UNTRUSTED, as a user who clones the repository sees them:
JupyterLab's sanitizer then drops `<style>` elements and inline SVG and keeps only the inline
`style=` declarations it knows. Each notebook is checked in the light and the dark theme, in a
1400 px wide window and in a 1440x900 laptop window, with DOM queries:

  - the views each notebook is expected to show are there and visible: chat transcripts
    (trajectory views), groups, reward tables, charts;
  - reward tables: long text columns (an answer, a RULER explanation) are at least TEXT_COL_MIN_PX
    wide and that much of them is on screen, no header is wider than HEADER_MAX_PX unless its
    column holds long text (long names wrap), and headers cannot be lost: sticky where the
    sanitizer keeps it (trusted), else no scrolling box of the table's own and, for tall
    tables, the header repeated below the last row (JupyterLab 4.6 drops an inline
    `position:sticky`);
  - groups: the trajectories wrap inside the cell instead of overflowing sideways, and equal
    rewards share a rank;
  - charts: the PNG is present, drawn at twice its displayed size (sharp on HiDPI screens) and
    has no opaque white box around it (the dark theme shows through);
  - no output is JupyterLab's placeholder for untrusted content, a bare `()`, or `Some("...")`.

Screenshots of each checked view go to SCREENSHOT_DIR (default target/browser-screenshots).
JupyterLab listens on 127.0.0.1 with a random token and is stopped at the end; Chromium gets a
fresh profile and flags that keep it off the network.
"""

import argparse
import base64
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from playwright.sync_api import sync_playwright

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHROMIUM = os.environ.get("ART_CHROMIUM", "/usr/bin/chromium")
NOTEBOOKS = [
    "notebooks/01-quickstart.ipynb",
    "notebooks/02-reward-prototyping.ipynb",
    "notebooks/03-grpo-training.ipynb",
    "notebooks/04-ruler.ipynb",
    "notebooks/05-tool-agent.ipynb",
    "notebooks/06-remote-backend.ipynb",
    "art-kernel/examples/display-tour.ipynb",
]
# What each notebook must show (kinds of views, see VIEWS below).
EXPECTED = {
    "01-quickstart": {"transcript", "group", "table"},
    "02-reward-prototyping": {"transcript", "table", "chart"},
    "03-grpo-training": {"group", "training", "chart"},
    "04-ruler": {"group", "table", "ruler"},
    "05-tool-agent": {"transcript", "group", "table"},
    "06-remote-backend": {"training"},
    "display-tour": {"transcript", "group", "chart"},
}
VIEWS = [  # (name, width, height)
    ("w1400", 1400, 1100),
    ("laptop", 1440, 900),
]
THEMES = [("light", "JupyterLab Light"), ("dark", "JupyterLab Dark")]
TEXT_COL_MIN_PX = 180
FOOTER_ROWS = 12  # art-core's display/table.rs: taller tables repeat their header below
HEADER_MAX_PX = 200
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]
# User settings for the fresh JupyterLab: no news or update checks (they ask first, covering the
# page), every cell rendered (windowing would leave off-screen outputs out of the DOM).
SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false",
        "checkForUpdates": False,
    },
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
}

# Runs in the page on the open notebook's node: everything measured, as JSON.
MEASURE = r"""
(node) => {
  const visible = (el) => { const r = el.getBoundingClientRect(); return r.width > 20 && r.height > 5; };
  const outputs = [...node.querySelectorAll('.jp-OutputArea-output')];
  const outRight = (el) => el.closest('.jp-OutputArea-output').getBoundingClientRect().right;
  const r = {transcripts: 0, groups: [], tables: [], charts: [], training: 0, ruler: 0,
             unit: 0, some: [], untrusted: 0, styleTags: node.querySelectorAll('.jp-OutputArea-output style').length};
  for (const out of outputs) {
    const text = out.innerText.trim();
    if (text === '()') r.unit++;
    if (/\bSome\("/.test(text)) r.some.push(text.slice(0, 80));
    if (/untrusted/i.test(text) && !out.querySelector('.art-root')) r.untrusted++;
  }
  for (const card of node.querySelectorAll('.art-root > .art-card')) {
    if (!card.querySelector(':scope > .art-cols') && card.querySelector('.art-msg') && visible(card)) r.transcripts++;
  }
  r.ruler = [...node.querySelectorAll('.art-note')].filter(visible).length;
  for (const cols of node.querySelectorAll('.art-cols')) {
    const cards = [...cols.querySelectorAll(':scope > .art-col')];
    const right = Math.max(...cards.map((c) => c.getBoundingClientRect().right));
    const ranks = cards.map((c) => {
      const rank = [...c.querySelectorAll('.art-chip')].map((e) => e.innerText.match(/^rank (\d+)/)).find((m) => m);
      const reward = [...c.querySelectorAll('.art-badge')].map((e) => e.innerText.match(/^reward ([-0-9.e]+)/)).find((m) => m);
      return [reward ? parseFloat(reward[1]) : null, rank ? parseInt(rank[1]) : null];
    });
    r.groups.push({cards: cards.length, visible: visible(cols), scrollWidth: cols.scrollWidth,
                   clientWidth: cols.clientWidth, right, outRight: outRight(cols),
                   minCardWidth: Math.min(...cards.map((c) => c.getBoundingClientRect().width)), ranks});
  }
  for (const table of node.querySelectorAll('table.art-table')) {
    const heads = [...table.querySelectorAll('thead th')];
    const first = table.querySelector('tbody tr');
    const cells = first ? [...first.children] : [];
    const rows = [...table.querySelectorAll('tbody tr')];
    const longText = heads.map((_, i) => rows.some((row) => {
      const td = row.children[i];
      return td && td.classList.contains('art-str') && td.innerText.length > 40;
    }));
    const wrap = table.closest('.art-table-wrap');
    const wrapRight = wrap ? wrap.getBoundingClientRect().right : Infinity;
    r.tables.push({
      visible: visible(table),
      columns: heads.map((th, i) => ({name: th.innerText.split('\n')[0].replace(/\s/g, ''),
        width: Math.round(th.getBoundingClientRect().width), longText: longText[i],
        shownPx: Math.round(Math.min(th.getBoundingClientRect().right, wrapRight) - th.getBoundingClientRect().left),
        position: getComputedStyle(th).position})),
      rows: rows.length,
      footer: !!table.querySelector('tfoot th'),
      innerScroll: wrap ? wrap.scrollHeight > wrap.clientHeight + 1 : false,
    });
  }
  r.trainingViews = [...node.querySelectorAll('.art-progress')].filter((p) => p.querySelector('.art-badge') && visible(p)).map((p) => ({
      text: p.innerText.slice(0, 120), charts: [...p.querySelectorAll('img.art-chart')].map((i) => i.src)}));
  for (const img of node.querySelectorAll('.jp-RenderedImage img')) {
    let corner = null;
    try {
      const c = document.createElement('canvas');
      c.width = img.naturalWidth; c.height = img.naturalHeight;
      const ctx = c.getContext('2d');
      ctx.drawImage(img, 0, 0);
      corner = [...ctx.getImageData(2, 2, 1, 1).data];
    } catch (e) { corner = String(e); }
    r.charts.push({visible: visible(img), naturalWidth: img.naturalWidth, width: img.getBoundingClientRect().width,
                   corner, right: img.getBoundingClientRect().right, outRight: outRight(img)});
  }
  return r;
}
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_lab(tmp, port, token):
    """JupyterLab on 127.0.0.1 with its own config, data, settings and runtime dirs: no kernelspec
    or notebook signature of this user leaks in, so the notebooks open untrusted."""
    settings = os.path.join(tmp, "settings")
    for name, value in SETTINGS.items():
        path = os.path.join(settings, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(value, f)
    env = dict(os.environ)
    for var, sub in [("JUPYTER_CONFIG_DIR", "config"), ("JUPYTER_DATA_DIR", "data"),
                     ("JUPYTER_RUNTIME_DIR", "runtime"), ("IPYTHONDIR", "ipython")]:
        env[var] = os.path.join(tmp, sub)
    env.pop("JUPYTER_PATH", None)
    lab = os.path.join(os.path.dirname(sys.executable), "jupyter-lab")
    log = open(os.path.join(tmp, "jupyterlab.log"), "w")
    proc = subprocess.Popen(
        [lab, "--no-browser", "--ip=127.0.0.1", f"--port={port}", "--port-retries=0",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={ROOT}",
         "--LabApp.expose_app_in_browser=True", f"--LabApp.user_settings_dir={settings}",
         f"--LabApp.workspaces_dir={os.path.join(tmp, 'workspaces')}",
         "--ServerApp.allow_remote_access=False", "--LabApp.extension_manager=readonly",
         *(["--allow-root"] if os.geteuid() == 0 else [])],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}/api/status?token={token}"
    deadline = time.time() + 90
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"JupyterLab exited: see {log.name}")
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return proc
        except OSError:
            time.sleep(0.3)
    stop_lab(proc)
    raise RuntimeError("JupyterLab did not answer within 90 s")


def stop_lab(proc):
    """Ends JupyterLab and whatever it started (its own process group)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class Checker:
    def __init__(self, shots):
        self.shots = shots
        self.failures = []
        self.passed = 0

    def check(self, ok, where, what):
        if ok:
            self.passed += 1
        else:
            self.failures.append(f"{where}: {what}")
            print(f"  FAIL {where}: {what}")

    def notebook(self, page, path, view, theme):
        name = os.path.splitext(os.path.basename(path))[0]
        where = f"{name} [{view}, {theme}]"
        page.evaluate("(p) => window.jupyterapp.commands.execute('docmanager:open', {path: p, factory: 'Notebook'}).then(() => null)", path)
        dismiss_kernel_dialog(page)
        panel = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden)").first
        panel.locator(".jp-OutputArea-output").first.wait_for(timeout=30000)
        # Images decode asynchronously: wait until every one has its size.
        page.wait_for_function(
            "() => [...document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) img')].every((i) => i.complete)",
            timeout=15000)
        m = panel.evaluate(MEASURE)
        expected = EXPECTED.get(name, set())
        kinds = {"transcript": m["transcripts"], "group": len(m["groups"]), "table": len(m["tables"]),
                 "chart": len(m["charts"]), "training": len(m["trainingViews"]), "ruler": m["ruler"]}
        for kind in sorted(expected):
            self.check(kinds[kind] > 0, where, f"no visible {kind} view")
        self.check(m["styleTags"] == 0, where, "a <style> element survived: the notebook is not untrusted")
        self.check(m["unit"] == 0, where, f"{m['unit']} output(s) print a bare ()")
        self.check(not m["some"], where, f"outputs print Option debug text: {m['some']}")
        self.check(m["untrusted"] == 0, where, f"{m['untrusted']} untrusted-content placeholder(s)")
        for i, g in enumerate(m["groups"]):
            self.check(g["scrollWidth"] <= g["clientWidth"] + 1 and g["right"] <= g["outRight"] + 1, where,
                       f"group {i} ({g['cards']} trajectories) overflows sideways: scroll {g['scrollWidth']} > "
                       f"{g['clientWidth']} px or right edge {g['right']:.0f} > {g['outRight']:.0f}")
            self.check(g["minCardWidth"] >= 240, where, f"group {i}: a trajectory card is {g['minCardWidth']:.0f} px wide")
            ranked = [(rw, rk) for rw, rk in g["ranks"] if rw is not None and rk is not None]
            for rw, rk in ranked:
                want = 1 + sum(1 for other, _ in ranked if other > rw)
                self.check(rk == want, where, f"group {i}: reward {rw} has rank {rk}, want {want} (ranks {g['ranks']})")
        for i, t in enumerate(m["tables"]):
            for c in t["columns"]:
                if c["longText"]:
                    self.check(c["width"] >= TEXT_COL_MIN_PX, where,
                               f"table {i}: text column `{c['name']}` is {c['width']} px wide (< {TEXT_COL_MIN_PX})")
                    self.check(c["shownPx"] >= TEXT_COL_MIN_PX, where,
                               f"table {i}: text column `{c['name']}` shows {c['shownPx']} px before the "
                               "table's right edge (pushed off-screen)")
                else:
                    self.check(c["width"] <= HEADER_MAX_PX, where,
                               f"table {i}: column `{c['name']}` is {c['width']} px wide (> {HEADER_MAX_PX})")
            # Untrusted, JupyterLab drops `position:sticky` (and the <style> that sets it when
            # trusted): the header must then never scroll away inside the table's own box, and
            # a tall table repeats it below its last row.
            sticky = all(c["position"] == "sticky" for c in t["columns"])
            self.check(sticky or not t["innerScroll"], where,
                       f"table {i}: headers are not sticky and the table scrolls inside its own box")
            self.check(sticky or t["rows"] <= FOOTER_ROWS or t["footer"], where,
                       f"table {i}: {t['rows']} rows, headers not sticky and not repeated below")
        for i, c in enumerate(m["charts"]):
            self.check(c["visible"] and c["naturalWidth"] > 0, where, f"chart {i} is not drawn")
            self.check(c["naturalWidth"] >= 1.9 * c["width"], where,
                       f"chart {i}: {c['naturalWidth']} px image shown at {c['width']:.0f} px (want 2x for HiDPI)")
            self.check(c["right"] <= c["outRight"] + 1, where, f"chart {i} runs past its cell")
            corner = c["corner"]
            opaque_white = isinstance(corner, list) and corner[3] > 200 and min(corner[:3]) > 235
            self.check(not (theme == "dark" and opaque_white), where, f"chart {i} draws a white box in the dark theme")
        for i, t in enumerate(m["trainingViews"]):
            for src in t["charts"]:
                dots = sparkline_points(src)
                self.check(dots >= 2, where, f"training view {i}: a sparkline of {dots} point(s)")
        # Screenshots: the notebook's first screen, then each kind of view once.
        base = os.path.join(self.shots, f"{name}-{view}-{theme}")
        page.screenshot(path=f"{base}.png")
        shots = 1
        for kind, selector in [("transcript", ".art-root > .art-card:not(:has(> .art-cols))"),
                               ("group", ".art-root > .art-card:has(> .art-cols)"),
                               ("table", ".art-table-wrap"), ("chart", ".jp-RenderedImage"),
                               ("training", ".art-progress:has(.art-badge)")]:
            found = panel.locator(selector)
            if found.count():
                found.first.scroll_into_view_if_needed()
                page.screenshot(path=f"{base}-{kind}.png")
                shots += 1
        print(f"  {where}: {kinds} -> {shots} screenshots")
        page.evaluate("() => window.jupyterapp.commands.execute('application:close-all').then(() => null)")


def sparkline_points(src):
    """The points of a training view's sparkline (an SVG data URL): its <circle> marks."""
    prefix = "data:image/svg+xml;base64,"
    if not src.startswith(prefix):
        return -1
    return base64.b64decode(src[len(prefix):]).decode().count("<circle")


def dismiss_kernel_dialog(page):
    """The notebooks ask for the ART kernel, which this JupyterLab does not have: choose none."""
    dialog = page.locator(".jp-Dialog")
    try:
        dialog.first.wait_for(timeout=4000)
    except Exception:
        return
    no_kernel = dialog.locator("button", has_text="No Kernel")
    if no_kernel.count():
        no_kernel.first.click()
    else:
        page.keyboard.press("Escape")
    dialog.first.wait_for(state="detached", timeout=5000)


def set_theme(page, theme):
    page.evaluate("(t) => window.jupyterapp.commands.execute('apputils:change-theme', {theme: t}).then(() => null)", theme)
    light = "true" if "Light" in theme else "false"
    page.wait_for_function(f"() => document.body.dataset.jpThemeLight === '{light}'", timeout=20000)
    page.wait_for_timeout(500)  # the theme's CSS applies after the flag


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("shots", nargs="?", default=os.path.join(ROOT, "target", "browser-screenshots"))
    parser.add_argument("--notebook", action="append", help="check only these (paths relative to the repo)")
    args = parser.parse_args()
    notebooks = args.notebook or NOTEBOOKS
    os.makedirs(args.shots, exist_ok=True)
    started = time.time()
    tmp = tempfile.mkdtemp(prefix="art-browser-")
    token = secrets.token_hex(24)
    port = free_port()
    checker = Checker(args.shots)
    lab = start_lab(tmp, port, token)
    try:
        print(f"JupyterLab on 127.0.0.1:{port} ({time.time() - started:.1f} s)")
        with sync_playwright() as p:
            context = p.chromium.launch_persistent_context(
                os.path.join(tmp, "chromium-profile"), executable_path=CHROMIUM, headless=True,
                args=CHROMIUM_FLAGS, viewport={"width": VIEWS[0][1], "height": VIEWS[0][2]})
            page = context.pages[0] if context.pages else context.new_page()
            page.goto(f"http://127.0.0.1:{port}/lab?reset&token={token}")
            page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell", timeout=60000)
            page.locator(".jp-DirListing").first.wait_for(timeout=60000)
            for view, width, height in VIEWS:
                page.set_viewport_size({"width": width, "height": height})
                for theme, theme_name in THEMES:
                    set_theme(page, theme_name)
                    for path in notebooks:
                        checker.notebook(page, path, view, theme)
            context.close()
    finally:
        stop_lab(lab)
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{checker.passed} passed, {len(checker.failures)} failed ({time.time() - started:.0f} s; "
          f"screenshots in {args.shots})")
    sys.exit(1 if checker.failures else 0)


if __name__ == "__main__":
    main()
