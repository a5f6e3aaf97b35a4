"""
Generation: one streaming turn of a language model, a token per step.

A turn feeds its prompt (or continues from the pending token), then each step feeds the
token sampled last, samples the next and hands out the text it adds, decoded a short window
at a time. It ends on max_new_tokens, an end-of-sequence token, a stop string, max_seq_len
or an interrupt; its end, like the end of its prompt, is a committed boundary. A
restore/rollback may end it in the middle of a step (preemption.py). An interrupt during a
long prompt stops the prefill at the next chunk boundary (engine.PREFILL_CHUNK): the chunks
run are the turn's prompt, committed like a whole one (result.prompt_consumed says how many
tokens), so the state is that of the shorter prompt and rollback counts as after any turn.

A conversation turn (chat.py) differs: its prompt is prefilled whole and is no boundary of
its own, and its end feeds the reply's last token and the template's end-of-turn tokens
before the commit, so that every boundary holds whole turns.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field, fields
import functools
import sys
import time
from typing import Callable, Iterator, Sequence

import torch

from ...errors import FlashRTError, InvalidRequestError
from ...preemption import guarded_forward, meet, StepAborted

STOP_REASONS = ('max_tokens', 'eos', 'stop_string', 'interrupted', 'max_seq_len', 'error')


@dataclass(frozen=True)
class TokenEvent:
    index: int
    token_id: int
    text: str  # decoded piece (may be "" while a multi-byte character is incomplete)


@dataclass(frozen=True, repr=False)
class GenerationResult:
    token_ids: list[int]
    stop_reason: str  # one of STOP_REASONS
    ttft_s: float
    tokens_per_s: float
    prompt_tokens: int
    # Prompt tokens in the state: fewer than prompt_tokens when an interrupt cut the prefill
    # at a chunk boundary (stop_reason 'interrupted'; the state is that shorter prompt's).
    prompt_consumed: int = 0
    # Gives `text`, on its first use: a long turn is not detokenized on the path of the
    # restore that ends it.
    detokenize: Callable[[], str] = field(default=lambda: '', repr=False, compare=False)

    @functools.cached_property
    def text(self) -> str:
        """Return the turn's text, cut before its stop string (stop_reason 'stop_string')."""
        return self.detokenize()

    def __repr__(self) -> str:
        shown = ', '.join(f'{f.name}={getattr(self, f.name)!r}' for f in fields(self) if f.repr)
        return f'GenerationResult(text={self.text!r}, {shown})'


@dataclass
class Sampling:
    """A turn's limits and sampling parameters (see Runtime.generate)."""

    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    eos: bool

    @classmethod
    def checked(cls, max_new_tokens, temperature, top_k, top_p, seed, stop, eos) -> 'Sampling':
        """Return the parameters normalized, or raise InvalidRequestError."""
        if isinstance(stop, str):
            stop = (stop,)
        if (
            isinstance(max_new_tokens, bool)
            or not isinstance(max_new_tokens, int)
            or max_new_tokens < 0
        ):
            raise InvalidRequestError('max_new_tokens must be an integer >= 0')
        if not temperature >= 0.0 or not 0.0 < top_p <= 1.0 or top_k < 0:
            raise InvalidRequestError('need temperature >= 0, 0 < top_p <= 1 and top_k >= 0')
        return cls(max_new_tokens, float(temperature), int(top_k), float(top_p), seed,
                   tuple(s for s in stop if s), bool(eos))


def prompt_ids(tokenizer, vocab_size: int, prompt: str | Sequence[int],
               first: bool = False) -> list[int]:
    """
    Return the prompt's token ids, or raise InvalidRequestError.

    first: the prompt starts the context, so it gets the specials (BOS) the tokenizer puts
    before a text. vocab_size: the ids the model has rows for; ids past the tokenizer's
    vocabulary are refused too (they have no token).
    """
    if isinstance(prompt, str):
        ids = tokenizer.encode_first(prompt) if first else tokenizer.encode(prompt)
    else:
        try:
            ids = [int(t) for t in prompt]
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError('prompt must be text or a sequence of token ids') from exc
    if not ids:
        raise InvalidRequestError('prompt is empty; pass text or at least one token id')
    return check_vocab(tokenizer, vocab_size, ids)


def check_vocab(tokenizer, vocab_size: int, ids: list[int]) -> list[int]:
    """Return ids if each has a token (and a model row), else raise InvalidRequestError."""
    limit = min(vocab_size, tokenizer.vocab_size)
    bad = [t for t in ids if not 0 <= t < limit]
    if bad:
        beyond = (f' (the model has {vocab_size} output rows, the tokenizer {tokenizer.vocab_size}'
                  " tokens: ids past the tokenizer's have no token)"
                  if vocab_size != tokenizer.vocab_size else '')
        raise InvalidRequestError(
            f'token ids {bad[:5]} are outside the vocabulary [0, {limit}){beyond}; send ids '
            'the tokenizer produces')
    return ids


def check_fits(rt, ids: list[int], reserve: int = 0) -> None:
    """
    Raise InvalidRequestError when ids (after the pending token) overflow max_seq_len.

    reserve: positions the turn needs after its prompt (a conversation turn's end-of-turn).
    """
    cursor = rt.cursor
    n = len(ids) + (cursor.pending is not None) + reserve
    if cursor.position + n > rt.config.max_seq_len:
        raise InvalidRequestError(
            f'prompt of {len(ids)} tokens does not fit: position {cursor.position}'
            f"{' + 1 pending token' if cursor.pending is not None else ''}"
            f"{f' + {reserve} for the end of the turn' if reserve else ''}, max_seq_len "
            f'{rt.config.max_seq_len}; reset(), roll back or raise max_seq_len'
        )


def prefill_ids(rt, ids: list[int], stop=None) -> int:
    """
    Consume ids (after the pending token, if any) into the state (lock held).

    stop(): see Engine.prefill; returns how many of `ids` were consumed (all unless stopped).
    """
    check_fits(rt, ids)
    cursor = rt.cursor
    pending = cursor.pending is not None
    if pending:
        ids = [cursor.pending] + ids  # the token sampled last turn has not been consumed yet
    cursor.extent = max(cursor.extent, cursor.position + len(ids))
    with guarded_forward(rt):
        n = rt.engine.prefill(ids, cursor.position, stop)
    rt.engine.record(ids[:n], cursor.position)
    cursor.position += n
    cursor.pending = None
    return n - pending


def _text(tokenizer, ids: list[int], stop: Sequence[str]) -> str:
    """Return the text of `ids`, cut before the first of the `stop` strings in it."""
    text = tokenizer.decode(ids)
    found = [text.find(x) for x in stop if x in text]
    return text[:min(found)] if found else text


def _feed(rt, token: int) -> None:
    cursor = rt.cursor
    cursor.extent = max(cursor.extent, cursor.position + 1)
    with guarded_forward(rt):
        rt.engine.decode(token, cursor.position)
    rt.engine.record((token,), cursor.position)
    cursor.position += 1


class Generation:
    """Streaming iterator over TokenEvents; `.result` is set when it finishes (else None)."""

    def __init__(self, runtime, prompt_ids: list[int] | None, sampling: Sampling,
                 plan=None):
        """plan: the conversation's chat.TurnPlan (None outside a conversation)."""
        self._rt = runtime
        self.prompt_ids = prompt_ids
        self.sampling = sampling
        self.plan = plan
        self.closes_turn = plan is not None and plan.closing is not None
        # Positions kept free for the end of the turn: the reply's last token + end-of-turn.
        self.reserve = 1 + len(plan.closing) if self.closes_turn else 0
        self.stop_ids = frozenset(runtime.tokenizer.eos_token_ids) | (
            plan.end_ids if plan is not None else frozenset())
        self.result: GenerationResult | None = None
        self.token_ids: list[int] = []
        self.started = False
        self.prompt_consumed = 0
        self.t_start = 0.0
        self.t_first = 0.0
        # Incremental detokenization: the text of token_ids[prefix:] minus that of
        # token_ids[prefix:read] is what the newest tokens add (decoding a short window per
        # step, not the whole turn; the window's first tokens give merges their context).
        self.prefix_offset = 0
        self.read_offset = 0
        self.tail = ''  # the end of the text handed out so far, for stop strings
        self._events: collections.deque[TokenEvent] = collections.deque()
        self._reason: str | None = None  # why the turn ends with the token accepted last

    def __iter__(self) -> Iterator[TokenEvent]:
        return self

    def __next__(self) -> TokenEvent:
        writer = self._rt.writer
        with writer.lock:
            if self._events:  # decided by the last speculative round, handed out one by one
                return self._events.popleft()
            if self.result is not None:
                raise StopIteration
            if writer.pending:  # a restore/rollback waits for this boundary
                writer.serve(self, torn=False)
                raise StopIteration
            try:
                return self._step()
            except StepAborted:
                writer.serve(self, torn=True)
                raise StopIteration from None

    def close(self) -> None:
        """Stop early (if still running); the state stays at the last step boundary, committed."""
        if self.result is None:
            self.finish('interrupted')

    def __del__(self):
        if sys.is_finalizing():  # interpreter exit: torch and the blob pool may be half gone
            return
        try:
            self.close()
        except Exception:
            pass

    def _step(self) -> TokenEvent:
        """One step (lock held): the prompt first, then a token per call."""
        rt, s, cursor = self._rt, self.sampling, self._rt.cursor
        if not self.started:
            self.started, self.t_start = True, time.perf_counter()
            if self.prompt_ids is not None:
                # A conversation turn's prompt is not cut by an interrupt: half a turn is
                # no boundary.
                stop = None if self.closes_turn else rt.writer.stop.is_set
                try:
                    with rt.writer.abortable():
                        self.prompt_consumed = prefill_ids(rt, self.prompt_ids, stop)
                except FlashRTError:
                    self._release()
                    raise
            if self.plan is not None:
                cursor.messages, cursor.turn_open = self.plan.messages, self.closes_turn
            # Seeded after the prompt, which samples nothing: a refused one changes nothing.
            if s.seed is not None:
                rt.generator.manual_seed(s.seed)
            if self.prompt_ids is not None and not self.closes_turn:
                rt.writer.commit()  # end of prefill is a committed boundary
        if rt.writer.stop.is_set():
            self.finish('interrupted')
        elif len(self.token_ids) >= s.max_new_tokens:
            self.finish('max_tokens')
        elif (cursor.pending is not None
              and cursor.position + self.reserve >= rt.config.max_seq_len):
            self.finish('max_seq_len')
        if self.result is not None:
            raise StopIteration
        speculator = rt.speculator
        if cursor.pending is not None and speculator is not None:
            done = len(self.token_ids)
            try:
                room = rt.config.max_seq_len - self.reserve - cursor.position
                with torch.inference_mode():
                    speculator.run_round(self._accept, min(s.max_new_tokens - done, room))
            except StepAborted:  # its tokens were never handed out
                del self.token_ids[done:]
                self._events.clear()
                raise
        else:
            with torch.inference_mode():  # once for the step's nested calls (inference.py)
                if cursor.pending is not None:
                    with rt.writer.abortable():
                        _feed(rt, cursor.pending)
                        meet()  # the step's last poll: only sampling and emitting follow
                    cursor.pending = None
                with guarded_forward(rt):  # e.g. NaN logits make sampling raise
                    token = rt.engine.sample(s.temperature, s.top_k, s.top_p, rt.generator)
            cursor.pending = token
            self._accept(token)
        if self._reason is not None:
            self.finish(self._reason)
        if not self._events:
            raise StopIteration
        return self._events.popleft()

    def _accept(self, token: int) -> bool:
        """Queue the event of sampled `token`; False when the turn ends with it."""
        s = self.sampling
        if not self.token_ids:
            self.t_first = time.perf_counter()
        if s.eos and token in self.stop_ids:
            self._reason = 'eos'
            return False
        self.token_ids.append(token)
        last = len(self.token_ids) >= s.max_new_tokens
        piece = self._new_text()
        if piece.endswith('\ufffd') and not last:
            # Hold it back while more tokens may follow: it can be a multi-byte character
            # cut in the middle. The last event flushes everything.
            piece = ''
        elif piece:
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        reason = 'max_tokens' if last else None
        if piece and s.stop:
            seen = self.tail + piece
            if any(x in seen for x in s.stop):
                reason = 'stop_string'
            self.tail = seen[-max(len(x) for x in s.stop):]
        self._events.append(TokenEvent(len(self.token_ids) - 1, token, piece))
        self._reason = reason
        return reason is None

    def _new_text(self) -> str:
        """Return the text the tokens past read_offset add (see __init__)."""
        ids, decode = self.token_ids, self._rt.tokenizer.decode
        done = decode(ids[self.prefix_offset:self.read_offset])
        text = decode(ids[self.prefix_offset:])
        return text[len(done):] if len(text) > len(done) else ''

    def _release(self) -> None:
        """Free the runtime's writer slot, if this turn holds it."""
        self._rt.writer.release(self)

    def finish(self, reason: str, commit: bool = True) -> None:
        """End of turn: build the result, commit the boundary, free the writer slot."""
        rt = self._rt
        with rt.writer.lock:
            if self.result is not None:
                return
            ids = list(self.token_ids)
            n = len(ids)
            now = time.perf_counter()
            decode_s = now - self.t_first if n > 1 else 0.0
            tps = (n - 1) / decode_s if decode_s > 0 else 0.0
            stop = self.sampling.stop if reason == 'stop_string' else ()
            self.result = GenerationResult(
                ids,
                reason,
                (self.t_first - self.t_start) if n else 0.0,
                tps,
                len(self.prompt_ids or ()),
                self.prompt_consumed,
                functools.partial(_text, rt.tokenizer, list(ids), stop),  # token_ids may change
            )
            if tps > 0:
                rt.driver.decode_tps = tps
            try:
                if commit and self.started and rt.writer.turn is self and not rt._closed:
                    if self.closes_turn and not self._closed_turn(reason):
                        return
                    rt.writer.commit()  # end of turn is a committed boundary
            finally:
                self._release()

    def _closed_turn(self, reason: str) -> bool:
        """
        Close the conversation turn (lock held); False when a waiting preemption cut it.

        The closing is a forward of a few tokens; a restore or rollback that comes meanwhile
        replaces the state anyway, so it abandons the closing rather than wait for it.
        """
        writer = self._rt.writer
        try:
            with writer.abortable():
                self._close_turn(reason)
        except StepAborted:
            writer.serve(self, torn=True)
            return False
        return True

    def _close_turn(self, reason: str) -> None:
        """Feed the reply's last token and the end-of-turn tokens; record the reply."""
        rt, cursor = self._rt, self._rt.cursor
        ids = list(self.plan.closing)
        if cursor.pending is not None and reason != 'eos':
            ids.insert(0, cursor.pending)  # the reply's last token (an EOS is replaced)
        cursor.pending = None
        if ids:
            prefill_ids(rt, ids)
        reply = rt.chat.reply_text(self.token_ids)  # all of it: a stop string was fed too
        cursor.messages = self.plan.messages + (('assistant', reply),)
        cursor.turn_open = False
