"""
Speech mode: audio in, text tokens out, one committed boundary per 80 ms frame.

feed_audio takes samples of any length; each frame they complete runs the codec encoder and
one decoder step (the first frame also the utterance's BOS step) and is committed, so
rollback(k) undoes the last k frames (and any samples of a frame not yet complete). The
samples of a partial frame are arena state, so a snapshot mid-frame continues exactly.
Audio at another rate goes through a streaming resampler first (models/resample.py); its
input history is arena state and its counters meta, and the first chunk of an utterance
fixes its rate (another rate is refused until reset).
position counts decoder steps (frame count + 1 once the utterance started); the cursor's
pending token is the text token the next frame's step is fed.

A checkpoint's silence prefix (its processor's audio_silence_prefix_seconds, which
transformers' pipeline and Kyutai's own scripts put before the audio) is fed at model rate
before the first audio of every utterance; the adapter's silence_left (meta) counts what of
it is still to feed, so a boundary inside it continues it exactly.

Decoding is greedy (Kyutai STT's own use). flush() reads the words still held back by the
text delay: it feeds that much silence to a copy of the state and puts the live one back.
Transcriber turns the token events into text, words with audio times and end-of-utterance
events (below).

A feed or a flush asks should_stop() before each frame it begins (so after each commit):
when it says stop, nothing more of the call's samples is taken in, not even into the
partial frame, so a cut feed leaves the state at the last frame it committed. A preempting
restore or rollback abandons a feed's frame in flight at its next module call and replaces
the state on the feeding thread (writer.py); the feed returns cut and `preempted`.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
import math
import sys
import time

import numpy as np
import torch

from .base import Driver
from ..engine import Engine
from ..errors import InvalidRequestError
from ..models.speech import KyutaiSTTAdapter, SpeechSpec
from ..preemption import guarded_forward, StepAborted
from ..state.arena import StateSpec

SAMPLE_FORMATS = ('int16', 'float32')


@dataclass(frozen=True)
class TranscriptEvent:
    frame: int  # index of the frame whose step produced the token (0-based, per utterance)
    token_id: int
    text: str  # '' for the pad token (a frame with no new text)
    is_pad: bool
    position: int  # the decoder position after the step
    rms: float = 0.0  # the frame's audio energy (root mean square, full scale 1.0)


class FedAudio(list):
    """The events of the frames a feed or flush ran; whether should_stop cut it short."""

    cut = False
    preempted = False  # a restore or rollback abandoned a frame and replaced the state
    dropped_samples = 0  # samples of the call not taken in (at the rate they were sent)
    last_sample = 0  # samples of the call taken in when its last frame completed


# Float samples are full scale at 1.0; a little gain past it is taken, more is refused.
MAX_AMPLITUDE = 8.0


def check_audio(adapter, samples, sample_rate: int | None = None) -> torch.Tensor:
    """Return mono samples as float32 [N] in [-1, 1], or raise InvalidRequestError."""
    adapter.resampler.check_rate(stated_rate(adapter, sample_rate))
    if isinstance(samples, torch.Tensor):
        samples = samples.detach().cpu().numpy()
    array = np.asarray(samples)
    if array.ndim != 1:
        raise InvalidRequestError(f'audio must be mono samples [N], got shape {array.shape}')
    if array.dtype == np.int16:
        array = array.astype(np.float32) / 32768.0
    elif array.dtype in (np.float32, np.float64) or (array.size == 0 and array.dtype == object):
        array = array.astype(np.float32)
    elif array.dtype.kind in 'iu' and array.size and (
            array.min() >= -32768 and array.max() <= 32767):
        array = array.astype(np.float32) / 32768.0  # plain ints: int16 values
    else:
        raise InvalidRequestError(
            f'audio samples of type {array.dtype} are not supported; send int16 or float32')
    if array.size and not np.isfinite(array).all():
        raise InvalidRequestError('audio holds NaN or Inf samples; nothing was fed')
    peak = float(np.abs(array).max()) if array.size else 0.0
    if peak > MAX_AMPLITUDE:  # finite, but enough to make the codec's state infinite
        raise InvalidRequestError(
            f'audio samples reach {peak:.3g}, far past full scale (1.0); send float samples in '
            f'[-1, 1] (at most {MAX_AMPLITUDE:g}) or int16; nothing was fed')
    return torch.from_numpy(np.ascontiguousarray(array))


def stated_rate(adapter, sample_rate: int | None) -> int:
    """Return the rate audio is sent at (None: the model's own)."""
    return adapter.spec.sample_rate if sample_rate is None else int(sample_rate)


class SpeechDriver(Driver):
    """Feeds audio frames to a streaming speech model; the text tokens go through the engine."""

    name = 'speech'
    kind = 'a speech model'
    calls = 'call feed_audio(samples) and flush()'

    def __init__(self, rt, adapter: KyutaiSTTAdapter):
        super().__init__(rt, adapter)
        self.spec = adapter.spec
        self.control_step_s = 0.0  # a frame's step in the last feed that completed one

    @staticmethod
    def serves(adapter) -> bool:
        return isinstance(adapter, KyutaiSTTAdapter)

    def state_specs(self) -> list[StateSpec]:
        """Return the engine's state: the last text logits (the adapter keeps the tokens)."""
        return [StateSpec('logits', 'logits', (self.adapter.vocab_size,), torch.float32)]

    def bind(self, views: dict) -> Engine:
        # Eager: a frame's codec and decoder steps branch on host state.
        self.engine = Engine(self.adapter, views['logits'], views['tokens'], False)
        return self.engine

    @property
    def speech_spec(self) -> SpeechSpec:
        return self.spec

    def warm(self) -> None:
        """Run two frames of silence from a fresh state."""
        rt = self.rt
        rt.cursor.position, rt.cursor.pending = 0, None
        self._feed_frames(torch.zeros(2 * self.adapter.spec.frame_size, device=rt.device),
                          None, False)

    def close(self) -> None:
        self.engine.drop_graph()
        super().close()

    def stats(self) -> dict:
        return dict(super().stats(), control_step_s=self.control_step_s)

    # ---- calls (Runtime's say what they do) --------------------------------------------

    def check_audio(self, samples, sample_rate: int | None = None) -> torch.Tensor:
        return check_audio(self.adapter, samples, sample_rate)

    def feed_audio(self, samples, sample_rate: int | None = None,
                   should_stop=None) -> FedAudio:
        rt = self.rt
        audio = self.check_audio(samples, sample_rate)
        t0 = time.perf_counter()
        with rt.writer.lock:
            rt._check_idle()
            events = self._feed_samples(audio, sample_rate, should_stop)
            if events:
                self.control_step_s = (time.perf_counter() - t0) / len(
                    {e.frame for e in events})
            return events

    def flush(self, should_stop=None) -> FedAudio:
        with self.rt.writer.lock:
            self.rt._check_idle()
            return self._read_delayed(should_stop)

    # ---- frames (lock held) ------------------------------------------------------------

    def _frames_needed(self, samples: int) -> int:
        """Count the decoder steps `samples` more samples run (the first frame also BOS)."""
        frames = (self.adapter.samples + samples) // self.adapter.spec.frame_size
        return frames + (1 if frames and self.rt.cursor.position == 0 else 0)

    def _feed_samples(self, audio: torch.Tensor, sample_rate: int | None = None,
                      should_stop=None) -> FedAudio:
        """Fold checked samples [N] into the state."""
        rt, adapter, cursor = self.rt, self.adapter, self.rt.cursor
        rate = stated_rate(adapter, sample_rate)
        adapter.resampler.check_stream(rate)
        steps = self._frames_needed(adapter.silence_left
                                    + adapter.resampler.count(audio.numel(), rate))
        limit = adapter.max_steps  # None: every cache is a window, no bound
        if limit is not None and cursor.position + steps > limit:
            raise InvalidRequestError(
                f'utterance is full: position {cursor.position} + {steps} frames > max_seq_len '
                f'{limit}; reset() or restore a capsule first, or raise max_seq_len')
        events = FedAudio()
        if adapter.silence_left:  # the utterance's silence prefix goes first
            events = self._feed_frames(torch.zeros(adapter.silence_left, device=rt.device),
                                       None, True, should_stop, prefix=True)
            if events.cut:
                events.dropped_samples = audio.numel()
                return events
        rest = self._feed_frames(audio.to(rt.device), rate, True, should_stop)
        rest[:0] = events
        return rest

    def _feed_frames(self, audio: torch.Tensor, rate: int | None, commit: bool,
                     should_stop=None, prefix: bool = False) -> FedAudio:
        """
        Fill the partial frame from samples [N] at `rate`; run and commit each frame completed.

        The resampler takes only the input that completes the frame, so every boundary is
        the state right after the sample that completed its frame, however the audio was
        chunked. rate None: model-rate samples that bypass the resampler (silence fed by
        flush, warmup). should_stop() is asked before each frame is begun; True leaves the
        rest untaken. prefix: the samples are the utterance's silence prefix (silence_left).
        """
        adapter, resampler = self.adapter, self.adapter.resampler
        events = FedAudio()
        frame_size, partial = adapter.spec.frame_size, adapter.partial
        done = 0
        while done < audio.numel():
            if should_stop is not None and should_stop():
                events.cut, events.dropped_samples = True, audio.numel() - done
                break
            need = frame_size - adapter.samples
            take = min(audio.numel() - done,
                       need if rate is None else resampler.needed(need, rate))
            chunk = audio[done:done + take]
            out = chunk if rate is None else resampler.process(chunk, rate)
            partial[adapter.samples:adapter.samples + out.numel()].copy_(out)
            adapter.samples += out.numel()
            begun, done = done, done + take
            if prefix:
                adapter.silence_left -= take
            if adapter.samples < frame_size:
                break
            try:  # a frame of the live state may be abandoned; a flush's copy may not
                with (self.rt.writer.abortable() if commit else contextlib.nullcontext()), \
                        guarded_forward(self.rt):  # torn by an error: the last frame back
                    events += self._frame()
            except StepAborted:
                self.rt.writer.serve(None, torn=True)  # the waiting restore replaces it
                events.cut = events.preempted = True
                events.dropped_samples = audio.numel() - begun
                break
            events.last_sample = 0 if prefix else done
            if commit:
                self.rt.writer.commit()
        return events

    def _frame(self) -> list[TranscriptEvent]:
        """Run the complete frame in the partial buffer: BOS first in a fresh utterance."""
        adapter, cursor, events = self.adapter, self.rt.cursor, []
        frame = max(cursor.position - 1, 0)
        cursor.extent = max(cursor.extent, cursor.position + 2)
        samples = adapter.partial.clone()
        rms = float(samples.square().mean().sqrt())
        if cursor.position == 0:
            events.append(self._emit(adapter.bos_step(0), adapter.config.bos_token_id, frame,
                                     rms))
        codes_logits = adapter.frame_step(samples, cursor.pending, cursor.position)
        adapter.partial.zero_()
        adapter.samples = 0
        events.append(self._emit(codes_logits[1], cursor.pending, frame, rms))
        return events

    def _emit(self, logits: torch.Tensor, fed: int, frame: int, rms: float) -> TranscriptEvent:
        """Record the step just run (fed token, logits, next token); return its event."""
        cursor, engine = self.rt.cursor, self.engine
        engine.logits.copy_(logits)
        engine.record((fed,), cursor.position)
        cursor.position += 1
        token = int(engine.logits.argmax())
        cursor.pending = token
        pad = token == self.adapter.spec.pad_token_id
        return TranscriptEvent(frame, token, '' if pad else self.rt.tokenizer.decode([token]),
                               pad, cursor.position, rms)

    def _read_delayed(self, should_stop=None) -> FedAudio:
        """Read the delayed words: feed text-delay silence to a copy; live state unchanged."""
        rt, adapter, spec = self.rt, self.adapter, self.adapter.spec
        saved = rt.codec.capture('flush', 'device')
        try:
            events, tail_cut = FedAudio(), False
            resampler = adapter.resampler
            limit = adapter.max_steps or sys.maxsize
            if resampler.rate and resampler.rate != spec.sample_rate:
                # The resampler's lookahead: silence at the input rate brings out its last
                # samples.
                tail = torch.zeros(2 * resampler.size, device=rt.device)
                if rt.cursor.position + self._frames_needed(
                        resampler.count(tail.numel(), resampler.rate)) < limit:
                    tail_events = self._feed_frames(tail, resampler.rate, False, should_stop)
                    events += tail_events
                    tail_cut = tail_events.cut
            frames = math.ceil(spec.text_delay_s * spec.sample_rate / spec.frame_size)
            silence = (frames * spec.frame_size
                       + (spec.frame_size - adapter.samples) % spec.frame_size)
            silence = min(silence,
                          (limit - rt.cursor.position - 1) * spec.frame_size)
            silence = torch.zeros(max(silence, 0), device=rt.device)
            rest = self._feed_frames(silence, None, False, should_stop)
            events += rest
            events.cut = tail_cut or rest.cut
            return events
        finally:
            rt.codec.apply(saved)


# ---- text, words and the end of an utterance ----------------------------------------------

END_OF_PADDING_ID = 0  # Kyutai STT's "a word starts next" token: never text
# End of utterance by default: 0.8 s of padding tokens over audio below -45 dBFS (a quiet
# room through a close microphone is below it; speech is 20-40 dB above).
QUIET_S, QUIET_DB = 0.8, -45.0


@dataclass(frozen=True)
class Word:
    """A word of the transcript in audio time (s from the utterance's first sample)."""

    text: str
    start: float
    end: float  # a partial word: its last piece so far
    partial: bool  # it may still grow; a later update repeats it, committed


@dataclass(frozen=True)
class EndOfUtterance:
    """The speaker stopped: the transcript quiet for `quiet_s` after these words."""

    text: str  # the words since the last end of utterance
    start: float  # audio time of its first word
    end: float  # audio time of its last word's end
    quiet_s: float
    frame: int  # the frame that completed the quiet interval
    pause_probability: float = math.nan  # a pause head's; NaN: the energy/padding rule


@dataclass
class TranscriptUpdate:
    """What the events of one feed add to the transcript."""

    ids: list  # the text tokens
    text: str  # the text they add (with the spaces between words)
    words: list  # the words they committed, then the one still partial (if any)
    first_frame: int  # frame of the first text token (0 if none)
    end_of_utterance: EndOfUtterance | None = None


class Transcriber:
    """
    Turn token events into text, timed words and end-of-utterance events.

    Text: decoded incrementally as the LM mode does (a short window of text tokens; what
    the newest add), so a SentencePiece tokenizer's word-start pieces become spaces; the
    pad token, end of padding (0), BOS and the tokenizer's special ids are never text.
    Times: the token of frame f was emitted after (f + 1) frames of audio; the text lags
    the audio by the text delay, and the silence prefix is not the speaker's, so its
    audio time is (f + 1) * frame_s - delay - prefix (at least 0). A word starts at its
    first character's frame and ends at the frame of the first token after it that does
    not extend it (whitespace, a pad, end of padding): by then the text delay has passed
    over its end, and it is committed; until then it is partial.
    End of utterance: quiet_s of frames whose token is no text and whose audio is below
    quiet_db (dB full scale), after at least one word (once per stretch of words).
    Host state only: reset() when the live state is replaced (an interrupt, reset,
    restore or rollback ends the utterance's transcript).
    """

    WINDOW = 8  # text tokens kept as decoding context

    def __init__(self, tokenizer, spec, quiet_s: float = QUIET_S, quiet_db: float = QUIET_DB):
        self._decode = tokenizer.decode
        self._frame_s = spec.frame_size / spec.sample_rate
        self._offset = spec.text_delay_s + spec.silence_prefix_s
        special = set(getattr(tokenizer, 'special_ids', ())) | set(
            getattr(tokenizer, 'specials', {}).values())  # (ByteTokenizer's)
        # Ids past the tokenizer's vocabulary (Kyutai's BOS, 48000) are no text either.
        self._not_text = frozenset(special | {END_OF_PADDING_ID, spec.pad_token_id})
        self._vocab = getattr(tokenizer, 'vocab_size', None)
        self.quiet_s, self.quiet_db, self._quiet_rms = quiet_s, quiet_db, 10 ** (quiet_db / 20)
        self.reset()

    def reset(self) -> None:
        """Start a new utterance's transcript."""
        self._ids: list[int] = []  # the decoding window
        self._read = 0  # _ids[:_read] handed out as text
        self._word: list | None = None  # [text, start frame, last frame] of the open word
        self._heard: list[Word] = []  # committed words since the last end of utterance
        self._quiet = 0  # quiet frames in a row
        self._frame = -1  # the last frame seen

    def fork(self) -> 'Transcriber':
        """Return a copy that goes on apart (a flush's words, read from a copy of the state)."""
        other = copy.copy(self)
        other._ids, other._heard = list(self._ids), list(self._heard)
        other._word = None if self._word is None else list(self._word)
        return other

    def time(self, frame: int) -> float:
        """Return the audio time of the text emitted at `frame`."""
        return max(0.0, round((frame + 1) * self._frame_s - self._offset, 6))

    def is_text(self, token: int) -> bool:
        return token not in self._not_text and (self._vocab is None or token < self._vocab)

    def update(self, events) -> TranscriptUpdate:
        """Fold the events of one feed (in order) into the transcript."""
        out = TranscriptUpdate([], '', [], 0)
        for event in events:
            new_frame = event.frame != self._frame
            self._frame = event.frame
            if self.is_text(event.token_id):
                if not out.ids:
                    out.first_frame = event.frame
                out.ids.append(event.token_id)
                piece = self._piece(event.token_id)
                out.text += piece
                for char in piece:
                    if char.isspace():
                        self._close(event.frame, out)
                    elif self._word is None:
                        self._word = [char, event.frame, event.frame]
                    else:
                        self._word[0] += char
                        self._word[2] = event.frame
                self._quiet = 0
            else:
                self._close(event.frame, out)
                quiet = event.rms < self._quiet_rms
                self._quiet = self._quiet + 1 if quiet and new_frame else (
                    self._quiet if quiet else 0)
                if self._heard and self._quiet * self._frame_s >= self.quiet_s - 1e-9:
                    out.end_of_utterance = self._end(event.frame)
        if self._word is not None:
            text, start, last = self._word
            out.words.append(Word(text, self.time(start), self.time(last), True))
        return out

    def _piece(self, token: int) -> str:
        """Return the text `token` adds (see the LM mode's Generation._new_text)."""
        self._ids.append(token)
        done = self._decode(self._ids[:self._read])
        text = self._decode(self._ids)
        piece = text[len(done):] if len(text) > len(done) else ''
        if piece.endswith('\ufffd'):
            return ''  # a multi-byte character cut in the middle: wait for the rest
        if piece:
            keep = max(len(self._ids) - self.WINDOW, 0)
            self._ids, self._read = self._ids[keep:], len(self._ids) - keep
        return piece

    def _close(self, frame: int, out: TranscriptUpdate) -> None:
        """End the open word at `frame` (committed)."""
        if self._word is not None:
            text, start, _ = self._word
            word = Word(text, self.time(start), self.time(frame), False)
            out.words.append(word)
            self._heard.append(word)
            self._word = None

    def _end(self, frame: int) -> EndOfUtterance:
        heard, self._heard = self._heard, []
        return EndOfUtterance(' '.join(w.text for w in heard), heard[0].start, heard[-1].end,
                              round(self._quiet * self._frame_s, 6), frame)
