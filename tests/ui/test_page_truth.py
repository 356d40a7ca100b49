"""The page tells the truth, in a real headless Chromium against a real `app.py --model tiny` server:
refusals next to Generate, a Stop that is not an error, one player, Ctrl+Enter, the phone layout, history that
survives a reload, and songs that stream on the CPU. Screenshots at both widths go to test-artifacts/."""

from __future__ import annotations

import time

import pytest
from app_server import ARTIFACTS, running_app
from test_ui_browser import CHROMIUM, browser, set_number, wait_text  # noqa: F401 - `browser` is a fixture

from music3_demo import contract as c
from music3_demo.events import AudioPiece, Progress
from music3_demo.request import GenerationRequest, InvalidRequest, validate

pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium (apt-get install chromium)")

PHONE = {"width": 390, "height": 844}
DESKTOP = {"width": 1440, "height": 900}


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    # Preloaded, as `python app.py` does (a generous start-up limit: the warm-up song is slow on a busy machine).
    with running_app(tmp_path_factory.mktemp("truth"), ready_timeout=900) as server:
        yield server


@pytest.fixture(scope="module")
def context(browser):
    """One browser profile (one localStorage) for the song tests: the history must survive a reload in it."""
    context = browser.new_context(viewport=DESKTOP)
    yield context
    context.close()


def open_page(context_or_browser, app, viewport=None):
    page = context_or_browser.new_page(**({"viewport": viewport} if viewport else {}))
    page.set_default_timeout(30_000)
    page.goto(app.url)
    page.wait_for_selector("#model-status", timeout=60_000)
    page.wait_for_selector("#generate", timeout=60_000)  # a busy machine mounts the page's parts one by one
    return page


def sentence(**fields) -> str:
    """What validate() says about these fields (the page must say the same)."""
    with pytest.raises(InvalidRequest) as refused:
        validate(GenerationRequest(**({"description": "pop", "lyrics": "[verse]\nla"} | fields)))
    return str(refused.value)


def fill_form(page, description: str, lyrics: str) -> None:
    page.locator("#description textarea").fill(description)
    page.locator("#lyrics textarea").fill(lyrics)


def error_badges(page) -> int:
    """Gradio's red "Error" status on an output (or an error toast)."""
    return page.get_by_text("Error", exact=True).count()


REFUSED = [
    ("no lyrics", "pop", "", None, {"lyrics": ""}),
    ("no description", "", "[verse]\nla", None, {"description": ""}),
    ("negative seed", "pop", "[verse]\nla", "-7", {"seed": -7}),
    ("huge seed", "pop", "[verse]\nla", "99999999999", {"seed": 99999999999}),
    ("fractional seed", "pop", "[verse]\nla", "1.5", {"seed": 1.5}),
]


@pytest.mark.parametrize("case", REFUSED, ids=[case[0] for case in REFUSED])
def test_a_refused_input_says_why_next_to_generate_within_a_second(browser, app, case):
    _, description, lyrics, seed, fields = case
    page = open_page(browser, app, DESKTOP)
    try:
        fill_form(page, description, lyrics)
        if seed is not None:
            page.locator("#random-seed input").uncheck()
            set_number(page, "seed", float(seed))
        expected = sentence(**fields)
        page.locator("#generate").click()
        # Within a second of the click, and right under the button.
        page.wait_for_function("(s) => document.querySelector('#refusal').innerText.includes(s)", arg=expected,
                               timeout=1_000)
        button, refusal = page.locator("#generate").bounding_box(), page.locator("#refusal").bounding_box()
        assert 0 <= refusal["y"] - (button["y"] + button["height"]) < 120
        assert page.locator("#generate").is_enabled() and not page.locator("#stop").is_visible()
    finally:
        page.close()


def test_a_clamped_number_is_said_in_validates_words(browser, app):
    page = open_page(browser, app, DESKTOP)
    try:
        box = page.locator("#duration input[type=number]")
        box.fill("9999")
        box.blur()  # the slider clamps to its maximum when the box loses focus
        note = page.locator(".m3-field-note")
        note.wait_for(timeout=2_000)
        said = sentence(duration=9999)  # "Duration (seconds) must be between 1 and 360, got 9999."
        assert note.inner_text() == f"{said[:-1]}: it is set to {c.MAX_DURATION_S:g}."
    finally:
        page.close()


def test_phone_layout_keeps_generate_on_screen_and_examples_lead_to_the_form(browser, app):
    page = open_page(browser, app, PHONE)
    try:
        in_view = ("(s) => { const r = document.querySelector(s).getBoundingClientRect();"
                   " return r.top >= 0 && r.bottom <= window.innerHeight; }")
        page.wait_for_function(in_view, arg="#generate", timeout=5_000)  # on the first screen once laid out
        page.wait_for_timeout(300)
        page.screenshot(path=str(ARTIFACTS / "truth-phone-390.png"))
        page.mouse.wheel(0, 5000)  # anywhere on the page
        page.wait_for_timeout(400)
        assert page.evaluate(in_view, "#generate"), "Generate scrolled away"
        # A refusal shows in the bar too, on screen.
        page.locator("#generate").click()
        wait_text(page, "#refusal", "Describe the music first", timeout=2_000)
        assert page.evaluate(in_view, "#refusal")
        # An example (far down the page) fills the form and brings it into view, with a note saying so.
        example = page.locator("#examples button").first
        example.scroll_into_view_if_needed()
        example.click()
        page.wait_for_function("() => document.querySelector('#description textarea').value.length > 0")
        page.wait_for_function(in_view.replace("r.bottom <= window.innerHeight", "r.top < window.innerHeight / 2"),
                               arg="#description textarea", timeout=5_000)
        assert "Filled in from the example" in page.locator("#m3-toast").inner_text()
    finally:
        page.close()


def test_stop_is_not_an_error(context, app):
    page = open_page(context, app)
    try:
        fill_form(page, "slow ambient pad", "[verse]\nla la la")
        set_number(page, "duration", 120)
        page.locator("#generate").click()
        wait_text(page, "#run-progress", "elapsed", timeout=30_000)
        page.locator("#stop").click()
        wait_text(page, "#run-status", "Stopped", timeout=5_000)
        deadline = time.monotonic() + 3.0  # the badge used to come 0.3-2 s after "Stopped"
        while time.monotonic() < deadline:
            assert error_badges(page) == 0, "Stop left an error badge"
            page.wait_for_timeout(100)
        assert page.locator("#generate").is_enabled() and not page.locator("#stop").is_visible()
        assert "Stopped" in page.locator("#run-status").inner_text()
    finally:
        page.close()


def test_stop_then_generate_at_once_delivers_the_next_song(browser, app):
    """Stop, then Generate as soon as the button is back: the page's one event stream per session must carry the
    new song to the end, not close with the stopped one (gradio_client lost a song this way)."""
    page = open_page(browser, app, DESKTOP)  # a fresh profile: its history starts empty
    try:
        fill_form(page, "slow ambient pad", "[verse]\nla la la")
        set_number(page, "steps", 1)
        set_number(page, "duration", 120)
        page.locator("#generate").click()
        wait_text(page, "#run-progress", "elapsed", timeout=30_000)
        set_number(page, "duration", 2)  # what the next Generate makes
        page.locator("#stop").click()
        page.wait_for_function("() => !document.querySelector('#generate').disabled", timeout=5_000, polling=10)
        page.locator("#generate").click()
        wait_text(page, "#run-status", "Finished", timeout=900_000)
        player_holds_the_whole_song(page, 2.0)
        page.wait_for_function("() => document.querySelectorAll('.m3-reuse').length === 1")
        assert error_badges(page) == 0
    finally:
        page.close()


def test_generate_pressed_while_the_stopped_run_is_still_ending_starts_the_next_song(browser, tmp_path):
    """Stop gives Generate back at once, but the stopped run's handler ends a moment later (on a busy server, much
    later). A Generate pressed in between must start the new song once it has ended: Gradio drops a trigger of an
    event still pending unless the event takes it as its last ("always_last"). The test holds the job registry's
    lock (which the stopped run takes to end) while it presses Generate, so the moment is as long as it likes."""
    import threading

    from test_delivery import in_process_app

    with in_process_app(tmp_path) as (ctx, url):
        page = browser.new_page(viewport=DESKTOP)
        page.set_default_timeout(30_000)
        try:
            page.goto(url)
            page.wait_for_selector("#generate", timeout=60_000)
            fill_form(page, "slow ambient pad", "[verse]\nla la la")
            set_number(page, "steps", 1)
            set_number(page, "duration", 120)
            page.locator("#generate").click()
            wait_text(page, "#run-progress", "elapsed", timeout=300_000)  # (the model loads first)
            set_number(page, "duration", 2)
            held, release = threading.Event(), threading.Event()

            def hold() -> None:
                with ctx.registry._lock:
                    held.set()
                    release.wait(30)

            page.locator("#stop").click()
            page.wait_for_function("() => !document.querySelector('#generate').disabled", timeout=5_000, polling=10)
            holder = threading.Thread(target=hold)
            holder.start()
            try:
                assert held.wait(10)
                page.locator("#generate").click()
                page.wait_for_timeout(2_000)  # the click's own handler and its start of the run have come and gone
            finally:
                release.set()
                holder.join()
            wait_text(page, "#run-progress", "elapsed", timeout=60_000)  # the new song runs
            wait_text(page, "#run-status", "Finished", timeout=300_000)
        finally:
            page.close()


def player_holds_the_whole_song(page, seconds: float) -> None:
    """The page's player (#result-audio) holds the whole song: its metadata says `seconds`. Its preload is a hint,
    which a busy browser may leave unserved (nothing fetched: readyState 0, network not loading); the check then asks
    for the metadata, as pressing play would, and a failure names the element's state."""
    ready = ("() => { const a = document.querySelector('#result-audio audio'); if (!a) return false;"
             " if (a.readyState === 0 && a.networkState !== 2 && a.currentSrc) a.load();"
             f" return Math.abs(a.duration - {seconds}) < 0.05; }}")
    try:
        page.wait_for_function(ready, timeout=90_000, polling=1_000)  # (a loaded CI box)
    except Exception:
        # Every audio element of the player (a stale one first would explain an empty source), whether the result
        # panel shows, and the status line: what tells a song never handed to the page from a player left behind.
        state = page.evaluate("() => ({audios: [...document.querySelectorAll('#result-audio audio')].map(a => ({src:"
                              " a.currentSrc, ready: a.readyState, network: a.networkState, duration: a.duration,"
                              " error: a.error && a.error.code})), result_shown: !!(document.querySelector('#result')"
                              " && document.querySelector('#result').offsetParent), status: (document.querySelector("
                              "'#run-status') || {}).innerText})")
        raise AssertionError(f"the player's audio never said {seconds} s: {state}") from None


def test_ctrl_enter_streams_then_one_player_and_history_survives_a_reload(context, app):
    page = open_page(context, app)
    page.wait_for_selector("#live-box", state="hidden", timeout=5_000)  # no empty live player before a song
    fill_form(page, "bright synth-pop", "[verse]\nhello there")
    set_number(page, "duration", 9)  # two flow chunks: the first is heard before the song is finished
    set_number(page, "steps", 1)
    page.locator("#lyrics textarea").press("Control+Enter")
    wait_text(page, "#run-progress", "elapsed", timeout=10_000)
    # Streaming on the CPU: the live player appears (only) once there is audio, before the song is finished.
    assert not page.locator("#live-box").is_visible()
    page.wait_for_selector("#live-box", state="visible", timeout=900_000)
    assert "Finished" not in page.locator("#run-status").inner_text()
    wait_text(page, "#run-status", "Finished", timeout=900_000)
    page.wait_for_function("() => document.querySelectorAll('.m3-reuse').length === 1")
    # One player for the song: the finished one (the live one has given way), none in the history row.
    page.wait_for_selector("#live-box", state="hidden")
    players = page.evaluate("() => [...document.querySelectorAll('audio')].filter(a => a.offsetParent !== null)"
                            ".map(a => a.closest('[id]') && a.closest('[id]').id)")
    assert players == ["result-audio"], players
    player_holds_the_whole_song(page, 9.0)
    # The picture and the FLAC / MP3 downloads are written after the song is handed over: they fill in.
    page.wait_for_selector("#waveform img", state="visible", timeout=30_000)
    assert all(page.locator(f"#download-{kind}").is_visible() for kind in ("wav", "flac", "mp3"))
    page.wait_for_timeout(500)
    page.screenshot(path=str(ARTIFACTS / "truth-desktop-1440.png"), full_page=True)

    # The list is drawn once per page load (its re-renders go through the queue carrying the stored songs): a second
    # drawing replaced the buttons' listeners, and a click in between was lost on a busy machine.
    drawings = []
    page.on("request", lambda r: drawings.append(r) if "queue/join" in r.url and "bright synth-pop" in
            (r.post_data or "") else None)
    page.reload()
    page.wait_for_selector("#model-status")
    page.wait_for_function("() => document.querySelectorAll('.m3-reuse').length === 1", timeout=10_000)
    assert "bright synth-pop" in page.locator("#history").inner_text()
    page.locator(".m3-play").click()  # the history's song plays in the page's one player
    player_holds_the_whole_song(page, 9.0)
    assert len(drawings) == 1, f"the history was drawn {len(drawings)} times on one page load"
    page.close()


def test_variations_each_get_their_own_player_and_history_row(browser, app):
    page = open_page(browser, app, DESKTOP)  # a fresh profile: its history starts empty
    try:
        fill_form(page, "warm lo-fi beat", "[verse]\nhello again")
        set_number(page, "duration", 2)
        set_number(page, "steps", 1)
        page.locator("#variations").get_by_text("3", exact=True).click()
        page.locator("#generate").click()
        page.wait_for_selector("#variation-3", state="visible", timeout=60_000)  # a card per further variation
        wait_text(page, "#variation-3", "Variation 3")
        wait_text(page, "#run-status", "3 variations made", timeout=900_000)
        for player in ("#result-audio", "#variation-2-audio", "#variation-3-audio"):
            page.wait_for_function("(s) => { const a = document.querySelector(s + ' audio');"
                                   " return a && Math.abs(a.duration - 2.0) < 0.05; }", arg=player)
        seeds = [page.locator(f"#variation-{n} .m3-variation-title").first.inner_text() for n in (2, 3)]
        first = int(page.locator("#seed input").input_value())
        assert f"seed {first + 1}" in seeds[0].replace("`", "") and f"seed {first + 2}" in seeds[1].replace("`", "")
        page.wait_for_function("() => document.querySelectorAll('.m3-reuse').length === 3")
        assert error_badges(page) == 0
        page.screenshot(path=str(ARTIFACTS / "truth-variations-1440.png"), full_page=True)
    finally:
        page.close()


def test_the_app_pipeline_streams_on_the_cpu():
    """The app's pipelines run the flow stage beside the semantic one, on the CPU too: a 12-s song's first audio
    comes while frames are still being made, and the pieces make the whole song."""
    import numpy as np

    from music3_demo.serve.holder import ModelHolder

    holder = ModelHolder("tiny", ["cpu"], warmup=False)
    events = []
    with holder.acquire() as lease:
        song = lease.pipeline.generate(GenerationRequest("pop", "[verse]\nla", duration=12.0, num_steps=1, seed=4),
                                       on_event=events.append)
    holder.release()
    first_piece = next(i for i, e in enumerate(events) if isinstance(e, AudioPiece))
    last_frame = max(i for i, e in enumerate(events) if isinstance(e, Progress) and e.stage == "semantic")
    assert first_piece < last_frame and events[last_frame].done == c.max_frames_for(12.0)
    assert np.array_equal(np.concatenate([e.samples for e in events if isinstance(e, AudioPiece)], axis=-1),
                          song.audio)
