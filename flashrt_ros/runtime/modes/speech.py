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

Decoding is greedy (Kyutai STT's own use). flush() reads the words still held back by the
text delay: it feeds that much silence to a copy of the state and puts the live one back.

A feed or a flush asks should_stop() before each frame it begins (so after each commit):
when it says stop, nothing more of the call's samples is taken in, not even into the
partial frame, so a cut feed leaves the state at the last frame it committed.
"""

from __future__ import annotations

from dataclasses import dataclass
import math
import time

import numpy as np
import torch

from .base import Driver
from ..engine import Engine
from ..errors import InvalidRequestError
from ..models.speech import KyutaiSTTAdapter, SpeechSpec
from ..preemption import guarded_forward
from ..state.arena import StateSpec

SAMPLE_FORMATS = ('int16', 'float32')


@dataclass(frozen=True)
class TranscriptEvent:
    frame: int  # index of the frame whose step produced the token (0-based, per utterance)
    token_id: int
    text: str  # '' for the pad token (a frame with no new text)
    is_pad: bool
    position: int  # the decoder position after the step


class FedAudio(list):
    """The events of the frames a feed or flush ran; whether should_stop cut it short."""

    cut = False
    dropped_samples = 0  # samples of the call not taken in (at the rate they were sent)


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
        """Return the engine's state: the last text logits and the token history."""
        return Engine.state_specs(self.adapter.vocab_size, self.rt.config.max_seq_len)

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
        steps = self._frames_needed(adapter.resampler.count(audio.numel(), rate))
        if cursor.position + steps > rt.config.max_seq_len:
            raise InvalidRequestError(
                f'utterance is full: position {cursor.position} + {steps} frames > max_seq_len '
                f'{rt.config.max_seq_len}; reset() or restore a capsule first, or raise '
                'max_seq_len')
        return self._feed_frames(audio.to(rt.device), rate, True, should_stop)

    def _feed_frames(self, audio: torch.Tensor, rate: int | None, commit: bool,
                     should_stop=None) -> FedAudio:
        """
        Fill the partial frame from samples [N] at `rate`; run and commit each frame completed.

        The resampler takes only the input that completes the frame, so every boundary is
        the state right after the sample that completed its frame, however the audio was
        chunked. rate None: model-rate samples that bypass the resampler (silence fed by
        flush, warmup). should_stop() is asked before each frame is begun; True leaves the
        rest untaken.
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
            done += take
            if adapter.samples < frame_size:
                break
            with guarded_forward(self.rt):  # a torn frame goes: back to the last completed one
                events += self._frame()
            if commit:
                self.rt.writer.commit()
        return events

    def _frame(self) -> list[TranscriptEvent]:
        """Run the complete frame in the partial buffer: BOS first in a fresh utterance."""
        adapter, cursor, events = self.adapter, self.rt.cursor, []
        frame = max(cursor.position - 1, 0)
        cursor.extent = max(cursor.extent, cursor.position + 2)
        if cursor.position == 0:
            events.append(self._emit(adapter.bos_step(0), adapter.config.bos_token_id, frame))
        codes_logits = adapter.frame_step(adapter.partial.clone(), cursor.pending,
                                          cursor.position)
        adapter.partial.zero_()
        adapter.samples = 0
        events.append(self._emit(codes_logits[1], cursor.pending, frame))
        return events

    def _emit(self, logits: torch.Tensor, fed: int, frame: int) -> TranscriptEvent:
        """Record the step just run (fed token, logits, next token); return its event."""
        cursor, engine = self.rt.cursor, self.engine
        engine.logits.copy_(logits)
        engine.record((fed,), cursor.position)
        cursor.position += 1
        token = int(engine.logits.argmax())
        cursor.pending = token
        pad = token == self.adapter.spec.pad_token_id
        return TranscriptEvent(frame, token, '' if pad else self.rt.tokenizer.decode([token]),
                               pad, cursor.position)

    def _read_delayed(self, should_stop=None) -> FedAudio:
        """Read the delayed words: feed text-delay silence to a copy; live state unchanged."""
        rt, adapter, spec = self.rt, self.adapter, self.adapter.spec
        saved = rt.codec.capture('flush', 'device')
        try:
            events, tail_cut = FedAudio(), False
            resampler = adapter.resampler
            if resampler.rate and resampler.rate != spec.sample_rate:
                # The resampler's lookahead: silence at the input rate brings out its last
                # samples.
                tail = torch.zeros(2 * resampler.size, device=rt.device)
                if rt.cursor.position + self._frames_needed(
                        resampler.count(tail.numel(), resampler.rate)) < rt.config.max_seq_len:
                    tail_events = self._feed_frames(tail, resampler.rate, False, should_stop)
                    events += tail_events
                    tail_cut = tail_events.cut
            frames = math.ceil(spec.text_delay_s * spec.sample_rate / spec.frame_size)
            silence = (frames * spec.frame_size
                       + (spec.frame_size - adapter.samples) % spec.frame_size)
            silence = min(silence,
                          (rt.config.max_seq_len - rt.cursor.position - 1) * spec.frame_size)
            silence = torch.zeros(max(silence, 0), device=rt.device)
            rest = self._feed_frames(silence, None, False, should_stop)
            events += rest
            events.cut = tail_cut or rest.cut
            return events
        finally:
            rt.codec.apply(saved)
