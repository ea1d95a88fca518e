"""``noria report`` on a real (tiny) run, opened in headless Chromium: every plot must render.

The page is loaded over the DevTools protocol (aiohttp's websocket client), each ``<img>`` is
checked for a decoded image (naturalWidth > 0), and a full-page screenshot is cut at each image's
box and checked for real drawing (not blank). A copy with one broken and one blank plot must fail
the same check (same browser session), so the check itself is tested.

Needs Debian's ``chromium``: installed here with apt-get when missing and this user may (root or
passwordless sudo); otherwise the test fails and says how to install it. CPU only.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from noria.cli import main as noria_main
from noria.runview.report import FIGURES, ROUNDING_ZERO, SFT_FIGURES, lines, load_run, write_report
from repo_util import ROOT
from runview_util import STEPS, tiny_run

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
IMAGES_JS = """JSON.stringify([...document.images].map(i => { const r = i.getBoundingClientRect();
  return {alt: i.alt, complete: i.complete, width: i.naturalWidth, height: i.naturalHeight,
          x: r.left + window.scrollX, y: r.top + window.scrollY, w: r.width, h: r.height}; }))"""


def find_chromium() -> str | None:
    return next((p for name in BROWSERS if (p := shutil.which(name))), None)


def install_chromium() -> str:
    """The browser's path, installing Debian's chromium package first when missing and permitted."""
    found = find_chromium()
    if found:
        return found
    prefix = [] if os.geteuid() == 0 else ["sudo", "-n"]
    allowed = os.geteuid() == 0 or (shutil.which("sudo") and subprocess.run(["sudo", "-n", "true"], capture_output=True).returncode == 0)
    if allowed and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        install = [*prefix, "apt-get", "install", "-y", "-q", "chromium"]
        if subprocess.run(install, env=env, capture_output=True, timeout=1200).returncode != 0:
            subprocess.run([*prefix, "apt-get", "update", "-q"], env=env, capture_output=True, timeout=600)
            subprocess.run(install, env=env, capture_output=True, timeout=1200)
    found = find_chromium()
    if not found:
        pytest.fail("headless Chromium is needed to check the report: apt-get install chromium (Debian package)")
    return found


async def _cdp_render(browser: str, pages: list[Path], width: int = 1700) -> list[tuple[list[dict], bytes]]:
    """Per page: (its images as the browser decoded them, a full-page PNG screenshot); one browser."""
    import aiohttp

    profile = Path(tempfile.mkdtemp(prefix="noria-chromium-"))
    cmd = [browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           "--no-first-run", "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
           f"--user-data-dir={profile}", f"--window-size={width},1000", "about:blank"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.is_file() and port_file.read_text().strip()):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"chromium did not start (exit code {proc.poll()})")
            await asyncio.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/json/list") as r:
                target = next(t for t in await r.json() if t["type"] == "page")
            async with http.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                cdp = _Cdp(ws)
                await cdp.call("Page.enable")
                return [await _load_and_shoot(cdp, page) for page in pages]
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(profile, ignore_errors=True)


async def _load_and_shoot(cdp: _Cdp, page: Path) -> tuple[list[dict], bytes]:
    cdp.events.clear()
    await cdp.call("Page.navigate", {"url": page.resolve().as_uri()})
    await cdp.event("Page.loadEventFired")
    images = json.loads((await cdp.call("Runtime.evaluate", {"expression": IMAGES_JS, "returnByValue": True}))["result"]["value"])
    size = (await cdp.call("Page.getLayoutMetrics"))["cssContentSize"]
    clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
    shot = await cdp.call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True, "clip": clip})
    return images, base64.b64decode(shot["data"])


class _Cdp:
    """Minimal DevTools-protocol client: numbered calls, and waiting for one event."""

    def __init__(self, ws) -> None:
        self.ws, self.next_id, self.events = ws, 0, []

    async def call(self, method: str, params: dict | None = None) -> dict:
        self.next_id += 1
        await self.ws.send_json({"id": self.next_id, "method": method, "params": params or {}})
        while True:
            msg = await asyncio.wait_for(self.ws.receive_json(), 60)
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]
            self.events.append(msg.get("method"))

    async def event(self, method: str) -> None:
        while method not in self.events:
            msg = await asyncio.wait_for(self.ws.receive_json(), 60)
            self.events.append(msg.get("method"))


def plot_problems(images: list[dict], screenshot: bytes) -> list[str]:
    """What is wrong with each plot as rendered: not decoded, not laid out, or blank in the screenshot."""
    from PIL import Image, ImageStat

    shot = Image.open(io.BytesIO(screenshot)).convert("L")
    problems = []
    for img in images:
        if not img["complete"] or img["width"] == 0:
            problems.append(f"{img['alt']}: not decoded (naturalWidth {img['width']})")
            continue
        if img["w"] < 100 or img["h"] < 100:
            problems.append(f"{img['alt']}: laid out at {img['w']}x{img['h']} px")
            continue
        box = (round(img["x"]), round(img["y"]), round(img["x"] + img["w"]), round(img["y"] + img["h"]))
        region = shot.crop(box)
        inked = sum(region.point(lambda v: 255 if v < 200 else 0).histogram()[255:])
        if ImageStat.Stat(region).stddev[0] < 10 or inked < 0.01 * region.width * region.height:
            problems.append(f"{img['alt']}: blank in the screenshot ({inked} dark pixels)")
    return problems


def render_in_browser(*pages: Path) -> list[tuple[list[dict], bytes]]:
    return asyncio.run(_cdp_render(install_chromium(), list(pages)))


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model_dir) -> Path:
    return tiny_run(tmp_path_factory, tiny_model_dir)


def test_report_renders_every_plot_in_chromium(run, tmp_path, capsys):
    assert noria_main(["report", str(run), "--out", str(tmp_path / "report")]) == 0
    page = tmp_path / "report" / "report.html"
    assert str(page) in capsys.readouterr().out
    for spec in FIGURES:
        assert (tmp_path / "report" / f"{spec.slug}.png").stat().st_size > 5000
    text = page.read_text()
    assert "src='data:image/png;base64," in text and "<script" not in text  # one self-contained file
    assert "rollout_logprob_abs_diff" in text and "max_steps: 3" in text  # metric table and resolved config
    broken = broken_copy(page, tmp_path / "broken.html")
    (images, shot), (broken_images, broken_shot) = render_in_browser(page, broken)
    (tmp_path / "screenshot.png").write_bytes(shot)
    assert [i["alt"] for i in images] == [spec.title for spec in FIGURES]
    assert plot_problems(images, shot) == []
    # The same check fails on a copy whose first plot cannot be decoded and whose second is blank.
    problems = plot_problems(broken_images, broken_shot)
    assert len(problems) == 2, problems
    assert problems[0].startswith(f"{FIGURES[0].title}: not decoded") and problems[1].startswith(f"{FIGURES[1].title}: blank")


def broken_copy(page: Path, out: Path) -> Path:
    from PIL import Image

    blank = io.BytesIO()
    Image.new("RGB", (800, 360), "white").save(blank, format="PNG")
    text = page.read_text()
    uris = re.findall(r"data:image/png;base64,[A-Za-z0-9+/=]+", text)
    text = text.replace(uris[0], "data:image/png;base64,AAAA", 1)
    text = text.replace(uris[1], "data:image/png;base64," + base64.b64encode(blank.getvalue()).decode(), 1)
    out.write_text(text)
    return out


def test_report_data_comes_from_the_run(run):
    data = load_run(run)
    assert [r["step"] for r in data.steps] == list(range(1, STEPS + 1))
    assert [e["step"] for e in data.evals] == [0, 2, 3]
    assert sorted(data.sampled_nll) == [1, 2, 3] and all(v > 0 for v in data.sampled_nll.values())
    assert sorted(data.lengths) == [1, 2, 3] and all(0 < mean <= top <= 6 for mean, top in data.lengths.values())
    assert not data.sft and data.resumed_at == []
    for key in ("loss", "grad_norm", "lr", "clip_frac", "rollout/truncated_frac", "rollout/groups_zero_variance_frac"):
        assert data.series(key)[0] == [1, 2, 3], key  # every new RL plot has its data in a real run


def test_float_noise_around_zero_is_drawn_flat_with_a_note():
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    ax = Figure().add_subplot()
    noise = [3e-9, -2e-9, 5e-10]
    assert lines(ax, [("loss", ([1, 2, 3], noise)), ("reward", ([1, 2, 3], [0.1, 0.2, 0.4]))], "y", "none")
    flat, real = ax.get_lines()
    assert list(flat.get_ydata()) == [0.0, 0.0, 0.0] and list(real.get_ydata()) == [0.1, 0.2, 0.4]
    assert any("loss: 0 within rounding" in t.get_text() for t in ax.texts)
    ax = Figure().add_subplot()
    lines(ax, [("loss", ([1, 2], [10 * ROUNDING_ZERO, -ROUNDING_ZERO]))], "y", "none")  # a real signal stays
    assert list(ax.get_lines()[0].get_ydata()) == [10 * ROUNDING_ZERO, -ROUNDING_ZERO] and not ax.texts


def test_a_resumed_run_is_marked(run, tmp_path):
    from noria.metrics import RunLog

    copy = tmp_path / "resumed"
    shutil.copytree(run, copy)
    RunLog(copy, STEPS, start_step=2, progress=False).close()  # what a resumed noria train writes first
    data = load_run(copy)
    assert data.resumed_at == [2] and [r["step"] for r in data.steps] == list(range(1, STEPS + 1))
    # metrics.jsonl stays one row per step; the resume is an event beside it
    assert all("step" in json.loads(line) for line in (copy / "metrics.jsonl").read_text().splitlines())
    assert [e["event"] for e in map(json.loads, (copy / "events.jsonl").read_text().splitlines())][-1] == "resumed"
    page = write_report(copy, tmp_path / "out")
    assert "after step 2" in page.read_text()


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory, tiny_model_dir) -> Path:
    from noria.config import load_config
    from noria.launch.sft import run_sft as train

    folder = tmp_path_factory.mktemp("sft") / "run"
    config = load_config(ROOT / "examples/sft_tiny.yaml",
                         ["--model.path", str(tiny_model_dir), "--train.max_steps", "3", "--train.save_every", "0"])  # fmt: skip
    train(config, run_dir=str(folder), progress=False)
    return folder


def test_sft_report_has_its_own_plots_and_they_render(sft_run, tmp_path):
    data = load_run(sft_run)
    assert data.sft and [r["step"] for r in data.steps] == [1, 2, 3]
    page = write_report(sft_run, tmp_path / "report")
    for spec in SFT_FIGURES:
        assert (tmp_path / "report" / f"{spec.slug}.png").stat().st_size > 5000
    assert "loss (first / last steps)" in page.read_text()
    ((images, shot),) = render_in_browser(page)
    assert [i["alt"] for i in images] == [spec.title for spec in SFT_FIGURES]
    assert plot_problems(images, shot) == []


def test_report_of_a_folder_without_metrics_is_a_one_line_error(tmp_path, capsys):
    assert noria_main(["report", str(tmp_path)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


if __name__ == "__main__":  # screenshot of a report for the docs: PYTHONPATH=tests python tests/runview/test_report.py PAGE OUT.png
    ((images, shot),) = render_in_browser(Path(sys.argv[1]))
    Path(sys.argv[2]).write_bytes(shot)
    print(plot_problems(images, shot) or "every plot rendered")
