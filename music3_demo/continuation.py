"""Continue a finished song: what a song keeps so that it can be extended, how that is saved, and the extension's
request.

A continuation feeds the song's codes back to the semantic stage as a forced prefix (teacher forcing) and decodes on
from there. The flow stage restarts at the song's last chunk, which is no longer the last one: it is denoised again
(over the longer frames now available) blending toward the latents of the chunk before it, exactly as a song decoded
in one go with those codes would be. Everything before that chunk's audio (`boundary` samples) was final when the
song was made, so it is kept as it was, sample for sample; the state carries those samples.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from . import contract as c
from .request import GenerationRequest, InvalidRequest

FORMAT_VERSION = 1


@dataclass
class FlowResume:
    """The flow stage just before one chunk: enough to decode it, and the chunks after it, as a whole song would."""

    chunk: int  # the chunk's index: it covers frames [chunk · 100, + 200)
    boundary: int  # samples of final audio before the chunk's own
    previous_latent: torch.Tensor | None  # [1, channels, n] latents the chunk's overlap blends toward (not chunk 0)
    previous_condition: torch.Tensor | None  # [1, n, width] the condition the chunk's overlap takes over
    generator_state: torch.Tensor  # uint8: the flow generator's state before the chunk's noise draw
    generator_device: str  # "cpu" or "cuda": a state only restores onto a generator of its kind

    @property
    def first_frame(self) -> int:
        return self.chunk * c.CHUNK_HOP

    def generator(self, device: torch.device) -> torch.Generator | None:
        """A generator in the saved state, when `device` is of the saved kind (else None: the caller seeds one)."""
        if device.type != self.generator_device:
            return None
        generator = torch.Generator(device)
        generator.set_state(self.generator_state)
        return generator


@dataclass
class SongState:
    """What a finished song keeps so that it can be continued."""

    request: GenerationRequest  # what made it (seed filled in; a continuation's duration is the seconds it added)
    codes: np.ndarray  # int32 [frames + 1, 8]: every decode step's codes; step 0 is not a frame
    flow: FlowResume  # the flow stage before the song's last chunk
    head: np.ndarray  # float32 [2, flow.boundary]: the song's audio before that chunk, kept as is

    @property
    def frames(self) -> int:
        return self.codes.shape[0] - 1

    @property
    def seconds(self) -> float:
        return self.frames / c.FRAME_RATE

    def from_the_start(self, flow_generator: torch.Generator) -> "SongState":
        """The same codes with the flow stage back at chunk 0 (drawing from `flow_generator`) and no audio kept:
        continuing from it decodes the whole song in one go with these codes as its forced prefix, which is what a
        continuation must equal."""
        start = FlowResume(0, 0, None, None, flow_generator.get_state(), flow_generator.device.type)
        return replace(self, flow=start, head=np.zeros((2, 0), np.float32))

    def on_host(self) -> "SongState":
        """The same state with its tensors in host memory: what crosses a process boundary (a Space's GPU worker
        pickles what it yields, and the main process has no GPU to unpickle a CUDA tensor onto)."""
        flow = self.flow
        host = [None if t is None else t.to("cpu") for t in (flow.previous_latent, flow.previous_condition)]
        return replace(self, flow=replace(flow, previous_latent=host[0], previous_condition=host[1],
                                          generator_state=flow.generator_state.to("cpu")))

    def save(self, path: str | Path) -> Path:
        """One .npz file (numpy arrays and a JSON header; no pickles), ~0.35 MB per second of song (the head)."""
        path = Path(path)
        meta = {
            "format": FORMAT_VERSION,
            "request": self.request.as_dict(),
            "chunk": self.flow.chunk,
            "boundary": self.flow.boundary,
            "generator_device": self.flow.generator_device,
        }
        with open(path, "wb") as file:  # a file object: np.savez would append ".npz" to a path
            np.savez(
                file,
                meta=np.array(json.dumps(meta)),
                codes=self.codes.astype(np.int32),
                head=np.ascontiguousarray(self.head, dtype=np.float32),
                previous_latent=_array(self.flow.previous_latent),
                previous_condition=_array(self.flow.previous_condition),
                generator_state=self.flow.generator_state.numpy(),
            )
        return path

    @classmethod
    def load(cls, path: str | Path) -> "SongState":
        """Read a state saved by `save`; a file that is not one raises ValueError with one sentence."""
        name = Path(path).name
        try:
            with np.load(path, allow_pickle=False) as data:
                arrays = {key: data[key] for key in data.files}
            meta = json.loads(str(arrays["meta"]))
            if meta.get("format") != FORMAT_VERSION:
                raise ValueError(f"format {meta.get('format')!r}")
            request = GenerationRequest(**meta["request"])
            flow = FlowResume(
                chunk=int(meta["chunk"]),
                boundary=int(meta["boundary"]),
                previous_latent=_tensor(arrays["previous_latent"]),
                previous_condition=_tensor(arrays["previous_condition"]),
                generator_state=torch.from_numpy(arrays["generator_state"].astype(np.uint8)),
                generator_device=str(meta["generator_device"]),
            )
            state = cls(request, arrays["codes"].astype(np.int32), flow, arrays["head"].astype(np.float32))
        except FileNotFoundError:
            raise ValueError(f"Cannot continue from {name}: the file does not exist.") from None
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise ValueError(f"Cannot continue from {name}: it is not a song state saved by this program "
                             f"({error}).") from None
        if (state.codes.ndim != 2 or state.codes.shape[1] != 8 or state.codes.shape[0] < 2
                or state.head.shape != (2, flow.boundary) or flow.first_frame >= state.frames):
            raise ValueError(f"Cannot continue from {name}: its codes, audio and flow state do not fit together.")
        return state


def _array(tensor: torch.Tensor | None) -> np.ndarray:
    return np.zeros(0, np.float32) if tensor is None else tensor.detach().float().cpu().numpy()


def _tensor(array: np.ndarray) -> torch.Tensor | None:
    return None if array.size == 0 else torch.from_numpy(array.astype(np.float32))


def extension_request(
    state: SongState, seconds: float, lyrics: str = "", seed: int | None = None, description: str | None = None
) -> GenerationRequest:
    """The request that continues `state`'s song by `seconds`: the song's description (or a new one) and settings,
    its lyrics followed by `lyrics` (the words of the added part, if any: the prompt holds the whole song's lyrics,
    as it did for the original), and a new random seed unless one is given."""
    original = state.request
    added = lyrics.strip() if isinstance(lyrics, str) else ""
    full_lyrics, instrumental = original.lyrics, original.instrumental
    if added:
        earlier = "" if original.instrumental else original.lyrics.rstrip()
        full_lyrics, instrumental = (earlier + "\n\n" + added if earlier else added), False
    return replace(original, description=original.description if description is None else description,
                   lyrics=full_lyrics, instrumental=instrumental, duration=seconds, seed=seed)


def check_continuation(request: GenerationRequest, state: SongState) -> int:
    """The frame budget of the continued song (the song's frames plus the request's), or InvalidRequest when it
    would pass the model's 360 s."""
    total = state.frames + request.max_frames
    if total <= c.MAX_AUDIO_FRAMES:
        return total
    room = (c.MAX_AUDIO_FRAMES - state.frames) / c.FRAME_RATE
    if room < c.MIN_DURATION_S:
        raise InvalidRequest(f"This song is already {state.seconds:.0f} s long, the model's limit: it cannot be "
                             f"continued.")
    raise InvalidRequest(f"This song is {state.seconds:.1f} s long and songs end at {c.MAX_DURATION_S:.0f} s: "
                         f"continue it by at most {int(room)} s.")
