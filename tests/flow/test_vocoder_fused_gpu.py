"""GPU: the vocoder's one-pass Snakes (`flow/vocoder_fused.py`) at full size: a whole chunk's samples are the eager
vocoder's bit for bit, in less time and with no more memory beside them (both sides timed in this one process; the
figures printed for docs/). The Snakes' temporaries never set the vocoder's peak (its convolutions' outputs do), so
the fused pass frees no memory: 1.66 GB beside a full chunk either way on an H200."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.autoencoders.minimax_music3_vocoder import MiniMaxMusic3Vocoder

from music3_demo import random_models
from music3_demo.flow import vocoder_fused

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")
CHUNK_LATENTS = 689  # a full chunk


def _timed(vocoder, latents: torch.Tensor, repeats: int = 5) -> tuple[torch.Tensor, float, int]:
    """(the waveform, seconds per call after a warm-up, the most allocated beside the inputs during one call)."""
    with torch.no_grad():
        out = vocoder(latents)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(DEVICE)
        torch.cuda.reset_peak_memory_stats(DEVICE)
        out = vocoder(latents)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(DEVICE) - before
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            vocoder(latents)
        end.record()
        end.synchronize()
    return out, start.elapsed_time(end) / 1e3 / repeats, peak


def test_fused_snakes_give_the_eager_samples_bit_for_bit_in_less_time():
    sizes = random_models.FULL
    torch.manual_seed(0)
    vocoder = MiniMaxMusic3Vocoder(latent_channels=sizes.dit_channels, decoder_input_dim=sizes.vocoder_input_dim,
                                   decoder_hidden_dim=sizes.vocoder_hidden_dim).to(DEVICE).float().eval()
    snakes = vocoder_fused.snakes(vocoder)
    for snake in snakes:  # (diffusers initialises alpha to ones)
        snake.alpha.data.uniform_(0.2, 3.0)
    latents = torch.randn(1, sizes.dit_channels, CHUNK_LATENTS, device=DEVICE)
    eager, eager_s, eager_peak = _timed(vocoder, latents)
    assert vocoder_fused.install(vocoder) == len(snakes)
    fused, fused_s, fused_peak = _timed(vocoder, latents)
    vocoder_fused.uninstall(vocoder)
    _, eager_again_s, _ = _timed(vocoder, latents)
    print(f"\nvocoder, a full chunk: eager {eager_s * 1e3:.1f} / {eager_again_s * 1e3:.1f} ms, fused Snakes "
          f"{fused_s * 1e3:.1f} ms; beside it at the peak {eager_peak / 1e9:.2f} GB eager, {fused_peak / 1e9:.2f} GB")
    assert torch.equal(fused, eager)
    assert fused_s < min(eager_s, eager_again_s)
    assert fused_peak <= eager_peak + 16 * 2**20  # (the output's own block lands elsewhere in the cache)
