"""A cheaper @torch.inference_mode() for functions called once per decode step."""

from __future__ import annotations

import functools

import torch


def inference(fn):
    """
    Run fn in inference mode, entering it only when the caller is not in it already.

    torch's decorator builds and enters a new context on every call: a few microseconds,
    paid several times per token by nested step functions. A turn enters it once per step.
    """
    @functools.wraps(fn)
    def run(*args, **kwargs):
        if torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode():
            return fn(*args, **kwargs)
    return run
