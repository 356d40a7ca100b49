"""Songs longer than the card's memory plan holds are refused when they arrive, with the longest that fits: through
the real app (gradio_client), the holder's line (a song that arrived before the model was loaded), the Python API
and the CLI (exit 2). The card is faked through the test seam `MUSIC3_TEST_FREE_BYTES` (loading.FREE_BYTES_ENV:
the plan is computed as for a GPU reporting that many bytes free; the tiny model still runs on the CPU)."""

from __future__ import annotations

import re
import threading

import pytest
from app_server import running_app
from cli_runs import run_main
from gradio_client import Client
from gradio_client.exceptions import ValidationError

from music3_demo import random_models
from music3_demo.loading import FREE_BYTES_ENV
from music3_demo.memory_plan import plan_memory

TINY = random_models.figures(random_models.TINY)
# (auto might pick the fp8 DiT on the faked card, or the stages in turn: this card's songs stream)
ASKED = {"precision": "bf16", "dit_precision": "bf16", "swap": "off"}
QUICK = {"description": "bright synth-pop, 120 BPM", "lyrics": "[verse]\nhello there", "num_steps": 1, "seed": 1,
         "guidance_scale": 1.7, "lm_cfg_scale": 1.5, "top_k": 50, "instrumental": False, "variations": 1}
LONGEST = re.compile(r"On this GPU \([\d.]+ GB free, float32 LM, float32 DiT\) songs with this prompt can be at most "
                     r"(?:(\d+) min ?)?(?:(\d+) s)? long; choose a shorter duration\.")
# A ~700-token prompt: the longest song that fits beside it is short, so the app test makes it quickly on the CPU.
LONG_PROMPT = QUICK | {"lyrics": "[verse]\n" + "hello there, we sing along\n" * 24}


def free_for(longest_s: float, prompt_tokens: int = 30) -> int:
    """The free bytes for which the tiny model's reference-engine plan holds about `longest_s` seconds alone."""
    low, high = 1e9, 40e9
    for _ in range(60):
        middle = (low + high) / 2
        frames = plan_memory(TINY, int(middle), (9, 0), engine="reference", **ASKED).max_frames(prompt_tokens)
        low, high = (middle, high) if frames < longest_s * 25 else (low, middle)
    return int(high)


FREE = free_for(40.0)  # (the pool must hold the warm-up's 770 positions, or the load is refused)


def seconds_in(sentence: str) -> int:
    minutes, seconds = LONGEST.fullmatch(sentence).groups()
    return int(minutes or 0) * 60 + int(seconds or 0)


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    with running_app(tmp_path_factory.mktemp("plan-app"), "--precision", "bf16", "--dit-precision", "bf16",
                     "--swap", "off", env={FREE_BYTES_ENV: str(FREE)}) as server:
        yield server


def test_the_app_refuses_a_song_longer_than_the_card_holds_at_once_and_keeps_serving(app):
    client = Client(app.url, verbose=False)
    status = client.predict(api_name="/status")
    plan = status["memory_plan"]["cpu"]
    assert plan["free_gb"] == round(FREE / 1e9, 2) and plan["slots"] == status["slots"]["cpu"]
    with pytest.raises(ValidationError) as refused:  # the sentence under the duration
        client.predict(**LONG_PROMPT, duration=120.0, api_name="/generate")
    sentence = re.search(r"- duration: (.*)$", str(refused.value).strip(), flags=re.M).group(1)
    longest = seconds_in(sentence)
    assert 4 <= longest < 30
    assert client.predict(api_name="/status")["jobs"] == []  # refused on arrival: it never became a job
    wav, report = client.predict(**(LONG_PROMPT | {"duration": float(longest)}), api_name="/generate")
    assert report["frames"] == longest * 25 and report["memory_plan"]["kv_pool_positions"] == plan[
        "kv_pool_positions"]


def test_a_song_waiting_in_line_that_no_card_holds_leaves_the_line_with_the_sentence(monkeypatch, tiny_folder):
    """A song that got past arrival unchecked (it came while the model loaded) and waits for a busy device: when its
    turn comes it leaves the line with the sentence, and the line moves on, instead of holding everyone for ever."""
    from music3_demo.request import GenerationRequest, InvalidRequest
    from music3_demo.ui.assets import banner_html
    from music3_demo.serve.holder import ModelHolder

    monkeypatch.setenv(FREE_BYTES_ENV, str(FREE))
    holder = ModelHolder("tiny", ["cpu"], "reference", warmup=False, **ASKED)
    holder.preload(background=False)
    assert holder.status().slots == {"cpu": 1}  # the faked card's plan: one song at a time
    failures: list[BaseException] = []

    def wait(ticket) -> None:
        try:
            with holder.acquire(ticket=ticket):
                pass
        except BaseException as error:  # noqa: BLE001 - what the song's caller hears
            failures.append(error)

    with holder.acquire() as lease:  # the device is busy
        long, short = (holder.ticket(GenerationRequest("x", "[verse]\nla", duration=seconds)) for seconds in (200, 1))
        waiters = [threading.Thread(target=wait, args=(ticket,)) for ticket in (long, short)]
        holder.enqueue([long, short])
        for waiter in waiters:
            waiter.start()
        with pytest.raises(InvalidRequest, match=LONGEST.pattern):  # the Python API refuses it the same way
            lease.pipeline.generate(GenerationRequest("x", "[verse]\nla", duration=200.0, num_steps=1, seed=1))
    for waiter in waiters:
        waiter.join(timeout=60)
    assert len(failures) == 1 and isinstance(failures[0], InvalidRequest) and failures[0].field == "duration"
    assert LONGEST.fullmatch(str(failures[0])) and short.placed and holder.scheduler.waiting() == 0
    # The page's banner says the plan in short (precision per stage, slots, longest song; under a minute after a
    # whole song's lyrics, also after a short prompt).
    assert re.search(r'id="plan-note">float32 LM, float32 DiT · 1 song at once · songs up to \d+ s'
                     r' after a 1,000-token prompt, \d+ s after a short one</div>',
                     banner_html(holder.status()))
    holder.release()


def test_the_cli_exits_2_with_the_sentence(monkeypatch, tmp_path, tiny_folder):
    monkeypatch.setenv(FREE_BYTES_ENV, str(FREE))
    result = run_main("generate", "--model", "tiny", "--prompt", "x", "--lyrics", "[verse]\nla", "--duration", "200",
                      "--precision", "bf16", "--dit-precision", "bf16", "--swap", "off", "--out",
                      str(tmp_path / "song.wav"), "--quiet")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert re.search(r"^error: " + LONGEST.pattern + "$", result.stderr, flags=re.M)
    assert "note: memory plan: float32 LM, float32 DiT · 1 song at once" in result.stderr
    assert not (tmp_path / "song.wav").exists()


def test_a_card_too_small_for_the_model_fails_the_load_with_one_sentence(monkeypatch, tiny_folder):
    from music3_demo.serve.holder import ModelHolder

    monkeypatch.setenv(FREE_BYTES_ENV, str(2 * 10**9))
    holder = ModelHolder("tiny", ["cpu"], "reference", warmup=False)
    holder.preload(background=False)
    status = holder.status()
    assert status.state == "failed"
    assert status.error.startswith("The model does not fit on cpu in int4 LM, fp8 DiT: 2.0 GB are free and it needs "
                                   "about ")
    assert status.error.endswith("close other programs that use the GPU, or use a GPU with more memory (--model tiny "
                                 "runs anywhere).")


def test_the_cli_exits_2_when_the_card_is_too_small_for_the_model(monkeypatch, tmp_path, tiny_folder):
    monkeypatch.setenv(FREE_BYTES_ENV, str(2 * 10**9))
    result = run_main("generate", "--model", "tiny", "--prompt", "x", "--instrumental", "--duration", "5", "--out",
                      str(tmp_path / "song.wav"), "--quiet")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert re.search(r"^error: The model does not fit on cpu in int4 LM, fp8 DiT: 2\.0 GB are free and it needs about "
                     r"[\d.]+ GB to load and make a song; close other programs", result.stderr, flags=re.M)


def test_a_warm_up_that_runs_out_of_memory_frees_what_the_load_took(monkeypatch, tiny_folder):
    """The load succeeded, its warm-up ran out of memory: the load fails with one sentence and the loaded pipeline
    is released at once (its weights, engine and flow executor), so the next request's load plans with the card's
    memory and not with 2.7 GB beside a dead pipeline's 21 GB (seen on a 24 GB card)."""
    from music3_demo import pipeline as pipeline_module
    from music3_demo.errors import DeviceOutOfMemory
    from music3_demo.serve.holder import ModelHolder

    built = []
    load = pipeline_module.Music3Pipeline.from_pretrained.__func__

    def from_pretrained(cls, *args, **kwargs):
        built.append(load(cls, *args, **kwargs))
        return built[-1]

    def warm(self):
        raise DeviceOutOfMemory("Not enough GPU memory on cpu for warming up in bf16.", "load")

    monkeypatch.setattr(pipeline_module.Music3Pipeline, "from_pretrained", classmethod(from_pretrained))
    monkeypatch.setattr(pipeline_module.Music3Pipeline, "warm", warm)
    holder = ModelHolder("tiny", ["cpu"], "reference", warmup=True)
    holder.preload(background=False)
    status = holder.status()
    assert status.state == "failed" and "warming up" in status.error, status.error
    (pipeline,) = built
    assert pipeline.components == {} and pipeline.engine is None and pipeline.flow_executor is None
