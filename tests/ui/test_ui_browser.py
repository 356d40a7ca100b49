"""The page in a real headless Chromium (Debian's `chromium`, driven by Playwright) against a real app server."""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import pytest
from app_server import ARTIFACTS, running_app

from music3_demo.ui.assets import load_examples

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--autoplay-policy=no-user-gesture-required"]

pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium (apt-get install chromium)")


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    # Lazy loading, so the first song also shows the model-loading progress; one song at a time (the tiny engine
    # has 4 slots), so a second user waits in line.
    with running_app(tmp_path_factory.mktemp("ui"), "--lazy-load", "--concurrency", "1", wait_for=("idle",)) as server:
        yield server


@pytest.fixture(scope="module")
def browser(app):
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


def open_page(browser, app):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(30_000)
    page.goto(app.url)
    page.wait_for_selector("#model-status", timeout=60_000)
    return page


@pytest.fixture(scope="module")
def page(browser, app):
    page = open_page(browser, app)
    yield page
    page.close()


def wait_text(page, selector: str, pattern: str, timeout: float = 30_000) -> None:
    """Wait until the element's text matches the JS regular expression `pattern`."""
    page.wait_for_function("([s, p]) => new RegExp(p).test(document.querySelector(s).innerText)",
                           arg=[selector, pattern], timeout=timeout)


def shot(page, name: str) -> None:
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def set_number(page, elem_id: str, value: float) -> None:
    box = page.locator(f"#{elem_id} input[type=number]")
    box.fill(str(value))
    box.press("Enter")
    page.wait_for_function("([s, v]) => Number(document.querySelector(s).value) === v",
                           arg=[f"#{elem_id} input[type=number]", value])


def pick_example(page, label: str) -> None:
    """Click an example and wait until it has filled the form: it fills asynchronously, so a value typed before
    that would be overwritten."""
    example = next(e for e in load_examples() if e.label == label)
    page.get_by_role("button", name=label).click()
    page.wait_for_function(
        "([d, n]) => document.querySelector('#description textarea').value === d"
        " && Number(document.querySelector('#duration input[type=number]').value) === n",
        arg=[example.description, example.duration])


def audio_duration(page, selector: str, at_least: float = 0.0) -> float:
    """Duration of the <audio> under `selector`, waiting until the browser knows it to be over `at_least` seconds
    (a live stream's duration grows as the player re-reads its playlist)."""
    page.wait_for_function(
        "([s, m]) => { const a = document.querySelector(s + ' audio');"
        " return a && isFinite(a.duration) && a.duration > m; }",
        arg=[selector, at_least], timeout=30_000)
    return page.evaluate("(s) => document.querySelector(s + ' audio').duration", selector)


def test_page_opens_before_the_model_and_shows_the_licence(page):
    assert "loads with the first song" in page.locator("#model-status").inner_text()
    licence = page.locator("#licence").inner_text()
    assert "MiniMax-Music3 Community License" in licence and "MiniMaxAI/MiniMax-Music3" in licence
    assert "diffusers" in licence
    shot(page, "01-page-opened")


def test_tag_buttons_and_token_counter(page):
    lyrics = page.locator("#lyrics textarea")
    lyrics.fill("[verse]\nfirst line")
    wait_text(page, "#token-counter", "/ 5,000 tokens")
    before = page.locator("#token-counter").inner_text()
    assert "≈" in before  # an estimate until the model's tokenizer is there
    page.get_by_role("button", name="[chorus]", exact=True).click()
    page.wait_for_function("() => document.querySelector('#lyrics textarea').value.includes('[chorus]')")
    assert lyrics.input_value().split("\n") == ["[verse]", "first line", "", "[chorus]", ""]
    page.wait_for_function("(b) => document.querySelector('#token-counter').innerText !== b", arg=before)
    lyrics.fill("[verse] this text is dropped")
    wait_text(page, "#token-counter", "Put the tag on its own line")


def test_instrumental_switch_and_reset_to_defaults(page):
    page.locator("#instrumental input").check()
    page.wait_for_function("() => document.querySelector('#lyrics textarea').disabled")
    set_number(page, "duration", 77)
    set_number(page, "guidance", 3.5)
    page.locator("#reset").click()
    page.wait_for_function("() => document.querySelector('#duration input[type=number]').value === '30'")
    assert page.locator("#guidance input[type=number]").input_value() == "1.7"
    assert not page.locator("#instrumental input").is_checked()
    page.wait_for_function("() => !document.querySelector('#lyrics textarea').disabled")
    assert "this text is dropped" in page.locator("#lyrics textarea").input_value()  # the user's text is kept


def test_example_generate_progress_and_playable_song(page, app):
    pick_example(page, "Synth-pop · English")
    set_number(page, "duration", 3)
    set_number(page, "steps", 8)
    page.locator("#generate").click()
    wait_text(page, "#run-progress", "Loading model", timeout=60_000)  # the first song loads the model (lazy)
    shot(page, "02-loading-model")
    # Stage progress from the pipeline's events, e.g. "Semantic 40/75 frames · 31.0 frames/s · ETA 1 s".
    wait_text(page, "#run-progress", "frames|Flow chunk|Vocoder", timeout=120_000)
    wait_text(page, "#run-status", "Finished", timeout=120_000)
    wait_text(page, "#model-status", "engine")  # the banner now reports the loaded model...
    assert "noise" in page.locator("#noise-banner").inner_text()  # ...and that a random model makes noise
    assert audio_duration(page, "#result-audio") == pytest.approx(3.0, abs=0.05)
    if shutil.which("ffmpeg"):
        # The streamed copy: all of the song reaches the live player (plus the short silence that flushes it).
        assert audio_duration(page, "#live-audio", at_least=2.9) < 3.6
    else:  # Gradio needs ffmpeg to stream; without it the page says so and shows the song when it is done
        assert not page.locator("#live-audio").is_visible()
        assert page.get_by_text("Live playback needs").is_visible()
    assert all(page.locator(f"#download-{kind}").is_visible() for kind in ("wav", "flac", "mp3"))
    assert "realtime" in page.locator("#report").inner_text()
    # The history re-renders in its own update after the result: wait for it rather than race it.
    page.wait_for_function("() => document.querySelectorAll('.m3-reuse').length === 1")
    assert page.get_by_role("button", name="↺ Reuse these settings").count() == 1
    page.wait_for_timeout(500)
    shot(page, "03-finished")


def test_stop_a_long_run(page, app):
    set_number(page, "duration", 120)
    page.locator("#generate").click()
    wait_text(page, "#run-progress", "Semantic \\d+/3000 frames", timeout=60_000)
    time.sleep(1.0)
    shot(page, "04-long-run-progress")
    page.locator("#stop").click()
    stopped_at = time.time()
    wait_text(page, "#run-status", "Stopped")
    while app.status()["busy"]:
        assert time.time() - stopped_at < 5, "the server kept generating after Stop"
        time.sleep(0.05)
    # Jobs are private to their client (the page's session, not this one): the server's log line says it stopped.
    assert "stopped before it finished" in app.log()
    generate = page.locator("#generate")
    page.wait_for_function("() => !document.querySelector('#generate').disabled")
    assert "Generate" in generate.inner_text() and not page.locator("#stop").is_visible()
    assert page.get_by_role("button", name="↺ Reuse these settings").count() == 1  # the first song is still there
    shot(page, "05-stopped")


def test_reuse_settings_then_generate_again(page):
    page.get_by_role("button", name="↺ Reuse these settings").click()
    page.wait_for_function("() => document.querySelector('#duration input[type=number]').value === '3'")
    assert not page.locator("#random-seed input").is_checked()  # the song's own seed, so it can be made again
    page.locator("#generate").click()
    wait_text(page, "#run-status", "Finished", timeout=120_000)
    page.wait_for_function("() => document.querySelectorAll('.m3-reuse').length === 2")
    assert audio_duration(page, "#result-audio") == pytest.approx(3.0, abs=0.05)
    page.wait_for_timeout(500)
    shot(page, "06-history")


def test_closing_the_tab_frees_the_device(browser, app):
    other = open_page(browser, app)
    pick_example(other, "Lo-fi hip hop · instrumental")
    set_number(other, "duration", 120)
    other.locator("#generate").click()
    wait_text(other, "#run-progress", "Semantic \\d+/3000 frames", timeout=60_000)
    closed_at = time.monotonic()
    other.close()
    while app.status()["busy"]:
        assert time.monotonic() - closed_at < 5, "a closed tab kept the device busy"
        time.sleep(0.05)


def test_a_waiting_user_sees_the_queue_position(page, app):
    from gradio_client import Client

    other_user = Client(app.url, verbose=False).submit(
        "ambient drone", "", 120, 1.7, 8, 1, 1.5, 50, True, 1, api_name="/generate")
    try:
        deadline = time.monotonic() + 60
        while not app.status()["busy"]:
            assert time.monotonic() < deadline, "the other user's song never started"
            time.sleep(0.1)
        pick_example(page, "Synth-pop · English")  # this test's own form, whatever the tests before left there
        set_number(page, "duration", 3)
        page.locator("#generate").click()
        # Told at once that it waits (the other user's song holds the one place, though the engine has 4 slots),
        # then its place in line...
        wait_text(page, "#run-status", "Waiting for your turn", timeout=30_000)
        wait_text(page, "#run-progress", "next in line", timeout=30_000)
        # ...and, for as long as it waits, the status line says so with its place and, once a song's speed has been
        # measured (at once after the earlier tests; after the model's load when run alone), when it should start:
        # when the other user's song ends, not now.
        wait_text(page, "#run-status", "Waiting for your turn: next in line, starts in about", timeout=90_000)
        start = re.search(r"starts in about ([\d.]+) (s|min)", page.locator("#run-status").inner_text())
        assert start and float(start[1]) > 0, page.locator("#run-status").inner_text()
        shot(page, "07-queued")
        page.locator("#stop").click()  # leaving the queue before the turn comes
        wait_text(page, "#run-status", "Stopped")
    finally:
        other_user.cancel()
