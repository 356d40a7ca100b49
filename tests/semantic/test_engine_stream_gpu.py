"""GPU: the engine's copies out (`EngineStream.copy_out`) wait for the block that wrote the rows, not for the blocks
queued on the engine's stream after it, and no later work on that stream overwrites the rows before they are read.
On the engine's own stream a copy waited behind `in_flight` more blocks: a first chunk's frames reached the flow
stage ~0.16 s after they were made."""

from __future__ import annotations

import time

import pytest
import torch

from music3_demo.semantic.engine_stream import EngineStream

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

LATER_S = 0.3  # the blocks queued behind the one whose rows are copied out


def _spin_cycles(seconds: float) -> int:
    """GPU clock cycles that torch.cuda._sleep spins for about `seconds` (measured, clocks vary)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 10_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return int(cycles * seconds / (start.elapsed_time(end) / 1e3))


def test_a_copy_out_waits_for_its_block_only_and_later_writes_wait_for_it():
    device = torch.device("cuda")
    stream = EngineStream(device, flag_rows=2, places=1)
    cycles = _spin_cycles(LATER_S)
    for attempt in ("warm-up", "measured"):  # the first round loads the kernels and the copy stream's memory
        with stream.scope():
            rows = torch.arange(16, device=device, dtype=torch.float32)
            done = stream.mark()  # the block that wrote `rows` ends here
            torch.cuda._sleep(cycles)  # the blocks queued after it
        asked = time.perf_counter()
        copy, copied = stream.copy_out(done, rows.clone)
        with stream.scope():
            rows.fill_(-1.0)  # a later block reusing the rows: ordered after the copy
        copied.synchronize()
        waited = time.perf_counter() - asked
        stream.synchronize()
        assert torch.equal(copy, torch.arange(16, device=device, dtype=torch.float32))
        assert torch.equal(rows, torch.full_like(rows, -1.0))
    assert waited < LATER_S / 3, f"the copy waited {waited:.3f} s behind later work"
