"""A language model's mode: generation, conversations (chat), speculative decoding."""

from .driver import LMDriver

__all__ = ['LMDriver']
