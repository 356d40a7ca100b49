"""The kernel profile's table (`bench profile`), from kernel durations shaped like the profiler's."""

from __future__ import annotations

from music3_demo.bench.kernel_profile import report


def test_profile_report_sums_kernels_per_unit_and_sorts_by_time():
    groups = {"gemv [128, 1, 1] x128": [0.010, 0.012, 0.011, 0.013], "attn [16, 16, 1] x128": [0.005, 0.007]}
    result = report(groups, units=2, unit="frame", wall_ms=0.05)
    assert [r["kernel"] for r in result["groups"]] == ["gemv [128, 1, 1] x128", "attn [16, 16, 1] x128"]
    assert abs(result["kernel_ms_per_frame"] - 0.029) < 1e-12 and result["kernels_per_frame"] == 3
    assert abs(result["gap_ms_per_frame"] - 0.021) < 1e-12
    assert abs(result["groups"][0]["mean_us"] - 11.5) < 1e-9
