"""
Streaming rational resampler: windowed-sinc polyphase, L/M = model rate / input rate.

Output sample n sits at input time t = n * M / L; it is the dot product of a Kaiser-windowed
sinc (cutoff the lower Nyquist) with the 2K input samples around t, one filter per phase
(n * M) mod L. An output is made once its last tap has arrived, so the stream lags by K input
samples. The state between calls: the last 2 * K_MAX input samples (an arena view; samples
before the stream are zeros) and two counters (meta): `lag`, how far the next output's
first tap lies behind the newest input, and `phase`. Each output is a fixed sequence of
multiply-adds over its taps, so any chunking of a stream gives the same bits.
"""

from __future__ import annotations

from functools import lru_cache
import math
from typing import Any

import torch

from ..errors import InvalidRequestError

ZEROS = 16  # zero crossings each side of the filter, at the lower rate
ROLLOFF = 0.94  # cutoff as a fraction of the lower Nyquist (room for the transition band)
BETA = 8.6  # Kaiser window shape: ~80 dB stopband
MIN_RATE, MAX_RATE = 8000, 48000
MAX_PHASES = 1024  # L above this means a rate with no useful common divisor


def ratio(rate: int, target: int) -> tuple[int, int]:
    """Return (L, M), the reduced up/down factors taking `rate` to `target`."""
    g = math.gcd(rate, target)
    return target // g, rate // g


def half_width(rate: int, target: int) -> int:
    """Return K, the filter's half-width in input samples."""
    up, down = ratio(rate, target)
    return math.ceil(ZEROS * max(1.0, down / up))


@lru_cache(maxsize=16)
def _taps(rate: int, target: int) -> torch.Tensor:
    """Return the polyphase filters [L, 2K] (float32); row p weighs x[b - K + 1 .. b + K]."""
    up, down = ratio(rate, target)
    k = half_width(rate, target)
    cutoff = ROLLOFF * min(1.0, up / down)  # in input-Nyquist units
    offsets = torch.arange(-k + 1, k + 1, dtype=torch.float64)  # tap index j minus base b
    phases = torch.arange(up, dtype=torch.float64).unsqueeze(1) / up
    x = phases - offsets  # t - j, in input samples: [L, 2K]
    window = torch.special.i0(BETA * torch.sqrt((1 - (x / k) ** 2).clamp(min=0))) / (
        torch.special.i0(torch.tensor(BETA, dtype=torch.float64)))
    taps = cutoff * torch.sinc(cutoff * x) * window * (x.abs() < k)
    return taps.float()


class StreamingResampler:
    """Resamples one utterance's stream to `target` Hz; history and counters are state."""

    def __init__(self, target: int):
        self.target = target
        self.size = 2 * max(half_width(r, target) for r in (MIN_RATE, MAX_RATE))
        self.history: torch.Tensor | None = None  # [size] arena view
        self.reset_meta()

    # ---- meta ----------------------------------------------------------------------------

    def reset_meta(self) -> None:
        self.rate = 0  # the utterance's input rate (0: none fixed yet)
        self.lag = 0
        self.phase = 0

    def export_meta(self) -> dict[str, Any]:
        return {'rate': self.rate, 'lag': self.lag, 'phase': self.phase}

    def check_meta(self, meta: dict[str, Any]) -> None:
        if not isinstance(meta, dict) or set(meta) != {'rate', 'lag', 'phase'} or not all(
                type(v) is int for v in meta.values()):
            raise ValueError('resample meta needs int rate, lag and phase')
        rate = meta['rate']
        if rate == 0 or rate == self.target:
            if meta['lag'] or meta['phase']:
                raise ValueError('resample lag and phase must be 0 without resampling')
            return
        self.check_rate(rate)
        up = ratio(rate, self.target)[0]
        k = half_width(rate, self.target)
        if not (0 <= meta['phase'] < up and 0 <= meta['lag'] <= k):
            raise ValueError(f'resample phase must be in [0, {up}), lag in [0, {k}]')

    def import_meta(self, meta: dict[str, Any]) -> None:
        self.rate, self.lag, self.phase = meta['rate'], meta['lag'], meta['phase']

    # ---- rates ---------------------------------------------------------------------------

    def check_rate(self, rate: int) -> None:
        """Raise InvalidRequestError unless `rate` can be resampled to the target."""
        if rate == self.target:
            return
        if not MIN_RATE <= rate <= MAX_RATE or ratio(rate, self.target)[0] > MAX_PHASES:
            raise InvalidRequestError(
                f'audio at {rate} Hz cannot be resampled to the model rate {self.target} Hz; '
                f'send {MIN_RATE}..{MAX_RATE} Hz at a common rate (8000, 16000, 22050, '
                '32000, 44100, 48000)')

    def check_stream(self, rate: int) -> None:
        """Raise InvalidRequestError if the utterance was started at another rate."""
        if self.rate and rate != self.rate:
            raise InvalidRequestError(
                f'audio at {rate} Hz, but this utterance is at {self.rate} Hz; keep one rate '
                'per utterance, or reset() first')

    def count(self, n: int, rate: int) -> int:
        """Return how many output samples `n` more input samples at `rate` complete."""
        if rate == self.target or n <= 0:
            return n if rate == self.target else 0
        up, down = ratio(rate, self.target)
        ready = n + self.lag - half_width(rate, self.target)  # first taps' room, this call
        # outputs m = 0.. with base offset floor((phase + m * M) / L) < ready
        return max(0, -(-(ready * up - self.phase) // down)) if ready > 0 else 0

    def needed(self, n: int, rate: int) -> int:
        """Return how many more input samples at `rate` complete `n` >= 1 output samples."""
        if rate == self.target:
            return n
        up, down = ratio(rate, self.target)
        last_base = (self.phase + (n - 1) * down) // up  # the n-th output's, past the next's
        return last_base + half_width(rate, self.target) - self.lag + 1

    # ---- compute -------------------------------------------------------------------------

    def process(self, x: torch.Tensor, rate: int) -> torch.Tensor:
        """Fold input samples x [N] at `rate` into the state; return the outputs they complete."""
        self.check_stream(rate)
        if x.numel():
            self.rate = rate
        if rate == self.target:
            return x
        up, down = ratio(rate, self.target)
        k = half_width(rate, self.target)
        n_out = self.count(x.numel(), rate)
        span = 2 * k
        # stream: the whole history, then x; its end is the newest input
        stream = torch.cat([self.history, x])
        first = self.size - self.lag - k + 1  # index of output 0's first tap in `stream`
        m = torch.arange(n_out, device=x.device)
        steps = self.phase + m * down
        starts = first + torch.div(steps, up, rounding_mode='floor')  # [n_out]
        taps = _taps(rate, self.target).to(x.device)[steps % up]  # [n_out, 2K]
        out = torch.zeros(n_out, dtype=torch.float32, device=x.device)
        for j in range(span):  # fixed order of multiply-adds: chunking cannot change bits
            out += taps[:, j] * stream[starts + j]
        total = self.phase + n_out * down
        self.lag += x.numel() - total // up
        self.phase = total % up
        self.history.copy_(stream[stream.numel() - self.size:])  # all of it: chunking-free
        return out
