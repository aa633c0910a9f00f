"""Screenshots of the live view for the README: docs/img/live-view-midway.png (blocks coming into
focus, steered beside default) and docs/img/live-view-finished.png (the finished comparison with a
token's attribution open).

    .venv/bin/python scripts/ui_screenshots.py                 # starts a local stack (steerling-small, CPU)
    .venv/bin/python scripts/ui_screenshots.py --url http://127.0.0.1:8000 --out /tmp/shots

The README's screenshots are this command's output with its defaults: the default model
(models/steerling-small) steered toward its `sea` concept beside the default run, same seed. On a
2-core CPU it takes a minute or two. tests/test_ui_browser.py runs it against the tiny stack
(`--url`, `--api-key`, `--concept ocean`), so the script keeps working as the page changes.

Needs Debian's chromium + chromium-driver and selenium (what scripts/test.sh installs).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.browser_fixture import chromium, missing, set_viewport  # noqa: E402


@contextlib.contextmanager
def served(url: str | None, run_dir: Path, model_dir: Path) -> Iterator[str]:
    if url:
        yield url.rstrip("/")
        return
    from tests.stack_fixture import running_stack
    with running_stack(run_dir, model_dir=model_dir) as stack:
        yield stack.base_url


def drive(driver, base: str, out: Path, prompt: str, concept: str, seed: int,  # noqa: ANN001
          api_key: str = "", max_tokens: int = 150) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import Select, WebDriverWait

    wait = WebDriverWait(driver, 60)
    driver.get(base + "/ui")
    if api_key:   # as typed into the top bar: kept in the tab's sessionStorage
        driver.execute_script("sessionStorage.setItem('cde.apiKey', arguments[0])", api_key)
        driver.get(base + "/ui")
    wait.until(lambda d: "·" in d.find_element(By.ID, "model-info").text)
    box = driver.find_element(By.ID, "prompt")
    box.clear()
    box.send_keys(prompt)
    seed_box = driver.find_element(By.ID, "opt-seed")
    seed_box.clear()
    seed_box.send_keys(str(seed))
    max_box = driver.find_element(By.ID, "opt-max-tokens")
    max_box.clear()
    max_box.send_keys(str(max_tokens))
    search = driver.find_element(By.ID, "concept-search")
    search.send_keys(concept)
    wait.until(ec.visibility_of_element_located((By.CSS_SELECTOR, "#concept-options [role=option]")))
    # the option named exactly `concept` (the search also lists e.g. "seagull" for "sea")
    options = driver.find_elements(By.CSS_SELECTOR, "#concept-options [role=option]")
    exact = [o for o in options if o.find_element(By.CLASS_NAME, "opt-name").text == concept]
    if not exact:
        raise SystemExit(f"no concept named {concept!r} among {[o.text for o in options]}")
    exact[0].click()
    chip = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#chips .chip"))[0]
    assert chip.find_element(By.CLASS_NAME, "chip-name").text == concept
    Select(driver.find_element(By.ID, "opt-pace")).select_by_value("120")
    driver.find_element(By.ID, "run").click()
    # mid-way: the second block partly filled in the steered column
    wait.until(lambda d: d.execute_script(
        "const r = document.querySelector('.run');"
        "return r && r.querySelector('.blk') && Number(r.querySelector('.cells').dataset.filled) >= 24;"))
    driver.save_screenshot(str(out / "live-view-midway.png"))
    WebDriverWait(driver, 600).until(lambda d: all(
        r.get_attribute("data-state") in ("done", "error", "stopped") for r in d.find_elements(By.CSS_SELECTOR, ".run")))
    states = [r.get_attribute("data-state") for r in driver.find_elements(By.CSS_SELECTOR, ".run")]
    if states != ["done", "done"]:
        raise SystemExit(f"the runs ended {states}: {driver.find_element(By.ID, 'error').text}")
    tokens = driver.find_elements(By.CSS_SELECTOR, ".run .tok")
    if tokens:
        driver.execute_script("arguments[0].scrollIntoView({block: 'center'}); arguments[0].click();", tokens[len(tokens) // 3])
    time.sleep(0.8)   # let the bars' width transition end
    # the whole page: both columns, their concepts and the inspector with the token's attribution
    width = driver.execute_script("return window.innerWidth")
    set_viewport(driver, width, driver.execute_script("return document.documentElement.scrollHeight"))
    driver.execute_script("window.scrollTo(0, 0)")
    time.sleep(0.3)
    driver.save_screenshot(str(out / "live-view-finished.png"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running gateway (default: start a local stack of --model-dir)")
    ap.add_argument("--model-dir", default=str(ROOT / "models" / "steerling-small"),
                    help="the local stack's model (default: the Quick start's, models/steerling-small)")
    ap.add_argument("--api-key", default="", help="for a gateway with API keys on")
    ap.add_argument("--max-tokens", type=int, default=150)
    ap.add_argument("--out", default=str(ROOT / "docs" / "img"))
    ap.add_argument("--prompt", default="Tell me about the sea.")
    ap.add_argument("--concept", default="sea", help="an exact concept name (default: steerling-small's sea)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--width", type=int, default=1280)
    ap.add_argument("--height", type=int, default=800)
    args = ap.parse_args()
    why = missing()
    if why:
        sys.exit(why)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="cde-shots-") as tmp:
        with served(args.url, Path(tmp) / "stack", Path(args.model_dir)) as base, \
                chromium(Path(tmp) / "profile", (args.width, args.height)) as driver:
            drive(driver, base, out, args.prompt, args.concept, args.seed, args.api_key, args.max_tokens)
    print(f"wrote {out / 'live-view-midway.png'} and {out / 'live-view-finished.png'}")


if __name__ == "__main__":
    main()
