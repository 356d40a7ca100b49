"""The graph engine's batch scheduler on plain values (no engine, no tensors): admission first come, first served
into places and KV regions, prefill chunks cut as alone, the bucket that replays, what a read-back block makes, and
songs leaving. (The engine carrying its plans out, song by song bit for bit: test_batch.py.)"""

from __future__ import annotations

from music3_demo.semantic.scheduler import PARKING, BatchScheduler, ScheduledSong, song_positions

CHUNK = 4


def _scheduler(places: int = 4, pool: int | None = 1024, in_flight: int = 1, limit: int | None = None):
    scheduler = BatchScheduler(places, tuple(b for b in (1, 2, 4, 8) if b <= places), CHUNK, replay_block=2,
                               in_flight=in_flight, pool_limit=limit)
    if pool is not None:
        scheduler.use_pool(pool)
    return scheduler


def _song(tokens: int, frames: int = 4, prompt: object = None) -> ScheduledSong:
    return ScheduledSong(tokens, frames, prompt if prompt is not None else ("prompt", tokens, frames))


def test_eight_songs_at_once_each_prefill_in_their_own_chunks():
    """Eight prompts admitted in one round: every prompt is cut at multiples of the chunk from its start, as alone,
    no round prefills more than one chunk, and the oldest waiting chunk is never passed over."""
    scheduler = _scheduler(places=8, in_flight=100)
    lengths = [6, 9, 3, 4, 1, 11, 5, 2]
    songs = [_song(n, prompt=index) for index, n in enumerate(lengths)]
    for song in songs:
        scheduler.add(song)
    cuts: dict[int, list] = {index: [] for index in range(8)}
    first = scheduler.plan()
    assert [admission.song for admission in first.admit] == songs and sorted(scheduler.active) == list(range(8))
    plans = [first]
    while not all(song.live for song in songs):
        plans.append(scheduler.plan())
    for plan in plans:
        assert sum(chunk.end - chunk.begin for chunk in plan.prefill) <= CHUNK
        for chunk in plan.prefill:
            cuts[chunk.song.place].append((chunk.begin, chunk.end))
    for song, length in zip(songs, lengths):
        assert cuts[song.place] == [(begin, min(begin + CHUNK, length)) for begin in range(0, length, CHUNK)]


def test_a_song_that_does_not_fit_waits_and_so_does_every_song_behind_it():
    scheduler = _scheduler(pool=PARKING + 2 * song_positions(8, 4))
    first, big, small = _song(8), _song(100), _song(1)
    for song in (first, big, small):
        scheduler.add(song)
    plan = scheduler.plan()
    assert [a.song for a in plan.admit] == [first] and (first.place, first.start) == (0, PARKING)
    assert list(scheduler.waiting) == [big, small]  # small fits, but big is ahead of it
    assert scheduler.pool_to_grow() is None  # a song runs: the pool grows only when the batch is idle
    assert not scheduler.can_admit(1, 1)  # someone is waiting
    assert scheduler.leave(first) and scheduler.retire_gone() == [first]
    assert scheduler.pool_to_grow() == big.positions
    scheduler.use_pool(PARKING + big.positions + small.positions)
    assert [a.song for a in scheduler.plan().admit] == [big, small]


def test_a_variation_copies_a_prompt_only_once_it_is_in_place():
    scheduler = _scheduler()
    original, early, later = _song(6, prompt="same"), _song(6, prompt="same"), _song(6, prompt="same")
    scheduler.add(original)
    scheduler.add(early)
    plan = scheduler.plan()  # both admitted while the original's prompt is still being prefilled: no copy
    assert [a.copy_from for a in plan.admit] == [None, None]
    assert [(c.song, c.begin, c.end) for c in plan.prefill] == [(original, 0, 4)]
    while not original.live:
        scheduler.plan()
    scheduler.add(later)
    admission = scheduler.plan().admit[0]
    assert admission.song is later and admission.copy_from is original and later.live
    assert later.peers == 2 and original.peers == 2


def test_blocks_replay_the_smallest_bucket_holding_every_place_and_read_back_in_order():
    scheduler = _scheduler(in_flight=1)
    songs = [_song(2, frames=3) for _ in range(3)]
    for song in songs:
        scheduler.add(song)
    first = scheduler.plan()  # the chunk budget prefills two prompts; the third waits for the next round
    assert [c.song for c in first.prefill] == songs[:2] and first.launch.bucket == 4  # places 0..2 admitted
    assert {place: done for place, (_, done) in first.launch.steps.items()} == {0: 2, 1: 2}
    second = scheduler.plan().launch  # one block may be queued ahead of the oldest
    assert {place: done for place, (_, done) in second.steps.items()} == {0: 4, 1: 4, 2: 2}  # total = 3 + 1
    assert scheduler.plan().collect is first.launch
    third = scheduler.plan().launch
    assert scheduler.plan().collect is second and third.steps[2][1] == 4


def test_a_read_back_block_hands_over_the_frames_before_the_end_token_and_frees_the_song():
    scheduler = _scheduler(in_flight=5)
    ends_early, runs_out = _song(2, frames=10), _song(2, frames=3)
    scheduler.add(ends_early)
    scheduler.add(runs_out)
    blocks = [scheduler.plan().launch, scheduler.plan().launch]
    no_end = 1 << 30
    made = scheduler.collected(blocks[0], [no_end, no_end])  # steps 0, 1 ran: frame 0 exists
    assert [(m.song, m.frames, m.steps) for m in made] == [(ends_early, (0, 1), None), (runs_out, (0, 1), None)]
    # steps 2, 3: the first song sampled the end token at step 3 (no frame 2 from it); the second made its 3 frames
    made = scheduler.collected(blocks[1], [3, no_end])
    assert [(m.song, m.frames, m.steps) for m in made] == [(ends_early, (1, 2), 4), (runs_out, (1, 3), 4)]
    assert not scheduler.active and scheduler.regions.free == scheduler.regions.positions - PARKING
    assert ends_early.emitted == 2 and runs_out.emitted == 3


def test_leaving_the_line_and_a_fixed_pool():
    scheduler = _scheduler(pool=None, limit=PARKING + song_positions(4, 4))
    assert scheduler.can_admit(4, 4) and not scheduler.can_admit(5, 4)  # the fixed size decides before a pool exists
    waiting = _song(4)
    scheduler.add(waiting)
    assert not scheduler.leave(waiting) and not scheduler.waiting and not scheduler.busy
    songs = [_song(2), _song(3)]
    scheduler.use_pool(1024)
    for song in songs:
        scheduler.add(song)
    scheduler.plan()
    failed = scheduler.fail()
    assert failed == songs and all(song.finished for song in failed) and not scheduler.busy
    assert scheduler.regions.free == 1024 - PARKING


def test_no_frames_are_queued_ahead_of_a_first_chunk_until_it_is_heard():
    """A song asks for its first 5 frames (6 steps) at once: blocks go ahead as usual while they are queued; once
    they are, a block is queued only when none is in flight (its first chunk's audio has the GPU), until its caller
    has heard that audio; a second song still gathering its own urgent steps keeps the batch running ahead."""
    scheduler = _scheduler(in_flight=3)
    song = ScheduledSong(2, 40, "a", urgent=6)
    scheduler.add(song)
    launched = [scheduler.plan().launch for _ in range(3)]  # prefill + 2 steps, 4, 6: its urgent steps are queued
    assert [block.steps[0][1] for block in launched] == [2, 4, 6]
    assert scheduler.lookahead() == 0
    assert scheduler.plan().collect is launched[0]  # (the old plan queued a fourth block here)
    assert scheduler.plan().collect is launched[1] and scheduler.plan().collect is launched[2]
    assert scheduler.plan().launch is not None  # nothing in flight: one block at a time (whoever drives goes on)
    assert scheduler.plan().collect is not None
    later = ScheduledSong(2, 40, "b", urgent=6)  # another song joins: while it gathers, the batch runs ahead
    scheduler.add(later)
    assert scheduler.plan().launch is not None and scheduler.lookahead() == 3
    assert scheduler.plan().launch is not None
    song.heard = later.heard = True
    assert scheduler.lookahead() == 3
