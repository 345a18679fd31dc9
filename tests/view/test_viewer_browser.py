"""`tracetrain view` in a real browser (Playwright driving Debian's chromium): run -> step ->
rollout as a user clicks through it, what the page shows checked against the run's own data;
trace markup never runs; the viewer serves pages while a run trains into the same directory.

Screenshots of each page go to $TRACETRAIN_SCREENSHOTS (docs/ for the README) or the test's
temporary folder."""

from __future__ import annotations

import math
import os
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest
from view_run import make_run, step_ids, store_rows

from tracetrain.gateway.serve import ThreadedServer
from tracetrain.view.app import create_view_app
from tracetrain.view.inspection import inspect_rollout

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


def browser_or_skip():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install playwright)")
    if not Path(CHROMIUM).exists():
        pytest.skip("no chromium here (apt-get install -y chromium; .ci/run installs it)")
    return sync_playwright


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    run = make_run(tmp_path_factory.mktemp("view-browser") / "run")
    with ThreadedServer(create_view_app(run)) as server:
        yield run, server.url


@pytest.mark.slow
def test_a_user_finds_a_failed_rollout_and_the_tokens_it_trained(served, tmp_path):
    sync_playwright = browser_or_skip()
    run, url = served
    shots = Path(os.environ.get("TRACETRAIN_SCREENSHOTS") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    stored = step_ids(run, 1)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(url + "/")
        assert page.locator("h1").inner_text() == f"run {run.name}"
        assert page.locator("figure.chart").count() >= 4
        page.screenshot(path=shots / "viewer-run.png", full_page=True)

        page.click('#steps a[href="/step/1"]')
        page.wait_for_url("**/step/1")
        assert page.locator("#rollouts tbody tr").count() == len(stored)
        page.screenshot(path=shots / "viewer-step.png", full_page=True)

        # failed ones only, then the first of them: its state and traceback, as text
        page.select_option('select[name="state"]', "failed-or-timed-out")
        page.click('button[type="submit"]')
        page.wait_for_url("**state=failed-or-timed-out**")
        failed = {r[0] for r in stored if r[1] == "failed"}
        shown = page.locator("#rollouts tbody tr").evaluate_all("rows => rows.map(r => r.dataset.rollout)")
        assert set(shown) == failed
        page.locator("#rollouts tbody tr a").first.click()
        page.wait_for_url("**/rollout/**")
        assert page.locator("#state").inner_text() == "failed"
        assert "RuntimeError: the tool crashed: <b>boom</b>" in page.locator("pre.traceback").inner_text()

        # a trained rollout with a drift break: tokens, weights, the break's position
        broken = next(rid for rid, *_ in stored
                      if "context_rewrite" in inspect_rollout(run, rid, out=lambda *_: None)["breaks"])
        facts = inspect_rollout(run, broken, out=lambda *_: None)
        page.goto(f"{url}/rollout/{broken}")
        trained = page.locator(".tokens .tok.trained")
        (responses,) = store_rows(
            run, "SELECT sum(length(response_ids) / 4) FROM turns WHERE rollout_id = ?", broken)
        assert trained.count() == responses[0]
        weights = trained.evaluate_all("ts => ts.map(t => Number(t.dataset.w))")
        assert math.fsum(weights) == pytest.approx(facts["loss_mass"], rel=1e-6)
        at = page.locator(".tokens .tok.at-break").evaluate_all("ts => ts.map(t => Number(t.dataset.pos))")
        assert sorted(at) == sorted(pos for _, pos in facts["break_positions"])
        trained.first.click()
        detail = page.locator("#token-detail").inner_text()
        assert "weight" in detail and "advantage" in detail and "engine logprob" in detail
        page.screenshot(path=shots / "viewer-rollout.png", full_page=True)

        # the hostile agent's markup is printed, and none of it ran
        (hostile,) = store_rows(run, "SELECT rollout_id FROM rollouts WHERE task LIKE '%hostile%' "
                                "AND state = 'succeeded' ORDER BY seq LIMIT 1")[0]
        page.goto(f"{url}/rollout/{hostile}")
        assert page.title() != "pwned" and page.evaluate("window.pwned") is None
        assert page.locator("script").count() == 1  # the viewer's own
        text = page.locator(".tokens").first.inner_text()
        assert "</div><script>document.title='pwned'" in text

        a, b = stored[0][0], stored[1][0]
        page.goto(f"{url}/compare?a={a}&b={b}")
        assert page.locator("section.rollout").count() == 2
        page.screenshot(path=shots / "viewer-compare.png", full_page=True)
        assert errors == []  # the viewer's script ran without an error on every page
        browser.close()


@pytest.mark.slow
def test_the_viewer_serves_a_run_while_it_trains(tmp_path):
    """Pages are requested all through a 4-step run into the same directory: none fails (a file
    not written yet is a 404 page), the trainer finishes, and the run page follows its steps."""
    run = tmp_path / "run"
    done = threading.Event()
    failure: list[BaseException] = []

    def trainer():
        try:
            make_run(run, steps=4)
        except BaseException as e:  # reported by the test
            failure.append(e)
        finally:
            done.set()

    with ThreadedServer(create_view_app(run)) as server:
        thread = threading.Thread(target=trainer)
        thread.start()
        seen_steps, statuses = set(), []
        with httpx.Client(base_url=server.url, timeout=30) as http:
            while not done.is_set():
                for path in ("/", "/api/status", "/step/0", "/step/1"):
                    r = http.get(path)
                    statuses.append((path, r.status_code))
                    if path == "/api/status":
                        seen_steps.add(r.json()["steps"])
                    if path == "/step/1" and r.status_code == 200 and "data-rollout=" in r.text:
                        rid = r.text.split('data-rollout="', 1)[1].split('"', 1)[0]
                        statuses.append(("rollout", http.get(f"/rollout/{rid}").status_code))
                time.sleep(0.05)
            thread.join()
            assert not failure, failure
            assert {s for _, s in statuses} <= {200, 404}, [x for x in statuses if x[1] not in (200, 404)]
            assert http.get("/api/status").json() == {"steps": 4, "last_step": 3}
            assert len(seen_steps) > 1  # the viewer followed the run, not a snapshot of it
