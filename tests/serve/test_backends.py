"""The app's backend flags without a cluster (that a local-backend app never imports Ray: tests/test_no_triton.py,
which builds the app in a fresh process anyway)."""

from __future__ import annotations

import pytest

import app


@pytest.mark.parametrize("flags, message", [
    (["--ray-address", "10.0.0.1:6379"], "--ray-address need --backend ray."),
    (["--replicas", "2", "--replica-slots", "2"], "--replicas, --replica-slots need --backend ray."),
    (["--backend", "ray", "--devices", "cuda:0"], "--devices is for the local backend"),
    (["--backend", "ray", "--replicas", "0"], "--replicas and --replica-slots must be at least 1."),
])
def test_cluster_flags_are_refused_where_they_mean_nothing(flags, message, capsys):
    with pytest.raises(SystemExit):
        app.parse_args(["--model", "tiny", *flags])
    assert message in capsys.readouterr().err
