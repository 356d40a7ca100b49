"""The vocoder's one-pass Snake (`flow/vocoder_fused.py`) under Triton's interpreter: diffusers' Snake up to the
interpreter's sine (numpy's, not libdevice's: the GPU test checks the bits), and `install` leaving the eager Snakes
in place where the fused one does not give their bits."""

from __future__ import annotations

import torch
from diffusers.models.autoencoders.minimax_music3_vocoder import MiniMaxMusic3Snake1d, MiniMaxMusic3Vocoder

from music3_demo.flow import vocoder_fused


def _snake(channels: int, seed: int) -> MiniMaxMusic3Snake1d:
    module = MiniMaxMusic3Snake1d(channels)
    module.alpha.data = torch.rand(1, channels, 1, generator=torch.Generator().manual_seed(seed)) * 3 + 0.05
    return module


def test_one_pass_snake_is_diffusers_snake_per_row_and_channel():
    """Rows of several channels, a length that is not a multiple of the block (masked tail), a 4-D input."""
    module = _snake(6, 0)
    x = torch.randn(2, 6, 2 * vocoder_fused.BLOCK + 77, generator=torch.Generator().manual_seed(1)) * 4
    with torch.no_grad():
        eager, fused = module(x), vocoder_fused.snake(x, module.alpha)
        assert (fused - eager).abs().max() <= 1e-5 * x.abs().max()
        four = x.view(2, 6, 1, -1)
        assert vocoder_fused.snake(four, module.alpha).shape == four.shape


def test_install_keeps_the_eager_snakes_where_the_bits_differ_and_falls_back_on_other_inputs(monkeypatch):
    vocoder = MiniMaxMusic3Vocoder(latent_channels=8, decoder_input_dim=16, decoder_hidden_dim=16).eval()
    snakes = vocoder_fused.snakes(vocoder)
    assert len(snakes) == 4 * 7 + 1  # per block: one before the upsampling, two per residual unit; one at the end
    assert vocoder_fused.install(vocoder) == 0  # the interpreter's sine is not the GPU's: nothing changes
    assert all("forward" not in snake.__dict__ for snake in snakes)
    monkeypatch.setattr(vocoder_fused, "snake", lambda x, alpha: type(snakes[0]).forward(snakes[0], x))
    assert vocoder_fused.install(vocoder) == len(snakes)  # (a stand-in that gives the eager bits)
    module = _snake(4, 2)
    module.forward = vocoder_fused._fused_forward.__get__(module)
    half = torch.randn(1, 4, 50).half()
    with torch.no_grad():
        assert torch.equal(module(half), type(module).forward(module, half))  # not float32: eager
    vocoder_fused.uninstall(vocoder)
    assert all("forward" not in snake.__dict__ for snake in snakes)
