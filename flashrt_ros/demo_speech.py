"""
The `make demo-speech` session: barge-in as a capsule operation, over ROS 2.

Starts the flashrt node in speech mode (builtin:tiny-stt: a Kyutai STT decoder over a Mimi
encoder, 24 kHz, 80 ms frames) and streams synthesized audio (gliding tones with a noise
floor, numpy) to ~/audio at real time in 40 ms chunks, prints the transcript's words with
their audio times and waits for the end of the utterance (~/end_of_utterance) over a pause
(random weights write text over silence, so the built-in says so instead). Then: snapshot
at the start of the
robot's reply, stream its echo, roll the echo frames back (~/interrupt ROLLBACK); snapshot
when the robot pauses for a sound, stream the noise, recover from the false barge-in
(~/interrupt RESTORE), compared with re-encoding the audio history; flush the last words
(~/flush); ~/reset. Prints the latencies, stops the node by PID, exits 0 when every check
holds.
"""

import sys
import time

from flashrt_ros.demo import _wait_event, run_demo  # the `make demo` helpers
import numpy as np

RATE, FRAME, CHUNK = 24000, 1920, 960  # Hz, samples per frame, samples per chunk (40 ms)


def voice(seconds, pitch, seed):
    """Synthesize speech-like audio: syllable-rate bursts of a gliding tone over noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * RATE)) / RATE
    syllables = (np.sin(2 * np.pi * 4 * t) > -0.2).astype(np.float32)
    glide = pitch * (1 + 0.2 * np.sin(2 * np.pi * 1.5 * t))
    tone = 0.3 * np.sin(2 * np.pi * np.cumsum(glide) / RATE) * syllables
    return (tone + 0.02 * rng.standard_normal(t.size)).astype(np.float32)


class Stream:
    """Numbered ~/audio chunks out, ~/transcript chunks in, with arrival times."""

    def __init__(self, client):
        self.client = client
        self.sent = 0  # the next chunk's first_sample
        self.done_at = {}  # frame index -> when the chunk completing it went out
        self.chunks = []  # (arrival time, TokenChunk)
        self.ends = []  # EndOfUtterance messages
        subs = (client.subscribe_transcript(
            lambda c: self.chunks.append((time.perf_counter(), c))),
            client.subscribe_end_of_utterance(self.ends.append))
        self.frames = 0  # frames of the utterance completed by what was sent
        self.base = 0  # frames of the utterance when the numbering last started
        client.wait_for_publishers(*subs, timeout=5.0)

    def restart(self, frames):
        """Restart the sample numbering at 0 (as the node does after an interrupt)."""
        self.sent, self.frames, self.base = 0, frames, frames

    def send(self, audio, real_time=True):
        """Publish audio in 40 ms chunks, paced at real time unless told otherwise."""
        start = time.perf_counter()
        for i in range(0, len(audio), CHUNK):
            if real_time:
                time.sleep(max(0.0, start + i / RATE - time.perf_counter()))
            part = audio[i:i + CHUNK]
            self.client.publish_audio(part, RATE, self.sent)
            self.sent += len(part)
            while self.frames < self.base + self.sent // FRAME:
                self.done_at[self.frames] = time.perf_counter()
                self.frames += 1

    def wait_position(self, position, timeout=60.0):
        """Wait until the node's live position is `position`; return the wait in seconds."""
        t0 = time.perf_counter()
        while f'live position {position};' not in self.client.list_capsules().message:
            if time.perf_counter() - t0 > timeout:
                raise TimeoutError(f'the node did not reach position {position}')
            time.sleep(0.005)
        return time.perf_counter() - t0


def _ms(values):
    values = sorted(values)
    return (f'median {values[len(values) // 2] * 1e3:.1f} ms, max {values[-1] * 1e3:.1f} ms'
            if values else 'no samples')


def _interrupt(client, events, **kwargs):
    from flashrt_ros.msg import Interrupt

    start = len(events)
    client.interrupt(mode=getattr(Interrupt, kwargs.pop('mode')), **kwargs)
    return _wait_event(events, start, 'interrupt')


def _words(stream, report, most=8):
    """Print the committed words of the transcript so far with their audio times."""
    words = [w for _, c in stream.chunks for w in c.words if not w.partial]
    shown = ' '.join(f'{w.text[:20]!r} {w.start:.2f}-{w.end:.2f}s' for w in words[:most])
    report.line(f'{len(words)} committed words: {shown or "none yet"}')
    last = stream.chunks[-1][1].words if stream.chunks else []
    if last and last[-1].partial:
        report.line(f'still partial: {last[-1].text[:40]!r} from {last[-1].start:.2f} s')


def _pause(stream, report, real_model):
    """Stream 1.2 s of silence; report the end-of-utterance event (a real model's check)."""
    before = len(stream.ends)
    stream.send(np.zeros(15 * FRAME, dtype=np.float32))
    stream.wait_position(stream.frames + 1)
    deadline = time.monotonic() + 3.0
    while len(stream.ends) == before and time.monotonic() < deadline:
        time.sleep(0.01)
    if len(stream.ends) > before:
        end = stream.ends[-1]
        report.line(f'~/end_of_utterance after {end.quiet_seconds:.2f} s quiet: '
                    f'{end.text[:60]!r} ({end.start:.2f}-{end.end:.2f} s of audio)')
    elif real_model:
        report.check(False, 'an end of utterance after 1.2 s of silence')
    else:
        report.line('no ~/end_of_utterance: the random-weight model writes text over '
                    'silence, so the padding rule never holds (a Kyutai checkpoint pads)')


def _run_session(client, report, events, real_model=False):
    stream = Stream(client)
    home_digest = client.state_digest()

    report.section('The user speaks: 3 s streamed at real time in 40 ms chunks')
    user = voice(38 * FRAME / RATE, 180, seed=1)  # whole frames: a boundary at its end
    stream.send(user)
    lag = stream.wait_position(stream.frames + 1)
    latencies = [at - stream.done_at[c.index] for at, c in stream.chunks
                 if c.index in stream.done_at]
    report.line(f'{stream.frames} frames; transcript chunk after its frame completed: '
                f'{_ms(latencies)}; the node was {lag * 1e3:.1f} ms behind the last chunk')
    report.check(lag < 1.0, 'the node keeps up with real time')

    report.section('Words with their audio times; a pause ends the utterance')
    _words(stream, report)
    _pause(stream, report, real_model)
    pause = np.zeros(15 * FRAME, dtype=np.float32)

    report.section('The robot answers: snapshot, then its echo comes back for 0.96 s')
    snap = client.snapshot('user_turn')
    turn_digest = client.state_digest()
    report.line(f'snapshot user_turn: position {snap.capsule.position}, '
                f'{snap.capsule.size_bytes} bytes, {snap.latency_ms:.3f} ms')
    echo_frames = 12
    stream.send(voice(echo_frames * FRAME / RATE, 320, seed=2))
    stream.wait_position(snap.capsule.position + echo_frames)
    event = _interrupt(client, events, mode='ROLLBACK', boundaries=echo_frames, reason='echo')
    stream.restart(stream.frames - echo_frames)
    report.check(event is not None and event.success and client.state_digest() == turn_digest,
                 f'~/interrupt ROLLBACK {echo_frames} frames: '
                 f'{event.latency_ms if event else 0:.2f} ms from receipt; the state is '
                 'user_turn byte for byte, as if the echo was never heard')

    report.section('A false barge-in: the robot pauses for a sound, which was noise')
    said = voice(12 * FRAME / RATE, 200, seed=3)
    stream.send(said)
    position = stream.frames + 1
    stream.wait_position(position)
    paused = client.snapshot('paused')
    paused_digest = client.state_digest()
    noise = 0.3 * np.random.default_rng(4).standard_normal(6 * FRAME)
    stream.send(noise.astype(np.float32))
    stream.wait_position(position + 6)
    event = _interrupt(client, events, mode='RESTORE', capsule='paused',
                       reason='false barge-in')
    report.check(event is not None and event.success and client.state_digest() == paused_digest,
                 f'~/interrupt RESTORE paused: {event.latency_ms if event else 0:.2f} ms from '
                 'receipt; transcription resumes where it paused')

    report.section('The cold alternative: re-encode the audio history from the utterance start')
    history = np.concatenate([user, pause, said])
    assert _interrupt(client, events, mode='RESTORE', capsule='home', reason='cold').success
    stream.restart(0)
    t0 = time.perf_counter()
    stream.send(history, real_time=False)
    stream.wait_position(paused.capsule.position)
    cold = time.perf_counter() - t0
    report.check(client.state_digest() == paused_digest,
                 'the re-encoded history reaches the same state as the capsule')
    report.line(f'restore paused: {event.latency_ms:.2f} ms | re-encode {len(history) / RATE:.1f}'
                f' s of audio: {cold * 1e3:.0f} ms (grows with the utterance; the restore '
                'does not)')

    report.section('~/flush: the words the text delay holds back')
    before = len(stream.chunks)
    client.flush()
    deadline = time.monotonic() + 10.0
    while len(stream.chunks) == before and time.monotonic() < deadline:
        time.sleep(0.01)
    final = stream.chunks[-1][1] if len(stream.chunks) > before else None
    report.check(final is not None and final.final and client.state_digest() == paused_digest,
                 f'final chunk with {len(final.token_ids) if final else 0} tokens; the live '
                 'state is unchanged')

    report.section('~/reset: the next utterance')
    client.reset()
    deadline = time.monotonic() + 5.0
    while client.state_digest() != home_digest and time.monotonic() < deadline:
        time.sleep(0.02)
    report.check(client.state_digest() == home_digest, 'back to home, byte for byte')


def _speech_session(node, client, workdir, params, report, events):
    _run_session(client, report, events,
                 real_model=not str(params.get('model', 'builtin:')).startswith('builtin:'))
    return node, client


def main(argv=None):
    """Run the speech demo; return 0 when every check passed."""
    return run_demo(argv, doc=__doc__, title='speech demo', default_model='builtin:tiny-stt',
                    params={'mode': 'speech', 'max_seq_len': 2048, 'rollback_depth': 16},
                    random_note='random weights: the transcript is not words; the state '
                                'handling is real',
                    session=_speech_session)


if __name__ == '__main__':
    sys.exit(main())
