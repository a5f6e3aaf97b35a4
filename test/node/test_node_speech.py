"""Speech mode over real DDS: ~/audio in, ~/transcript out, gap checks, interrupt, reset."""

import math
import time

from flashrt_ros.msg import Interrupt
from flashrt_ros.node_process import NodeProcess
from flashrt_ros.runtime import Runtime
from flashrt_ros.runtime.modes.speech import Transcriber
from node_harness import diagnostics, EventLog, HOME, node_in_process, start_client
from node_harness import wait_active, wait_until
import numpy as np
import pytest
from speech_script import script_tokens

FRAME = 1920
SPEECH_PARAMS = {'mode': 'speech', 'model': 'builtin:tiny-stt', 'max_seq_len': 512,
                 'rollback_depth': 16, 'diagnostics_period': 1.0}


def _audio(frames, seed):
    rng = np.random.default_rng(seed)
    t = np.arange(frames * FRAME) / 24000
    tone = 0.3 * np.sin(2 * np.pi * (150 + 50 * seed) * t * (1 + t))
    return (tone + 0.05 * rng.standard_normal(t.size)).astype(np.float32)


class _Speech:
    """A client of the speech node, the transcript chunks and events it published."""

    def __init__(self, proc):
        self.client = start_client('flashrt_speech')
        wait_active(self.client, proc)
        assert self.client.wait_for_subscribers(10.0, 'audio'), 'no subscription'
        self.chunks = []
        self.client.subscribe_transcript(self.chunks.append)
        self.events = EventLog(self.client)
        self.sent = 0  # samples sent since the last reset (the next first_sample)

    def send(self, audio, chunk=960):
        for i in range(0, len(audio), chunk):
            self.client.publish_audio(audio[i:i + chunk], 24000, self.sent + i)
        self.sent += len(audio)

    def words(self):
        return [i for c in self.chunks for i in c.token_ids]


@pytest.fixture(scope='module')
def speech(tmp_path_factory, capsule_dir):
    workdir = str(tmp_path_factory.mktemp('speech_node'))
    proc = NodeProcess(workdir, dict(SPEECH_PARAMS, capsule_dir=capsule_dir),
                       name='flashrt_speech')
    s = _Speech(proc)
    yield s
    s.events.close()
    s.client.close()
    assert proc.stop() == 0, proc.log()[-2000:]


@pytest.fixture(scope='module')
def reference():
    """Return a runtime of the same model in this process: what the node must transcribe."""
    rt = Runtime({'model': 'builtin:tiny-stt', 'max_seq_len': 512})
    yield rt
    rt.close()


def _text(rt, events):
    """Return the text tokens of runtime events (what ~/transcript carries)."""
    transcriber = Transcriber(rt.tokenizer, rt.speech_spec)
    return [e.token_id for e in events if transcriber.is_text(e.token_id)]


def _reset(s):
    start = len(s.events.events)
    s.client.reset()
    assert s.events.wait_for(lambda e: e.operation == 'reset' and e.success, start=start)
    s.sent, s.chunks[:] = 0, []


def _at(s, position, timeout=60.0):
    """Wait until the node's live position (decoder steps) is `position`."""
    return wait_until(
        lambda: f'live position {position};' in s.client.list_capsules().message, timeout)


def test_audio_in_transcript_out(speech, reference):
    s = speech
    _reset(s)
    audio = _audio(12, seed=0)
    reference.reset()
    expected = _text(reference, reference.feed_audio(audio))
    assert expected
    s.send(audio)
    assert wait_until(lambda: s.words() == expected, 60.0), (s.words(), expected)
    assert all(c.turn_id == s.chunks[0].turn_id and not c.final for c in s.chunks)
    digest = s.client.state_digest()
    assert digest == reference.state_digest()
    s.client.flush()  # the delayed words go out; the state stays
    assert wait_until(lambda: s.chunks[-1].final, 30.0)
    assert s.chunks[-1].stop_reason == 'flush' and s.client.state_digest() == digest


def test_a_gap_or_a_wrong_rate_is_an_event_and_changes_nothing(speech):
    s = speech
    _reset(s)
    s.send(_audio(2, seed=1))
    assert _at(s, 3)
    digest = s.client.state_digest()
    start = len(s.events.events)
    s.client.publish_audio(_audio(1, seed=2), 24000, s.sent + 480)  # 480 samples lost
    event = s.events.wait_for(lambda e: e.operation == 'audio', start=start)
    assert event is not None and not event.success
    assert f'expected sample {s.sent}, got {s.sent + 480}' in event.message
    s.client.publish_audio(_audio(1, seed=2), 16000, s.sent)
    event = s.events.wait_for(lambda e: e.operation == 'audio' and '16000 Hz' in e.message,
                              start=start)
    assert event is not None and not event.success
    assert s.client.state_digest() == digest


def test_audio_at_16_khz_is_resampled_like_the_runtime_does(speech, reference):
    s = speech
    _reset(s)
    t = np.arange(8 * FRAME * 2 // 3) / 16000  # 8 frames' time at 16 kHz
    noise = 0.05 * np.random.default_rng(5).standard_normal(t.size)
    audio = (0.3 * np.sin(2 * np.pi * 300 * t * (1 + t)) + noise).astype(np.float32)
    reference.reset()
    expected = _text(reference, reference.feed_audio(audio, 16000))
    digest = reference.state_digest()
    for i in range(0, len(audio), 640):
        s.client.publish_audio(audio[i:i + 640], 16000, i)
    # The resampler lags its input, so the last frame completes before the last chunks
    # arrive: those only fill the partial frame. The position alone does not say all the
    # audio was taken; the state's digest does.
    assert _at(s, reference.position)
    assert wait_until(lambda: s.client.state_digest() == digest, 30.0)
    assert wait_until(lambda: s.words() == expected, 30.0), (s.words(), expected)


def test_interrupt_rolls_back_frames_and_reset_goes_home(speech):
    s = speech
    _reset(s)
    home = s.client.state_digest()
    s.send(_audio(5, seed=3))
    assert _at(s, 6)
    assert s.client.snapshot('user_turn').success
    turn = s.client.state_digest()
    s.send(_audio(3, seed=4))  # echo of the robot's own voice
    assert _at(s, 9)
    start = len(s.events.events)
    s.client.interrupt(mode=Interrupt.ROLLBACK, boundaries=3, reason='echo')
    event = s.events.wait_for(lambda e: e.operation == 'interrupt', start=start)
    assert event is not None and event.success and event.position == 6
    assert s.client.state_digest() == turn
    _reset(s)
    assert s.client.state_digest() == home
    assert [c.name for c in s.client.list_capsules().capsules if c.pinned] == [HOME]


def test_words_stamps_and_the_end_of_utterance_over_dds():
    params = dict(SPEECH_PARAMS, end_of_utterance_s=0.4, diagnostics_period=0.5)
    with node_in_process('flashrt_speech_eou', params) as (client, node):
        script_tokens(node.session.runtime)
        chunks, ends = [], []
        subs = (client.subscribe_transcript(chunks.append),
                client.subscribe_end_of_utterance(ends.append))
        assert client.wait_for_publishers(*subs)
        assert client.wait_for_subscribers(inputs='audio')
        stamp = client.now()
        client.publish_audio(_audio(8, seed=6), 24000, 0, stamp)  # one chunk, 8 frames
        assert wait_until(lambda: chunks, 30.0)
        first = chunks[0]
        sent_ns = stamp.sec * 10 ** 9 + stamp.nanosec
        got_ns = first.header.stamp.sec * 10 ** 9 + first.header.stamp.nanosec
        assert got_ns - sent_ns == round(8 * FRAME * 1e9 / 24000)  # its last frame's sample
        assert first.text == 'hi there' and first.index == 0
        assert [(w.text, w.partial) for w in first.words] == [('hi', False), ('there', True)]
        assert first.words[1].start == pytest.approx(4 * 0.08 - 0.24)
        silence = np.zeros(FRAME, dtype=np.float32)
        for i in range(8):  # 0.64 s of silence after the words, frame by frame
            client.publish_audio(silence, 24000, (8 + i) * FRAME)
        assert wait_until(lambda: ends, 30.0)
        end = ends[0]
        assert end.text == 'hi there' and end.index == 0 and end.turn_id == first.turn_id
        assert end.quiet_seconds == pytest.approx(0.4) and math.isnan(end.pause_probability)
        assert end.start == 0.0 and end.end == pytest.approx(first.words[1].end + 0.08)
        committed = [w for c in chunks for w in c.words if not w.partial]
        assert [w.text for w in committed] == ['hi', 'there']
        time.sleep(0.5)
        assert len(ends) == 1  # the silence went on: one event
        values = diagnostics(client)
        assert values['speech_settings'] == 'built-in' and values['text_delay_s'] == '0.24'
        assert 'energy/padding rule: 0.4 s' in values['end_of_utterance']
