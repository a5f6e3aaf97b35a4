"""
MTPAdapter: a causal-LM adapter whose state also holds its MTP head's state.

The head (models/mtp.py) drafts tokens for self-speculative decoding
(runtime/modes/lm/speculation.py). Its state lives in the arena next to the main model's, so
every capsule carries it:

  mtp.L0.key / mtp.L0.value   the head's attention KV, in the row block (append-only)
  mtp.L0.length               rows of it in use
  mtp.hidden                  the main model's post-final-norm hidden of the last token
  mtp.meta                    [position after the hidden's token, head rows]: a record to check

At a committed position P (tokens t_0..t_{P-1} consumed) the head's row p holds its layer's
K/V for (h_{p-1}, t_p), 1 <= p < P, and row 0 and every row from P on are zero: what
consuming the tokens one by one writes, so a plain step keeps it, and a rejected draft
leaves no trace once its rows are zeroed. Every forward therefore runs the head over the
tokens it consumes (one decoder layer: the upkeep), which the first draft of a round also
computes.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from . import cpu_step
from .base import CausalLMAdapter
from .binding import CacheBinding, module_fingerprint, PROBE_TOKENS
from .mtp import MTPHead
from ..inference import inference
from ..state.arena import StateSpec

PREFIX = 'mtp.'
HIDDEN, META = 'mtp.hidden', 'mtp.meta'


class MTPAdapter(CausalLMAdapter):
    """Wraps an HFCausalLMAdapter; adds the MTP head's state and keeps it in every forward."""

    def __init__(self, inner, head: MTPHead):
        self.inner, self.head = inner, head.eval()
        for p in head.parameters():
            p.requires_grad_(False)
        for name in ('tokenizer', 'vocab_size', 'family', 'device', 'dtype', 'kernels',
                     'meta_trusted', 'model', 'max_seq_len'):
            setattr(self, name, getattr(inner, name))
        self.base = inner.model.model  # the decoder stack: hidden states, not logits
        self.lm_head = inner.model.lm_head
        self.binding = CacheBinding(head.config, inner.max_seq_len, self.family, self._probe)
        self.layer = self.binding.cache.layers[0]
        # Set by a round whose first draft already wrote the head row of the first token.
        self.skip_first_upkeep = False
        self.last_hidden: torch.Tensor | None = None  # [1, T, H] of the last forward
        self.cpu_head: cpu_step.CpuHead | None = None  # built in bind() with the main's

    # ---- the state contract ------------------------------------------------------------

    def state_specs(self) -> list[StateSpec]:
        own = [StateSpec(PREFIX + s.name, 'mtp', s.shape, s.dtype, s.seq_dim)
               for s in self.binding.specs]
        hidden = self.head.config.hidden_size
        return self.inner.state_specs() + own + [
            StateSpec(HIDDEN, 'mtp', (hidden,), self.dtype),
            StateSpec(META, 'mtp', (2,), torch.int64)]

    def bind(self, views: dict[str, torch.Tensor]) -> None:
        self.inner.bind(views)
        own = {k[len(PREFIX):]: v for k, v in views.items() if k.startswith(PREFIX)}
        self.binding.bind(own)
        # The head's first row is t_1's: row 0 of its arena rows stays zero, so a token at
        # position p writes row p like every other row-block tensor (append-only), and
        # attention sees rows 1.. only.
        self.layer.keys, self.layer.values = own['L0.key'][:, :, 1:], own['L0.value'][:, :, 1:]
        self.layer.max_cache_len = self.binding.max_len = self.max_seq_len - 1
        self.hidden, self.meta = views[HIDDEN], views[META]  # [H], [2] int64
        main = self.inner.cpu_step
        if main is not None and cpu_step.CpuHead.refusal(self.head) is None:
            self.cpu_head = cpu_step.CpuHead(self.head, main, self.layer.keys,
                                             self.layer.values, own['L0.length'],
                                             self.binding.max_len)

    def compiled(self) -> bool:
        """Whether the main model and the head run their steps compiled now (cpu_step.py)."""
        return (self.cpu_head is not None and not self.inner.cpu_step.observed()
                and not self.cpu_head.observed())

    def export_meta(self) -> dict[str, Any]:
        return self.inner.export_meta()

    def import_meta(self, meta: dict[str, Any]) -> None:
        self.inner.import_meta(meta)

    def check_meta(self, meta: dict[str, Any]) -> None:
        self.inner.check_meta(meta)

    def reset_meta(self) -> None:
        self.inner.reset_meta()

    def fingerprint(self) -> str:
        head = module_fingerprint({'mtp': self.family}, self.head, self.dtype)
        return hashlib.sha256((self.inner.fingerprint() + head).encode()).hexdigest()

    @property
    def has_sliding_layers(self) -> bool:
        return self.inner.has_sliding_layers

    def prepare_capture(self) -> None:
        self.inner.prepare_capture()

    def decode_ready(self) -> bool:
        return self.inner.decode_ready()

    # ---- compute -----------------------------------------------------------------------

    def _head_forward(self, ids: torch.Tensor, prev: torch.Tensor, cache,
                      rows: int | None) -> torch.Tensor:
        """
        Run the head over ids [1, T] after hiddens prev [1, T, H]; return its hidden [1, T, H].

        Writes the head rows from its cache's length on; rows: that length once done, when
        known on the host (eager attention then reads only the live part).
        """
        from transformers.masking_utils import create_causal_mask

        layer = cache.layers[0]
        embeds = self.base.embed_tokens(ids)
        start = layer.cumulative_length if layer.is_initialized else 0
        # Row j of the head is at sequence position j + 1 (its first token is t_1).
        positions = (torch.arange(ids.shape[1], device=ids.device) + start + 1).unsqueeze(0)
        if cache is self.binding.cache:
            self.binding.set_window(rows)
        mask = create_causal_mask(config=self.head.config, inputs_embeds=embeds,
                                  attention_mask=None, cache=cache, position_ids=positions)
        rotary = self.base.rotary_emb(embeds, positions)
        return self.head(embeds, prev, rotary, attention_mask=mask, cache=cache,
                         position_ids=positions)

    @torch.inference_mode()
    def _probe(self, cache) -> None:
        ids = torch.arange(PROBE_TOKENS, device=self.device).unsqueeze(0)  # [1, P]
        prev = torch.zeros(1, PROBE_TOKENS, self.head.config.hidden_size, device=self.device,
                           dtype=self.dtype)
        self._head_forward(ids, prev, cache, None)

    @torch.inference_mode()
    def draft_step(self, token: torch.Tensor, prev: torch.Tensor,
                   rows: int | None) -> torch.Tensor:
        """One head step: token [1, 1] after hidden prev [1, 1, H]; returns its hidden."""
        return self._head_forward(token, prev, self.binding.cache, rows)

    @inference
    def draft(self, token: int, prev: torch.Tensor, row: int,
              limit: int) -> tuple[int, torch.Tensor]:
        """One head step at arena row `row` after hidden prev [1, H]: (draft < limit, hidden)."""
        if self.compiled():
            logits, hidden = self.cpu_head.forward((token,), prev, row)
            return int(logits.numpy()[0, :limit].argmax()), hidden
        ids = torch.tensor([[token]], device=self.device)
        hidden = self.draft_step(ids, prev.view(1, 1, -1), row)  # [1, 1, H]
        return int(self.lm_head(hidden)[0, -1, :limit].argmax()), hidden.view(1, -1)

    def _compiled_step(self, token: int, kv_len: int) -> torch.Tensor:
        """Run a decode step of main and head compiled; return the main's logits."""
        logits, hidden = self.inner.cpu_step.forward((token,), kv_len - 1)
        if self.skip_first_upkeep:
            self.skip_first_upkeep = False
        else:
            self.cpu_head.forward((token,), self.hidden.view(1, -1), kv_len - 1, logits=False)
        self.commit_hidden(hidden[0], kv_len)
        return logits

    def commit_hidden(self, hidden: torch.Tensor, kv_len: int) -> None:
        """Record the main's hidden [H] of the token before position kv_len."""
        self.hidden.copy_(hidden)
        self.meta[0].fill_(kv_len)
        self.meta[1].copy_(self.layer.cumulative_length)

    @torch.inference_mode()
    def forward_hidden(self, input_ids: torch.Tensor, kv_len: int | None) -> torch.Tensor:
        """
        Consume input_ids [1, T] into the main and head state; return post-norm hiddens.

        The head consumes (h_{p-1}, t_p) for every token but the sequence's first (and the
        round's first, when its draft wrote that row already).
        """
        self.inner.binding.set_window(kv_len)
        hidden = self.base(input_ids=input_ids, cache=self.inner.cache,
                           use_cache=True).last_hidden_state  # [1, T, H]
        prev = torch.cat([self.hidden.view(1, 1, -1), hidden[:, :-1]], dim=1)  # [1, T, H]
        first = None if kv_len is None else kv_len - input_ids.shape[1]  # None: a decode step
        skip = 1 if (self.skip_first_upkeep or first == 0) else 0
        self.skip_first_upkeep = False
        if input_ids.shape[1] > skip:
            rows = None if kv_len is None else kv_len - 1
            self._head_forward(input_ids[:, skip:], prev[:, skip:], self.binding.cache, rows)
        self.hidden.copy_(hidden[0, -1])
        if kv_len is None:
            self.meta[0].add_(input_ids.shape[1])
        else:
            self.meta[0].fill_(kv_len)
        self.meta[1].copy_(self.layer.cumulative_length)
        self.last_hidden = hidden
        return hidden

    @inference
    def forward(self, input_ids: torch.Tensor, kv_len: int | None = None) -> torch.Tensor:
        if (kv_len is not None and kv_len > 1 and input_ids.shape[1] == 1
                and self.inner.binding.decode_ready() and self.compiled()):
            return self._compiled_step(int(input_ids), kv_len)
        hidden = self.forward_hidden(input_ids, kv_len)
        return self.lm_head(hidden[:, -1:])[:, -1]  # [1, V], as the causal LM slices it

    def __getattr__(self, name: str):
        # Anything else (benchmarks reach for the model's modules) is the main adapter's.
        if name == 'inner':
            raise AttributeError(name)
        return getattr(self.inner, name)
