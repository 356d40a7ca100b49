"""Gradio keeps a copy of the page's config for every session it meets; every call of the plain HTTP API is a
session of its own. The sweep drops the idle ones that hold no State value, so a server polled for its status does
not collect copies (and the collector's full passes over them) without end; a session with a State value stays."""

from __future__ import annotations

import time

import gradio as gr
import httpx
from gradio_client import Client

from music3_demo.ui import sessions


def build() -> gr.Blocks:
    with gr.Blocks() as demo:
        out = gr.JSON(visible=False)
        kept = gr.State(None)
        for index in range(20):  # a page of some size: each session's copy builds every component's config
            gr.Textbox(f"field {index}", visible=False)

        async def status() -> dict:
            sessions.keep_sessions_bounded(demo)
            return {"ok": True}

        def remember(value: str) -> tuple:
            return value, {"kept": value}

        gr.Button(visible=False).click(status, None, out, api_name="status", queue=False)
        note = gr.Textbox(visible=False)
        gr.Button(visible=False).click(remember, note, [kept, out], api_name="remember")
    return demo


def call_status(http: httpx.Client, url: str) -> None:
    event = http.post(f"{url}gradio_api/call/status", json={"data": []}).json()["event_id"]
    with http.stream("GET", f"{url}gradio_api/call/status/{event}") as response:
        assert any(line.startswith("event: complete") for line in response.iter_lines())


def test_idle_sessions_without_state_are_dropped_and_a_session_with_state_stays(monkeypatch):
    """Sweeps every 0.2 s; while the sessions are made nothing is idle long enough to go (however slow the machine
    makes them), then the idle time drops to 0.5 s and every session but the State value's goes."""
    monkeypatch.setattr(sessions, "IDLE_S", 60.0)
    monkeypatch.setattr(sessions, "EVERY_S", 0.2)
    demo = build()
    _, url, _ = demo.launch(prevent_thread_lock=True, quiet=True)
    try:
        holder = demo.state_holder
        with httpx.Client(timeout=30) as http:
            for _ in range(12):  # each plain HTTP call: a session of its own
                call_status(http, url)
        keeper = Client(url, verbose=False)
        keeper.predict("mine", api_name="/remember")  # a session that holds a State value
        assert len(holder.session_data) >= 13
        monkeypatch.setattr(sessions, "IDLE_S", 0.5)
        deadline = time.monotonic() + 10
        while len(holder.session_data) > 1:
            assert time.monotonic() < deadline, f"{len(holder.session_data)} sessions still held"
            time.sleep(0.1)
        (left,) = holder.session_data.values()
        assert left.state_data  # the State value's session, untouched
        assert keeper.predict("again", api_name="/remember") == {"kept": "again"}  # it still answers
        with httpx.Client(timeout=30) as http:
            call_status(http, url)  # a new session after a sweep is served as any other
    finally:
        demo.close()


def test_a_session_in_use_is_kept_until_it_has_been_idle():
    demo = build()
    _, url, _ = demo.launch(prevent_thread_lock=True, quiet=True)
    try:
        with httpx.Client(timeout=30) as http:
            call_status(http, url)
        holder = demo.state_holder
        held = len(holder.session_data)
        assert held >= 1
        assert sessions.sweep(holder, idle_s=60.0) == 0  # just used: kept
        assert sessions.sweep(holder, idle_s=0.0) == held  # idle and without State: dropped
        assert not holder.session_data
    finally:
        demo.close()
