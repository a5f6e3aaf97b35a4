"""Speech mode: streamed audio in, text tokens out, with the same capsule guarantees."""

from flashrt_ros.runtime import InvalidRequestError
from flashrt_ros.runtime.models.speech import build_tiny_stt, save_speech_builtin
import numpy as np
import pytest
import torch

STT = 'builtin:tiny-stt'
RATE, FRAME = 24000, 1920


def _audio(seconds, seed):
    """Seeded speech-like test audio: noise bursts and gliding tones, float32 [N]."""
    g = torch.Generator().manual_seed(seed)
    n = int(seconds * RATE)
    t = torch.arange(n) / RATE
    f0 = 150 + 100 * torch.rand(1, generator=g)
    envelope = (torch.sin(2 * torch.pi * 3 * t) > 0).float()
    tone = 0.3 * torch.sin(2 * torch.pi * f0 * t * (1 + 0.5 * t)) * envelope
    return (tone + 0.05 * torch.randn(n, generator=g)).numpy().astype(np.float32)


def _chunks(audio, seed, low_ms=5, high_ms=60):
    """Split audio into random chunks of low_ms..high_ms."""
    rng = np.random.default_rng(seed)
    out, i = [], 0
    while i < len(audio):
        n = int(rng.integers(low_ms * RATE // 1000, high_ms * RATE // 1000 + 1))
        out.append(audio[i:i + n])
        i += n
    return out


def _feed(rt, chunks):
    return [e.token_id for c in chunks for e in rt.feed_audio(c)]


def _logits_after(rt, audio):
    """Feed audio, return a copy of the last step's logits."""
    rt.feed_audio(audio)
    return rt.engine.logits.clone()


@pytest.fixture
def stt(make_runtime):
    return make_runtime(STT, max_seq_len=512, rollback_depth=8)


def test_streamed_random_chunks_match_one_shot_generate(stt):
    rt = stt
    audio = _audio(1.6, seed=0)  # 20 frames: both sliding windows wrap several times
    steps = []  # (position, logits) after each call that completed a frame
    tokens = []
    for chunk in _chunks(audio, seed=1):
        events = rt.feed_audio(chunk)
        tokens += [e.token_id for e in events]
        if events:
            steps.append((events[-1].position, rt.engine.logits.clone()))
    with torch.inference_mode():
        ref = rt.adapter.model.generate(
            input_values=torch.from_numpy(audio).view(1, 1, -1), do_sample=False,
            output_logits=True, return_dict_in_generate=True)
    expected = ref.sequences[0, 1:].tolist()  # after the BOS token
    assert len(expected) == 20 and len(set(expected)) > 3  # the text depends on the audio
    assert tokens[:len(expected)] == expected
    checked = 0
    for position, logits in steps:
        if position <= len(ref.logits):
            assert torch.allclose(logits, ref.logits[position - 1][0], atol=1e-5, rtol=0)
            checked += 1
    assert checked >= 10


def test_chunk_size_invariance_is_bit_exact(stt):
    rt = stt
    audio = _audio(1.3, seed=2)[:-700]  # ends in the middle of a frame
    digests, tokens = [], []
    for chunks in ([audio], _chunks(audio, 0, 5, 60), _chunks(audio, 1, 5, 10),
                   _chunks(audio, 2, 40, 60)):
        rt.reset()
        tokens.append(_feed(rt, chunks))
        digests.append(rt.state_digest())
        assert rt.adapter.samples == len(audio) % FRAME != 0
    assert len(set(digests)) == 1 and all(t == tokens[0] for t in tokens)


def test_restore_mid_frame_after_wrap_continues_bit_exactly(stt):
    rt = stt
    rt.feed_audio(_audio(1.3, seed=3)[:15 * FRAME + 700])  # caches wrapped; 700 samples wait
    rt.snapshot('mid')
    later = _audio(0.8, seed=4)
    tokens_a, digest_a = _feed(rt, _chunks(later, 5)), rt.state_digest()
    rt.feed_audio(_audio(0.5, seed=9))  # wander off
    rt.restore('mid')
    assert rt.adapter.samples == 700
    tokens_b, digest_b = _feed(rt, _chunks(later, 6)), rt.state_digest()
    assert tokens_a == tokens_b and digest_a == digest_b


def test_restore_from_disk_into_another_runtime(make_runtime):
    a = make_runtime(STT, max_seq_len=512)
    a.feed_audio(_audio(1.0, seed=3)[:10 * FRAME + 321])
    a.snapshot('disk_mid', 'disk')
    later = _audio(0.6, seed=4)
    tokens_a, digest_a = _feed(a, _chunks(later, 5)), a.state_digest()
    b = make_runtime(STT, max_seq_len=512)
    b.restore('disk_mid')
    assert _feed(b, _chunks(later, 7)) == tokens_a and b.state_digest() == digest_a


def test_attention_only_restore_diverges(stt):
    rt = stt
    rt.feed_audio(_audio(1.0, seed=3)[:12 * FRAME + 500])
    rt.snapshot('turn')
    later = _audio(0.4, seed=4)
    reference = _logits_after(rt, later)
    rt.feed_audio(_audio(0.5, seed=9))  # other conv context and partial samples
    rt.restore('turn', mode='kv_only')
    ablated = _logits_after(rt, later)
    rt.restore('turn')
    assert torch.equal(_logits_after(rt, later), reference)  # the full restore is exact
    assert not torch.allclose(ablated, reference, atol=1e-4)


def test_dropping_the_first_call_flags_diverges(stt):
    rt = stt
    rt.feed_audio(_audio(1.0, seed=3)[:12 * FRAME])
    rt.snapshot('turn')
    later = _audio(0.4, seed=4)
    reference = _logits_after(rt, later)
    rt.restore('turn')
    rt.adapter.padding.started[:] = [False] * len(rt.adapter.padding.started)
    assert not torch.allclose(_logits_after(rt, later), reference, atol=1e-4)


def test_rollback_undoes_whole_frames_and_the_partial_one(stt):
    rt = stt
    audio = _audio(1.0, seed=5)
    digests = []
    for f in range(10):
        rt.feed_audio(audio[f * FRAME:(f + 1) * FRAME])
        digests.append(rt.state_digest())
    info = rt.rollback(3)
    assert rt.state_digest() == digests[6] and info.position == rt.position == 8
    rt.feed_audio(audio[7 * FRAME:7 * FRAME + 999])  # part of a frame
    rt.rollback(1)  # the partial samples and frame 7 go
    assert rt.state_digest() == digests[5] and rt.adapter.samples == 0


def test_flush_reads_the_delayed_words_and_leaves_the_live_state(stt):
    rt = stt
    rt.feed_audio(_audio(1.0, seed=6)[:9 * FRAME + 1234])
    digest, ring = rt.state_digest(), len(rt.ring)
    flushed = rt.flush()
    assert rt.state_digest() == digest and len(rt.ring) == ring
    # The same tokens as really feeding that silence (the rest of the frame, then 3 frames).
    silence = np.zeros(FRAME - 1234 + 3 * FRAME, dtype=np.float32)
    assert [e.token_id for e in flushed] == [e.token_id for e in rt.feed_audio(silence)]
    assert len(flushed) == 4


def test_should_stop_cuts_a_feed_at_a_frame_boundary_exactly(stt, make_runtime):
    rt = stt
    audio = _audio(1.0, seed=11)  # 12.5 frames
    asked = []

    def stop_after_three():
        asked.append(rt.position)
        return len(asked) > 3

    events = rt.feed_audio(audio[:FRAME // 2], should_stop=lambda: False)  # a partial frame
    events = rt.feed_audio(audio[FRAME // 2:], should_stop=stop_after_three)
    assert events.cut and len({e.frame for e in events}) == 3
    assert events.dropped_samples == len(audio) - FRAME // 2 - (3 * FRAME - FRAME // 2)
    reference = make_runtime(STT, max_seq_len=512, rollback_depth=8)
    assert not reference.feed_audio(audio[:3 * FRAME]).cut
    assert rt.state_digest() == reference.state_digest()  # nothing of the rest taken in
    # A flush cut short leaves the live state as it was, as a whole one does.
    digest = rt.state_digest()
    assert rt.flush(should_stop=lambda: True).cut and rt.state_digest() == digest
    assert not rt.flush().cut and rt.state_digest() == digest


def test_codebooks_are_seeded_and_diverse():
    model, _ = build_tiny_stt('tiny-stt')
    audio = torch.from_numpy(_audio(2.0, seed=7)).view(1, 1, -1)
    with torch.inference_mode():
        codes = model.codec_model.encode(audio).audio_codes[0]  # [K, T]
        for layer in model.codec_model.quantizer.semantic_residual_vector_quantizer.layers:
            layer.codebook.embed_sum.zero_()  # transformers' initialisation
            layer.codebook._embed = None
        zeroed = model.codec_model.encode(audio).audio_codes[0]
    assert codes.shape[0] == 4
    assert all(len(torch.unique(row)) >= 2 for row in codes)
    assert len(torch.unique(zeroed[0])) == 1  # a zero codebook: one code for every frame


def test_bad_audio_is_refused_and_loses_nothing(stt):
    rt = stt
    rt.feed_audio(_audio(0.3, seed=8))
    digest = rt.state_digest()
    bad = [
        (np.full(100, np.nan, dtype=np.float32), None, 'NaN'),
        (np.zeros(100, dtype=np.float32), 12345, 'cannot be resampled'),
        (np.zeros(100, dtype=np.float32), 96000, '8000..48000 Hz'),
        (np.zeros((2, 100), dtype=np.float32), None, 'mono'),
        (np.zeros(100, dtype=np.complex64), None, 'int16 or float32'),
        # Finite, but the codec's state would become inf/NaN in committed frames.
        (np.full(4000, 1e30, dtype=np.float32), None, 'far past full scale'),
        (np.full(4000, -3.4e38, dtype=np.float32), None, 'far past full scale'),
        (np.full(4000, 9.0), None, 'at most 8'),
    ]
    for samples, rate, words in bad:
        with pytest.raises(InvalidRequestError, match=words):
            rt.feed_audio(samples, rate)
        assert rt.state_digest() == digest
    with pytest.raises(InvalidRequestError, match='feed_audio'):
        rt.generate('hello')
    # int16 at the right rate is the same audio as float32.
    pcm = (np.clip(_audio(0.2, seed=9), -1, 1) * 32767).astype(np.int16)
    snap = rt.snapshot('before')
    a = [e.token_id for e in rt.feed_audio(pcm, 24000)]
    rt.restore(snap.name)
    b = [e.token_id for e in rt.feed_audio(pcm.astype(np.float32) / 32768.0)]
    assert a == b
    rt.feed_audio(np.full(4000, 8.0, dtype=np.float32))  # gain past full scale: taken
    views = [rt.arena.view(e) for e in rt.arena.manifest]
    assert all(torch.isfinite(v).all() for v in views if v.is_floating_point())


def test_a_frame_failing_in_the_model_puts_the_last_frame_back(stt, monkeypatch):
    rt = stt
    audio = _audio(1.0, seed=12)
    rt.feed_audio(audio[:5 * FRAME])
    digest = rt.state_digest()

    def boom(*args, **kwargs):
        raise RuntimeError('out of memory')

    monkeypatch.setattr(rt.adapter.model.model, 'forward', boom)  # the decoder, mid-frame
    with pytest.raises(RuntimeError, match='out of memory'):
        rt.feed_audio(audio[5 * FRAME:7 * FRAME + 500])
    assert rt.state_digest() == digest
    monkeypatch.undo()
    assert len(rt.feed_audio(audio[5 * FRAME:7 * FRAME])) == 2


def test_local_checkpoint_folder_gives_the_same_transcript(make_runtime, tmp_path):
    path = save_speech_builtin(STT, tmp_path / 'stt')
    audio = _audio(0.8, seed=10)
    built = make_runtime(STT, max_seq_len=512)
    loaded = make_runtime(str(path), max_seq_len=512)
    assert loaded.is_speech and loaded.speech_spec == built.speech_spec
    assert _feed(loaded, [audio]) == _feed(built, [audio])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')
def test_cuda_stream_is_chunk_invariant_and_restores_exactly(make_runtime):
    audio = _audio(1.3, seed=11)
    gpu = make_runtime(STT, device='cuda', max_seq_len=512)
    gpu.warmup()
    whole = _feed(gpu, [audio])
    digest = gpu.state_digest()
    gpu.reset()
    assert _feed(gpu, _chunks(audio, 12)) == whole and gpu.state_digest() == digest
    gpu.snapshot('mid', 'host')
    later = _audio(0.5, seed=13)
    tokens, digest = _feed(gpu, [later]), gpu.state_digest()
    gpu.restore('mid')
    assert _feed(gpu, _chunks(later, 14)) == tokens and gpu.state_digest() == digest
