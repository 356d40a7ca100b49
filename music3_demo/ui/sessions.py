"""Gradio's per-session copies of the page, kept bounded.

Gradio keeps a `SessionState` for every session it meets: a copy of the Blocks' config with every component's
config built (`config_for_block` for each block, pydantic schemas among them), held until 10,000 newer sessions
push it out (`state_session_capacity`). Every call of the plain HTTP API (`/gradio_api/call/<name>`) is a session of
its own and every gradio_client `Client` one more, so a status poll twice a second left ~500 dicts and lists per
second behind it. Nothing frees them, and the collector's full passes walk them all while holding the interpreter:
on the tiny model's CPU server a full pass took 0.01 s at the start and 0.16 s four minutes later; in the H200 soak 7
of 9 stalls of the whole server (0.13-0.32 s, the `status` samples above 0.2 s among them) were such passes.

So a session that holds no `gr.State` value and has not been used for `IDLE_S` is dropped (on that CPU server the
tracked objects then level off near 85k instead of growing by ~1,100 a second). Nothing a user made lives in such a
session: the page's request ticket is a State value, which keeps its session, and its song history lives in the
browser; a dropped session that comes back gets a fresh copy, as a new one does. The sweep runs on the server's event
loop (`keep_sessions_bounded` from any coroutine handler attaches it), between Gradio's own uses of the holder, which
also run there; so does every attach, and no lock of ours is needed.
"""

from __future__ import annotations

import asyncio
import datetime
import weakref

IDLE_S = 30.0  # a session without State values unused this long is dropped
EVERY_S = 10.0  # between two sweeps

_ATTACHED: weakref.WeakSet = weakref.WeakSet()  # the state holders whose loop sweeps them


def sweep(holder, idle_s: float | None = None) -> int:
    """Drop `holder`'s sessions (a Gradio `StateHolder`) that hold no State value and were last used more than
    `idle_s` ago; how many were dropped. Call it on the event loop that serves the holder's Blocks."""
    idle = datetime.timedelta(seconds=IDLE_S if idle_s is None else idle_s)
    now = datetime.datetime.now()  # Gradio stamps its sessions with naive local times
    with holder.lock:
        stale = [session_id for session_id, session in holder.session_data.items()
                 if not session.state_data and now - holder.time_last_used.get(session_id, now) > idle]
        for session_id in stale:
            del holder.session_data[session_id]
            holder.time_last_used.pop(session_id, None)
    return len(stale)


def keep_sessions_bounded(blocks) -> None:
    """From a coroutine on the server's loop: sweep `blocks`' sessions every EVERY_S from now on (once per holder;
    nothing before Gradio made the holder)."""
    holder = getattr(blocks, "state_holder", None)
    if holder is None:
        return
    if holder in _ATTACHED:
        return
    _ATTACHED.add(holder)
    loop = asyncio.get_running_loop()
    holder_ref = weakref.ref(holder)

    def every() -> None:
        holder = holder_ref()
        if holder is None:  # the Blocks were closed and freed
            return
        sweep(holder)
        loop.call_later(EVERY_S, every)

    loop.call_later(EVERY_S, every)
