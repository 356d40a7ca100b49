"""Who runs next: the line of songs waiting for a device, the songs each device runs, and when a waiting song should
start.

A device runs as many songs at once as its pipeline has slots (the semantic engine's batch slots while the flow stage
can take that many songs side by side; 1 before the device is loaded), and a song joins only when the device says its
memory can hold it (`admits`, the engine's KV-pool check), so a song waits in line instead of running out of memory.
The line is strictly first come, first served across devices: only its head is placed, on the device with the most
room (a variation goes where its siblings run, so they share the prefill and the batch), and nobody overtakes a song
that waits for room. The estimate of a waiting song's start plays the line forward on the songs' expected times.
Every change publishes the counts (songs running per device, songs waiting) as one value that `running()` and
`waiting()` read without the lock, so the status endpoint never waits behind a song being placed.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ..events import Cancelled
from ..request import InvalidRequest

_ids = itertools.count(1)
# How often a waiting song checks its cancel flag and refreshes what its user is told.
POLL_S = 0.1


@dataclass(eq=False)
class Ticket:
    """One song's place: in the line, then on a device until it leaves."""

    frames: int = 0  # the most frames it may make (its KV need)
    steps: int = 1  # denoising steps (for its expected time)
    prompt_tokens: int | None = None  # None: not known yet (the tokenizer is not loaded); counted when placed
    text: tuple[str, str] | None = None  # (description, lyrics sent), to count the prompt's tokens then
    group: int | None = None  # variations of one request share a group
    id: int = field(default_factory=lambda: next(_ids))
    submitted: float = field(default_factory=time.monotonic)
    device: str | None = None  # set when placed
    started: float | None = None
    joined: bool = False  # the engine holds its memory (its first frames came), so `admits` counts it
    left: bool = False
    refused: Exception | None = None  # the device check's sentence for a song no device can ever hold (too long)
    peers: int = 0  # the most other songs that ran on its device at the same time as it

    @property
    def placed(self) -> bool:
        return self.device is not None


# admits(device, tickets): whether the device's memory holds these songs together with those already joined there.
# It raises InvalidRequest for a last ticket that no device can ever hold: that song leaves the line with the sentence.
AdmitFn = Callable[[str, list[Ticket]], bool]
# expected_s(ticket): seconds the song will take once started; None when nothing has been measured yet.
ExpectedFn = Callable[[Ticket], float | None]


class Scheduler:
    def __init__(self, devices: list[str], capacity: Callable[[str], int], admits: AdmitFn | None = None,
                 limit: int | None = None, loaded: Callable[[str], bool] | None = None) -> None:
        """`capacity(device)`: songs it may run at once now; `limit`: songs at once over all devices (None: no
        limit beyond the devices'); `loaded(device)`: whether its model is loaded (an unloaded one is used last)."""
        self.devices = list(devices)
        self._capacity = capacity
        self._loaded = loaded or (lambda device: True)
        self._admits = admits
        self.limit = limit
        self._line: deque[Ticket] = deque()
        self._running: dict[str, list[Ticket]] = {device: [] for device in self.devices}
        self._changed = threading.Condition()
        self._counts: tuple[dict[str, int], int] = ({device: 0 for device in self.devices}, 0)  # published

    # ---- the line ---------------------------------------------------------------------------------------------
    def enqueue(self, tickets: list[Ticket]) -> list[Ticket]:
        """Put songs at the end of the line together (nobody else's song lands between them)."""
        with self._changed:
            self._line.extend(tickets)
            self._place()
        return tickets

    def wait(self, ticket: Ticket, cancel: threading.Event | None = None,
             on_wait: Callable[[int, float | None], None] | None = None,
             expected_s: ExpectedFn | None = None, every_s: float = 1.0) -> str:
        """Block until the ticket has a device and return it; `Cancelled` (the ticket gone from the line) when
        `cancel` is set first. While it waits, `on_wait(position, start_in_s)` hears where it stands: at once, when
        its place changes and every `every_s`."""
        told, told_at = None, 0.0
        with self._changed:
            if ticket not in self._line and not ticket.placed and not ticket.left:
                self._line.append(ticket)
            while True:
                self._place()
                if ticket.placed:
                    return ticket.device
                if ticket.refused is not None:
                    raise ticket.refused
                if ticket.left:  # withdrawn by its caller
                    raise Cancelled()
                if cancel is not None and cancel.is_set():
                    self._line.remove(ticket)
                    ticket.left = True
                    self._place()
                    self._changed.notify_all()
                    raise Cancelled()
                position = self._line.index(ticket) + 1
                if on_wait is not None and (position != told or time.monotonic() - told_at >= every_s):
                    start = self._start_in(ticket, expected_s) if expected_s is not None else None
                    told, told_at = position, time.monotonic()
                    on_wait(position, start)
                self._changed.wait(POLL_S)

    def joined(self, ticket: Ticket) -> None:
        """The song's memory is now the engine's (its first frames came): the device's check counts it from here."""
        with self._changed:
            ticket.joined = True
            self._place()
            self._changed.notify_all()

    def withdraw(self, ticket: Ticket) -> None:
        """Take a song out of the line if it is still waiting there (its caller went away before it started); a
        placed song keeps its place until its own `leave`, so its device is never promised twice while it stops."""
        with self._changed:
            if ticket in self._line:
                self._line.remove(ticket)
                ticket.left = True
                self._place()
                self._changed.notify_all()

    def leave(self, ticket: Ticket) -> None:
        """The song ended (finished, stopped or failed) or was never started: its place goes to the next."""
        with self._changed:
            ticket.left = True
            if ticket in self._line:
                self._line.remove(ticket)
            if ticket.device is not None and ticket in self._running[ticket.device]:
                self._running[ticket.device].remove(ticket)
            self._place()
            self._changed.notify_all()

    def refresh(self) -> None:
        """A device's capacity changed (it finished loading): place whoever now fits."""
        with self._changed:
            self._place()
            self._changed.notify_all()

    # ---- placing ----------------------------------------------------------------------------------------------
    def _place(self) -> None:
        """Place the line's head while it fits somewhere; a head that fits nowhere holds everyone behind it."""
        placed = False
        while self._line:
            head = self._line[0]
            try:
                device = self._device_for(head)
            except InvalidRequest as error:  # it never fits: it leaves, and the line moves on
                self._line.popleft()
                head.refused, head.left = error, True
                placed = True
                continue
            if device is None:
                break
            self._line.popleft()
            head.device, head.started = device, time.monotonic()
            running = self._running[device]
            running.append(head)
            for ticket in running:
                ticket.peers = max(ticket.peers, len(running) - 1)
            placed = True
        if placed:
            self._changed.notify_all()
        # Every change to the line or the places ends here (under the lock): publish the counts, replaced whole.
        self._counts = ({device: len(songs) for device, songs in self._running.items()}, len(self._line))

    def _device_for(self, ticket: Ticket) -> str | None:
        if self.limit is not None and sum(map(len, self._running.values())) >= self.limit:
            return None
        siblings = {t.device for t in itertools.chain(*self._running.values())
                    if ticket.group is not None and t.group == ticket.group}
        room = [device for device in self.devices if len(self._running[device]) < self._capacity(device)]
        # A variation's siblings' device first (shared prefill and batch), then the emptiest device; a device that
        # is not loaded yet (capacity 1, its first song loads it) only when every loaded one is full.
        room.sort(key=lambda d: (d not in siblings, not self._loaded(d), len(self._running[d]) - self._capacity(d)))
        for device in room:
            if self._admits is None:
                return device
            # Songs placed there but not yet holding engine memory are asked about together with this one, so two
            # songs placed at once cannot both be promised the same room.
            joining = [t for t in self._running[device] if not t.joined]
            if self._admits(device, joining + [ticket]):
                return device
        return None

    # ---- what a waiting user is told ---------------------------------------------------------------------------
    def _start_in(self, ticket: Ticket, expected_s: ExpectedFn) -> float | None:
        """Seconds until the ticket should start (a ticket not in line: as if it joined the line's end now): the
        songs ahead take the earliest free places in turn, each for its expected time; the running songs free theirs
        after what is left of theirs. The places are the devices' slots, no more than `limit` in all."""
        now = time.monotonic()
        free_at: list[float] = []
        room = 0
        for device in self.devices:
            running = self._running[device]
            for song in running:
                expected = expected_s(song)
                if expected is None:
                    return None
                free_at.append(max(expected - (now - song.started), 0.0))
            room += max(self._capacity(device) - len(running), 0)
        if self.limit is not None:  # a device's empty slot is no place while the limit is reached (_device_for)
            room = min(room, max(self.limit - len(free_at), 0))
        free_at.extend([0.0] * room)
        if not free_at:
            return None
        heapq.heapify(free_at)
        for ahead in [*self._line, *([] if ticket in self._line else [ticket])]:
            start = heapq.heappop(free_at)
            if ahead is ticket:
                return start
            expected = expected_s(ahead)
            if expected is None:
                return None
            heapq.heappush(free_at, start + expected)
        return None

    def start_in(self, ticket: Ticket, expected_s: ExpectedFn) -> float | None:
        with self._changed:
            return self._start_in(ticket, expected_s)

    def position(self, ticket: Ticket) -> int | None:
        """1 for the head of the line; None once placed (or gone)."""
        with self._changed:
            return self._line.index(ticket) + 1 if ticket in self._line else None

    def waiting(self) -> int:
        """Songs in line (as last published: never waits for the lock)."""
        return self._counts[1]

    def running(self) -> dict[str, int]:
        """Songs running per device (as last published: never waits for the lock)."""
        return dict(self._counts[0])
