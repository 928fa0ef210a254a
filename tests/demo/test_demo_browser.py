"""End to end in a real headless Chromium: `mmrl demo` on a free port with a tiny finished run
of each modality; in every tab, draw a held-out prompt, press Generate and wait for both the
before and the after samples; a screenshot of each tab is kept as a test artifact (and, with
MMRL_SCREENSHOT_DIR set, copied there: that is how docs/images/demo_*.png are made).

Needs the `demo` extra (Gradio), Playwright's Python package and a system Chromium (Debian's
`chromium`; .ci/run installs both). It skips, saying which is missing, only when they cannot
be had. No browser is downloaded: Playwright drives the system one."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("gradio", reason="the demo extra (Gradio) is not installed: pip install -e '.[demo]'")
sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright's Python package is not installed")

CHROMIUM = next((p for p in (os.environ.get("MMRL_CHROMIUM"), shutil.which("chromium"),
                             shutil.which("chromium-browser"), shutil.which("google-chrome")) if p), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on PATH (apt-get install chromium)")

TABS = {"vlm": "Vision-language", "diffusion": "Flow / diffusion", "dllm": "Diffusion LM"}


def field_id(modality: str) -> str:
    return {"vlm": "vlm-question", "diffusion": "diffusion-prompt", "dllm": "dllm-problem"}[modality]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_runs, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("demo_server") / "server.log"
    cmd = [sys.executable, "-m", "mmrl", "demo", "--port", str(port), "--no-train",
           *[a for m in ("vlm", "diffusion", "dllm") for a in ("--run", str(tiny_runs[m]))]]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.time() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"mmrl demo exited with {proc.returncode}:\n{log.read_text()}")
            try:
                urllib.request.urlopen(url, timeout=2)
                break
            except OSError:
                if time.time() > deadline:
                    pytest.fail(f"mmrl demo did not answer on {url} in 120 s:\n{log.read_text()}")
                time.sleep(0.5)
        # the address, once, and not Gradio's "To create a public link, set `share=True`": the
        # demo serves this machine alone
        time.sleep(0.5)
        said = log.read_text()
        assert f"demo at {url}" in said and "share=True" not in said, said
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_demo_before_and_after_in_every_tab(server, tiny_runs, tmp_path):
    requests: list[str] = []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 1000})
        page.on("request", lambda r: requests.append(r.url))
        page.goto(server)
        shots = []
        for modality, title in TABS.items():
            page.get_by_role("tab", name=title).click()
            field = page.locator(f"#{field_id(modality)} textarea")
            old = field.input_value()
            page.locator(f"#{modality}-new").click()  # a held-out prompt from the task generator
            page.wait_for_function("([sel, old]) => document.querySelector(sel).value !== old",
                                   arg=[f"#{field_id(modality)} textarea", old], timeout=120_000)
            page.locator(f"#{modality}-generate").click()
            for side in ("before", "after"):
                box = page.locator(f"#{modality}-{side}")
                box.locator(".sample").first.wait_for(timeout=120_000)
                text = box.inner_text()
                assert "total" in text, text  # every sample shows its atoms and its total
            if modality == "diffusion":
                for side in ("before", "after"):
                    assert page.locator(f"#diffusion-{side}-images img").count() >= 4  # seeds 0-3
            if modality == "dllm":
                assert page.locator("#dllm-after .tok").count() > 0  # the denoising order
            shot = tmp_path / f"demo_{modality}.png"
            page.screenshot(path=str(shot), full_page=True)
            shots.append(shot)
        page.get_by_role("tab", name="Runs").click()  # the curves of a run directory
        field = page.locator("#run-dir input")
        field.fill(str(tiny_runs["dllm"]))
        field.press("Enter")
        page.locator("#run-plot img").wait_for(timeout=60_000)
        assert "Diffusion LM run" in page.locator("#run-info").inner_text()
        shot = tmp_path / "demo_runs.png"
        page.screenshot(path=str(shot), full_page=True)
        shots.append(shot)
        browser.close()
    local = ("http://127.0.0.1", "ws://127.0.0.1", "data:", "blob:")
    assert requests and all(u.startswith(local) for u in requests), [u for u in requests if not u.startswith(local)]
    assert all(s.stat().st_size > 10_000 for s in shots)
    out = os.environ.get("MMRL_SCREENSHOT_DIR")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        for s in shots:
            shutil.copy(s, Path(out) / s.name)
