"""Speech mode: audio chunks in, transcript chunks out, gap checks and barge-in recipes."""

import threading
import time

from flashrt_ros.session import InterruptMode
import numpy as np
import pytest
from speech_script import script_tokens

STT = 'builtin:tiny-stt'
FRAME = 1920


def _audio(frames, seed):
    """Seeded noise and tone, float32 [frames * FRAME]."""
    rng = np.random.default_rng(seed)
    t = np.arange(frames * FRAME) / 24000
    tone = 0.3 * np.sin(2 * np.pi * (150 + 50 * seed) * t * (1 + t))
    return (tone + 0.05 * rng.standard_normal(t.size)).astype(np.float32)


def _stream(session, audio, start=0, chunk=700):
    """Feed audio in numbered chunks; return the tokens of the frames they completed."""
    tokens = []
    for i in range(0, len(audio), chunk):
        events = session.mode.audio(audio[i:i + chunk], 24000, start + i, time.time())
        tokens += [e.token_id for e in events]
    return tokens


@pytest.fixture
def speech(make_session):
    return make_session(STT, 'speech', rollback_depth=16)


def test_audio_in_transcript_out(speech):
    session, out = speech
    tokens = _stream(session, _audio(10, seed=0))
    assert session.runtime.position == 11 and len(tokens) == 11
    words = [t for t in tokens if session.mode.transcriber.is_text(t)]  # no pad, no specials
    assert [i for c in out.transcripts for i in c['ids']] == words and words
    assert ''.join(c['text'] for c in out.transcripts) == session.runtime.tokenizer.decode(words)
    digest = session.runtime.state_digest()
    session.mode.flush()
    assert out.transcripts[-1]['final'] and session.runtime.state_digest() == digest


def test_a_gap_a_wrong_rate_or_nan_is_refused_with_the_state_untouched(speech):
    session, out = speech
    audio = _audio(3, seed=1)
    _stream(session, audio[:1000])
    digest = session.runtime.state_digest()
    mode = session.mode
    mode.audio(audio[1500:2000], 24000, 1500, time.time())  # 500 samples lost
    mode.audio(audio[1000:1500], 16000, 1000, time.time())
    mode.audio(np.full(500, np.nan, dtype=np.float32), 24000, 1000, time.time())
    assert session.runtime.state_digest() == digest
    messages = [e['message'] for e in out.events if e['operation'] == 'audio']
    assert len(messages) == 3 and not any(e['success'] for e in out.events[-3:])
    assert 'expected sample 1000, got 1500 (500 samples missing)' in messages[0]
    assert '16000 Hz' in messages[1] and 'NaN' in messages[2]
    _stream(session, audio[1000:], start=1000)  # the resent chunk is taken
    assert session.runtime.position == 4


def test_barge_in_echo_rolls_back_and_a_false_one_resumes_from_the_capsule(speech):
    session, out = speech
    rt = session.runtime
    _stream(session, _audio(6, seed=2))  # the user speaks
    session.snapshot('user_turn')  # the robot starts its reply: its own voice may follow
    turn_digest = rt.state_digest()
    echo_frames = 4
    _stream(session, _audio(echo_frames, seed=3), start=6 * FRAME)  # the robot's echo
    session.interrupts.apply('interrupt', InterruptMode.ROLLBACK, echo_frames, '', 'echo',
                             time.time())
    assert out.events[-1]['success'] and rt.state_digest() == turn_digest
    user = _audio(5, seed=4)
    after_rollback = _stream(session, user)
    # The same as if the echo had never been heard.
    session.restore('user_turn')
    assert _stream(session, user) == after_rollback
    # A false barge-in: the robot paused for a noise; the capsule taken when it paused
    # brings the transcription back without re-encoding anything.
    session.snapshot('paused')
    paused_digest = rt.state_digest()
    _stream(session, _audio(3, seed=5))  # the noise
    session.interrupts.apply('interrupt', InterruptMode.RESTORE, 1, 'paused', 'false barge-in',
                             time.time())
    assert out.events[-1]['success'] and rt.state_digest() == paused_digest


def test_audio_sent_before_an_interrupt_is_dropped(speech):
    session, _ = speech
    sent = time.time()
    session.interrupts.apply('reset', InterruptMode.RESTORE, 1, '', 'reset', time.time())
    assert session.mode.audio(_audio(1, seed=6), 24000, 0, sent) == []
    assert session.runtime.position == 0
    assert len(session.mode.audio(_audio(1, seed=6), 24000, 5000, time.time())) == 2


def test_turns_are_refused_in_speech_mode(speech):
    session, _ = speech
    assert 'publish audio on ~/audio' in session.reserve_turn('goal')


def test_an_interrupt_cuts_a_long_chunk_at_the_next_frame(speech):
    session, out = speech
    rt = session.runtime
    _stream(session, _audio(3, seed=7))
    session.snapshot('before')
    before = rt.state_digest()
    long_chunk = _audio(400, seed=8)  # 32 s of audio in one message
    fed = []
    feeding = threading.Thread(
        target=lambda: fed.append(session.mode.audio(long_chunk, 24000, -1, time.time())))
    feeding.start()
    while rt.position < 10:  # some frames in
        time.sleep(0.001)
    session.interrupts.apply('interrupt', InterruptMode.RESTORE, 1, 'before', 'stop',
                             time.time())
    feeding.join(10.0)
    assert not feeding.is_alive() and fed[0].cut and len(fed[0]) < 400
    assert rt.state_digest() == before  # the restore came after the cut, not before it
    cut = [e for e in out.events if e['operation'] == 'audio']
    assert len(cut) == 1 and not cut[0]['success'] and 'dropped' in cut[0]['message']
    assert out.events[-1]['operation'] == 'interrupt' and out.events[-1]['success']


def test_a_long_chunk_is_fed_and_transcribed_a_slice_at_a_time(speech, make_session):
    """A 4 s chunk: transcript chunks of at most SLICE_S each, the state of one feed."""
    from flashrt_ros.session.speech import SLICE_S
    session, out = speech
    audio, stamp = _audio(50, seed=3)[:50 * FRAME - 7], 7_000_000_000
    events = session.mode.audio(audio, 24000, 0, time.time(), stamp)
    assert len(events) == 50 and not events.cut and events.last_sample == 49 * FRAME
    chunks = out.transcripts
    assert len(chunks) >= 4 * SLICE_S, 'one transcript chunk per slice of audio'
    assert all(c['stamp'] <= stamp + round(len(audio) * 1e9 / 24000) for c in chunks)
    assert [c['stamp'] for c in chunks] == sorted(c['stamp'] for c in chunks)
    ids = [i for c in chunks for i in c['ids']]
    assert ids == [e.token_id for e in events if session.mode.transcriber.is_text(e.token_id)]
    whole, _ = make_session(STT, 'speech', rollback_depth=16)
    assert len(whole.runtime.feed_audio(audio, 24000)) == 50
    assert whole.runtime.state_digest() == session.runtime.state_digest()  # exact


def test_a_restore_abandons_the_frame_in_flight(speech, hold_in_forward):
    """A RESTORE does not wait for the frame: the feed is preempted, its words never go out."""
    session, out = speech
    rt = session.runtime
    _stream(session, _audio(3, seed=7))
    session.snapshot('before')
    before, said = rt.state_digest(), len(out.transcripts)
    inside = hold_in_forward(rt.adapter.model.model.layers[0])  # its cache row written
    fed = []
    feeding = threading.Thread(
        target=lambda: fed.append(session.mode.audio(_audio(40, seed=8), 24000, 3 * FRAME,
                                                     time.time())))
    feeding.start()
    assert inside.wait(10.0)
    session.interrupts.apply('interrupt', InterruptMode.RESTORE, 1, 'before', '', time.time())
    feeding.join(10.0)
    assert not feeding.is_alive() and fed[0].preempted and fed[0].cut
    assert rt.state_digest() == before and len(out.transcripts) == said
    kinds = [e['operation'] for e in out.events]
    assert kinds[-2:] == ['audio', 'interrupt'] and out.events[-1]['success']
    assert 'dropped' in out.events[-2]['message']
    # The stream starts over: the next chunk is numbered afresh, a new utterance.
    session.mode.audio(_audio(3, seed=9), 24000, 0, time.time())
    assert rt.position > 0 and out.transcripts[-1]['utterance'] == session.mode.utterance


def test_chunks_carry_words_with_audio_times_and_the_audio_stamp(speech):
    session, out = speech
    script_tokens(session.runtime)
    stamp = 5_000_000_000
    events = session.mode.audio(_audio(9, seed=9)[:9 * FRAME - 100], 24000, 0, time.time(),
                                stamp)
    chunk = out.transcripts[-1]
    # Stamped with the sample that completed its last frame: 8 frames (8 * 1920 samples).
    assert len(events) == 9 and chunk['stamp'] == stamp + round(8 * FRAME * 1e9 / 24000)
    assert chunk['text'] == 'hi there' and chunk['index'] == 0
    words = chunk['words']
    assert [(w.text, w.partial) for w in words] == [('hi', False), ('there', True)]
    delay = session.runtime.speech_spec.text_delay_s  # 0.24 s: 3 frames
    assert words[0].start == 0.0 and words[1].start == pytest.approx(4 * 0.08 - delay)
    assert words[1].end == pytest.approx(8 * 0.08 - delay)
    session.mode.audio(_audio(2, seed=9), 24000, 9 * FRAME - 100, time.time())
    assert out.transcripts[-1]['words'][0].text == 'there'  # repeated, now committed
    assert not out.transcripts[-1]['words'][0].partial


def test_end_of_utterance_after_a_pause_once_and_again_after_new_words(speech):
    session, out = speech
    script_tokens(session.runtime)
    silence = np.zeros(FRAME, dtype=np.float32)
    _stream(session, _audio(8, seed=10))
    _stream(session, np.tile(silence, 9), start=8 * FRAME)  # 0.72 s: not yet
    assert out.ends == []
    _stream(session, silence, start=17 * FRAME)  # 0.8 s of padded silence
    end = out.ends[-1]
    assert end['index'] == 0 and end['end'].text == 'hi there'
    assert end['end'].quiet_s == pytest.approx(0.8)
    _stream(session, np.tile(silence, 20), start=18 * FRAME)
    assert len(out.ends) == 1  # silence goes on: no second event
    _stream(session, _audio(3, seed=11), start=38 * FRAME)
    _stream(session, np.tile(silence, 10), start=41 * FRAME)
    assert [e['index'] for e in out.ends] == [0, 1] and out.ends[1]['end'].text == 'hi'
    session.interrupts.apply('reset', InterruptMode.RESTORE, 1, '', 'reset', time.time())
    _stream(session, np.tile(silence, 10))
    assert len(out.ends) == 2  # a new episode starts with no words heard


def test_diagnostics_say_the_speech_settings_and_the_end_of_utterance_rule(speech):
    session, _ = speech
    values = session.mode.diagnostics(session.runtime.stats())
    assert values['speech_settings'] == 'built-in' and values['text_delay_s'] == '0.24'
    assert values['silence_prefix_s'] == '0' and values['sample_rate'] == '24000'
    assert 'energy/padding rule' in values['end_of_utterance']


def test_diagnostics_say_how_far_the_model_is_from_real_time(speech):
    session, _ = speech
    received = time.time()
    session.mode.audio(_audio(4, seed=3), None, -1, received)
    stats = session.runtime.stats()
    values = session.mode.diagnostics(stats)
    factor = stats.control_step_s / (1920 / 24000)
    assert values['real_time_factor'].startswith(f'{factor:.3f}')
    assert ('slower than real time' in values['real_time_factor']) == (factor > 1.0)
    assert 0.0 < float(values['audio_lag_ms']) < (time.time() - received) * 1e3 + 1.0
