"""
Speech mode: audio chunks in, transcript token chunks out.

Each audio chunk is fed to the runtime (every completed 80 ms frame a committed boundary)
and the text tokens its frames produced go out as one transcript chunk: its text decoded
incrementally, its words with audio times (committed, then the one still partial), stamped
with the audio that completed its last frame (the chunk's stamp plus that sample's offset).
When the transcript has been quiet for end_of_utterance_s after words, an end-of-utterance
event goes out (runtime/modes/speech.py's Transcriber has the rules). A chunk carries
the index of its first sample in the stream, so a lost chunk is detected: the chunk after
a gap is refused (the state stays where it was; resend from the expected sample, or reset)
rather than transcribing audio with a hole in it. After an interrupt, reset, restore or
rollback the stream starts over: the next chunk's index is taken as it comes.

`_gate` makes feeding a chunk one step against an interrupt's forget-replace (quiet()) and
against forget_inputs, which run on other threads: audio sent before an interrupt is not
fed into the state the interrupt put in place. An interrupt does not wait for a long chunk:
quiet() asks the chunk being fed to stop at its next frame (the rest is dropped and said so
on ~/events), so a STOP waits for one frame at most. An interrupt or reset that restores
or rolls back does not wait for the gate: as in policy mode it counts an epoch under
`_queue_lock`, and its restore abandons the frame in flight at its next module call; the
feed asks for the epoch before each frame and publishes a transcript only if it still holds,
and the inputs and transcript of the stopped episode are dropped at the next chunk. A long
chunk is fed and its transcript published SLICE_S of audio at a time, so its words go out
as they are heard. docs/semantics.md has the barge-in recipes.
"""

import contextlib
import dataclasses
import threading
import time

from flashrt_ros.runtime import FlashRTError
from flashrt_ros.runtime.modes.speech import FedAudio, QUIET_DB, QUIET_S, Transcriber

from .modes import Mode

SLICE_S = 1.0  # audio per feed and per transcript chunk, at most


class SpeechMode(Mode):
    """A streaming speech-to-text model: the audio gate, gap detection, transcript chunks."""

    name = 'speech'
    kind = 'a speech model'
    accepts_audio = True

    def __init__(self, runtime, param, outputs):
        super().__init__(runtime, param, outputs)
        self._gate = threading.RLock()  # guards the fields below and feeding a chunk
        self._cut = threading.Event()   # set while an interrupt waits for the gate
        self._queue_lock = threading.Lock()  # a transcript going out; _epoch
        self._epoch = 0                 # interrupts begun that replace the state
        self._seen = 0                  # the epoch the stream and transcript belong to
        self._next_sample = None        # expected first_sample of the next chunk (None: any)
        self._interrupted_at = 0.0      # wall time before which audio is stale
        self._lag_s = 0.0               # receipt of the last chunk -> its frames done
        self.utterance = 0              # counts episodes (the chunks' turn_id)
        quiet_s, quiet_db = param('end_of_utterance_s'), param('end_of_utterance_db')
        self.transcriber = Transcriber(
            runtime.tokenizer, runtime.speech_spec, QUIET_S if quiet_s is None else quiet_s,
            QUIET_DB if quiet_db is None else quiet_db)
        self._ends = 0                  # end-of-utterance events of this episode

    @staticmethod
    def serves(runtime):
        return runtime.is_speech

    def turn_refusal(self, source):
        return (f'{source} rejected: the node runs a speech model (mode speech); publish '
                'audio on ~/audio instead')

    def audio(self, samples, sample_rate=None, first_sample=-1, received=None, stamp=None):
        """
        Feed one chunk of mono samples (int16 or float32) received at wall time `received`.

        first_sample < 0 means the sender does not number its samples (no gap check).
        stamp: the chunk's first sample's time (integer ns, node clock; None: unknown, the
        transcript is stamped when published). Returns the transcript events of the frames
        it completed ([] if refused).
        """
        with self._gate:
            if received is not None and received <= self._interrupted_at:
                return []  # sent before the last interrupt/reset: the stopped episode's
            self._catch_up()
            expected = self._next_sample
            if first_sample >= 0 and expected is not None and first_sample != expected:
                what = 'missing' if first_sample > expected else 'repeated'
                self.reject_audio(
                    f'gap in the audio stream: expected sample {expected}, got {first_sample} '
                    f'({abs(first_sample - expected)} samples {what}); resend from sample '
                    f'{expected}, or reset')
                return []
            try:
                events = self._feed(samples, sample_rate, stamp)
            except FlashRTError as exc:  # bad audio or a full utterance: refused untouched
                self.reject_audio(str(exc))
                return []
            except Exception as exc:  # the model failed mid-frame: report it, keep serving
                message = f'speech step failed: {exc!r}; state at the last completed frame'
                self._out.log('error', message)
                self._out.event('audio', '', '', 0, 0.0, False, message)
                return []
            if first_sample >= 0:
                self._next_sample = first_sample + len(samples)
            if received is not None:  # from the middleware's receipt to its frames' end
                self._lag_s = max(0.0, time.time() - received)
            if events.cut:
                self._out.event('audio', '', '', 0, 0.0, False,
                                f'audio chunk cut by an interrupt at frame boundary '
                                f'{self.runtime.position}: its last {events.dropped_samples} '
                                'samples were dropped')
            return events

    def _feed(self, samples, sample_rate, stamp):
        """
        Feed a chunk SLICE_S of audio at a time, publishing each slice's transcript (gate held).

        The first call is given the whole chunk, so that bad audio or a full utterance is
        refused before anything is fed; it pauses after SLICE_S of frames (a should_stop
        that counts them) and the rest follows in slices. Returns every slice's events; cut
        and dropped_samples say what an interrupt left untaken, last_sample counts from the
        chunk's first sample.
        """
        rt, spec = self.runtime, self.runtime.speech_spec
        rate = sample_rate or spec.sample_rate
        frames = max(1, round(SLICE_S * spec.sample_rate / spec.frame_size))
        epoch, asked = self._epoch, [0]

        def stopped():  # asked before each frame is begun, under the step lock
            return self._cut.is_set() or self._epoch != epoch

        def paused():
            asked[0] += 1
            return stopped() or asked[0] > frames

        fed, total, start, stop = FedAudio(), len(samples), 0, len(samples)
        piece = rt.feed_audio(samples, sample_rate, paused)
        while True:
            if piece:
                fed.last_sample = start + piece.last_sample
                with self._queue_lock:
                    if self._epoch == epoch:  # else: the stopped episode's words
                        self._publish(piece, final=False, stamp=None if stamp is None else
                                      stamp + round(fed.last_sample * 1e9 / rate))
                fed += piece
            start = stop - piece.dropped_samples if piece.cut else stop
            fed.preempted = fed.preempted or piece.preempted
            if start >= total or stopped():
                break
            stop = min(total, start + max(1, round(SLICE_S * rate)))
            piece = rt.feed_audio(samples[start:stop], sample_rate, stopped)
        fed.cut, fed.dropped_samples = start < total, total - start
        return fed

    def flush(self):
        """Publish the words the text delay holds back (final chunk); state unchanged."""
        with self._gate:
            self._catch_up()
            epoch = self._epoch
            events = self.runtime.flush(lambda: self._cut.is_set() or self._epoch != epoch)
            if events.cut:  # the episode it would have ended is over: nothing to finalise
                self._out.event('flush', '', '', 0, 0.0, False,
                                'flush cut by an interrupt: no final transcript chunk')
                return []
            self._publish(events, final=True)
            return events

    def _publish(self, events, final, stamp=None):
        # A flush reads a copy of the state: its words go out, the live transcript stays.
        transcriber = self.transcriber.fork() if final else self.transcriber
        update = transcriber.update(events)
        if final:  # nothing follows the flushed words: the open one is complete
            update.words = [dataclasses.replace(w, partial=False) for w in update.words]
        if update.ids or update.words or final:
            self._out.transcript(self.utterance, update.first_frame, update.ids, update.text,
                                 final, update.words, stamp)
        end = update.end_of_utterance
        if end is not None and not final and self.transcriber.quiet_s > 0:
            self._out.end_of_utterance(self.utterance, self._ends, end, stamp)
            self._ends += 1

    def reject_audio(self, reason):
        message = (f'audio rejected: {reason}; state unchanged at frame boundary '
                   f'{self.runtime.position}')
        self._out.log('warning', message, throttle_s=1.0)
        self._out.event('audio', '', '', 0, 0.0, False, message)

    def forget_inputs(self, before=None):
        with self._gate, self._queue_lock:
            self._interrupted_at = max(self._interrupted_at, before or time.time())
            self._seen = self._epoch
            self._start_over()

    def _start_over(self):
        """Start a new episode: the stream numbering and the transcript (gate held)."""
        self._next_sample = None
        self.utterance += 1
        self.transcriber.reset()
        self._ends = 0

    def _catch_up(self):
        """Start over if an interrupt replaced the state since the last chunk (gate held)."""
        if self._seen != self._epoch:
            self._seen = self._epoch
            self._start_over()

    @contextlib.contextmanager
    def interrupting(self, received, replaces):
        if not replaces:  # a STOP: the feed stops at its next frame and lets go of the gate
            with super().interrupting(received, replaces):
                yield
            return
        with self._queue_lock:  # no transcript of the stopped episode goes out after this
            self._epoch += 1
            self._interrupted_at = max(self._interrupted_at, received)
            yield
        with self._gate:  # the restore is done; the cut chunk's event goes out before ours
            pass

    @contextlib.contextmanager
    def quiet(self):
        self._cut.set()  # a chunk being fed stops at its next frame and lets go of the gate
        with self._gate:
            self._cut.clear()  # (here, not on the way out: another quiet() may wait by then)
            yield

    def diagnostics(self, stats):
        spec, quiet = self.runtime.speech_spec, self.transcriber
        frame_s = spec.frame_size / spec.sample_rate
        # Above 1 the model falls behind the audio (a CPU at real size): said, not hidden.
        factor = (stats.control_step_s or 0.0) / frame_s
        return {'frame_step_ms': f'{(stats.control_step_s or 0.0) * 1e3:.3f}',
                'real_time_factor': f'{factor:.3f}' + (' (slower than real time)'
                                                       if factor > 1.0 else ''),
                'audio_lag_ms': f'{self._lag_s * 1e3:.1f}',
                'speech_settings': spec.settings,
                'text_delay_s': f'{spec.text_delay_s:g}',
                'silence_prefix_s': f'{spec.silence_prefix_s:g}',
                'sample_rate': str(spec.sample_rate),
                'end_of_utterance': (
                    'off' if quiet.quiet_s <= 0 else
                    f'energy/padding rule: {quiet.quiet_s:g} s of padding tokens below '
                    f'{quiet.quiet_db:g} dBFS (the model has no pause heads)')}
