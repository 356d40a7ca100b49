"""The cluster's side of the Ray backend: `SongWorker`, the Ray Serve deployment that makes songs (one replica per
GPU, two for a stage split), and `SongBoard`, where every replica posts how it stands for the front to read.

A replica is the in-process app's serving layer on its own device: a model holder (its pipeline, its line, its
measured speed) and the job runner. `generate` is an async generator streamed to the front through a streaming
handle: the song runs on a thread of its own (the GPU loop never blocks the replica's event loop) and its events,
record snapshots and failure come back as values (`runner.relayed_events`, as from a ZeroGPU worker). When the front
cancels the response, Serve raises `CancelledError` in the generator, which sets the song's cancel flag: the
pipeline stops within a frame block or a denoising step and the song leaves the batch. Ray Serve routes a request
only to a replica with fewer than `max_ongoing_requests` (its batch slots) in flight, restarts a replica that dies,
and waits `graceful_shutdown_timeout_s` for running songs before it stops one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time

import ray
from ray import serve

from ..continuation import SongState
from ..request import GenerationRequest
from .holder import ModelHolder
from .runner import JobRecord, RecordUpdate, relayed_events

log = logging.getLogger("music3_demo.cluster")

REPORT_EVERY_S = 1.0  # a replica's report to the board, also sent at once when a song starts or ends
STALE_AFTER_S = 5.0  # a replica silent this long is gone (killed, its node lost)
_DONE = object()


@ray.remote(num_cpus=0)
class SongBoard:
    """Each replica's latest status (its holder's, plus who and where it is), for the front's `status` and places."""

    def __init__(self) -> None:
        self._reports: dict[str, tuple[float, dict]] = {}

    def report(self, replica: str, status: dict) -> None:
        self._reports[replica] = (time.monotonic(), status)

    def snapshot(self) -> dict[str, dict]:
        """The replicas heard from within STALE_AFTER_S, by name."""
        now = time.monotonic()
        return {name: status for name, (at, status) in self._reports.items() if now - at < STALE_AFTER_S}


def replica_device(device: str | None) -> str:
    """What this replica runs on: the flag's value, else its first GPU (Ray shows it only the GPUs it was given),
    else the CPU."""
    if device:
        return device
    import torch

    return "cuda:0" if torch.cuda.is_available() else "cpu"


class SongWorker:
    """One replica: a pipeline on its device (loaded in the background, so Serve counts it up at once and the front
    shows the load), songs streamed back as they are made."""

    def __init__(self, model: str, engine: str, precision: str, device: str | None, warmup: bool, preload: bool,
                 board, dit_precision: str = "auto", kv_precision: str = "auto") -> None:
        replica = serve.get_replica_context().replica_id
        self.device = replica_device(device)
        # The name the front shows in status, in song reports and job records: unique in the cluster.
        self.name = f"replica {replica.unique_id} ({self.device} on {ray.util.get_node_ip_address()})"
        self.actor = replica.to_full_id_str()  # its Ray actor's name (namespace "serve")
        self.holder = ModelHolder(model, [self.device], engine, warmup=warmup, precision=precision,
                                  dit_precision=dit_precision, kv_precision=kv_precision)
        self._board = board
        self._changed = threading.Event()
        if preload:
            self.holder.preload(background=True)
        ray.get(board.report.remote(self.name, self.report()))  # the front knows it once serve.run returns
        threading.Thread(target=self._keep_reporting, name="music3-board", daemon=True).start()

    def report(self) -> dict:
        speed = self.holder.speed()
        return self.holder.status().as_dict() | {
            "replica": self.name, "actor": self.actor, "device": self.device,
            "speed": dataclasses.asdict(speed) if speed is not None else None,
            "plans": self.holder.plans(),  # the front refuses a song no replica holds (memory_layout.MemoryPlan)
        }

    def _keep_reporting(self) -> None:
        while True:
            self._changed.wait(REPORT_EVERY_S)
            self._changed.clear()
            try:
                self._board.report.remote(self.name, self.report())
            except Exception as error:  # noqa: BLE001 - the board went with its front; the next front brings one
                log.debug("no board to report to: %s", error)

    def tokenizer(self):
        """The model's tokenizer (None until fetched), so the front counts prompt tokens without the weights."""
        return self.holder.tokenizer

    async def generate(self, request: GenerationRequest, record: JobRecord, continue_from: SongState | None):
        """The song's `relayed_events` (no idle ticks), `RecordUpdate`s naming this replica as the device."""
        loop = asyncio.get_running_loop()
        items: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()

        def work() -> None:
            try:
                for item in relayed_events(self.holder, request, record, 0.5, continue_from, cancel):
                    if isinstance(item, RecordUpdate):
                        if item.fields.get("device") is not None:
                            item = RecordUpdate(item.fields | {"device": self.name})
                        self._changed.set()  # placed, or ended: the board hears it now
                    if item is not None:
                        loop.call_soon_threadsafe(items.put_nowait, item)
            finally:
                self._changed.set()
                loop.call_soon_threadsafe(items.put_nowait, _DONE)

        threading.Thread(target=work, name=f"music3-replica-job-{record.id}", daemon=True).start()
        try:
            while (item := await items.get()) is not _DONE:
                yield item
        finally:
            cancel.set()  # the front cancelled the response (CancelledError here) or the song is over
