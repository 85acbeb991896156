"""Our EDM Euler sampler with per-frame linear guidance, as Terra's refiner configures it.

Terra (inference.yaml) uses sgm's `EulerEDMSampler` (15 steps, no churn), `EDMDiscretization`
(sigma_min 0.002, sigma_max 700, rho 7, a final 0 appended), `VScalingWithEDMcNoise`
preconditioning and `LinearPredictionGuider` (CFG scale from 1.5 on the first frame to 3.0 on
the 25th). Written from those definitions:

- sigmas: (sigma_max^(1/rho) + i/(n-1) (sigma_min^(1/rho) - sigma_max^(1/rho)))^rho, i = 0..n-1,
  then 0; Terra casts them to bfloat16 (`.bfloat16()` in `prepare_sampling_loop`), so we round
  them the same way (sigma_max 700 is exact in bf16; the others move by up to 0.4%).
- start: x = noise * sqrt(1 + sigma_0^2).
- denoiser: D(x, s) = c_skip x + c_out F(c_in x, c_noise) with c_skip = 1/(s^2+1),
  c_out = -s/sqrt(s^2+1), c_in = 1/sqrt(s^2+1), c_noise = ln(s)/4.
- guidance: D = D_u + w_f (D_c - D_u), w_f = linspace(1.5, 3.0, 25)[f] per frame f of a window.
- Euler: x <- x + (s_next - s) (x - D) / s; the last step (s_next = 0) returns D.

So a window costs `steps` guided denoiser calls, 30 UNet evaluations with the pair. Terra's
unconditional input is the conditional one (its conditioner runs
`get_unconditional_conditioning(batch, force_uc_zero_embeddings=[])` with every ucg_rate 0, so
uc == c key for key): D_u = D_c and the guided result is D_c whatever the scale. `guided_pair`
batches both halves into one network call (what Terra computes); `same_uncond=True` states that
the two halves are equal and makes one call of half the batch (what Terra's result is).

We keep the sampler state in float32 (Terra keeps it in bf16); the network runs in its own dtype.
"""

from __future__ import annotations

from typing import Callable

import torch

# network(x_in (B, F, C, H, W), c_noise (B,), condition) -> F output (B, F, C_out, H, W)
Network = Callable[[torch.Tensor, torch.Tensor, object], torch.Tensor]


def edm_sigmas(steps: int, sigma_min: float = 0.002, sigma_max: float = 700.0, rho: float = 7.0,
               round_to: torch.dtype | None = torch.bfloat16) -> torch.Tensor:
    """steps + 1 noise levels, high to low, ending in 0 (float32, rounded through `round_to`)."""
    ramp = torch.linspace(0, 1, steps, dtype=torch.float64)
    lo, hi = sigma_min ** (1 / rho), sigma_max ** (1 / rho)
    sigmas = (hi + ramp * (lo - hi)) ** rho
    sigmas = torch.cat([sigmas, sigmas.new_zeros(1)])
    if round_to is not None:
        sigmas = sigmas.to(round_to)
    return sigmas.to(torch.float32)


def v_scaling(sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """VScalingWithEDMcNoise: (c_skip, c_out, c_in, c_noise)."""
    c_skip = 1.0 / (sigma ** 2 + 1.0)
    c_out = -sigma / (sigma ** 2 + 1.0).sqrt()
    c_in = 1.0 / (sigma ** 2 + 1.0).sqrt()
    return c_skip, c_out, c_in, 0.25 * sigma.log()


def guidance_scales(frames: int, min_scale: float, max_scale: float) -> torch.Tensor:
    """LinearPredictionGuider's per-frame scale (frames,)."""
    return torch.linspace(min_scale, max_scale, frames, dtype=torch.float32)


def denoise(network: Network, x: torch.Tensor, sigma: float, cond, uncond, scales: torch.Tensor,
            same_uncond: bool, pair: Callable | None = None) -> torch.Tensor:
    """One guided denoiser evaluation D(x, sigma) for a batch of windows x (B, F, C, H, W), float32."""
    s = torch.full((x.shape[0],), float(sigma), dtype=torch.float32, device=x.device)
    c_skip, c_out, c_in, c_noise = (t.view(-1, 1, 1, 1, 1) if i < 3 else t for i, t in enumerate(v_scaling(s)))
    x_in = x * c_in
    if same_uncond:
        out = network(x_in, c_noise, cond).float()
        return c_skip * x + c_out * out
    both = network(torch.cat([x_in, x_in]), torch.cat([c_noise, c_noise]), (pair or _pair)(uncond, cond)).float()
    d_u, d_c = (c_skip * x + c_out * half for half in both.chunk(2))
    w = scales.to(x.device).view(1, -1, 1, 1, 1)
    return d_u + w * (d_c - d_u)


def _pair(uncond, cond):
    return torch.cat([uncond, cond])


def sample(network: Network, noise: torch.Tensor, cond, *, uncond=None, sigmas: torch.Tensor, scales: torch.Tensor,
           same_uncond: bool = False, pair: Callable | None = None,
           on_step: Callable[[int], None] | None = None) -> torch.Tensor:
    """Euler over `sigmas` from x = noise * sqrt(1 + sigma_0^2); returns the final denoised latents (float32).

    `cond`/`uncond` are whatever `network` takes as its condition (batched along dim 0 like x);
    `pair(uncond, cond)` concatenates them for one call (default: torch.cat of tensors)."""
    x = noise.float() * torch.sqrt(1.0 + sigmas[0] ** 2)
    for i in range(len(sigmas) - 1):
        sigma, nxt = float(sigmas[i]), float(sigmas[i + 1])
        d = denoise(network, x, sigma, cond, uncond if not same_uncond else None, scales, same_uncond, pair)
        x = d if nxt == 0.0 else x + (nxt - sigma) * (x - d) / sigma
        if on_step is not None:
            on_step(i)
    return x
