"""VoxCPM2's local modules: FSQ, patch encoder (VoxCPMLocEnc), local DiT (VoxCPMLocDiTV2), CFM Euler solver."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from models.qwen3_tts.layers import Linear
from mtp_fsm import invariant

from .config import MiniCPM4Config
from .minicpm import MiniCPMModel


class ScalarQuantizationLayer(nn.Module):
    """`fsq_layer`: in_proj -> tanh -> round to multiples of 1/scale -> out_proj (inference form)."""

    def __init__(self, hidden: int, latent: int, scale: int, bi: bool):
        super().__init__()
        self.scale = scale
        self.tanh = invariant.tanh if bi else torch.tanh
        self.in_proj = Linear(hidden, latent, True, bi)
        self.out_proj = Linear(latent, hidden, True, bi)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tanh(self.in_proj(x))
        return self.out_proj(torch.round(h * self.scale) / self.scale)


class VoxCPMLocEnc(nn.Module):
    """`feat_encoder`: each patch [P, D] becomes [CLS, in_proj(frames)] through a bidirectional
    MiniCPM stack; the CLS output is the patch embedding."""

    def __init__(self, cfg: MiniCPM4Config, feat_dim: int, bi: bool):
        super().__init__()
        self.special_token = nn.Parameter(torch.empty(1, 1, 1, cfg.hidden_size))
        self.in_proj = Linear(feat_dim, cfg.hidden_size, True, bi)
        self.encoder = MiniCPMModel(cfg, bi)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, T, P, D] -> [B, T, hidden]; cos/sin cover positions 0..P."""
        b, t, p, _ = x.shape
        h = self.in_proj(x)
        h = torch.cat((self.special_token.expand(b, t, 1, -1), h), dim=2).reshape(b * t, p + 1, -1)
        return self.encoder.forward_full(h, cos[:p + 1], sin[:p + 1])[:, 0].reshape(b, t, -1)


def sinusoidal_embedding(t: torch.Tensor, dim: int, scale: float = 1000.0) -> torch.Tensor:
    """Upstream `SinusoidalPosEmb` (same op order): t [N] -> [N, dim] = [sin | cos]; exp, sin and
    cos from mtp_fsm.invariant (the same bits on every CPU kernel set)."""
    half = dim // 2
    freq = invariant.exp(torch.arange(half, dtype=t.dtype, device=t.device) * -(math.log(10000) / (half - 1)))
    cos, sin = invariant.cos_sin(scale * t.unsqueeze(1) * freq.unsqueeze(0))
    return torch.cat((sin, cos), dim=-1)


class TimestepEmbedding(nn.Module):
    def __init__(self, dim: int, bi: bool):
        super().__init__()
        self.linear_1 = Linear(dim, dim, True, bi)
        self.linear_2 = Linear(dim, dim, True, bi)
        self.act = invariant.silu if bi else F.silu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class VoxCPMLocDiTV2(nn.Module):
    """`feat_decoder.estimator`: velocity of the patch given mu (two condition tokens: the LM and
    residual projections), the time token, the previous patch and the noisy patch."""

    def __init__(self, cfg: MiniCPM4Config, feat_dim: int, bi: bool):
        super().__init__()
        hidden = cfg.hidden_size
        self.in_proj = Linear(feat_dim, hidden, True, bi)
        self.cond_proj = Linear(feat_dim, hidden, True, bi)
        self.out_proj = Linear(hidden, feat_dim, True, bi)
        self.time_mlp = TimestepEmbedding(hidden, bi)
        self.delta_time_mlp = TimestepEmbedding(hidden, bi)
        self.decoder = MiniCPMModel(cfg, bi)

    def forward(self, x: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, cond: torch.Tensor, dt: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [N, P, D], mu [N, 2 * hidden], t/dt [N], cond [N, P', D] -> velocity [N, P, D].

        Upstream keeps patches as [N, D, P] and transposes around the projections; the
        frame-major layout here is the same arithmetic.
        """
        h = self.in_proj(x)
        c = self.cond_proj(cond)
        width = h.shape[-1]
        temb = self.time_mlp(sinusoidal_embedding(t, width).to(h.dtype))
        temb = temb + self.delta_time_mlp(sinusoidal_embedding(dt, width).to(h.dtype))
        mu = mu.view(h.shape[0], -1, width)
        seq = torch.cat((mu, temb.unsqueeze(1), c, h), dim=1)
        out = self.decoder.forward_full(seq, cos[:seq.shape[1]], sin[:seq.shape[1]])
        return self.out_proj(out[:, mu.shape[1] + 1 + c.shape[1]:])


class UnifiedCFM(nn.Module):
    """`feat_decoder`: Euler flow-matching solver from t = 1 (noise) to 0 with a sway-sampled
    schedule, classifier-free guidance (mu = 0 branch) and CFG-Zero* (optimal scale, zeroed
    first steps), as upstream `UnifiedCFM.forward` / `solve_euler` at inference."""

    def __init__(self, estimator: VoxCPMLocDiTV2, mean_mode: bool):
        super().__init__()
        self.estimator = estimator
        self.mean_mode = mean_mode

    def forward(self, mu: torch.Tensor, cond: torch.Tensor, noise: torch.Tensor, n_timesteps: int,
                cfg_value: float, sway_sampling_coef: float, use_cfg_zero_star: bool,
                cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """mu [B, 2h], cond (previous patch) [B, P, D], noise [B, P, D] (the z upstream draws,
        already times temperature) -> patch [B, P, D]. Every op is per row, so a row's result
        does not depend on the batch; the loop length is static (no host sync)."""
        t_span = torch.linspace(1, 0, n_timesteps + 1, device=mu.device, dtype=mu.dtype)
        t_span = t_span + sway_sampling_coef * (invariant.cos_sin(torch.pi / 2 * t_span)[0] - 1 + t_span)
        x, t, dt = noise, t_span[0], t_span[0] - t_span[1]
        b = x.shape[0]
        zero_init_steps = max(1, int((n_timesteps + 1) * 0.04))
        for step in range(1, n_timesteps + 1):
            # CFG-Zero*: the first steps use zero velocity, so x stays the noise (x - dt * 0 == x).
            if not (use_cfg_zero_star and step <= zero_init_steps):
                rows = torch.ones(2 * b, dtype=x.dtype, device=x.device)
                velocity = self.estimator(
                    torch.cat((x, x)), torch.cat((mu, torch.zeros_like(mu))), t * rows, torch.cat((cond, cond)),
                    dt * rows if self.mean_mode else torch.zeros_like(rows), cos, sin)
                pos, neg = velocity[:b], velocity[b:]
                if use_cfg_zero_star:
                    # Upstream's [D, P] order; fixed-order sums (mtp_fsm.invariant).
                    pos_flat, neg_flat = pos.transpose(1, 2).reshape(b, -1), neg.transpose(1, 2).reshape(b, -1)
                    st = invariant.tree_sum(pos_flat * neg_flat, 1, keepdim=True) / (
                        invariant.tree_sum(neg_flat * neg_flat, 1, keepdim=True) + 1e-8)
                    st = st.view(b, 1, 1)
                    velocity = neg * st + cfg_value * (pos - neg * st)
                else:
                    velocity = neg + cfg_value * (pos - neg)
                x = x - dt * velocity
            t = t - dt
            if step < n_timesteps:
                dt = t - t_span[step + 1]
        return x
