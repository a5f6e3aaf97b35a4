"""Audio at a stated rate: the streaming resampler, its state in capsules, one rate a stream."""

import math

from flashrt_ros.runtime import InvalidRequestError
from flashrt_ros.runtime.models.resample import half_width, StreamingResampler
import numpy as np
import pytest
import torch

STT = 'builtin:tiny-stt'
MODEL_RATE, FRAME = 24000, 1920
RATES = (8000, 16000, 22050, 32000, 44100, 48000)


def _tone(freq, rate, n):
    t = torch.arange(n, dtype=torch.float64) / rate
    return 0.5 * torch.sin(2 * math.pi * freq * t)


def _resample(x, rate):
    r = StreamingResampler(MODEL_RATE)
    r.history = torch.zeros(r.size)
    return r.process(x.float(), rate)


def _audio(seconds, rate, seed):
    """Seeded speech-like audio at `rate`: a gliding tone plus noise, float32 [N]."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    tone = 0.3 * np.sin(2 * np.pi * (150 + 40 * seed) * t * (1 + 0.5 * t))
    return (tone + 0.05 * rng.standard_normal(t.size)).astype(np.float32)


def _chunks(audio, seed, high=900):
    """Split audio into random chunks of 1..high samples."""
    rng = np.random.default_rng(seed)
    out, i = [], 0
    while i < len(audio):
        n = int(rng.integers(1, high + 1))
        out.append(audio[i:i + n])
        i += n
    return out


def _feed(rt, chunks, rate):
    return [e.token_id for c in chunks for e in rt.feed_audio(c, rate)]


@pytest.fixture
def stt(make_runtime):
    return make_runtime(STT, max_seq_len=512, rollback_depth=8)


@pytest.mark.parametrize('rate', RATES)
def test_a_tone_resampled_matches_the_tone_made_at_the_model_rate(rate):
    y = _resample(_tone(1000.0, rate, rate), rate)  # one second
    ref = _tone(1000.0, MODEL_RATE, y.numel())
    # what is out: the last K input samples (the filter's lookahead)
    assert MODEL_RATE - y.numel() == half_width(rate, MODEL_RATE) * MODEL_RATE // rate
    err = (y.double() - ref)[64:].abs().max().item()
    assert err < 1e-4, err  # a 0.5 tone: about -80 dB


def test_downsampling_removes_what_the_model_rate_cannot_hold():
    y = _resample(_tone(15000.0, 48000, 48000), 48000)  # above 12 kHz: would alias to 9 kHz
    assert y[200:].abs().max().item() < 1e-3
    kept = _resample(_tone(8000.0, 48000, 48000), 48000)  # speech band: kept
    ref = _tone(8000.0, MODEL_RATE, kept.numel())
    assert (kept.double() - ref)[200:].abs().max().item() < 1e-3


@pytest.mark.parametrize('rate', (16000, 44100))
def test_resampled_stream_is_chunk_size_invariant_bit_exact(stt, rate):
    rt = stt
    audio = _audio(1.1, rate, seed=1)
    digests, tokens = [], []
    for chunks in ([audio], _chunks(audio, 0, 7), _chunks(audio, 1), _chunks(audio, 2, 3000)):
        rt.reset()
        tokens.append(_feed(rt, chunks, rate))
        digests.append(rt.state_digest())
    assert len(set(digests)) == 1 and all(t == tokens[0] for t in tokens)
    assert len(tokens[0]) > 10
    # the same as resampling the whole signal first and feeding it at the model rate
    rt.reset()
    whole = _resample(torch.from_numpy(audio), rate).numpy()
    assert _feed(rt, [whole], None) == tokens[0]


def test_restore_mid_stream_continues_bit_exactly(stt):
    rt = stt
    rt.feed_audio(_audio(0.9, 22050, seed=3)[:-333], 22050)
    resampler = rt.adapter.resampler
    assert resampler.rate == 22050 and resampler.phase and rt.adapter.samples
    rt.snapshot('mid', 'host')
    later = _audio(0.6, 22050, seed=4)
    tokens_a, digest_a = _feed(rt, _chunks(later, 5), 22050), rt.state_digest()
    rt.reset()
    rt.feed_audio(_audio(0.3, 16000, seed=9), 16000)  # wander off, at another rate
    rt.restore('mid')
    assert resampler.rate == 22050
    tokens_b, digest_b = _feed(rt, _chunks(later, 6), 22050), rt.state_digest()
    assert tokens_a == tokens_b and digest_a == digest_b


def test_dropping_the_history_diverges(stt):
    rt = stt
    rt.feed_audio(_audio(0.5, 16000, seed=5), 16000)
    snap = rt.snapshot('mid')
    later = _audio(0.3, 16000, seed=6)
    rt.feed_audio(later, 16000)
    digest = rt.state_digest()
    rt.restore(snap.name)
    rt.arena.views['audio.history'].zero_()
    rt.feed_audio(later, 16000)
    assert rt.state_digest() != digest


def test_a_rate_change_mid_utterance_is_refused_and_leaves_the_state(stt):
    rt = stt
    rt.feed_audio(_audio(0.3, 16000, seed=7), 16000)
    digest = rt.state_digest()
    for rate in (24000, None, 48000):
        with pytest.raises(InvalidRequestError, match='this utterance is at 16000 Hz'):
            rt.feed_audio(np.zeros(800, dtype=np.float32), rate)
        assert rt.state_digest() == digest
    rt.reset()
    assert rt.feed_audio(_audio(0.2, 48000, seed=8), 48000)  # a new utterance: a new rate
    assert rt.adapter.resampler.rate == 48000


def test_flush_reads_out_the_lookahead_and_leaves_the_live_state(stt):
    rt = stt
    rt.feed_audio(_audio(0.7, 16000, seed=10), 16000)
    digest = rt.state_digest()
    flushed = rt.flush()
    assert flushed and rt.state_digest() == digest
    assert rt.flush() == flushed  # reads a copy, every time the same


def test_rollback_lands_on_the_same_boundary_however_the_audio_was_chunked(stt):
    rt = stt
    audio, later = _audio(1.0, 32000, seed=11), _audio(0.3, 32000, seed=12)
    results = []
    for chunks in ([audio], _chunks(audio, 3), _chunks(audio, 4, 5000)):
        rt.reset()
        _feed(rt, chunks, 32000)
        rt.rollback(3)
        digest = rt.state_digest()
        results.append((digest, tuple(_feed(rt, [later], 32000)), rt.state_digest()))
    assert len(set(results)) == 1 and results[0][1]
