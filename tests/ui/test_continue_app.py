"""The `continue` endpoint of a real `python app.py --model tiny` server, through gradio_client: a song made with
`generate` is extended by its report's song_id; a song the server does not hold gets one sentence back."""

from __future__ import annotations

import pytest
import soundfile as sf
from app_server import running_app
from gradio_client import Client
from gradio_client.exceptions import AppError

from music3_demo import contract as c


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with running_app(tmp_path_factory.mktemp("continue-app"), ready_timeout=400) as server:
        yield Client(server.url, verbose=False)


def test_continue_extends_a_song_by_its_report_song_id(client):
    wav, report = client.predict(description="synth-pop", lyrics="[verse]\nhello", duration=2.0, num_steps=1,
                                 seed=4, api_name="/generate")
    longer, extended = client.predict(song_id=report["song_id"], seconds=1.0, lyrics="[outro]\nbye", seed=6,
                                      api_name="/continue")
    assert extended["frames"] == report["frames"] + 25 == 75 and extended["song_id"] != report["song_id"]
    assert extended["settings"]["lyrics"] == "[verse]\nhello\n\n[outro]\nbye" and extended["seed"] == 6
    assert sf.info(longer).frames == int(75 * 3.4453125) * c.LATENT_HOP_LENGTH
    assert sf.info(wav).frames < sf.info(longer).frames

    with pytest.raises(AppError, match="^That song is no longer on the server"):
        client.predict(song_id="20000101-000000-abcdef", seconds=5.0, lyrics="", seed=-1, api_name="/continue")
    with pytest.raises(AppError, match="continue it by at most"):
        client.predict(song_id=report["song_id"], seconds=359.0, lyrics="", seed=-1, api_name="/continue")
