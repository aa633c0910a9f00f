"""Debian's Chromium driven through chromedriver by Selenium, for the live-view tests and the
screenshot script (scripts/ui_screenshots.py). Nothing is downloaded: the browser and the driver
are the apt packages `chromium` and `chromium-driver` (scripts/test.sh installs them), and
Selenium is told their paths so its own driver manager never runs.

    with chromium(tmp_path / "profile") as driver:
        driver.get(url)
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

CHROMIUM = os.environ.get("CDE_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("CDE_CHROMEDRIVER", "/usr/bin/chromedriver")
WINDOW = (1280, 800)


def missing() -> str | None:
    """Why the browser cannot run here (None when it can)."""
    for path in (CHROMIUM, CHROMEDRIVER):
        if not (os.path.exists(path) or shutil.which(path)):
            return f"{path} not found (apt-get install -y chromium chromium-driver)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (requirements-test.txt)"
    return None


@contextlib.contextmanager
def chromium(profile_dir: Path, window: tuple[int, int] = WINDOW) -> Iterator["WebDriver"]:  # noqa: F821
    """A headless Chromium with a fresh profile, quit on exit whatever happens."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile_dir.mkdir(parents=True, exist_ok=True)
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", f"--user-data-dir={profile_dir}",
                f"--window-size={window[0]},{window[1]}", "--force-device-scale-factor=1"):
        opts.add_argument(arg)
    # the browser console, to report CSP violations and script errors
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = Service(executable_path=CHROMEDRIVER, log_output=str(profile_dir / "chromedriver.log"))
    driver = webdriver.Chrome(options=opts, service=service)
    try:
        set_viewport(driver, *window)
        driver.set_page_load_timeout(60)
        driver.set_script_timeout(120)
        yield driver
    finally:
        driver.quit()


def set_viewport(driver, width: int, height: int) -> None:  # noqa: ANN001 - a selenium WebDriver
    """The page's own size in CSS pixels (a window size would include the browser's frame)."""
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                           {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})


def console_errors(driver) -> list[str]:  # noqa: ANN001 - a selenium WebDriver
    """Severe browser-console entries since the last call (script errors, CSP refusals); failed
    HTTP requests are left out: the API answering 401 or 404 is the page's business to show."""
    return [e["message"] for e in driver.get_log("browser")
            if e.get("level") == "SEVERE" and e.get("source") != "network"]
