"""Songs sharing one pipeline's flow stage: the pipeline's FlowExecutor runs every song's DiT and vocoder
calls; merged calls equal per-song calls; concurrent songs equal the same songs made alone; a lone song never waits
for a partner.

On the CPU the shared modules hold nothing that two songs could corrupt (no captured graphs; the vocoder's
weight-norm hooks and the DiT's rotary cache recompute equal values), so the concurrency test passes on the code
before the executor too: the hazard is on CUDA (static graph buffers, tensors crossing streams), shown by
tests/flow/test_flow_batch_gpu.py. Here the same test pins the contract with and without merging.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from torch.nn.utils.weight_norm import WeightNorm

from music3_demo import random_models
from music3_demo.bench.flow_batch import hold_executor
from music3_demo.flow.call_queue import HOLD_UNTIL_S, MergePlan, Order
from music3_demo.flow.executor import FlowExecutor, tiled_vocode
from music3_demo.flow.guidance import guided_velocity
from music3_demo.flow.stream import FlowSettings, FlowStream, full_chunk_latents
from music3_demo.flow.worker import FirstChunks
from music3_demo.pipeline import Music3Pipeline
from music3_demo.request import GenerationRequest

STEPS = 2
# Two short songs (one 100-frame chunk each: equal lengths, so their calls can merge) with their own prompts, seeds
# and guidance scales; kept short because the tiny model's eager semantic stage dominates the test's time.
SONGS = {
    "a": GenerationRequest("ambient", "[verse]\nhello", duration=4.0, num_steps=STEPS, guidance_scale=1.7, seed=21),
    "b": GenerationRequest("rock", "[verse]\nyeah", duration=4.0, num_steps=STEPS, guidance_scale=2.5, seed=5),
}
# float32 on the CPU: a merged call's rows may take other matrix-kernel blockings than a lone call's, so one call
# agrees to ~1e-6; through a song's steps and the vocoder (the tiny random model amplifies) the audio to ~1e-5 in
# relative L2 (a few samples differ by up to ~4e-4); the bound keeps a 30x margin.
CLOSE = dict(rtol=1e-4, atol=1e-5)
AUDIO_CLOSE = 1e-3  # a mixed-up row or scale is off by O(1)


@pytest.fixture(scope="module")
def pipeline(tiny_folder):
    # overlap=True: the app's configuration (the holder's), with batched CFG and a flow generator per song.
    return Music3Pipeline.from_pretrained(str(tiny_folder), device="cpu", engine="reference", overlap=True)


@pytest.fixture(scope="module")
def alone(pipeline):
    return {name: pipeline.generate(request).audio for name, request in SONGS.items()}


def _together(pipeline) -> dict:
    songs, errors = {}, []

    def make(name):
        try:
            songs[name] = pipeline.generate(SONGS[name])
        except BaseException as error:  # noqa: BLE001 - reported by the test
            errors.append(error)

    threads = [threading.Thread(target=make, args=(name,)) for name in SONGS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors
    return songs


def test_concurrent_songs_equal_the_same_songs_made_alone(pipeline, alone):
    assert pipeline.flow_executor.mode == "auto" and pipeline.flow_executor.plans["eager"].buckets == [1]
    songs = _together(pipeline)
    for name, song in songs.items():
        assert np.array_equal(song.audio, alone[name]), name  # nothing merged: exactly the lone numbers
        assert song.timings["flow_shared_calls"] == 0


def test_concurrent_songs_with_merged_calls_match_alone(pipeline, alone):
    executor = pipeline.flow_executor
    executor.set_mode("always")
    before = executor.stats["velocity_x2"]
    try:
        # Hold the executor until both songs' first DiT calls are queued, so they merge whatever the timing.
        hold_executor(executor, 2)
        songs = _together(pipeline)
    finally:
        executor.set_mode("auto")
    assert executor.stats["velocity_x2"] > before
    for name, song in songs.items():
        assert song.timings["flow_shared_calls"] >= 1, name
        assert song.audio.shape == alone[name].shape
        error = np.linalg.norm(song.audio - alone[name]) / np.linalg.norm(alone[name])
        print(f"song {name}: merged vs alone, relative L2 {error:.2e}")
        assert error < AUDIO_CLOSE, name


@pytest.fixture(scope="module")
def components():
    return random_models.build_components(random_models.TINY, seed=0)


@pytest.fixture(scope="module")
def modules(components):
    return components["transformer"], components["vocoder"]


def _call(transformer, length: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    latents = torch.randn(1, transformer.config.in_channels, length, generator=generator)
    condition = torch.randn(1, length, transformer.config.condition_dim, generator=generator)
    timestep = torch.rand(1, generator=generator)
    return latents, timestep, condition, 1.0 + seed / 4


def test_merged_calls_equal_per_song_calls(modules):
    transformer, vocoder = modules
    executor = FlowExecutor(transformer, vocoder, torch.device("cpu"), mode="always")
    gate = threading.Event()
    executor.submit_call(gate.wait)  # everything below is queued before the executor takes any of it
    calls = [_call(transformer, 37, seed) for seed in range(3)] + [_call(transformer, 20, 3)]
    chunks = [torch.randn(1, vocoder.config.latent_channels, 11, generator=torch.Generator().manual_seed(s))
              for s in range(2)]
    pending = [executor.submit_velocity(*call) for call in calls] + [executor.submit_vocode(c) for c in chunks]
    gate.set()
    results = [p.result(timeout=60) for p in pending]
    executor.close()
    # The three 37-latent calls ran as one DiT call (each its own timestep, condition and scale), the 20-latent one
    # alone (the model has no mask: only equal lengths merge), the two vocoder chunks as one call.
    assert executor.stats["velocity_x3"] == 1 and executor.stats["velocity_x1"] == 1
    assert executor.stats["vocode_x2"] == 1
    assert [p.partners for p in pending] == [2, 2, 2, 0, 1, 1]
    with torch.no_grad():
        for call, got in zip(calls, results[:4]):
            expected = guided_velocity(transformer, *call, batched=True)
            assert got.shape == expected.shape
            torch.testing.assert_close(got, expected, **CLOSE)
        for chunk, got in zip(chunks, results[4:]):
            torch.testing.assert_close(got, vocoder(chunk), **CLOSE)


def test_a_lone_song_never_waits_for_a_partner(components):
    """With every merge allowed, a song alone still runs at once: each call is taken as soon as the executor is
    free, never held for a partner that may come (a song's chunk here, its partner never arriving)."""
    executor = FlowExecutor(components["transformer"], components["vocoder"], torch.device("cpu"), mode="always")
    waits = []
    for seed in range(4):
        pending = executor.submit_velocity(*_call(components["transformer"], 37, seed))
        pending.result(timeout=30)  # a policy that held calls for a partner would hang here
        waits.append(pending.started - pending.submitted)
    assert max(waits) < 1.0, waits  # the thread's wake-up only, even on a loaded machine

    hidden = components["language_model"].config.hidden_size
    frames = torch.randn(210, 8 * hidden, generator=torch.Generator().manual_seed(1))
    flow = FlowStream(components, FlowSettings(STEPS, batched_cfg=True), torch.Generator().manual_seed(1),
                      torch.device("cpu"), executor=executor)
    done = threading.Thread(target=lambda: flow.push(frames) + flow.finish())
    done.start()
    done.join(timeout=120)
    assert not done.is_alive()
    assert set(executor.stats) == {"calls", "velocity_x1", "vocode_x1"}
    executor.close()


def test_a_tiled_vocoder_call_gives_the_whole_chunks_samples(modules):
    """Where the card's plan has no room for a whole chunk's vocoder activations the executor decodes it in tiles:
    the same samples (the halo covers what the decoder's convolutions see; in float64, so rounding cannot hide a
    missing input); a halo too short would not."""
    vocoder = type(modules[1]).from_config(modules[1].config)
    vocoder.load_state_dict(modules[1].state_dict())
    vocoder.double()
    latents = torch.randn(1, vocoder.config.latent_channels, 300, generator=torch.Generator().manual_seed(3),
                          dtype=torch.float64)
    executor = FlowExecutor(modules[0], vocoder, torch.device("cpu"), vocoder_tile=64)
    with torch.no_grad():
        whole = vocoder(latents)
        got = executor.vocode(latents)
        assert got.shape == whole.shape
        torch.testing.assert_close(got, whole, rtol=1e-9, atol=1e-12)
        assert (tiled_vocode(vocoder, latents, 64, halo=4) - whole).abs().max() > 1e-3  # the test can fail
    executor.close()


def test_the_executors_vocoder_calls_leave_no_second_copy_of_the_weights_behind(modules):
    """The vocoder's weight-norm hooks compute each convolution's weight before every call and leave it on the module
    (a second copy of the weights no plan counts, which stayed on the card when the stages took turns): after each
    executor call none is left, and the next call, which computes them again, gives the same samples bit for bit,
    as a direct call does."""
    vocoder = type(modules[1]).from_config(modules[1].config)
    vocoder.load_state_dict(modules[1].state_dict())
    executor = FlowExecutor(modules[0], vocoder, torch.device("cpu"))
    normed = [(module, hook.name) for module in vocoder.modules() for hook in module._forward_pre_hooks.values()
              if isinstance(hook, WeightNorm)]
    assert normed and all(name in module.__dict__ for module, name in normed)  # (computed at load)
    latents = torch.randn(1, vocoder.config.latent_channels, 40, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        first = executor.vocode(latents)
        assert not any(name in module.__dict__ for module, name in normed)
        assert torch.equal(executor.vocode(latents), first)
        assert torch.equal(vocoder(latents), first)
    executor.close()


def test_a_failing_call_reaches_its_song_and_the_executor_keeps_serving(modules):
    transformer, vocoder = modules
    executor = FlowExecutor(transformer, vocoder, torch.device("cpu"))

    def broken():
        raise ValueError("a bad call")

    with pytest.raises(ValueError, match="a bad call"):
        executor.call(broken)
    call = _call(transformer, 16, 0)
    with torch.no_grad():
        assert torch.equal(executor.velocity(*call), guided_velocity(transformer, *call, batched=True))
    executor.close()
    with pytest.raises(RuntimeError, match="shut down"):
        executor.velocity(*call)


def test_merge_plan_keeps_only_buckets_measured_faster():
    # 2 songs in one call beat two calls; 4 do not beat four by the margin: never merge four.
    plan = MergePlan.measured({1: 1.0, 2: 1.6, 4: 3.95})
    assert plan.buckets == [1, 2]
    assert [plan.choose(ready) for ready in (1, 2, 3, 4)] == [1, 2, 2, 2]
    # Only 4 pays: a pair runs as two lone calls rather than half-filling a bucket of 4; 3 fill one.
    plan = MergePlan.measured({1: 1.0, 2: 1.99, 4: 2.8})
    assert plan.buckets == [1, 4]
    assert [plan.choose(ready) for ready in (1, 2, 3, 4)] == [1, 1, 4, 4]
    assert MergePlan.lone().choose(4) == 1 and MergePlan.always().choose(3) == 4
    with pytest.raises(ValueError):
        FlowExecutor(None, None, torch.device("cpu"), mode="sometimes")


def _wait_for(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def test_urgent_calls_go_ahead_of_calls_queued_before_them_and_merge_only_with_each_other(modules):
    """A song's first chunk (`urgent`: before its first audio) is taken before other songs' later chunks queued
    earlier, its vocoder call too; urgent calls merge with urgent ones only. Nothing else changes order."""
    transformer, vocoder = modules
    executor = FlowExecutor(transformer, vocoder, torch.device("cpu"), mode="always")
    gate = threading.Event()
    executor.submit_call(gate.wait)
    _wait_for(lambda: executor.queued() == 0)  # the gate call is running: the rest queue behind it
    chunk = torch.randn(1, vocoder.config.latent_channels, 11, generator=torch.Generator().manual_seed(0))
    later = [executor.submit_velocity(*_call(transformer, 37, seed)) for seed in range(2)]
    later_vocode = executor.submit_vocode(chunk)
    first = [executor.submit_velocity(*_call(transformer, 37, seed), order=Order(first_chunk=0.0)) for seed in (2, 3)]
    first_vocode = executor.submit_vocode(chunk, order=Order(first_chunk=0.0))
    gate.set()
    for pending in later + [later_vocode] + first + [first_vocode]:
        pending.result(timeout=60)
    executor.close()
    assert first[0].started == first[1].started < first_vocode.started < later[0].started == later[1].started
    assert first_vocode.started < later_vocode.started
    assert [p.partners for p in first + later] == [1, 1, 1, 1]  # the two first chunks merged, the later two too


def test_a_hold_runs_ahead_of_first_chunk_calls_submitted_after_it(modules):
    """The benches' and tests' hold (`hold_executor`) is running when it returns: two songs' first-chunk calls
    submitted right after it queue behind it and merge. A hold merely queued would be passed by those urgent calls
    and then wait out its timeout for calls that never come."""
    transformer, vocoder = modules
    executor = FlowExecutor(transformer, vocoder, torch.device("cpu"), mode="always")
    try:
        for _ in range(3):
            hold = hold_executor(executor, 2, timeout=5.0)
            first = [executor.submit_velocity(*_call(transformer, 37, seed), order=Order(first_chunk=0.0))
                     for seed in (0, 1)]
            for pending in first:
                pending.result(timeout=60)
            hold.result(timeout=60)
            assert hold.started < first[0].started == first[1].started
            assert [p.partners for p in first] == [1, 1]
    finally:
        executor.close()


def test_first_chunks_run_one_song_after_another_in_the_order_they_began(modules):
    """Songs that reach their first chunk together get their first audio one after another: the chunk that began
    first has its calls taken first, even when another song's call was queued before them (FIFO alternated the
    songs' steps, so every song waited for the last one's chunk)."""
    transformer, _ = modules
    executor = FlowExecutor(transformer, modules[1], torch.device("cpu"), mode="off")
    gate = threading.Event()
    executor.submit_call(gate.wait)
    _wait_for(lambda: executor.queued() == 0)
    a, b = Order(first_chunk=2.0), Order(first_chunk=1.0)  # b's chunk began first
    calls = [(name, executor.submit_velocity(*_call(transformer, 37, seed), order=order))
             for seed, (name, order) in enumerate([("a", a), ("b", b), ("a", a), ("b", b)])]
    gate.set()
    for _, pending in calls:
        pending.result(timeout=60)
    executor.close()
    ran = [name for name, pending in sorted(calls, key=lambda item: item[1].started)]
    assert ran == ["b", "b", "a", "a"], ran


def test_first_chunks_merge_only_where_it_lowers_the_mean_wait():
    """A merged call of b first chunks makes all b wait for it; one after another they wait (b + 1) / 2 lone calls
    on average. On a compute-bound GPU (the H200's DiT: 4 songs in 3.9 lone calls) first chunks do not merge, later
    chunks still do."""
    compute_bound = {1: 0.37, 2: 0.70, 4: 1.43}
    assert MergePlan.measured(compute_bound).buckets == [1, 2, 4]
    assert MergePlan.for_first_chunks(compute_bound).buckets == [1]
    assert MergePlan.for_first_chunks({1: 1.0, 2: 1.2, 4: 1.8}).buckets == [1, 2, 4]


def test_later_chunks_wait_while_a_song_gathers_its_first_frames(modules):
    """While a song's caller gathers its first chunk's frames, other songs' later chunks wait, unless their listener
    has less than HOLD_UNTIL_S of audio left; calls that say nothing about a listener are never held."""
    transformer, _ = modules
    executor = FlowExecutor(transformer, modules[1], torch.device("cpu"), mode="off")
    now = time.perf_counter()
    try:
        with executor.gathering():
            far = executor.submit_velocity(*_call(transformer, 37, 1), order=Order(audio_until=now + 60.0))
            due = executor.submit_velocity(*_call(transformer, 37, 2),
                                           order=Order(audio_until=now + HOLD_UNTIL_S / 2))
            plain = executor.submit_call(lambda: "ran")
            due.result(timeout=60)
            assert plain.result(timeout=60) == "ran"
            time.sleep(0.2)
            assert far.started is None  # still held: its listener has a minute of audio
            released = time.perf_counter()
        far.result(timeout=60)
        assert far.started >= released
    finally:
        executor.close()


def test_a_later_chunk_says_until_when_its_listener_has_audio(components):
    """A stream's first chunk is urgent (when it began); each later chunk's calls carry when a listener who began at
    the first audio runs out of what was made so far."""
    executor = FlowExecutor(components["transformer"], components["vocoder"], torch.device("cpu"))
    orders: list[Order] = []
    submit = executor._submit
    executor._submit = lambda pending: (orders.append(pending.order), submit(pending))[1]
    hidden = components["condition_encoder"].config.condition_hidden_dim
    stream = FlowStream(components, FlowSettings(STEPS, 1.7, batched_cfg=True), torch.Generator().manual_seed(1),
                        torch.device("cpu"), executor=executor)
    try:
        first = stream.push(torch.randn(200, 8 * hidden, generator=torch.Generator().manual_seed(2)))
        assert orders and all(order.urgent and order.first_chunk == stream.timings.first_chunk.began
                              for order in orders)
        count = len(orders)
        stream.push(torch.randn(100, 8 * hidden, generator=torch.Generator().manual_seed(3)))
    finally:
        executor.close()
    made_s = first[0].samples.shape[-1] / 44100
    later = orders[count:]
    assert later and all(not order.urgent for order in later)
    assert all(order.audio_until == pytest.approx(stream.timings.first_chunk.done + made_s) for order in later)


def test_a_first_chunk_runs_before_another_songs_later_chunk_queued_ahead_of_it(components):
    """Two songs on one executor (as in a pipeline, the tiny model on the CPU): song A is past its first audio and
    its last chunk's first DiT call waits in the queue; then song B's first chunk arrives behind it. B's call runs
    first: a user who joins mid-song does not wait behind the other songs' chunks. (FIFO ran A's first.)"""
    executor = FlowExecutor(components["transformer"], components["vocoder"], torch.device("cpu"))
    hidden = components["condition_encoder"].config.condition_hidden_dim

    def stream(seed: int) -> FlowStream:
        return FlowStream(components, FlowSettings(STEPS, 1.7, batched_cfg=True), torch.Generator().manual_seed(seed),
                          torch.device("cpu"), executor=executor)

    def frames(count: int, seed: int) -> torch.Tensor:
        return torch.randn(count, 8 * hidden, generator=torch.Generator().manual_seed(seed))

    a, b = stream(1), stream(2)
    assert len(a.push(frames(200, 3))) == 1  # A's first audio: it plays on
    lengths: list[int] = []  # the latent length of each DiT call, in the order the executor ran them
    hook = components["transformer"].register_forward_pre_hook(
        lambda module, args, kwargs: lengths.append(kwargs["hidden_states"].shape[-1]), with_kwargs=True)
    gate = threading.Event()
    try:
        executor.submit_call(gate.wait)
        _wait_for(lambda: executor.queued() == 0)
        results = {}
        songs = {"a": lambda: a.push(frames(50, 4)) + a.finish(),  # A's last chunk: 150 frames (a shorter call)
                 "b": lambda: b.push(frames(200, 5))}  # B's first chunk: 200 frames
        threads = {}
        for count, (name, make) in enumerate(songs.items(), start=1):
            threads[name] = threading.Thread(target=lambda name=name, make=make: results.update({name: make()}))
            threads[name].start()
            _wait_for(lambda count=count: executor.queued() == count)  # A's call is queued before B's
        gate.set()
        for thread in threads.values():
            thread.join(timeout=120)
    finally:
        hook.remove()
        gate.set()
        executor.close()
    assert results["a"] and results["b"]
    full = full_chunk_latents(components)  # B's chunk; A's last one is shorter
    short = min(lengths)
    # B's first call ran before A's, queued ahead of it (after that, whichever song has a call queued runs: B's
    # next call comes only once its first has returned)
    assert lengths[0] == full and set(lengths) == {full, short} and short < full, lengths
    assert lengths.count(full) == STEPS and lengths.count(short) == STEPS
    first = b.timings.first_chunk  # what the song's timings report (A's is its chunk 0, made before)
    assert first.began <= first.first_call_started <= first.denoised <= first.done and first.executor_wait_s > 0


def test_other_songs_wait_between_blocks_while_a_first_chunk_is_denoised():
    """`FirstChunks`, the pipeline's record of first chunks being denoised: a caller waits while one is (the
    semantic batch then stands still), not at all otherwise, and a cancel ends the wait."""
    chunks = FirstChunks()
    assert chunks.wait() < 0.05
    inside, release = threading.Event(), threading.Event()

    def first_audio():
        with chunks.denoising():
            inside.set()
            release.wait(30)

    holder = threading.Thread(target=first_audio)
    holder.start()
    inside.wait(30)
    threading.Timer(0.3, release.set).start()
    assert chunks.wait() >= 0.25  # until that song's first audio
    holder.join(30)
    assert chunks.wait() < 0.05
    inside.clear()
    release.clear()
    holder = threading.Thread(target=first_audio)
    holder.start()
    inside.wait(30)
    cancel = threading.Event()
    threading.Timer(0.1, cancel.set).start()
    assert chunks.wait(cancel) < 5  # the waiting song was cancelled
    release.set()
    holder.join(30)


def test_a_first_chunk_keeps_its_turn_between_its_calls():
    """Between two calls of a first chunk, the song's next call comes from its own thread a moment later: the queue
    keeps the turn for it (up to TURN_S) instead of giving the GPU to another song's first chunk, and gives it up
    at the chunk's vocoder call. (Without the turn, songs starting together alternated step by step.)"""
    from dataclasses import dataclass as _dataclass

    from music3_demo.flow.call_queue import TURN_S, CallQueue

    @_dataclass(eq=False)
    class Call:
        order: Order
        key: tuple

    queue = CallQueue({"graph": (1, 2, 4), "eager": (1, 2, 4), "vocode": (1, 2, 4)})
    a, b = Order(first_chunk=1.0), Order(first_chunk=2.0)
    step = ("velocity", "graph", (8, 689), (689, 16), "bf16")
    queue.calls += [Call(a, step), Call(b, step)]
    assert queue.take()[0][0].order is a
    assert queue.take() == ([], 0)  # a's next step is on its way: b waits
    assert 0 < queue.held_for() <= TURN_S
    queue.calls.append(Call(a, step))
    assert queue.take()[0][0].order is a
    queue.calls.append(Call(a, ("vocode", "vocode", (64, 689), "f32")))
    assert queue.take()[0][0].order is a
    assert queue.take()[0][0].order is b  # a's chunk is done: no turn kept
    c = Order(first_chunk=3.0)
    queue.calls.append(Call(c, step))
    assert queue.take() == ([], 0)  # b's turn
    time.sleep(TURN_S * 1.5)
    assert queue.take()[0][0].order is c  # b's next call did not come within TURN_S: the turn passes on


def test_flow_worker_streams_are_lent_and_reused(monkeypatch):
    """A pipeline's flow workers take their streams from its pool and give them back, so the next song reuses a
    stream (and the allocator's blocks cached for it) instead of a new one per song; songs at once get their own."""
    from music3_demo.flow.worker import FLOW_PRIORITY, StreamPool

    made = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda device, priority=0: made.append(priority) or object())
    pool, cuda = StreamPool(FLOW_PRIORITY), torch.device("cuda", 0)
    first = pool.take(cuda)
    pool.give_back(cuda, first)
    assert pool.take(cuda) is first and made == [-1]  # the flow stage's high priority
    second = pool.take(cuda)
    assert second is not first and pool.created == 2
    assert pool.take(torch.device("cpu")) is None
