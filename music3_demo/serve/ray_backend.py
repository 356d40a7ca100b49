"""The Ray backend's front (`--backend ray`): this process keeps the page, the API and the line of songs, and the
`SongWorker` replicas of a Ray cluster make the songs (ray_worker.py).

The line is the front's own scheduler over one pool, the cluster, whose places are the replicas' batch slots as they
report them on the board (each at most the deployment's `max_ongoing_requests`), so places and estimated starts
count every replica, and a song is sent only when a place is free: Serve's router then finds the replica that has
it. Each song streams back through a streaming handle; closing the song's events (Stop, a closed page, a cancelled
API job) cancels the response in a `finally`, which cancels the song on its replica. A replica that dies mid-song
(its process or node lost): the song is started once more on another replica with the same seed, so it is the same
song (on the same GPU model), and the listener gets only the pieces after what it already has; a second loss is a
sentence. `status` lists every replica (its slots, songs, memory) from the board. Nothing here runs a model: the
front needs no GPU, and the tokenizer that counts prompt tokens comes from a replica.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import ray
from ray import serve
from ray.exceptions import RayError
from ray.serve.exceptions import RequestCancelledError

from .. import contract as c
from ..events import AudioPiece, Cancelled, Event
from ..semantic.config import GraphConfig
from .holder import HolderStatus, too_long_on
from .ray_worker import SongBoard, SongWorker
from .runner import Job, Phase, Waiting, handed_back, received
from .scheduler import Scheduler, Ticket
from .speed import Speed

log = logging.getLogger("music3_demo.cluster")

APP = "music3"
POOL = "cluster"  # the front scheduler's one device: every replica's places
BOARD_POLL_S = 0.25  # how often the front reads the board (status and places are this fresh)
# A replica stops only when its songs are done, or after this: twice the longest song's length, since a replica
# slower than real time could not serve anyway.
GRACEFUL_SHUTDOWN_S = 2 * c.MAX_DURATION_S
LOST_MESSAGE = ("The server making your song stopped, and starting the song again on another one failed too: "
                "please try again in a minute.")
RESTART_TEXT = "the server making your song stopped: starting it again on another one"
PACKAGE = Path(__file__).resolve().parents[1]


class ReplicaLost(RuntimeError):
    """A song's replica died twice (str: the sentence for the user)."""


def connect(address: str | None) -> bool:
    """Join the Ray cluster at `address`, or start one on this machine (its GPUs); True when this process started
    it. RuntimeError with one sentence when the cluster cannot be joined."""
    # The package travels with the job, so the cluster's nodes need only the requirements installed.
    options = {"runtime_env": {"py_modules": [str(PACKAGE)]}, "logging_level": logging.WARNING}
    try:
        if address:
            ray.init(address=address, **options)
        else:  # "local": never some other cluster that RAY_ADDRESS or an old session file names
            ray.init(address="local", include_dashboard=False, **options)
    except Exception as error:  # noqa: BLE001 - Ray's reasons vary (no cluster there, no token, versions)
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise RuntimeError(
            f"Could not {'join the Ray cluster at ' + address if address else 'start a Ray cluster here'}: "
            f"{reason}. A cluster that uses token authentication (Ray 2.60+) needs its token in this process too: "
            "RAY_AUTH_MODE=token with RAY_AUTH_TOKEN or ~/.ray/auth_token (docs/DEPLOY.md).") from error
    return not address


class RayBackend:
    """A `backend.SongBackend` whose songs are made by SongWorker replicas on a Ray cluster."""

    def __init__(self, model: str, engine: str = "auto", precision: str = "auto", replica_device: str | None = None,
                 replicas: int | None = None, slots: int | None = None, warmup: bool = True, preload: bool = True,
                 max_running: int | None = None, address: str | None = None, dit_precision: str = "auto",
                 kv_precision: str = "auto") -> None:
        """`replica_device`: what each replica runs on (cuda:0, cuda:0+cuda:1 for a stage split, or cpu: the
        default is cuda:0 on a cluster with GPUs); `replicas`: how many (default: the cluster's GPUs over the GPUs
        a replica takes); `slots`: songs a replica takes at once (default: the engines' batch slots)."""
        self.model = model
        self._own_cluster = connect(address)
        gpus = int(ray.cluster_resources().get("GPU", 0))
        device = replica_device or ("cuda:0" if gpus else "cpu")
        # One replica per GPU (two for a stage split); placed by GPU even when it computes on the CPU (tests).
        per_replica = (2 if "+" in device else 1) if gpus else 0
        self.replicas = replicas or max(1, gpus // max(per_replica, 1))
        self.slots = slots or GraphConfig().slots
        self._board = SongBoard.remote()
        serve.start(proxy_location="Disabled")  # the front is the only way in
        worker = serve.deployment(SongWorker, name="SongWorker").options(
            num_replicas=self.replicas, max_ongoing_requests=self.slots,
            ray_actor_options={"num_gpus": per_replica, "num_cpus": 1},
            graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_S)
        log.info("starting %d SongWorker replica(s) on %s, %d song(s) each", self.replicas, device, self.slots)
        self._handle = serve.run(worker.bind(model, engine, precision, replica_device, warmup, preload,
                                             self._board, dit_precision, kv_precision), name=APP, route_prefix=None)
        self._reports: dict[str, dict] = {}
        self._tokenizer = None
        self.scheduler = Scheduler([POOL], self._places, limit=max_running,
                                   loaded=lambda _: any(r["state"] == "ready" for r in self._reports.values()))
        self._stopped = threading.Event()
        self._read_board()
        threading.Thread(target=self._follow_board, name="music3-board-reader", daemon=True).start()

    @classmethod
    def from_flags(cls, args) -> RayBackend:
        return cls(args.model, args.engine, args.precision, args.replica_device, args.replicas, args.replica_slots,
                   args.warmup, args.preload, args.concurrency, args.ray_address, args.dit_precision,
                   args.kv_precision)

    # ---- the board ------------------------------------------------------------------------------------------------
    def _read_board(self) -> None:
        reports = ray.get(self._board.snapshot.remote(), timeout=10)
        changed = {n: self._slots_of(r) for n, r in reports.items()} != {
            n: self._slots_of(r) for n, r in self._reports.items()}
        self._reports = reports
        if changed:
            self.scheduler.refresh()
        if self._tokenizer is None and any(r["state"] == "ready" for r in reports.values()):
            self._tokenizer = self._handle.tokenizer.remote().result(timeout_s=60)

    def _follow_board(self) -> None:
        while not self._stopped.wait(BOARD_POLL_S) and ray.is_initialized():  # (a ray call would start Ray again)
            try:
                self._read_board()
            except Exception as error:  # noqa: BLE001 - keep serving on what it last said; the next read may do
                log.warning("could not read the replicas' board: %s", error)

    def _slots_of(self, report: dict) -> int:
        return min(sum(report["slots"].values()), self.slots)

    def _places(self, _: str) -> int:
        return sum(map(self._slots_of, self._reports.values()))

    # ---- what the page shows --------------------------------------------------------------------------------------
    def status(self) -> HolderStatus:
        reports = list(self._reports.values())
        ready = [r for r in reports if r["state"] == "ready"]
        failed = [r for r in reports if r["state"] == "failed"]
        if ready:
            state, phase = "ready", f"ready on {len(ready)} of {self.replicas} replica(s)"
        elif reports and len(failed) == len(reports):
            state, phase = "failed", "failed to load"
        elif reports and all(r["state"] == "idle" for r in reports):
            state, phase = "idle", "not loaded yet: each replica loads the model on its first song"
        else:
            state = "loading"
            phase = next((r["phase"] for r in reports if r["state"] == "loading"), "starting the replicas")
        first = (ready or reports or [{}])[0]
        names = [f.name for f in dataclasses.fields(HolderStatus)]
        fields = {name: first.get(name) for name in names}  # the replica's engine, precision, notice, ...
        running = {r["replica"]: sum(r["running"].values()) for r in reports}
        loading = [r["loading_for_s"] for r in reports if r["loading_for_s"] is not None]
        memory = {f"{r['replica']} {gpu}": figures for r in reports for gpu, figures in (r["memory"] or {}).items()}
        plans = {f"{r['replica']} {device}": plan for r in reports for device, plan in (r["memory_plan"] or {}).items()}
        return HolderStatus(**fields | {
            "model": self.model, "state": state, "phase": phase, "devices": tuple(running),
            "busy": tuple(name for name, songs in running.items() if songs),
            "slots": {r["replica"]: self._slots_of(r) for r in reports}, "running": running,
            "waiting": self.scheduler.waiting() + sum(r["waiting"] for r in reports),
            "engine_note": next((r["engine_note"] for r in reports if r["engine_note"]), None),
            "memory": memory or None, "memory_plan": plans or None,
            "plan_summary": next((r["plan_summary"] for r in ready if r["plan_summary"]), None),
            "error": failed[0]["error"] if failed and not ready else None,
            "loading_for_s": max(loading) if loading else None, "loads": sum(r["loads"] for r in reports),
        })

    @property
    def has_tokenizer(self) -> bool:
        return self._tokenizer is not None

    def count_tokens(self, description: str, lyrics: str) -> int | None:
        if self._tokenizer is None:
            return None
        from ..prompt import count_prompt_tokens

        return count_prompt_tokens(self._tokenizer, description, lyrics)

    def too_long(self, prompt_tokens: int | None, frames: int) -> str | None:
        """The refusal for a song that no ready replica's memory plan holds even alone, or None."""
        return too_long_on([plan for r in self._reports.values() if r["state"] == "ready" for plan in r["plans"]],
                           prompt_tokens, frames)

    # ---- the line -------------------------------------------------------------------------------------------------
    def ticket(self, request=None, max_frames: int | None = None, group: int | None = None) -> Ticket:
        """A place in the front's line (a replica's memory is its own line's business)."""
        if request is None:
            return Ticket(group=group)
        return Ticket(frames=max_frames if max_frames is not None else request.max_frames, steps=request.num_steps,
                      group=group)

    def enqueue(self, tickets: list[Ticket]) -> list[Ticket]:
        return self.scheduler.enqueue(tickets)

    def speeds(self) -> list[Speed]:
        return [Speed(**r["speed"]) for r in self._reports.values() if r.get("speed")]

    def speed(self) -> Speed | None:
        return min(self.speeds(), key=lambda speed: speed.frames_per_s, default=None)

    def estimate_s(self, frames: int, steps: int) -> float | None:
        times = [speed.seconds_for(frames, steps) for speed in self.speeds()]
        return max(times) if times else None

    def expected_s(self, ticket: Ticket) -> float | None:
        return self.estimate_s(ticket.frames, ticket.steps)

    def start_in(self, ticket: Ticket) -> float | None:
        return self.scheduler.start_in(ticket, self.expected_s)

    # ---- songs ----------------------------------------------------------------------------------------------------
    def song_events(self, job: Job, tick: float, wake: threading.Event | None = None
                    ) -> Iterator[Event | Phase | Waiting | None]:
        request = job.request.with_seed()  # a song started again elsewhere must be the same song
        live: dict = {}

        def work(put) -> None:
            def waiting(position: int, start_in_s: float | None) -> None:
                job.record.position, job.record.starts_in_s = position, start_in_s
                put(Waiting(position, start_in_s))

            try:
                self.scheduler.wait(job.ticket, job.cancel, waiting, self.expected_s)
                job.record.position = job.record.starts_in_s = None
                self._stream(job, request, put, live)
            except BaseException as error:  # the hand-off raises it again in the consumer's thread
                if job.record.state in ("queued", "running"):
                    job.record.state = "cancelled" if job.cancel.is_set() else "failed"
                    job.record.error = str(error) or type(error).__name__
                raise
            finally:
                self.scheduler.leave(job.ticket)

        try:
            yield from handed_back(work, f"music3-job-{job.record.id}", job.cancel, tick, wake)
        finally:
            response = live.get("response")
            if response is not None:
                response.cancel()  # the replica's generator gets CancelledError: the song leaves its batch

    def _stream(self, job: Job, request, put, live: dict) -> None:
        """The song from a replica, its events put in order; once more on another replica if its replica dies."""
        have = 0  # samples the listener already has
        for attempt in range(2):
            response = self._handle.options(stream=True).generate.remote(request, job.record, job.continue_from)
            live["response"] = response
            try:
                for item in response:
                    if (item := received(job, item)) is None:
                        continue
                    if isinstance(item, AudioPiece):
                        item = _after(item, have)
                        if item is None:
                            continue
                        have = item.start_sample + item.samples.shape[-1]
                    put(item)
                return
            except RequestCancelledError:
                raise Cancelled() from None
            except RayError as error:
                if job.cancel.is_set():
                    raise Cancelled() from None
                if attempt:
                    raise ReplicaLost(LOST_MESSAGE) from error
                log.warning("job %s: its replica stopped (%s); starting the song again on another",
                            job.record.id, str(error).splitlines()[0] if str(error) else type(error).__name__)
                put(Phase(RESTART_TEXT))

    def preload(self, background: bool = True) -> None:
        """Nothing to do here: each replica loads its model as it starts (unless --lazy-load)."""

    def release(self) -> None:
        """Stop the replicas (each after its songs, within GRACEFUL_SHUTDOWN_S) and, when this process started the
        cluster, the cluster."""
        self._stopped.set()
        try:
            serve.delete(APP)
        except Exception as error:  # noqa: BLE001 - the cluster went first: nothing of ours is left on it
            log.warning("could not stop the SongWorker replicas: %s", error)
        finally:
            if self._own_cluster:
                ray.shutdown()


def _after(piece: AudioPiece, have: int) -> AudioPiece | None:
    """The part of `piece` after the first `have` samples (None: it is all there already)."""
    end = piece.start_sample + piece.samples.shape[-1]
    if end <= have:
        return None
    if piece.start_sample >= have:
        return piece
    return AudioPiece(piece.samples[:, have - piece.start_sample:], have)
