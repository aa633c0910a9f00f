"""The live view (/ui) in a real headless Chromium against the real local stack (tiny model, CPU,
API keys on): load the page, enter the key, type a prompt, pick a concept with the keyboard, run
with "compare with default" on, and check what the page shows against what the API itself answers
for the same requests (same seed, so the same tokens).

Needs Debian's chromium + chromium-driver and selenium (scripts/test.sh installs them); a missing
browser fails the tests (set CDE_NO_BROWSER=1 to skip them on a machine without one).
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.browser_fixture import chromium, console_errors, missing, set_viewport
from tests.stack_fixture import running_stack

pytestmark = [pytest.mark.browser, pytest.mark.e2e, pytest.mark.slow]

KEY = "ui-test-key"
PROMPT = "Tell me about the sea."
SEED = 11
MAX_TOKENS = 120
PACE_MS = 40     # the page's slow motion: one step drawn per 40 ms


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator:
    with running_stack(tmp_path_factory.mktemp("ui-stack"), gateway_args=["--api-keys", KEY]) as s:
        yield s


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> Iterator:
    why = missing()
    if why:
        if os.environ.get("CDE_NO_BROWSER") == "1":
            pytest.skip(why)
        pytest.fail(why)
    with chromium(tmp_path_factory.mktemp("chromium-profile")) as d:
        yield d


def api(stack) -> httpx.Client:
    return httpx.Client(base_url=stack.base_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


def stream_api(stack, body: dict) -> list[dict]:
    """The SSE objects the API sends for `body` (what the page reads for the same request)."""
    out = []
    with api(stack) as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                out.append(json.loads(line[5:]))
    return out


def page_body(steering: dict | None) -> dict:
    """The body the page sends for this test's settings (main.js requestBody)."""
    body = {"model": "steerling-tiny", "stream": True, "stream_mode": "steps", "stream_options": {"include_usage": True},
            "max_tokens": MAX_TOKENS, "seed": SEED, "attribution": "all",
            "messages": [{"role": "user", "content": PROMPT}]}
    if steering:
        body["steering"] = steering
    return body


def visible(text: str) -> str:
    """How a cell shows a token's text (run.js visible()): the whole text, spaces etc. made visible."""
    if text == "":
        return "∅"
    return text.replace(" ", "␣").replace("\n", "↵").replace("\t", "⇥")


def assert_cell_shows_all_of(driver, cell, text: str) -> None:
    """The cell's text is the token's whole text, and none of it is clipped."""
    assert cell.get_attribute("textContent") == visible(text), (cell.get_attribute("textContent"), text)
    clipped = js(driver, "const c = arguments[0]; return [c.scrollWidth - c.clientWidth, c.scrollHeight - c.clientHeight];", cell)
    assert clipped[0] <= 1 and clipped[1] <= 1, f"cell for {text!r} clipped by {clipped} px"


def wait_for(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.05)


def js(driver, script: str, *args):
    return driver.execute_script(script, *args)


def set_field(driver, element_id: str, value: str) -> None:
    from selenium.webdriver.common.by import By
    el = driver.find_element(By.ID, element_id)
    el.clear()
    if value:
        el.send_keys(value)


def test_ui_and_assets_are_served_with_a_strict_csp(stack) -> None:
    with httpx.Client(base_url=stack.base_url, timeout=10) as c:
        page = c.get("/ui")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        csp = page.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "script-src 'self'" in csp and "unsafe-inline" not in csp
        assert "frame-ancestors 'none'" in csp and page.headers["x-content-type-options"] == "nosniff"
        assert 'src="/ui/js/main.js"' in page.text and "<script>" not in page.text   # no inline script
        module = c.get("/ui/js/main.js")
        assert module.status_code == 200 and module.headers["content-type"].startswith("text/javascript")
        landing = c.get("/")
        assert landing.status_code == 200 and 'href="/ui"' in landing.text
        for bad in ("/ui/nope.js", "/ui/../app.py", "/ui/%2e%2e/app.py", "/ui/js/../../ui.py"):
            assert c.get(bad).status_code == 404, bad
        assert "/ui" not in json.dumps(c.get("/openapi.json").json()["paths"])   # not part of the API


def test_key_prompt_concept_compare_steps_and_attribution(stack, driver) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select

    driver.get(stack.base_url + "/ui")
    # Keys are on: the model list is refused, and the page shows the API's own words.
    with httpx.Client(base_url=stack.base_url, timeout=10) as c:
        refusal = c.get("/v1/models").json()["error"]["message"]
    wait_for(lambda: refusal in driver.find_element(By.ID, "error").text, 30, "the 401 shown")
    key = driver.find_element(By.ID, "api-key")
    key.send_keys(KEY, Keys.TAB)   # change event: stored in sessionStorage, the model reloads
    wait_for(lambda: "steerling-tiny" in driver.find_element(By.ID, "model-info").text, 30, "model info")
    assert js(driver, "return sessionStorage.getItem('cde.apiKey')") == KEY
    assert not driver.find_element(By.ID, "error").is_displayed()

    set_field(driver, "prompt", PROMPT)
    set_field(driver, "opt-seed", str(SEED))
    set_field(driver, "opt-max-tokens", str(MAX_TOKENS))
    Select(driver.find_element(By.ID, "opt-pace")).select_by_value(str(PACE_MS))
    # type-ahead + keyboard pick
    search = driver.find_element(By.ID, "concept-search")
    search.send_keys("ocea")
    wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, "#concept-options [role=option]"), 30, "concept options")
    assert search.get_attribute("aria-expanded") == "true"
    search.send_keys(Keys.ENTER)
    chip = wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, "#chips .chip"), 10, "a chip")[0]
    assert chip.find_element(By.CLASS_NAME, "chip-name").text == "ocean"
    with api(stack) as c:
        ocean = next(x for x in c.get("/v1/concepts", params={"q": "ocean"}).json()["data"] if x["name"] == "ocean")
    assert driver.find_element(By.ID, "compare").is_selected()
    curl = driver.find_element(By.ID, "curl").get_attribute("textContent")
    assert f'"id": {ocean["id"]}' in curl and "$CDE_API_KEY" in curl and KEY not in curl

    # Record the filled-cell count of each column every 10 ms inside the page.
    js(driver, """
        window.fillLog = [];
        window.fillTimer = setInterval(() => {
          const runs = [...document.querySelectorAll('.run')];
          window.fillLog.push(runs.map(r => [r.querySelector('.block-title').textContent,
                                             Number(r.querySelector('.cells').dataset.filled)]));
        }, 10);""")
    driver.find_element(By.ID, "run").click()
    wait_for(lambda: len(driver.find_elements(By.CSS_SELECTOR, ".run")) == 2
             and all(r.get_attribute("data-state") in ("done", "error", "stopped")
                     for r in driver.find_elements(By.CSS_SELECTOR, ".run")), 300, "both runs to finish")
    log = js(driver, "clearInterval(window.fillTimer); return window.fillLog;")
    runs = driver.find_elements(By.CSS_SELECTOR, ".run")
    assert [r.get_attribute("data-state") for r in runs] == ["done", "done"], driver.find_element(By.ID, "error").text
    assert runs[0].find_element(By.CLASS_NAME, "run-title").text.startswith("Steered")
    assert runs[1].find_element(By.CLASS_NAME, "run-title").text.startswith("Default")

    # Cells filled over several steps: within one block, many different counts were on screen.
    for col in (0, 1):
        by_block: dict[str, set[int]] = {}
        for sample in log:
            if len(sample) == 2:
                title, filled = sample[col]
                block = title.split(":")[0]
                by_block.setdefault(block, set()).add(filled)
        seen = max((len(v) for v in by_block.values()), default=0)
        assert seen >= 8, f"column {col}: filled counts per block {by_block}"

    # The page shows what the API sends for the same requests (same seed => same tokens).
    steered_api = stream_api(stack, page_body({"concepts": [{"id": ocean["id"], "strength": 1.0}], "mode": "amplify"}))
    default_api = stream_api(stack, page_body(None))

    def api_tokens(events: list[dict]) -> dict[int, dict]:
        return {ta["position"]: ta for e in events for ta in (e.get("cde") or {}).get("token_attributions", [])}

    def api_steps(events: list[dict]) -> dict[int, int]:
        return {p: e["cde"]["step"] for e in events if e["object"] == "cde.step" for p in e["cde"]["positions"]}

    def page_tokens(run) -> dict[int, str]:
        return {int(t.get_attribute("data-position")): t.get_attribute("textContent")
                for t in run.find_elements(By.CSS_SELECTOR, ".committed .tok")}

    for run, events in ((runs[0], steered_api), (runs[1], default_api)):
        expected = {p: ta["text"] for p, ta in api_tokens(events).items()}
        assert page_tokens(run) == expected
        # the last block's cells carry the step that filled them, as the API's step events say,
        # and each shows its token's whole text
        steps = api_steps(events)
        step_texts = {p: t for e in events if e["object"] == "cde.step"
                      for p, t in zip(e["cde"]["positions"], e["cde"]["texts"])}
        cells = run.find_elements(By.CSS_SELECTOR, ".cells .cell.filled")
        assert cells
        for cell in cells:
            pos = int(re.match(r"position (\d+)", cell.get_attribute("aria-label")).group(1))
            assert int(cell.get_attribute("data-step")) == steps[pos], pos
            assert_cell_shows_all_of(driver, cell, step_texts[pos])
    assert page_tokens(runs[0]) != page_tokens(runs[1]), "steering changed nothing"

    # The concept panel shows catalog labels.
    labels = [b.text for b in runs[0].find_elements(By.CSS_SELECTOR, ".chunks .concept-link")]
    assert labels
    served_labels = {c["label"] for ta in api_tokens(steered_api).values() for c in ta["top"]}
    served_labels |= {c["label"] for e in steered_api for ca in (e.get("cde") or {}).get("chunk_attributions", [])
                      for c in ca["top"]}
    assert set(labels) <= served_labels
    with api(stack) as c:
        for label in labels:
            m = re.match(r"Known: (.+)$", label)
            if m:   # a known concept's label names a catalog entry
                names = [x["name"] for x in c.get("/v1/concepts", params={"q": m.group(1)}).json()["data"]]
                assert m.group(1) in names, label

    # A token's attribution adds up.
    tok = runs[0].find_elements(By.CSS_SELECTOR, ".committed .tok")[5]
    tok.click()
    body = driver.find_element(By.ID, "inspector-body")
    wait_for(lambda: body.get_attribute("data-view") == "token", 10, "token attribution")
    terms = [float(td.text.replace("−", "-")) for td in body.find_elements(By.CSS_SELECTOR, "td.score")]
    shown_sum = float(body.find_element(By.CSS_SELECTOR, "[data-sum]").get_attribute("data-sum"))
    shown_logit = float(body.find_element(By.CSS_SELECTOR, "[data-logit]").get_attribute("data-logit"))
    served = api_tokens(steered_api)[int(tok.get_attribute("data-position"))]
    assert abs(sum(terms) - shown_sum) <= 1e-4 * len(terms)       # the rows shown are the sum shown
    assert shown_logit == pytest.approx(served["target_logit"], abs=1e-6)
    if "other" in served:   # the server reports the concepts outside the top list: exact
        assert shown_sum == pytest.approx(served["target_logit"], abs=1e-5)
        assert body.find_element(By.CSS_SELECTOR, "[data-adds-up]").get_attribute("data-adds-up") == "true"
    else:                   # top concepts + residual only, as served
        assert shown_sum == pytest.approx(sum(c["score"] for c in served["top"]) + served["residual"], abs=1e-5)
        assert "not reported by this server" in body.text

    # A concept's entry, and "steer toward it" makes it a chip.
    link = body.find_elements(By.CSS_SELECTOR, "td .concept-link")[0]
    name = link.text
    link.click()
    wait_for(lambda: body.get_attribute("data-view") == "concept", 10, "concept entry")
    assert body.find_element(By.CLASS_NAME, "entry-name").text
    steer = body.find_element(By.XPATH, ".//button[text()='Steer toward it']")
    if steer.is_enabled():
        steer.click()
        wait_for(lambda: len(driver.find_elements(By.CSS_SELECTOR, "#chips .chip")) == 2, 10, "a second chip")
    else:
        assert name.startswith("Discovered"), name

    assert console_errors(driver) == []


def open_ui(stack, driver) -> None:
    """The page with the key in this tab's sessionStorage (as typed in the first test), so a test
    runs alone too."""
    from selenium.webdriver.common.by import By
    driver.get(stack.base_url + "/ui")
    js(driver, "sessionStorage.setItem('cde.apiKey', arguments[0])", KEY)
    driver.get(stack.base_url + "/ui")
    wait_for(lambda: "steerling-tiny" in driver.find_element(By.ID, "model-info").text, 30, "model info")


def test_a_cell_shows_a_long_tokens_whole_text(stack, driver) -> None:
    """The tiny model's tokens are single bytes; a BPE model's are words (" dragon"): a cell is as
    wide as its token, never a clipped middle of it. Drawn through the page's own RunView."""
    from selenium.webdriver.common.by import By

    open_ui(stack, driver)
    set_field(driver, "prompt", PROMPT)
    set_field(driver, "opt-seed", str(SEED))
    set_field(driver, "opt-max-tokens", "16")
    driver.find_element(By.ID, "run").click()
    wait_for(lambda: [r for r in driver.find_elements(By.CSS_SELECTOR, ".run") if r.get_attribute("data-state") == "done"],
             120, "the run to finish")
    texts = [" dragon", " extraordinarily", "\n\n", "🐉 ok"]
    js(driver, """
        const view = window.cdeRuns[0], texts = arguments[0];
        const block = Math.floor(view.winStart / view.width);
        const first = Math.max(view.winStart, view.promptLen);
        view.push({object: "cde.step", cde: {step: 999, block_index: block,
                   positions: texts.map((_, i) => first + i), tokens: texts.map(() => 1), texts}});""", texts)
    run = driver.find_element(By.CSS_SELECTOR, ".run")
    cells = wait_for(lambda: [c for c in run.find_elements(By.CSS_SELECTOR, ".cells .cell.filled")
                              if c.get_attribute("data-step") == "999"], 10, "the drawn step")
    assert len(cells) == len(texts)
    for cell, text in zip(cells, texts):
        assert_cell_shows_all_of(driver, cell, text)
    assert js(driver, "return document.documentElement.scrollWidth <= window.innerWidth + 1")
    assert console_errors(driver) == []


def pick_concept(driver, query: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    search = driver.find_element(By.ID, "concept-search")
    search.send_keys(query)
    wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, "#concept-options [role=option]"), 30, "concept options")
    search.send_keys(Keys.ENTER)
    wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, "#chips .chip"), 10, "a chip")


def record_requests(driver) -> None:
    """Wrap the page's fetch so the test reads every request body the page sends."""
    js(driver, """
        window.sentBodies = [];
        const real = window.fetch;
        window.fetch = (url, opts) => {
          if (opts && opts.body) window.sentBodies.push({url: String(url), body: JSON.parse(opts.body)});
          return real(url, opts);
        };""")


def test_steering_target_reaches_the_request(stack, driver) -> None:
    from selenium.webdriver.common.by import By

    open_ui(stack, driver)
    set_field(driver, "prompt", PROMPT)
    set_field(driver, "opt-seed", str(SEED))
    set_field(driver, "opt-max-tokens", "16")
    pick_concept(driver, "ocea")
    # the strength slider says what strength means
    slider = driver.find_element(By.CSS_SELECTOR, "#chips .chip input[type=range]")
    help_text = driver.find_element(By.ID, slider.get_attribute("aria-describedby")).get_attribute("textContent")
    assert "0.5" in help_text and "half" in help_text and "double" in help_text
    driver.find_element(By.CSS_SELECTOR, "#steer-advanced summary").click()
    curl = driver.find_element(By.ID, "curl")
    assert '"target"' not in curl.get_attribute("textContent")   # empty: the server's default
    set_field(driver, "opt-steer-target", "3.5")
    wait_for(lambda: '"target": 3.5' in curl.get_attribute("textContent"), 10, "target in the curl command")
    record_requests(driver)
    driver.find_element(By.ID, "run").click()
    wait_for(lambda: len(driver.find_elements(By.CSS_SELECTOR, ".run")) == 2
             and all(r.get_attribute("data-state") in ("done", "error", "stopped")
                     for r in driver.find_elements(By.CSS_SELECTOR, ".run")), 120, "both runs to finish")
    assert [r.get_attribute("data-state") for r in driver.find_elements(By.CSS_SELECTOR, ".run")] == ["done", "done"], \
        driver.find_element(By.ID, "error").text
    sent = [b["body"] for b in js(driver, "return window.sentBodies") if b["url"].endswith("/v1/chat/completions")]
    steered = [b for b in sent if "steering" in b]
    assert len(sent) == 2 and len(steered) == 1
    assert steered[0]["steering"]["target"] == 3.5
    # out of its bound: the API's 400 names the field, and the page shows it
    set_field(driver, "opt-steer-target", "1000")
    driver.find_element(By.ID, "run").click()
    box = driver.find_element(By.ID, "error")
    wait_for(lambda: box.is_displayed() and "steering.target" in box.text, 60, "the 400 naming steering.target")
    set_field(driver, "opt-steer-target", "")
    wait_for(lambda: '"target"' not in curl.get_attribute("textContent"), 10, "no target once emptied")
    assert console_errors(driver) == []


def test_stopped_run_says_stopped(stack, driver) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    open_ui(stack, driver)
    set_field(driver, "prompt", PROMPT)
    set_field(driver, "opt-seed", str(SEED))
    set_field(driver, "opt-max-tokens", "512")
    Select(driver.find_element(By.ID, "opt-pace")).select_by_value("120")   # well behind the stream
    driver.find_element(By.ID, "run").click()
    run = wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, ".run"), 30, "a run")[0]
    wait_for(lambda: run.get_attribute("data-state") == "running"
             and int(run.find_element(By.CLASS_NAME, "cells").get_attribute("data-filled") or 0) > 0, 60, "first steps drawn")
    driver.find_element(By.ID, "stop").click()
    wait_for(lambda: run.get_attribute("data-state") == "stopped", 30, "the stopped state")
    stats = run.find_element(By.CLASS_NAME, "run-stats").text
    assert stats.endswith("stopped") and "finished" not in stats, stats
    assert "ended" in run.find_element(By.CLASS_NAME, "cells").get_attribute("class")
    assert not driver.find_element(By.ID, "error").is_displayed()   # stopping is not an error
    assert driver.find_element(By.ID, "stop").get_attribute("disabled") == "true"
    assert driver.find_element(By.ID, "run").is_enabled()
    assert console_errors(driver) == []


def test_bad_request_shows_the_api_error_text(stack, driver) -> None:
    from selenium.webdriver.common.by import By

    driver.get(stack.base_url + "/ui")   # the key stays in this tab's sessionStorage
    wait_for(lambda: "steerling-tiny" in driver.find_element(By.ID, "model-info").text, 30, "model info")
    set_field(driver, "opt-temperature", "5")
    body = page_body(None) | {"temperature": 5}
    with api(stack) as c:
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 400
    err = r.json()["error"]
    driver.find_element(By.ID, "run").click()
    box = driver.find_element(By.ID, "error")
    wait_for(lambda: box.is_displayed() and err["message"] in box.text, 60, "the API's error text")
    assert "400" in box.text and err["param"] in box.text
    assert driver.find_element(By.CSS_SELECTOR, ".run").get_attribute("data-state") == "error"


def test_narrow_window_has_no_horizontal_scroll(stack, driver) -> None:
    from selenium.webdriver.common.by import By

    try:
        set_viewport(driver, 420, 900)
        driver.get(stack.base_url + "/ui")
        wait_for(lambda: "steerling-tiny" in driver.find_element(By.ID, "model-info").text, 30, "model info")
        assert js(driver, "return document.documentElement.scrollWidth <= window.innerWidth + 1")
        # every form control has an accessible name
        unnamed = js(driver, """
            return [...document.querySelectorAll('input, select, textarea, button')].filter(e => {
              if (e.closest('template') || e.type === 'hidden') return false;
              const id = e.id && document.querySelector(`label[for="${e.id}"]`);
              return !(e.labels && e.labels.length) && !id && !e.getAttribute('aria-label') && !e.textContent.trim();
            }).map(e => e.outerHTML.slice(0, 80));""")
        assert unnamed == []
    finally:
        set_viewport(driver, 1280, 800)


def test_screenshot_script_runs(stack, driver, tmp_path) -> None:
    """scripts/ui_screenshots.py (the README's screenshots) against this stack: both pictures come
    out, the finished one the whole page. Its defaults (steerling-small, `sea`) are the README's."""
    import subprocess
    import sys

    from cde.launch import ROOT
    script = ROOT / "scripts" / "ui_screenshots.py"
    text = script.read_text()
    assert 'default=str(ROOT / "models" / "steerling-small")' in text and 'default="sea"' in text
    proc = subprocess.run([sys.executable, str(script), "--url", stack.base_url, "--api-key", KEY, "--concept", "ocean",
                           "--max-tokens", "96", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    for name in ("live-view-midway.png", "live-view-finished.png"):
        png = (tmp_path / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
        width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
        assert width == 1280 and height >= 800, (name, width, height)


@pytest.fixture(scope="module")
def causal_stack(tmp_path_factory) -> Iterator:
    from cde.launch import ROOT
    with running_stack(tmp_path_factory.mktemp("ui-causal-stack"), model_dir=ROOT / "models" / "idlm-tiny") as s:
        yield s


def test_causal_model_marks_accepted_rejected_and_bonus_tokens(causal_stack, driver) -> None:
    """The bundled I-DLM: no steering or concepts; each forward's accepted drafts, the rejected one
    and the bonus are marked as the API's step events say, with tokens per forward and acceptance."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    stack = causal_stack
    driver.get(stack.base_url + "/ui")
    wait_for(lambda: "causal" in driver.find_element(By.ID, "model-info").text, 30, "model info")
    assert not driver.find_element(By.ID, "steering").is_displayed()
    assert driver.find_element(By.ID, "opt-stride").is_displayed()
    assert not driver.find_element(By.ID, "opt-tokens-per-step").is_displayed()
    seed, max_tokens = 3, 64
    set_field(driver, "prompt", PROMPT)
    set_field(driver, "opt-seed", str(seed))
    set_field(driver, "opt-max-tokens", str(max_tokens))
    set_field(driver, "opt-temperature", "0.7")
    Select(driver.find_element(By.ID, "opt-pace")).select_by_value(str(PACE_MS))
    driver.find_element(By.ID, "run").click()
    run = wait_for(lambda: [r for r in driver.find_elements(By.CSS_SELECTOR, ".run")
                            if r.get_attribute("data-state") in ("done", "error")], 300, "the run to finish")[0]
    assert run.get_attribute("data-state") == "done", driver.find_element(By.ID, "error").text

    body = {"model": "idlm-tiny", "stream": True, "stream_mode": "steps", "stream_options": {"include_usage": True},
            "max_tokens": max_tokens, "seed": seed, "temperature": 0.7, "decode": {"stride": 4},
            "messages": [{"role": "user", "content": PROMPT}]}
    events = []
    with httpx.Client(base_url=stack.base_url, timeout=120) as c, \
            c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:") and line != "data: [DONE]"]
    steps = [e["cde"] for e in events if e["object"] == "cde.step"]
    text = "".join((ch.get("delta") or {}).get("content") or "" for e in events
                   if e["object"] != "cde.step" for ch in e["choices"])
    usage = next(e for e in events if e.get("usage"))
    # the step events are the forwards of this very completion: together they are its tokens, and a
    # rejected draft never equals the correction in its place (the residual has no mass there)
    blocks = [t for e in events if e["object"] != "cde.step" for t in (e.get("cde") or {}).get("tokens", [])]
    assert [t for s in steps for t in s["tokens"]] == blocks
    assert [s["step"] for s in steps] == list(range(1, len(steps) + 1))
    for s in steps:
        assert 0 <= s["drafts_accepted"] <= s["drafts_proposed"] <= 3
        if "rejected_token" in s:
            assert s["drafts_accepted"] < s["drafts_proposed"] and s["rejected_token"] != s["tokens"][s["drafts_accepted"]]
    assert run.find_element(By.CLASS_NAME, "committed").get_attribute("textContent") == text
    stats = run.find_element(By.CLASS_NAME, "run-stats").text
    assert f"forward {steps[-1]['step']}" in stats
    assert f"final: {usage['usage']['completion_tokens']} tokens in {usage['cde']['forwards']} forwards" in stats
    proposed = sum(s["drafts_proposed"] for s in steps)
    if proposed:
        pct = 100 * sum(s["drafts_accepted"] for s in steps) / proposed
        assert f"acceptance {pct:.0f} %" in stats
    # the forward log (newest first, the last 8) marks each token as the API's event says
    shown = run.find_elements(By.CSS_SELECTOR, ".forward-log li")
    assert shown and len(shown) == min(8, len(steps))
    for li, s in zip(shown, reversed(steps)):
        assert li.text.startswith(f"forward {s['step']}:")
        kinds = [m.get_attribute("class").split()[-1] for m in li.find_elements(By.CLASS_NAME, "tok-mark")]
        want = []
        for i in range(len(s["tokens"])):
            if i == s["drafts_accepted"] and "rejected_token" in s:
                want.append("rejected")
            if not s["drafts_proposed"]:
                want.append("cold")
            elif i < s["drafts_accepted"]:
                want.append("accepted")
            else:
                want.append("bonus" if s["drafts_accepted"] == s["drafts_proposed"] else "correction")
        assert kinds == want, (s, kinds)
    assert console_errors(driver) == []


def test_a_tokens_input_attribution_heat_map(stack, driver) -> None:
    """Click a token, then "Which inputs caused it?": the heat map shows every input the token
    conditioned on, each with the score the API gives for that request and position."""
    from selenium.webdriver.common.by import By

    open_ui(stack, driver)
    set_field(driver, "prompt", PROMPT)
    set_field(driver, "opt-seed", str(SEED))
    set_field(driver, "opt-max-tokens", "12")
    if driver.find_element(By.ID, "compare").is_selected():
        driver.find_element(By.ID, "compare").click()
    driver.find_element(By.ID, "run").click()
    run = wait_for(lambda: [r for r in driver.find_elements(By.CSS_SELECTOR, ".run")
                            if r.get_attribute("data-state") == "done"], 120, "the run to finish")[0]
    toks = wait_for(lambda: run.find_elements(By.CSS_SELECTOR, ".committed .tok"), 10, "attributed tokens")
    tok = toks[min(3, len(toks) - 1)]
    position = int(tok.get_attribute("data-position"))
    tok.click()
    body = driver.find_element(By.ID, "inspector-body")
    button = wait_for(lambda: body.find_elements(By.CLASS_NAME, "inputs-button"), 10, "the inputs button")[0]
    button.click()
    wait_for(lambda: body.find_elements(By.CSS_SELECTOR, "[data-done=true]"), 60, "the input attribution")
    spans = body.find_elements(By.CSS_SELECTOR, ".heat .in[data-position]")
    shown = {int(s.get_attribute("data-position")): float(s.get_attribute("data-score")) for s in spans}
    rid = js(driver, "return window.cdeRuns[window.cdeRuns.length - 1].requestId")
    with api(stack) as c:
        want = c.post("/v1/attributions/inputs", json={"request_id": rid, "positions": [position], "n_steps": 16}).json()
    (target,) = want["targets"]
    assert shown == {s["position"]: pytest.approx(s["score"], rel=1e-6, abs=1e-9) for s in target["inputs"]}
    assert len(shown) > len(PROMPT) // 2   # the prompt's tokens at least
    assert console_errors(driver) == []
