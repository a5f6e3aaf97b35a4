"""
The two long operations of a multi-token forward, run in pieces where that pays.

A forward of more than one token spends most of its time in two operations that call no
module for as long as they run: the chunked gated-delta rule of a hybrid's linear-attention
layers and the attention over the cache. Per thread, either runs in pieces:

- `recurrent_rule()`: the gated-delta rule token by token, the rule a decode step runs. The
  chunked rule pads to 64-token chunks: for the 2-4 tokens of a speculative verify that
  costs many decode steps on CPU.
- `preemptible()` (a prefill): the rule and the attention PIECE_ROWS query rows at a time,
  with preemption.meet() between pieces, so a waiting preemption abandons a prefill within
  one piece. Otherwise it waits for one layer's operation over a whole PREFILL_CHUNK, which
  grows with the chunk and, for the attention, with the cache. CPU tensors only: on CUDA
  the launches are asynchronous and the next module call comes soon anyway.

Pieces give the same bytes as one call (test/runtime/test_pieces.py): the rule carries its
recurrent state from piece to piece, cut at a multiple of its 64-token chunk; a query row's
attention does not depend on the other rows, and a causal attention gets its mask
explicitly, over the keys up to the piece's last row rounded up to the kernel's key block.

The bindings are process-wide, as transformers' are: `install(model)` wraps the rule of each
modeling module of `model` and the 'sdpa' attention function, once; outside the two context
managers the wrappers call what they wrap.
"""

from __future__ import annotations

import contextlib
import sys
import threading

import torch

from ..preemption import meet

CHUNK, RECURRENT = 'torch_chunk_gated_delta_rule', 'torch_recurrent_gated_delta_rule'
RULE_CHUNK = 64  # the chunked rule's chunk_size default: rule pieces are a multiple of it
PIECE_ROWS = 128  # query rows (tokens) per piece: 64 costs the default model 20% of its prefill
# Keys per block of torch's CPU attention kernel: keys cut at a multiple of it are summed in
# the same order for every row (test_pieces checks the bytes).
KEY_BLOCK = 512
_RULE_ARGS = ('query', 'key', 'value', 'g', 'beta')  # the rule's positional parameters
_mode = threading.local()  # .short, .pieces: how this thread's forwards run


@contextlib.contextmanager
def switched(mode: threading.local, name: str, on: bool):
    """Set this thread's flag `name` of `mode` to `on` inside; the one before after."""
    before = getattr(mode, name, False)
    setattr(mode, name, on)
    try:
        yield
    finally:
        setattr(mode, name, before)


def recurrent_rule(on: bool = True):
    """Run this thread's gated-delta forwards token by token inside."""
    return switched(_mode, 'short', on)


def preemptible(on: bool = True):
    """Run this thread's long CPU operations in pieces inside, meeting preemptions between."""
    return switched(_mode, 'pieces', on)


def _in_pieces(rows: torch.Tensor, dim: int) -> bool:
    return (getattr(_mode, 'pieces', False) and rows.device.type == 'cpu'
            and rows.shape[dim] > PIECE_ROWS)


def install(model: torch.nn.Module) -> None:
    """Wrap the gated-delta rule of `model`'s modeling modules and 'sdpa' (idempotent)."""
    for name in {type(m).__module__ for m in model.modules()}:
        module = sys.modules.get(name)
        if module is not None:
            _wrap_rule(module)
    _wrap_attention()


def _wrap_rule(module) -> None:
    chunked = getattr(module, CHUNK, None)
    if chunked is None or not hasattr(module, RECURRENT) or getattr(chunked, 'pieces', False):
        return

    def rule(*args, **kwargs):
        if getattr(_mode, 'short', False):
            kwargs.pop('chunk_size', None)
            return getattr(module, RECURRENT)(*args, **kwargs)
        query = args[0] if args else kwargs.get('query')
        if (len(args) > len(_RULE_ARGS) or kwargs.get('cu_seqlens') is not None
                or query is None or not _in_pieces(query, 1)):
            return chunked(*args, **kwargs)
        return _rule_in_pieces(chunked, dict(zip(_RULE_ARGS, args), **kwargs))

    rule.pieces = True
    # kernels.route_kernels looks through it to the transformers binding.
    rule.flashrt_kernel = getattr(chunked, 'flashrt_kernel', chunked)
    setattr(module, CHUNK, rule)


def _rule_in_pieces(chunked, kwargs: dict):
    """Run the chunked rule over [B, T, ...] inputs PIECE_ROWS tokens (rounded up) at a time."""
    chunk = kwargs.get('chunk_size', RULE_CHUNK)
    size = -(-PIECE_ROWS // chunk) * chunk
    state, keep = kwargs.get('initial_state'), kwargs.get('output_final_state', False)
    outs = []
    for start in range(0, kwargs['query'].shape[1], size):
        if start:
            meet()
        piece = dict(kwargs, initial_state=state, output_final_state=True)
        for name in _RULE_ARGS:
            piece[name] = kwargs[name][:, start:start + size]
        out, state = chunked(**piece)
        outs.append(out)
    return torch.cat(outs, dim=1), (state if keep else None)


def _wrap_attention() -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    whole = ALL_ATTENTION_FUNCTIONS.get('sdpa')
    if whole is None or getattr(whole, 'pieces', False):
        return

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                  is_causal=None, **kwargs):
        if (not _in_pieces(query, 2) or dropout or kwargs.get('position_bias') is not None
                or kwargs.get('softcap') is not None or kwargs.get('output_attentions')):
            return whole(module, query, key, value, attention_mask, dropout, scaling,
                         is_causal, **kwargs)
        return _attention_in_pieces(module, query, key, value, attention_mask, scaling,
                                    is_causal), None

    attention.pieces = True
    attention.flashrt_kernel = whole
    AttentionInterface.register('sdpa', attention)


def _attention_in_pieces(module, query, key, value, mask, scaling, is_causal):
    """
    Run the sdpa attention PIECE_ROWS query rows at a time; return [B, T, H, D].

    As transformers' whole call does: a causal attention without a mask sees keys up to its
    own row (the keys past the rows cut off); grouped key/value heads are repeated, here
    once for all the pieces.
    """
    rows, keys = query.shape[2], key.shape[2]
    causal = mask is None and (
        is_causal if is_causal is not None else getattr(module, 'is_causal', True))
    if causal:
        keys = rows
        at = torch.arange(rows, device=query.device)
        mask = (at[None, :] <= at[:, None])[None, None]  # [1, 1, rows, rows]
    groups = getattr(module, 'num_key_value_groups', 1)
    if groups > 1:
        key, value = (x.repeat_interleave(groups, dim=1) for x in (key, value))
    # No piece of one row: a lone query row can take another kernel path than a block.
    starts = [s for s in range(0, rows, PIECE_ROWS) if rows - s > 1 or s == 0]
    outs = []
    for start, stop in zip(starts, starts[1:] + [rows]):
        if start:
            meet()
        # A causal piece sees no key past its last row: those key blocks are left out.
        seen = min(keys, -(-stop // KEY_BLOCK) * KEY_BLOCK) if causal else keys
        part = None if mask is None else (
            mask[..., :seen] if mask.shape[-2] == 1 else mask[..., start:stop, :seen])
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            query[:, :, start:stop], key[:, :, :seen], value[:, :, :seen], attn_mask=part,
            scale=scaling))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous()
