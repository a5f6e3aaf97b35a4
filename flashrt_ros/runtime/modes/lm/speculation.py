"""
Self-speculative greedy decoding with the model's MTP head, committed exactly.

A round starts at a committed boundary: position P, the pending token x (sampled, not yet
consumed) and the main model's last hidden h_{P-1} in the arena. It

1. drafts up to k tokens with the head: d_1 from (h_{P-1}, x), each further one from the
   head's own hidden and the previous draft (its rows past x's are zeroed again at once:
   only the row of x is what consuming x writes, models/speculative.py);
2. verifies them with the main model, `sequential` (one single-token step per token, ending
   at the first mismatch: every step is exactly the one plain greedy decoding would run,
   so tokens and state digests are identical at every commit) or `batched` (one forward
   over x, d_1..d_k: compiled, keeping each token's state; with torch, on a rejection the
   head of the arena (recurrent, conv, counters) goes back to its copy from before the
   forward, the rows it wrote are zeroed and the accepted tokens are fed again as one
   forward, all on the device with one host read per round (device_round.py), as CUDA
   graphs once the decode step is captured);
3. commits the accepted drafts and the main model's next greedy token (the bonus, pending).

Every token is handed to the turn as it is decided (accept); when the turn ends with one
(EOS, max_new_tokens, a stop string) the round stops there, as plain decoding would. The
round never takes a capsule: capsules are only taken at committed boundaries.
"""

from __future__ import annotations

import collections
from typing import Callable

import numpy
import torch

from .device_round import DeviceRound
from .generation import _feed
from ...config import MAX_DRAFT_TOKENS
from ...errors import FlashRTError
from ...inference import inference
from ...models.pieces import recurrent_rule
from ...preemption import guarded_forward

TRACE_ROUNDS = 4096  # accepted-draft counts of the latest rounds (tests, benchmarks)
NAN_LOGITS = ('the model produced NaN logits; no token was taken: check the model (dtype, '
              'weights) and the capsule the state came from')


def _greedy(logits: torch.Tensor, limit: int) -> list[int]:
    """
    Return the argmax of each row of logits [T, V] among ids below `limit`.

    Those are the ids plain decoding samples from (Engine.limit_vocab); NaN is refused as
    the engine refuses it.
    """
    if logits.device.type == 'cpu':  # numpy: the same first-maximum argmax, no torch op cost
        logits = logits.numpy()[:, :limit]
        nan = bool(numpy.isnan(logits).any())
    else:
        logits = logits[:, :limit]
        nan = bool(torch.isnan(logits).any())
    if nan:
        raise FlashRTError(NAN_LOGITS)
    return logits.argmax(-1).tolist()


class Speculator:
    """Runs speculative rounds for a runtime whose adapter is an MTPAdapter."""

    def __init__(self, rt, draft_tokens: int, verify: str):
        self.rt, self.adapter = rt, rt.adapter
        self.draft_tokens, self.verify = draft_tokens, verify
        # Tests and benchmarks: script(position, pending, k) -> drafts, instead of the head.
        self.script: Callable[[int, int, int], list[int]] | None = None
        self.reset_stats()
        views, arena = rt.arena.views, rt.arena
        self._head_rows = [views[e.name] for e in arena.manifest
                           if e.kind == 'mtp' and e.seq_dim is not None]
        self.device = DeviceRound(rt, draft_tokens) if verify == 'batched' else None

    def reset_stats(self) -> None:
        """Start the round counters (not the graph replays) from zero."""
        self.rounds = 0
        self.drafted = [0] * MAX_DRAFT_TOKENS  # rounds that drafted depth j + 1
        self.accepted = [0] * MAX_DRAFT_TOKENS  # ... and committed it
        self.tokens = 0  # tokens the rounds handed out
        self.trace: collections.deque[int] = collections.deque(maxlen=TRACE_ROUNDS)

    def stats(self) -> dict:
        """Return rounds, mean tokens per round and the acceptance rate of each draft depth."""
        return {
            'verify': self.verify,
            'draft_tokens': self.draft_tokens,
            'rounds': self.rounds,
            'mean_accepted_length': self.tokens / self.rounds if self.rounds else 0.0,
            'acceptance_by_depth': [a / d if d else 0.0 for a, d in
                                    zip(self.accepted[:self.draft_tokens],
                                        self.drafted[:self.draft_tokens])],
            'cuda_graphs': bool(self.device and self.device.graphs),
            'cuda_graph_note': self.device.graph_error if self.device else None,
            'cuda_graph_replays': self.device.replays if self.device else 0,
        }

    def close(self) -> None:
        """Drop the round's graphs and device buffers (Runtime.close)."""
        self.device = None

    @torch.inference_mode()
    def capture(self, views: dict[str, torch.Tensor]) -> bool:
        """Capture the batched torch round's phases as CUDA graphs (after the decode step)."""
        if self.device is None or self.adapter.compiled():
            return False
        if self.device.graphs:  # a later warmup(): the graphs stay valid
            return True
        rt, a = self.rt, self.adapter
        counters = [views[e.name] for e in rt.arena.manifest if e.kind == 'position']

        def prepare(position: int = 0):
            """Zero the arena, past its prefill; set its counters to `position` (if not 0)."""
            rt.arena.zero_()
            a.prepare_capture()
            a.skip_first_upkeep = False
            if position:
                for view in counters:
                    view.fill_(position)
                a.layer.cumulative_length.fill_(position - 1)  # the head's rows: from row 1
                a.meta[0].fill_(position)
        try:
            return self.device.capture(views, prepare)
        finally:
            a.skip_first_upkeep = False

    # ---- a round (step lock held, pending token set) ------------------------------------

    def run_round(self, accept: Callable[[int], bool], limit: int) -> int:
        """
        Run one round; hand each decided token to accept(token) (False: the turn ends).

        limit: tokens the turn may still hand out (>= 1). Returns the drafts committed.
        """
        rt = self.rt
        position = rt.cursor.position
        room = rt.config.max_seq_len - position  # tokens that may still be consumed (>= 1)
        k = max(0, min(self.draft_tokens, room - 1, limit - 1))
        try:
            if self.device is not None and k and not self.adapter.compiled():
                with recurrent_rule(rt.device.type == 'cpu'):
                    accepted, drafted = self._device_round(k, accept)
            else:
                drafts = self._draft(rt.cursor.pending, position, k)
                drafted = len(drafts)
                if self.verify == 'batched' and drafts:
                    accepted = self._compiled(drafts, accept)
                else:
                    accepted = self._sequential(drafts, accept)
        finally:
            self.adapter.skip_first_upkeep = False  # also after an abandoned forward
        self.rounds += 1
        self.tokens += accepted + 1
        for j in range(drafted):
            self.drafted[j] += 1
            self.accepted[j] += accepted > j
        self.trace.append(accepted)
        return accepted

    def _zero_head_rows(self, start: int, stop: int) -> None:
        for view in self._head_rows:
            view.narrow(2, start, stop - start).zero_()

    @inference
    def _draft(self, pending: int, position: int, k: int) -> list[int]:
        """Up to k draft tokens; the arena is left as it was but for the head row of x."""
        if self.script is not None:
            return [int(t) for t in self.script(position, pending, k)][:k]
        if k == 0:
            return []
        a, rt = self.adapter, self.rt
        token, hidden = pending, a.hidden.view(1, -1)
        drafts = []
        # The head writes rows position..position + k - 1: an abandoned draft's are zeroed.
        rt.cursor.extent = max(rt.cursor.extent, position + k)
        for j in range(k):
            with rt.writer.abortable(), guarded_forward(rt):
                token, hidden = a.draft(token, hidden, position + j,  # hidden [1, H]
                                        rt.engine.vocab_limit)
            drafts.append(token)
        self._drafted(position, k)
        return drafts

    def _drafted(self, position: int, k: int) -> None:
        """After k head drafts from `position`: only x's head row stays (see module doc)."""
        # A captured decode graph writes x's row itself: then none of the rows is kept.
        keep = 1 if self.rt.engine.graph is None else 0
        self._zero_head_rows(position + keep, position + k)
        self.adapter.layer.cumulative_length.fill_(position - 1 + keep)
        self.adapter.skip_first_upkeep = bool(keep)

    def _sequential(self, drafts: list[int], accept) -> int:
        """Verify one token a step, exactly as plain greedy decoding steps; stop at a miss."""
        rt = self.rt
        cursor = rt.cursor
        for j, token in enumerate([cursor.pending] + drafts):
            with rt.writer.abortable():
                _feed(rt, token)
            cursor.pending = None
            with guarded_forward(rt):
                best = rt.engine.sample(0.0, 0, 1.0, rt.generator)
            cursor.pending = best
            if not accept(best) or j == len(drafts) or best != drafts[j]:
                return j
        raise AssertionError('unreachable')

    @staticmethod
    def _accepted(tokens: list[int], best: list[int], accept) -> int:
        """Hand out the verified tokens up to the first miss; return the drafts accepted."""
        n, accepted = len(tokens), 0
        for j in range(n):
            accepted = j
            if not accept(best[j]) or j == n - 1 or best[j] != tokens[j + 1]:
                break
        return accepted

    def _advance(self, tokens: list[int], best: list[int], accepted: int,
                 on_device: torch.Tensor | None = None) -> int:
        """End a round: its consumed tokens in the history, the bonus token pending."""
        cursor, used = self.rt.cursor, accepted + 1
        self.rt.engine.record(tokens[:used], cursor.position,
                              None if on_device is None else on_device[:used])
        cursor.position += used
        cursor.pending = best[accepted]
        return accepted

    @inference
    def _compiled(self, drafts: list[int], accept) -> int:
        """
        Verify compiled: one call over x, d_1..d_k that keeps each token's state.

        Its logits and state are bit for bit those of single compiled steps (cpu_step.c), so
        the committed state is exactly plain greedy decoding's. The head rows of the consumed
        tokens are written after the verify, from the main model's hiddens, in one call.
        """
        rt, a = self.rt, self.adapter
        arena, cursor, main = rt.arena, rt.cursor, a.inner.cpu_step
        position, tokens = cursor.position, [cursor.pending] + drafts
        n = len(tokens)
        cursor.extent = max(cursor.extent, position + n)
        with rt.writer.abortable(), guarded_forward(rt):
            logits, hidden = main.forward(tokens, position, save=True)  # [n, V], [n, H]
            best = _greedy(logits, rt.engine.vocab_limit)
        accepted = self._accepted(tokens, best, accept)
        used = accepted + 1
        with guarded_forward(rt):
            main.keep_prefix(used, n)
            arena.zero_rows(position + used, position + n)
            # The head rows of the consumed tokens (x's when no draft of the head wrote it)
            first = 1 if a.skip_first_upkeep else 0
            if used > first:
                prev = (hidden[:used - 1] if first else
                        torch.cat([a.hidden.view(1, -1), hidden[:used - 1]]))
                a.cpu_head.forward(tokens[first:used], prev, position + first, logits=False)
            a.skip_first_upkeep = False
            a.commit_hidden(hidden[used - 1], position + used)
            rt.engine.logits.copy_(logits[used - 1])
        return self._advance(tokens, best, accepted)

    @inference
    def _device_round(self, k: int, accept) -> tuple[int, int]:
        """
        Draft and verify with torch on the device; one host read decides the round.

        Returns (drafts committed, drafts made). On a rejection the head of the arena goes
        back to its copy from before the verify, the rows the verify wrote are zeroed and the
        accepted tokens are fed again.
        """
        rt, a, dev = self.rt, self.adapter, self.device
        arena, cursor = rt.arena, rt.cursor
        position, pending = cursor.position, cursor.pending
        if self.script is not None:
            drafts = [int(t) for t in self.script(position, pending, k)][:k]
            k = len(drafts)
            dev.ids[0, :k + 1].copy_(torch.tensor([pending] + drafts))
            if k == 0:
                return self._sequential([], accept), 0
        else:
            dev.ids[0, 0].fill_(pending)
            cursor.extent = max(cursor.extent, position + k)  # as _draft
            with rt.writer.abortable(), guarded_forward(rt):
                dev.run('draft', k, position)
            self._drafted(position, k)
        n = k + 1
        skip, meta = a.skip_first_upkeep, a.export_meta()
        cursor.extent = max(cursor.extent, position + n)
        with rt.writer.abortable(), guarded_forward(rt):
            dev.run('verify', n, position)
            tokens, best, nan = dev.read(n)
            if nan:
                raise FlashRTError(NAN_LOGITS)
        accepted = self._accepted(tokens, best, accept)
        used = accepted + 1
        with guarded_forward(rt):
            if used == n:
                rt.engine.logits.copy_(dev.logits[n - 1])
            else:
                arena.storage[:arena.head_nbytes].copy_(dev.head)
                arena.zero_rows(position, position + n)
                a.import_meta(meta)
                if skip:  # the zeroed rows held x's head row too: the feed writes it again
                    a.layer.cumulative_length.fill_(position - 1)
                with rt.writer.abortable():
                    dev.run('feed', used, position)
        return self._advance(tokens, best, accepted, dev.ids[0]), k


def attach(adapter, model_id: str):
    """
    Return (adapter, None) wrapped with its MTP head, or (adapter, why not) unchanged.

    A built-in gets a seeded random head (its drafts are mostly wrong; the round is still
    exact); a checkpoint directory its `mtp.*` weights; a model without a head runs plain.
    """
    from pathlib import Path

    from ...models.builtin import INIT_STD, SEED
    from ...models.hf import HFCausalLMAdapter
    from ...models.mtp import FAMILIES, load_head, seeded_head
    from ...models.speculative import MTPAdapter

    if not isinstance(adapter, HFCausalLMAdapter):
        return adapter, f'off: a {type(adapter).__name__} has no MTP head'
    family = adapter.model.config.model_type
    if family not in FAMILIES:
        return adapter, (f'off: model type {family!r} has no MTP head (known: '
                         f'{", ".join(sorted(FAMILIES))})')
    if model_id.startswith('builtin:'):
        head = seeded_head(adapter.model, SEED + 1, INIT_STD)
    else:
        head = load_head(adapter.model, Path(model_id).expanduser())
        if head is None:
            return adapter, f'off: checkpoint {model_id!r} ships no mtp.* weights'
    return MTPAdapter(adapter, head), None
