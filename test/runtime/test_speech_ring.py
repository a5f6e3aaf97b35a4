"""
Speech mode's rollback ring keeps what each frame wrote; an utterance has no length bound.

The sliding windows keep their rows in a ring, so a committed frame's ring entry holds the
rest of the state and the few window rows the next frame overwrites (state/ring.py). Rolling
back must give, byte for byte, what a ring of whole copies gives and what the frames gave
the first time, across the windows' wrap-around (tiny-stt: Mimi's window is 6 rows, two a
frame; the decoder's 8).
"""

import json

from flashrt_ros.runtime import InvalidRequestError
from flashrt_ros.runtime.models.builtin import SEED, SPEECH_BUILTINS
from flashrt_ros.runtime.models.speech import calibrate_codebooks
from flashrt_ros.runtime.models.tokenizer import ByteTokenizer
import numpy as np
import pytest
import torch

STT = 'builtin:tiny-stt'
FRAME = 1920


def _audio(frames, seed):
    """Seeded noise and a gliding tone, float32 [frames * FRAME]."""
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(frames * FRAME) / 24000
    tone = 0.3 * torch.sin(2 * torch.pi * 200 * t * (1 + 0.3 * t))
    return (tone + 0.05 * torch.randn(t.numel(), generator=g)).numpy().astype(np.float32)


def _frames(audio, first, count):
    return audio[first * FRAME:(first + count) * FRAME]


@pytest.fixture
def one_thread():
    """Run torch on one thread: tiny ops are slower on a contended pool."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


CUDA = pytest.param('cuda', marks=[
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')])


@pytest.mark.parametrize('device', ['cpu', CUDA])
def test_delta_rollback_equals_whole_copies_and_the_first_pass(
        device, make_runtime, one_thread):
    delta = make_runtime(STT, device=device, rollback_depth=40)
    whole = make_runtime(STT, device=device, rollback_depth=40)
    whole.ring.head_only = False  # the reference: every boundary a whole copy
    audio = _audio(40, seed=0)
    digests = [delta.state_digest()]  # the state at every frame of the first pass

    def feed(first, count):
        for f in range(first, first + count):
            for rt in (delta, whole):
                rt.feed_audio(_frames(audio, f, 1))
            assert delta.state_digest() == whole.state_digest()
            digests.append(delta.state_digest())

    feed(0, 24)
    assert all(e.window_rows is not None for e in delta.ring)
    assert all(e.window_rows is None for e in list(whole.ring)[1:])  # [0]: before the switch
    assert delta.ring.nbytes() < whole.ring.nbytes()
    frame = 24
    for back in (1, 4, 9, 13):  # past every window's length: rows written over and over
        for rt in (delta, whole):
            rt.rollback(back)
        del digests[-back:]
        frame -= back
        assert delta.state_digest() == whole.state_digest() == digests[-1]
        feed(frame, 3)  # and it decodes on from there, as the first pass did
        frame += 3


def test_rollback_crosses_a_restore_and_a_flush(make_runtime, one_thread):
    rt = make_runtime(STT, rollback_depth=40)
    audio = _audio(30, seed=1)
    at = {}  # position: digest, the first pass
    for f in range(16):
        frame = _frames(audio, f, 1)
        rt.feed_audio(frame[:700])  # a frame in two feeds
        rt.feed_audio(frame[700:])
        at[rt.position] = rt.state_digest()
        if f == 9:
            rt.snapshot('mid')
    rt.rollback(2)
    rt.feed_audio(_audio(1, seed=9))  # another branch
    rt.restore('mid')  # the capsule goes on the ring whole
    rt.flush()  # reads ahead on a copy; the live state is put back
    for f in range(10, 14):
        rt.feed_audio(_frames(audio, f, 1))
        rt.flush()
        assert rt.state_digest() == at[rt.position]
    for back, position in ((1, 14), (3, 11), (2, 10), (3, 7)):  # the capsule, then before it
        rt.rollback(back)
        assert rt.position == position and rt.state_digest() == at[position]


def test_a_reset_takes_the_frames_before_it_off_the_ring(make_runtime):
    rt = make_runtime(STT, rollback_depth=8)
    rt.feed_audio(_audio(4, seed=2))
    rt.reset()
    with pytest.raises(InvalidRequestError, match='only 0 earlier boundaries'):
        rt.rollback(1)


def _wide_stt(directory, window):
    """Save tiny-stt with `window`-row sliding windows as a checkpoint folder."""
    from transformers import (KyutaiSpeechToTextConfig,
                              KyutaiSpeechToTextForConditionalGeneration)

    spec = SPEECH_BUILTINS['tiny-stt']
    config = KyutaiSpeechToTextConfig(**dict(spec['decoder'], sliding_window=window),
                                      codec_config=dict(spec['codec'], sliding_window=window))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = KyutaiSpeechToTextForConditionalGeneration(config).eval()
        calibrate_codebooks(model.codec_model, torch.Generator().manual_seed(SEED))
    model.save_pretrained(str(directory))
    ByteTokenizer().save(directory)
    (directory / 'preprocessor_config.json').write_text(json.dumps(
        {'sampling_rate': 24000, 'audio_delay_seconds': spec['text_delay_s']}))
    return str(directory)


def test_the_ring_budget_holds_frames_not_windows(make_runtime, tmp_path, one_thread):
    path = _wide_stt(tmp_path / 'wide', window=250)  # Mimi's window length
    rt = make_runtime(path, max_seq_len=64, rollback_depth=200)
    head = rt.arena.head_nbytes  # what a whole-copy boundary holds
    rt.ring.budget = 4 * head
    audio = _audio(120, seed=3)
    rt.feed_audio(_frames(audio, 0, 30))
    digest = rt.state_digest()
    rt.feed_audio(_frames(audio, 30, 90))
    ring = rt.stats().rollback_ring
    assert ring.last_commit_bytes < head / 20
    assert len(rt.ring) > 80 and ring.bytes_used <= 4 * head  # a whole-copy ring: 4 frames
    rt.rollback(90)
    assert rt.state_digest() == digest


def test_a_long_utterance_is_never_refused_and_stays_bounded(make_runtime, one_thread):
    rt = make_runtime(STT, max_seq_len=64, rollback_depth=80)
    arena = rt.arena.nbytes
    audio = _audio(500, seed=4)
    sizes = []
    for _ in range(4):  # 160 s of audio: 2000 frames, 31 times max_seq_len
        rt.feed_audio(audio)
        sizes.append(rt.snapshot('now').nbytes)
    assert rt.position == 2001
    assert rt.arena.nbytes == arena and len(set(sizes)) == 1
    digest = rt.state_digest()
    later = _audio(30, seed=5)
    rt.feed_audio(later)
    tokens = [e.token_id for e in rt.feed_audio(later)]
    after = rt.state_digest()
    rt.rollback(60)
    assert rt.state_digest() == digest
    rt.feed_audio(later)
    assert [e.token_id for e in rt.feed_audio(later)] == tokens
    assert rt.state_digest() == after
    rt.restore('now')
    assert rt.state_digest() == digest
