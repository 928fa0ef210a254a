"""Stochastic flow-matching steps with log-probabilities, time shifts and an RL sampler.

Convention (diffusers'): ``sigma`` runs from 1 (pure noise) to 0 (data),

    x_sigma = (1 - sigma) x0 + sigma eps,        eps ~ N(0, I),

and the model predicts the velocity ``v ~ eps - x0``. A deterministic (ODE, Euler) step from
``sigma`` to ``sigma_next < sigma`` is ``x' = x + Delta v`` with ``Delta = sigma_next - sigma < 0``.
For RL the step must be stochastic, with a density: :func:`sde_step_with_logprob` makes one
Gaussian step ``x' = mean + std * eps`` and returns the log-probability of the sample it drew
(or of a ``prev_sample`` it is given), as Flow-GRPO does (docs/methods.md section 4). ``a`` below
is ``noise_level``.

``kind="sde"`` -- Flow-GRPO's reverse-time SDE, discretised by Euler-Maruyama::

    std_t    = a * sqrt(sigma / (1 - sigma))        (sigma_next replaces the denominator's sigma
                                                     at sigma = 1, which would divide by zero)
    mean     = x * (1 + std_t^2 / (2 sigma) * Delta) + v * (1 + std_t^2 (1 - sigma) / (2 sigma)) * Delta
    std      = std_t * sqrt(-Delta)
    log_prob = mean over the non-batch dims of the Gaussian log-density
               -(x' - mean)^2 / (2 std^2) - log(std) - log(sqrt(2 pi))

``kind="cps"`` -- coefficients-preserving sampling (Flow-CPS)::

    std      = sigma_next * sin(a pi / 2)           (a in [0, 1])
    x0_hat   = x - sigma v,      x1_hat = x + (1 - sigma) v
    mean     = (1 - sigma_next) x0_hat + sqrt(sigma_next^2 - std^2) x1_hat
    log_prob = -mean over the non-batch dims of (x' - mean)^2

  (the CPS "log-prob" drops the 1 / (2 std^2) scale and the normalising constant, as Flow-CPS
  does; it is only ever used in ratios against itself, where those terms cancel per step).
  CPS keeps the coefficients of x_sigma exact: with an exact x0_hat (e.g. data that is a single
  point) every intermediate marginal is exact. With a posterior-mean x0_hat and a > 0 it
  narrows the spread of the data part a little at every step, whatever the number of steps
  (the fresh noise does not shrink with the step size, unlike the "sde" kind's).

``noise_level = 0`` (either kind) is the deterministic Euler step ``x' = x + Delta v``: it has
no density, so ``log_prob`` is defined as 0 and ``std`` as 0. Both kinds reduce to that step
as ``a -> 0``. Evaluation samples with ``noise_level = 0`` everywhere.

Time shifts (:func:`sd3_shift`, :func:`flux_mu`, :func:`flux_shift`) warp a uniform sigma
grid towards the noisy end: SD3 ``sigma' = s sigma / (1 + (s - 1) sigma)`` with ``s = 3``;
FLUX / Qwen-Image ``sigma' = e^mu / (e^mu + 1 / sigma - 1)`` with ``mu`` linear in the number
of image tokens. :class:`FlowSDESampler` is a scheduler-like object (diffusers' contract:
``set_timesteps``, ``step``) that holds the sigmas, picks the SDE window (Flow-GRPO-Fast) and
steps; the last step (to sigma = 0) is never an SDE step.

Where we depart from Flow-GRPO's code (``flow_grpo/diffusers_patch/sd3_sde_with_logprob.py``):

- At sigma = 1 Flow-GRPO puts the scheduler's second sigma (``sigmas[1]``) in the std's
  denominator; we put the step's own ``sigma_next``. Inside a sampler only the first step has
  sigma = 1 and its ``sigma_next`` is ``sigmas[1]``, so the two agree; ours also holds for
  per-sample sigmas.
- ``log_prob`` scores the sample that is *returned*, i.e. after rounding to the input dtype
  (bf16 rollouts), so re-scoring the stored sample reproduces ``log_prob`` bit for bit (the
  ratio is exactly 1 on-policy). Flow-GRPO scores the float32 sample before any rounding.
- ``noise_level = 0`` is an exact Euler step with ``log_prob = 0``; Flow-GRPO's formula makes the
  same step with a log-prob of 0 / 0 (NaN), which it never reads. (The noise comes from
  ``generator`` when given, from torch's global RNG otherwise: the same as Flow-GRPO, whose
  diffusers ``randn_tensor`` draws from the global RNG when no generator is given.)
- The schedule is ``shift(linspace(1, 0, N + 1))`` for every shift (stretched to
  ``shift_terminal`` where the scheduler's config sets one, Qwen-Image's 0.02), which is exactly
  what diffusers' FLUX / Qwen-Image pipelines build. diffusers' SD3 pipeline (so Flow-GRPO's SD3
  runs) instead spaces its N sigmas from 1 down to the shifted training minimum (~0.003),
  shifts them, and appends 0, which leaves a last step of only ~0.009 in sigma.
- The SDE window is drawn as a *start* in ``[lo, hi]`` (both inclusive); Flow-GRPO's
  ``sde_window_range = (lo, hi + W)`` bounds the whole window instead -- the same windows.

Everything computes in float32 (float64 inputs stay float64) whatever the input dtype: the
mean's coefficients overflow or lose the step in bf16.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "KINDS",
    "SHIFTS",
    "FlowSDESampler",
    "SDEStep",
    "flux_mu",
    "flux_shift",
    "sd3_shift",
    "sde_step_with_logprob",
]

KINDS = ("sde", "cps")
SHIFTS = ("sd3", "flux", "none")

_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)

Generators = torch.Generator | Sequence[torch.Generator] | None


@dataclass(frozen=True)
class SDEStep:
    """One step of a flow sampler, with the density of the transition it made.

    ``prev_sample`` is the next (less noisy) sample x_{sigma_next}, in the input's dtype (the
    name follows diffusers: "previous" in diffusion time). It is the ``prev_sample`` argument
    itself when one was given, else the drawn ``mean + std * eps`` (a differentiable function of
    the velocity: reparameterisation). ``log_prob`` never differentiates through it.
    "float32" below means the compute dtype: float64 when the sample is float64.
    """

    prev_sample: Tensor  # [B, ...] input dtype
    log_prob: Tensor  # [B] float32: mean over the non-batch dims (0 for an ODE step)
    mean: Tensor  # [B, ...] float32: the Gaussian's mean (the Euler step for an ODE step)
    std: Tensor  # [B, 1, ..., 1] float32, broadcastable to the sample (0 for an ODE step)
    elem_log_prob: Tensor | None = None  # [B, ...] float32: the per-element terms log_prob averages
    # (0 for an ODE step); CAST's per-patch ratios average them over a latent token's channels only
    kl_std: Tensor | None = None  # [B, 1, ..., 1] float32: the std of Flow-GRPO's KL to the reference,
    # std_t = a sqrt(sigma / (1 - sigma)) for "sde" (without sqrt(-Delta), as Flow-GRPO's code divides
    # by 2 std_t^2), the transition std for "cps"; 0 for an ODE step


# --------------------------------------------------------------------------- helpers


def _check_choice(value: str, allowed: tuple[str, ...], what: str) -> None:
    if value not in allowed:
        raise ValueError(f"{what} must be one of {', '.join(map(repr, allowed))}; got {value!r}")


def _as_sigma(value, name: str, batch: int, ndim: int, dtype: torch.dtype) -> Tensor:
    """A float, a 0-d tensor or a [B] tensor -> [B, 1, ..., 1] (``ndim`` dims) in ``dtype``, on
    the tensor's own device (the CPU for a float): the caller checks it there, then moves it."""
    if isinstance(value, Tensor):
        if value.dim() == 0:
            value = value.reshape(1).expand(batch)
        elif value.dim() != 1 or value.shape[0] != batch:
            raise ValueError(
                f"{name} must be a float, a 0-d tensor or a tensor of shape [B] = [{batch}]; "
                f"got shape {tuple(value.shape)}"
            )
        sig = value.detach().to(dtype=dtype)
    else:  # on the CPU: the checks below read it without a device sync
        sig = torch.full((batch,), float(value), dtype=dtype)
    if not torch.isfinite(sig).all():
        raise ValueError(f"{name} must be finite; got {sig.tolist()}")
    return sig.view(batch, *([1] * (ndim - 1)))


def _randn(shape: torch.Size, generator: Generators, dtype: torch.dtype, device) -> Tensor:
    """Standard normal noise, drawn only from ``generator`` when one (or one per sample) is given,
    on the generator's own device, then moved to ``device``: a CPU generator (the trainer's) draws
    the same numbers whatever device the model is on, so a seeded run does not depend on it."""
    if generator is None:
        return torch.randn(shape, dtype=dtype, device=device)
    if isinstance(generator, torch.Generator):
        noise = torch.randn(shape, generator=generator, dtype=dtype, device=generator.device)
        return noise.to(device)
    gens = list(generator)
    if len(gens) != shape[0] or not all(isinstance(g, torch.Generator) for g in gens):
        raise ValueError(
            f"generator must be a torch.Generator or a list of {shape[0]} (one per sample); "
            f"got {generator!r}"
        )
    rows = [torch.randn(shape[1:], generator=g, dtype=dtype, device=g.device) for g in gens]
    return torch.stack([r.to(device) for r in rows])


# --------------------------------------------------------------------------- the step


def sde_step_with_logprob(
    velocity: Tensor,
    sample: Tensor,
    sigma: float | Tensor,
    sigma_next: float | Tensor,
    *,
    noise_level: float,
    kind: str = "sde",
    prev_sample: Tensor | None = None,
    generator: Generators = None,
) -> SDEStep:
    """One stochastic flow-matching step from ``sigma`` to ``sigma_next``, Flow-GRPO's formulation.

    Args:
        velocity: [B, ...] the model's prediction v ~ eps - x0 at (sample, sigma).
        sample: [B, ...] x_sigma (at least 2 dims; any float dtype).
        sigma, sigma_next: floats, 0-d tensors or per-sample tensors of shape [B], with
            0 < sigma <= 1 and 0 <= sigma_next < sigma.
        noise_level: ``a`` >= 0 (Flow-GRPO's 0.7 for "sde"; a in [0, 1] for "cps").
            0 makes the deterministic Euler step with log_prob 0 (see the module docstring).
        kind: "sde" (Flow-GRPO) or "cps" (coefficients-preserving sampling).
        prev_sample: [B, ...] if given, score this sample instead of drawing one (training
            re-scores the rollout's samples under the current policy).
        generator: a torch.Generator, or a list of B of them (one per sample, as diffusers
            allows), the only source of the noise when given.

    Returns:
        :class:`SDEStep` with ``prev_sample`` (input dtype), ``log_prob`` [B], ``mean`` (float32,
        same shape as the sample) and ``std`` ([B, 1, ..., 1] float32), the std of the Gaussian
        transition: ``std_t * sqrt(-Delta)`` for "sde", ``sigma_next sin(a pi / 2)`` for "cps".
    """
    _check_choice(kind, KINDS, "kind")
    if not isinstance(sample, Tensor) or not isinstance(velocity, Tensor):
        raise TypeError("velocity and sample must be tensors")
    if not sample.is_floating_point() or not velocity.is_floating_point():
        raise ValueError(
            f"velocity and sample must be floating point; got {velocity.dtype} and {sample.dtype}"
        )
    if sample.dim() < 2:
        raise ValueError(
            f"sample must have a batch dim and at least one more ([B, ...]); got shape "
            f"{tuple(sample.shape)}"
        )
    if velocity.shape != sample.shape:
        raise ValueError(
            f"velocity and sample must have the same shape; got {tuple(velocity.shape)} and "
            f"{tuple(sample.shape)}"
        )
    if prev_sample is not None and tuple(prev_sample.shape) != tuple(sample.shape):
        raise ValueError(
            f"prev_sample must have the sample's shape {tuple(sample.shape)}; got "
            f"{tuple(prev_sample.shape)}"
        )
    if isinstance(noise_level, Tensor):
        if noise_level.numel() != 1:
            raise ValueError(f"noise_level must be a scalar; got shape {tuple(noise_level.shape)}")
        noise_level = noise_level.item()
    a = float(noise_level)
    if not math.isfinite(a) or a < 0:
        raise ValueError(f"noise_level must be a finite number >= 0; got {noise_level!r}")
    if kind == "cps" and a > 1:
        raise ValueError(f"noise_level for kind 'cps' must lie in [0, 1]; got {noise_level!r}")

    dtype = torch.float64 if sample.dtype == torch.float64 else torch.float32
    out_dtype, device = sample.dtype, sample.device
    batch, ndim = sample.shape[0], sample.dim()
    # Checked where they are (the sampler's and a batch's sigmas stay on the CPU: no device
    # sync per step), then moved to the sample's device.
    sig = _as_sigma(sigma, "sigma", batch, ndim, dtype)  # [B, 1, ...]
    sig_next = _as_sigma(sigma_next, "sigma_next", batch, ndim, dtype).to(sig.device)  # [B, 1, ...]
    if ((sig <= 0) | (sig > 1)).any():
        raise ValueError(f"sigma must lie in (0, 1]; got {sig.flatten().tolist()}")
    if (sig_next < 0).any():
        raise ValueError(f"sigma_next must be >= 0; got {sig_next.flatten().tolist()}")
    if (sig_next >= sig).any():
        raise ValueError(
            f"sigma_next must be < sigma (steps go from noise, sigma = 1, to data, sigma = 0); "
            f"got sigma {sig.flatten().tolist()} and sigma_next {sig_next.flatten().tolist()}"
        )
    sig, sig_next = sig.to(device), sig_next.to(device)

    x = sample.to(dtype)
    v = velocity.to(dtype)
    delta = sig_next - sig  # [B, 1, ...] < 0
    reduce_dims = tuple(range(1, ndim))

    if a == 0.0:  # the deterministic Euler (ODE) step: no density, log_prob := 0
        mean = x + delta * v
        out = mean.to(out_dtype) if prev_sample is None else prev_sample
        zeros = torch.zeros(batch, dtype=dtype, device=device)
        return SDEStep(out, zeros, mean, torch.zeros_like(sig), torch.zeros_like(mean), torch.zeros_like(sig))

    if kind == "sde":
        denom = 1 - torch.where(sig == 1, sig_next, sig)  # sigma = 1 would divide by zero
        std_t = a * torch.sqrt(sig / denom)
        var_t = std_t**2
        mean = x * (1 + var_t / (2 * sig) * delta) + v * (1 + var_t * (1 - sig) / (2 * sig)) * delta
        std = std_t * torch.sqrt(-delta)
        kl_std = std_t
    else:  # "cps"
        std = sig_next * math.sin(a * math.pi / 2)
        x0_hat = x - sig * v
        x1_hat = x + (1 - sig) * v
        keep = torch.sqrt((sig_next**2 - std**2).clamp_min(0))  # clamp: rounding at a = 1
        mean = (1 - sig_next) * x0_hat + keep * x1_hat
        kl_std = std

    if prev_sample is None:
        noise = _randn(sample.shape, generator, dtype, device)
        out = (mean + std * noise).to(out_dtype)
    else:
        out = prev_sample
    # Score the returned sample itself (after rounding to the input dtype), never through it.
    target = out.detach().to(dtype)
    if kind == "sde":
        elem = -((target - mean) ** 2) / (2 * std**2) - torch.log(std) - _LOG_SQRT_2PI
    else:
        elem = -((target - mean) ** 2)
    return SDEStep(out, elem.mean(dim=reduce_dims), mean, std, elem, kl_std)


# --------------------------------------------------------------------------- time shifts


def sd3_shift(sigmas: float | Tensor, shift: float = 3.0) -> float | Tensor:
    """SD3's time shift ``s sigma / (1 + (s - 1) sigma)``; keeps 0 and 1 fixed.

    sd3_shift(0.5, 3) = 1.5 / 2 = 0.75.
    """
    if not shift > 0:
        raise ValueError(f"shift must be > 0; got {shift!r}")
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def flux_mu(
    image_seq_len: int,
    base_seq_len: int = 256,
    max_seq_len: int = 4096,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
) -> float:
    """FLUX / Qwen-Image's resolution-dependent ``mu = m L + b``, L = number of image tokens.

    The line through (base_seq_len, base_shift) and (max_seq_len, max_shift):
    m = (1.15 - 0.5) / (4096 - 256), b = 0.5 - 256 m (diffusers' ``calculate_shift``).
    """
    if max_seq_len == base_seq_len:
        raise ValueError("max_seq_len must differ from base_seq_len")
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    b = base_shift - m * base_seq_len
    return image_seq_len * m + b


def flux_shift(sigmas: float | Tensor, mu: float) -> float | Tensor:
    """FLUX / Qwen-Image's exponential time shift ``e^mu / (e^mu + 1 / sigma - 1)``.

    Written as ``e^mu sigma / (e^mu sigma + 1 - sigma)`` (the same for sigma > 0), which also
    maps sigma = 0 to 0 instead of dividing by zero.
    """
    e = math.exp(mu)
    return e * sigmas / (e * sigmas + 1 - sigmas)


# --------------------------------------------------------------------------- the sampler


class FlowSDESampler:
    """A flow-matching sampler for RL, after diffusers' scheduler contract.

    ``set_timesteps`` builds ``sigmas`` ([N + 1] float32, from 1 down to exactly 0) and
    ``timesteps`` ([N], ``sigma * num_train_timesteps`` as diffusers feeds its transformers);
    step ``i`` goes from ``sigmas[i]`` to ``sigmas[i + 1]``. ``sde_steps`` picks which steps are
    stochastic (Flow-GRPO-Fast's window); ``step`` makes one step, an ODE step where ``sde`` is
    False. The last step (to sigma = 0) is never an SDE step. Evaluation: ``sde=False`` (or
    ``noise_level=0``) everywhere.

    Usage::

        sampler = FlowSDESampler()
        sampler.set_timesteps(10, shift="flux", image_seq_len=1024)
        window = set(sampler.sde_steps(2, (0, 4), generator=g))
        for i, t in enumerate(sampler.timesteps):
            v = model(x, t)
            out = sampler.step(v, x, i, noise_level=0.7, sde=i in window, generator=g)
            x = out.prev_sample
    """

    def __init__(self, num_train_timesteps: int = 1000) -> None:
        self.num_train_timesteps = num_train_timesteps
        self.sigmas: Tensor | None = None  # [N + 1] float32, sigmas[0] = 1, sigmas[-1] = 0
        self.timesteps: Tensor | None = None  # [N] float32, sigmas[:-1] * num_train_timesteps

    @property
    def num_steps(self) -> int:
        return len(self._require_sigmas()) - 1

    def _require_sigmas(self) -> Tensor:
        if self.sigmas is None:
            raise RuntimeError("call set_timesteps(num_steps, ...) first")
        return self.sigmas

    def set_timesteps(
        self,
        num_steps: int,
        *,
        shift: str = "sd3",
        shift_value: float = 3.0,
        image_seq_len: int | None = None,
        base_seq_len: int = 256,
        max_seq_len: int = 4096,
        base_shift: float = 0.5,
        max_shift: float = 1.15,
        mu: float | None = None,
        shift_terminal: float | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        """``sigmas = shift(linspace(1, 0, num_steps + 1))``.

        shift: "sd3" (``shift_value``, SD3 / SD3.5's 3.0), "flux" (FLUX / Qwen-Image; needs
        ``image_seq_len``, the number of image tokens, and takes diffusers' ``calculate_shift``
        parameters, or ``mu`` itself, as FLUX.2's pipeline computes it) or "none" (uniform sigmas).

        shift_terminal (in (0, 1); None or 0: off): then the shifted sigmas before the final 0 are
        stretched affinely in ``1 - sigma`` so that sigmas[0] stays 1 and sigmas[-2] becomes
        ``shift_terminal`` (diffusers' ``stretch_shift_to_terminal``; Qwen-Image's 0.02). One step
        has no sigma to stretch but the starting 1 itself: it stays [1, 0] (diffusers' is NaN).
        """
        _check_choice(shift, SHIFTS, "shift")
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"num_steps must be an integer >= 1; got {num_steps!r}")
        if shift_terminal is not None and not 0 <= shift_terminal < 1:
            raise ValueError(f"shift_terminal must lie in [0, 1) (0 or None: off); got {shift_terminal!r}")
        sigmas = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
        if shift == "sd3":
            sigmas = sd3_shift(sigmas, shift_value)
        elif shift == "flux":
            if mu is None and image_seq_len is None:
                raise ValueError('shift="flux" needs image_seq_len (the number of image tokens)')
            if mu is None:
                mu = flux_mu(image_seq_len, base_seq_len, max_seq_len, base_shift, max_shift)
            sigmas = flux_shift(sigmas, mu)
        if shift_terminal and num_steps > 1:
            # 1 - sigma scaled so the last sigma before 0 lands on shift_terminal: an increasing
            # affine map of sigma, so the schedule stays strictly decreasing, and sigma < 1 after
            # the first (the SDE's std_t = a sqrt(sigma / (1 - sigma)) stays finite)
            one_minus = 1 - sigmas[:-1]
            sigmas[:-1] = 1 - one_minus / (one_minus[-1] / (1 - shift_terminal))
        self.sigmas = sigmas.to(dtype=torch.float32, device=device)
        self.timesteps = self.sigmas[:-1] * self.num_train_timesteps

    def sde_steps(
        self,
        window_size: int | None = None,
        window_start_range: tuple[int, int] | None = None,
        generator: torch.Generator | None = None,
    ) -> list[int]:
        """The indices of the stochastic steps, ascending.

        ``window_size=None``: every step but the last (plain Flow-GRPO). Otherwise a window of
        ``window_size`` consecutive steps starting at a step drawn uniformly from
        ``window_start_range = (lo, hi)``, both inclusive (default: every start that keeps the
        window off the last step, ``(0, N - 1 - window_size)``), drawn from ``generator``.
        """
        n = self.num_steps
        if window_size is None:
            return list(range(n - 1))
        if isinstance(window_size, bool) or not isinstance(window_size, int) or window_size < 1:
            raise ValueError(f"window_size must be an integer >= 1 or None; got {window_size!r}")
        latest = n - 1 - window_size  # the latest start that keeps the window off the last step
        if latest < 0:
            raise ValueError(
                f"window_size {window_size} leaves no room in {n} steps: the last step is never "
                f"an SDE step, so window_size must be <= {n - 1}"
            )
        lo, hi = (0, latest) if window_start_range is None else window_start_range
        if not (0 <= lo <= hi <= latest):
            raise ValueError(
                f"window_start_range must satisfy 0 <= lo <= hi <= {latest} (= num_steps - 1 - "
                f"window_size, keeping the window off the last step); got {window_start_range!r}"
            )
        device = generator.device if generator is not None else "cpu"
        start = int(torch.randint(lo, hi + 1, (1,), generator=generator, device=device).item())
        return list(range(start, start + window_size))

    def step(
        self,
        velocity: Tensor,
        sample: Tensor,
        index: int | Tensor,
        *,
        noise_level: float,
        kind: str = "sde",
        sde: bool = True,
        prev_sample: Tensor | None = None,
        generator: Generators = None,
    ) -> SDEStep:
        """Step ``index`` (an int, or a [B] integer tensor of per-sample step indices).

        ``sde=False`` makes the deterministic Euler step (log_prob 0, whatever
        ``noise_level``); ``sde=True`` calls :func:`sde_step_with_logprob`. An SDE step at the
        last index is refused: the step to sigma = 0 is never stochastic.
        """
        sigmas = self._require_sigmas()
        n = len(sigmas) - 1
        if isinstance(index, Tensor):
            if index.dim() > 1 or index.dtype.is_floating_point or index.dtype == torch.bool:
                raise ValueError(
                    f"index must be an int or an integer tensor of shape [B]; got "
                    f"{index.dtype} of shape {tuple(index.shape)}"
                )
            idx = index.to(device=sigmas.device, dtype=torch.long)
        elif isinstance(index, int) and not isinstance(index, bool):
            idx = torch.tensor(index, device=sigmas.device)
        else:
            raise TypeError(f"index must be an int or an integer tensor; got {index!r}")
        if ((idx < 0) | (idx >= n)).any():
            raise ValueError(f"index must lie in [0, {n - 1}]; got {idx.tolist()}")
        if sde and (idx == n - 1).any():
            raise ValueError(f"step {n - 1} (to sigma = 0) is the last step, never an SDE step")
        return sde_step_with_logprob(
            velocity,
            sample,
            sigmas[idx],
            sigmas[idx + 1],
            noise_level=noise_level if sde else 0.0,
            kind=kind,
            prev_sample=prev_sample,
            generator=generator,
        )
