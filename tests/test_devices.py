"""Device names: one device, or "cuda:A+cuda:B" (a stage split: frames on A, the flow stage on B)."""

from __future__ import annotations

import pytest
import torch

from music3_demo.devices import split_devices


def test_one_device_has_no_flow_device():
    assert split_devices("cpu") == (torch.device("cpu"), None)
    assert split_devices(None) == (None, None)
    assert split_devices(torch.device("cpu")) == (torch.device("cpu"), None)


def test_a_stage_split_names_two_gpus():
    assert split_devices("cuda:0+cuda:1") == (torch.device("cuda", 0), torch.device("cuda", 1))
    assert split_devices("cuda:1 + cuda:0") == (torch.device("cuda", 1), torch.device("cuda", 0))
    assert split_devices("cuda:0", "cuda:1") == (torch.device("cuda", 0), torch.device("cuda", 1))


@pytest.mark.parametrize("name", ["cpu+cpu", "cuda:0+cuda:0", "cpu+cuda:1", "cuda:1+cpu"])
def test_a_split_that_is_not_two_gpus_is_refused_in_a_sentence(name):
    with pytest.raises(ValueError, match="A stage split needs two different GPUs"):
        split_devices(name)


def test_the_flow_device_is_named_once():
    with pytest.raises(ValueError, match="names the flow stage's device already"):
        split_devices("cuda:0+cuda:1", "cuda:1")


@pytest.mark.parametrize(("devices", "said"), [
    ("cpu+cpu", "A stage split needs two different GPUs"),
    ("cuda:0+cuda:1,cuda:1", "--devices names a GPU twice"),
])
def test_the_app_refuses_such_devices_before_loading(devices, said):
    import app

    with pytest.raises(SystemExit) as refused:
        app.main(["--devices", devices])
    assert said in str(refused.value)


def test_a_split_songs_report_names_both_cards(tiny_pipeline):
    """A stage split's song report: its device as written, the engine GPU's peak and the flow stage's."""
    from dataclasses import replace

    from music3_demo.request import GenerationRequest
    from music3_demo.ui.report import report_markdown, song_report
    from music3_demo.serve.runner import JobRecord

    request = GenerationRequest("x", "[verse]\nla", duration=1.0, num_steps=1, seed=2)
    song = replace(tiny_pipeline.generate(request),
                   memory={"device_peak_gb": 20.5, "flow_device": "cuda:1", "flow": {"device_peak_gb": 6.25}})
    text = report_markdown(song_report(song, request, JobRecord(1, 1.0, device="cuda:0+cuda:1"), "tiny"))
    assert "weights on `cuda:0+cuda:1` · peak 20.5 GB of GPU memory, 6.2 GB on the flow stage's" in text, text
