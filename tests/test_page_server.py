"""The driving page in a real headless Chromium (Debian's chromium + chromedriver, Selenium): it
loads, starts a session on the embedded sample road, takes an arrow key, and shows the new frame.
A screenshot is kept (in the test's tmp dir, and in $TERRA_ARTIFACTS when set). Outside CI a
machine without Chromium skips this test; in CI (CI=true) it must run."""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest

from server_helpers import default_tokenizer, serve_checkpoint, wait_for

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


def _browser_or_skip():
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not Path(p).exists()]
    if missing and os.environ.get("CI") != "true":
        pytest.skip(f"no headless Chromium here ({', '.join(missing)} missing; .ci/run installs it)")
    assert not missing, f"CI must have Chromium: {missing} missing (.ci/run installs chromium chromium-driver)"
    if os.environ.get("CI") != "true":
        pytest.importorskip("selenium")
    from selenium import webdriver

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,1000"):
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def live_server(tmp_path):
    import uvicorn

    from terra_cli.server.app import Settings, create_app
    from terra_cli.server.loader import EngineConfig, load_engine

    engine = load_engine(EngineConfig(model=str(serve_checkpoint(tmp_path / "model")), tokenizer=default_tokenizer(),
                                      backend="hf", device="cpu", dtype="float32", threads=1))
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(engine, Settings()), host="127.0.0.1", port=port,
                                           log_level="warning", ws="auto"))
    thread = threading.Thread(target=server.run, daemon=True)  # not the main thread: no signal handlers
    thread.start()
    wait_for(lambda: server.started, 60)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=60)


def test_page_drives_a_session_in_chromium(live_server, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    browser = _browser_or_skip()
    shot = tmp_path / "terra-serve-page.png"
    try:
        browser.get(live_server + "/")
        assert browser.title.startswith("terra serve")
        browser.find_element(By.ID, "start").click()
        frame = browser.find_element(By.ID, "frame")
        # the session's context (3 frames of the sample road) arrives first, then each new frame
        wait_for(lambda: frame.get_attribute("data-index") == "2", 120, 0.2)
        first_src = frame.get_attribute("src")
        assert first_src.startswith("data:image/jpeg;base64,")
        wait_for(lambda: "drive with the arrow keys" in browser.find_element(By.ID, "status").text, 30, 0.2)
        browser.find_element(By.TAG_NAME, "body").send_keys(Keys.ARROW_LEFT)
        wait_for(lambda: frame.get_attribute("data-index") == "3", 120, 0.2)
        assert frame.get_attribute("src") != first_src
        assert "frame 3" in browser.find_element(By.ID, "caption").text
        natural = browser.execute_script("return [arguments[0].naturalWidth, arguments[0].naturalHeight]", frame)
        assert natural == [512, 288]
        # the path plot drew the step: some pixel of the canvas is the path's green
        drawn = browser.execute_script(
            "const c = document.getElementById('path'); const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;"
            "let n = 0; for (let i = 0; i < d.length; i += 4) if (d[i] === 0x11 && d[i + 1] === 0xaa && d[i + 2] === 0x66) n++;"
            "return n;")
        assert drawn > 0
        time.sleep(0.2)
    finally:
        browser.save_screenshot(str(shot))
        browser.quit()
    assert shot.stat().st_size > 1000
    if os.environ.get("TERRA_ARTIFACTS"):
        target = Path(os.environ["TERRA_ARTIFACTS"])
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, target / shot.name)
