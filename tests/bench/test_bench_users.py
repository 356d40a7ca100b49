"""`python -m music3_demo.bench users` drives the app on a lent GPU, where a broken summary costs device time: its
phase summaries and targets are checked here on made-up results."""

from __future__ import annotations

from music3_demo.bench import users


def test_phase_summary_and_targets():
    def song(first_audio: float, shared: int, handover: float = 0.2) -> dict:
        return {"duration_s": 60.0, "first_audio_s": first_audio, "shared_gpu_with": shared, "invalid": None,
                "handover_s": handover,  # song end on the server -> the client has its WAV
                "device": "cuda:0", "started_at": 100.0, "ended_at": 115.0}

    alone = users.phase_summary([{"wall_s": 15.0, "songs": [song(1.9, 0)]}])
    four = users.phase_summary([{"wall_s": 30.0 + i, "songs": [song(2.5, 3)]} for i in range(4)] +
                               [{"wall_s": 5.0, "error": "boom"}])
    assert alone["song_s_per_s"] == 4.0 and four["max_wall_s"] == 33.0 and four["max_shared_gpu_with"] == 3
    late = users.phase_summary([{"wall_s": 20.0, "songs": [song(2.0, 1, 0.1), song(2.0, 1, 0.3), song(2.0, 1, 4.9)]}])
    assert late["handover_s"] == {"median": 0.3, "max": 4.9}  # the late one shows, not only the typical
    assert four["failed"] == [{"wall_s": 5.0, "error": "boom"}] and four["song_s_per_s"] == round(240 / 33, 3)
    joined = users.phase_summary([{"user": "u0", "wall_s": 30.0, "songs": [song(2.5, 3)]},
                                  {"user": "u3", "wall_s": 30.0, "songs": [song(3.4, 3) | {"path": {
                                      "chunk0_frames_s": 2.6, "chunk0_done_s": 3.3}}]}])
    assert joined["slowest_first_audio"] == {"user": "u3", "chunk0_frames_s": 2.6, "chunk0_done_s": 3.3,
                                             "first_audio_s": 3.4}  # where the joining user's wait went
    memory = [("soak", t, [1000 + (200 if t >= 6 else 0), 500]) for t in range(8)]
    status = [("idle", 0.0, 0.9, 0.9), ("four", 1.0, 0.05, 0.06), ("four", 2.0, 0.15, 0.16)]  # (phase, t, took, client)
    result = users.targets({"phases": {"alone": alone, "four": four}, "memory_mib": memory, "status_samples": status})
    assert result["status_s"] == {"value": 0.15, "target": 0.2, "met": True}  # idle samples (loading) do not count
    assert result["handover_s"] == {"value": 0.2, "target": 0.5, "met": True}
    assert result["four_over_alone"] == {"value": 2.2, "target": 2.2, "met": True}
    assert result["eight_over_alone"]["value"] is None and result["first_audio_s"]["value"] == 2.5
    assert result["soak_memory_growth_mib"] == {"value": 200, "target": 1024, "met": True, "above_quarter_mark": 200}
    assert result["soak_memory_growth_by_kind_gb"] is None  # no status answer carried memory figures
    # The load's own swing (a busy first quarter, a quiet sample at its end) is not growth; what keeps rising is.
    swing = [("soak", t, [1000 + (600 if t in (1, 5) else 0)]) for t in range(8)]
    leak = [("soak", t, [1000 + 150 * t + (600 if t == 1 else 0)]) for t in range(8)]
    for series, grew, mark in ((swing, 0, 600), (leak, 2050 - 1750, 2050 - 1300)):
        figures = users.targets({"phases": {}, "memory_mib": series, "status_samples": []})["soak_memory_growth_mib"]
        assert (figures["value"], figures["above_quarter_mark"]) == (grew, mark)


def test_the_soaks_growth_is_told_apart_by_kind():
    """From status' memory figures: live tensors that grow after the first quarter show as `allocated`, memory torch
    does not see as `outside_torch`; the first quarter's growth (warming caches) and its peaks (songs in flight) do
    not count."""
    def kinds(t: int) -> dict:
        return {"cuda:0": {"process": 30.0 + 0.1 * t, "reserved": 25.0 + 0.1 * max(0, t - 2),
                           "allocated": 20.0 + (0.5 if t == 1 else 0.0), "outside_torch": 5.0 + 0.1 * min(t, 2)}}

    samples = [("soak", float(t), kinds(t)) for t in range(8)]
    result = users.targets({"phases": {}, "memory_mib": [("soak", t, [1000]) for t in range(8)],
                            "memory_kinds_gb": samples, "status_samples": []})
    growth = result["soak_memory_growth_by_kind_gb"]["cuda:0"]
    assert growth == {"process": 0.5, "reserved": 0.5, "allocated": 0.0, "outside_torch": 0.0}
    assert result["soak_idle_growth_gb"] is None  # (no idle samples around the soak)
    # With nothing in flight before and after: what the soak left behind, by kind.
    idle = [("before_soak", -1.0, kinds(0)), *samples, ("after_soak", 9.0, {"cuda:0": kinds(7)["cuda:0"] | {
        "allocated": 20.25}}), ("idle", 10.0, kinds(0))]
    result = users.targets({"phases": {}, "memory_mib": [("soak", t, [1000]) for t in range(8)],
                            "memory_kinds_gb": idle, "status_samples": []})
    assert result["soak_idle_growth_gb"] == {"cuda:0": {"process": 0.7, "reserved": 0.5, "allocated": 0.25,
                                                        "outside_torch": 0.2}}


def _song(device: str, started: float, ended: float) -> dict:
    return {"duration_s": 20.0, "first_audio_s": 1.8, "shared_gpu_with": 0, "invalid": None, "handover_s": 0.1,
            "device": device, "started_at": started, "ended_at": ended}


def test_songs_on_several_devices_at_once():
    """Each phase names the devices its songs ran on and how long two songs on different devices overlapped; on
    several devices the run needs a phase of several users with songs on every device at the same time."""
    apart = users.phase_summary([{"wall_s": 9.0, "songs": [_song("cuda:0", 0.0, 5.0)]},
                                 {"wall_s": 9.0, "songs": [_song("cuda:1", 6.0, 9.0)]}])
    together = users.phase_summary([{"wall_s": 9.0, "songs": [_song("cuda:1", 0.0, 5.0)]},
                                    {"wall_s": 9.0, "songs": [_song("cuda:0", 1.0, 4.0), _song("cuda:0", 4.0, 8.0)]}])
    one = users.phase_summary([{"wall_s": 9.0, "songs": [_song("cuda:0", 0.0, 5.0)]},
                               {"wall_s": 9.0, "songs": [_song("cuda:0", 1.0, 6.0)]}])
    assert apart["devices_used"] == ["cuda:0", "cuda:1"] and apart["max_overlap_s"] == -1.0
    assert together["max_overlap_s"] == 3.0 and one["max_overlap_s"] is None and one["devices_used"] == ["cuda:0"]
    alone = users.phase_summary([{"wall_s": 5.0, "songs": [_song("cuda:0", 0.0, 5.0)]}])
    assert users.spread({"alone": alone, "four": together}, 2) == {"devices": 2, "devices_used": 2,
                                                                   "max_overlap_s": 3.0, "met": True}
    assert users.spread({"four": apart}, 2)["met"] is False and users.spread({"four": one}, 2)["met"] is False
    assert users.spread({"four": together}, 1) is None and users.spread({"alone": alone}, 2) is None
