"""Speech transcripts: words with audio times, end of utterance, a checkpoint's settings."""

import json

from flashrt_ros.runtime.models.speech import SpeechSpec
from flashrt_ros.runtime.models.tokenizer import HFTokenizer
from flashrt_ros.runtime.modes.speech import Transcriber, TranscriptEvent, Word
import numpy as np
import pytest
import torch

RATE, FRAME = 24000, 1920
PAD, EPAD = 3, 0  # Kyutai's text padding and end-of-padding ids
WORDS = ['▁the', '▁robot', '▁pick', 'ed', '▁up', '▁red', '▁cup']


def sentencepiece_tokenizer():
    """Return a SentencePiece-style tokenizer (Unigram + Metaspace) with Kyutai's specials."""
    from tokenizers import decoders, models, pre_tokenizers, Tokenizer
    from transformers import PreTrainedTokenizerFast

    vocab = [('<unk>', 0.0), ('<s>', 0.0), ('</s>', 0.0), ('<pad>', 0.0)]
    vocab += [(w, -2.0) for w in WORDS] + [(c, -5.0) for c in '▁abcdefghijklmnopqrstuvwxyz']
    tok = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token='<unk>', bos_token='<s>',
                                   eos_token='</s>', pad_token='<pad>')


def _events(tokens, first_frame=0, rms=0.3):
    """Return the events of one token per frame (Kyutai's stream after its first frame)."""
    return [TranscriptEvent(first_frame + i, t, '', t == PAD, first_frame + i + 2, rms)
            for i, t in enumerate(tokens)]


@pytest.fixture
def spm():
    return HFTokenizer(sentencepiece_tokenizer(), ())


SPEC = SpeechSpec(RATE, FRAME, text_delay_s=0.48, pad_token_id=PAD, silence_prefix_s=0.16)


def test_sentencepiece_words_keep_their_spaces_and_no_special_id_is_text(spm):
    ids = spm.encode('the robot picked up the red cup')
    assert ''.join(spm.decode([i]) for i in ids) == 'therobotpickeduptheredcup'  # per token
    stream = [PAD, EPAD] + ids[:4] + [PAD, EPAD, 1, 2] + ids[4:] + [PAD, PAD]
    update = Transcriber(spm, SPEC).update(_events(stream))
    assert update.text == 'the robot picked up the red cup'
    assert update.ids == ids and update.first_frame == 2  # no pad, EPAD, <s> or </s>
    assert [w.text for w in update.words] == 'the robot picked up the red cup'.split()
    assert not any(w.partial for w in update.words)


def test_words_carry_audio_times_and_stay_partial_until_they_end(spm):
    t = Transcriber(spm, SPEC)
    offset = SPEC.text_delay_s + SPEC.silence_prefix_s  # 0.64 s: 8 frames

    def at(frame):
        return round((frame + 1) * 0.08 - offset, 6)

    ids = spm.encode('the robot picked')  # ▁the ▁robot ▁pick ed
    first = t.update(_events([PAD] * 10 + ids[:3]))  # frames 0..12: '▁pick' at 12
    assert [w.text for w in first.words] == ['the', 'robot', 'pick']
    assert first.words[0] == Word('the', at(10), at(11), False)
    assert first.words[-1] == Word('pick', at(12), at(12), True)  # may still grow
    second = t.update(_events([ids[3], PAD], first_frame=13))
    assert second.text == 'ed' and second.words == [Word('picked', at(12), at(14), False)]
    assert t.time(2) == 0.0  # before the speaker's first sample: clamped


def test_end_of_utterance_after_quiet_padded_frames_once(spm):
    t = Transcriber(spm, SPEC, quiet_s=0.4, quiet_db=-40.0)
    ids = spm.encode('the red cup')
    update = t.update(_events(ids + [PAD] * 3, rms=0.0))
    assert update.end_of_utterance is None  # 0.24 s quiet
    loud = t.update(_events([PAD] * 6, first_frame=6, rms=0.1))  # padding over speech
    assert loud.end_of_utterance is None
    quiet = t.update(_events([PAD] * 6, first_frame=12, rms=1e-4))
    end = quiet.end_of_utterance
    assert end is not None and end.text == 'the red cup' and end.frame == 16
    assert end.quiet_s == pytest.approx(0.4) and np.isnan(end.pause_probability)
    assert end.start == t.time(0) and end.end == t.time(3)
    assert t.update(_events([PAD] * 20, first_frame=18, rms=0.0)).end_of_utterance is None
    t.update(_events(spm.encode('up'), first_frame=38))
    again = t.update(_events([PAD] * 5, first_frame=39, rms=0.0)).end_of_utterance
    assert again is not None and again.text == 'up'


def test_a_fork_goes_on_apart(spm):
    t = Transcriber(spm, SPEC)
    t.update(_events(spm.encode('the pick')))
    fork = t.fork()
    assert fork.update(_events([PAD], first_frame=2)).words[0].text == 'pick'
    ed = spm.encode('picked')[-1]
    assert t.update(_events([ed], first_frame=2)).words[-1].text == 'picked'


# ---- a checkpoint saved by transformers 5, with its processor ----------------------------


def _save_checkpoint(path, delay=0.32, prefix=0.2):
    """Save the tiny STT model, a SentencePiece tokenizer and its processor (transformers 5)."""
    from flashrt_ros.runtime.models.speech import build_tiny_stt
    from transformers import KyutaiSpeechToTextFeatureExtractor, KyutaiSpeechToTextProcessor

    model, _ = build_tiny_stt('tiny-stt')
    model.save_pretrained(str(path))
    extractor = KyutaiSpeechToTextFeatureExtractor(
        sampling_rate=RATE, audio_delay_seconds=delay, audio_silence_prefix_seconds=prefix)
    processor = KyutaiSpeechToTextProcessor(extractor, sentencepiece_tokenizer())
    processor.save_pretrained(str(path))
    return model, processor


def _audio(seconds, seed):
    g = torch.Generator().manual_seed(seed)
    n = int(seconds * RATE)
    t = torch.arange(n) / RATE
    tone = 0.3 * torch.sin(2 * torch.pi * 180 * t * (1 + 0.5 * t))
    return (tone + 0.05 * torch.randn(n, generator=g)).numpy().astype(np.float32)


def test_transformers5_checkpoint_runs_with_its_own_delay_and_prefix(make_runtime, tmp_path):
    model, processor = _save_checkpoint(tmp_path / 'stt')
    assert (tmp_path / 'stt' / 'processor_config.json').is_file()
    assert not (tmp_path / 'stt' / 'preprocessor_config.json').exists()
    rt = make_runtime(str(tmp_path / 'stt'), max_seq_len=512)
    spec = rt.speech_spec
    assert (spec.text_delay_s, spec.silence_prefix_s) == (0.32, 0.2)
    assert spec.settings == 'processor_config.json'
    audio = _audio(1.2, seed=3)
    tokens = [e.token_id for i in range(0, len(audio), 700)
              for e in rt.feed_audio(audio[i:i + 700])]
    # 0.2 s of silence (2.5 frames) went in first: BOS + (4800 + 28800) // 1920 frames.
    assert rt.position == 1 + (4800 + len(audio)) // FRAME == len(tokens)
    inputs = processor.feature_extractor(audio, sampling_rate=RATE, return_tensors='pt')
    with torch.inference_mode():
        ref = model.generate(input_values=inputs['input_values'], do_sample=False)
    expected = ref[0, 1:].tolist()
    assert len(expected) > len(tokens) and len(set(expected)) > 3
    assert tokens == expected[:len(tokens)]
    plain = make_runtime('builtin:tiny-stt', max_seq_len=512)  # the same weights, no prefix
    assert [e.token_id for e in plain.feed_audio(audio)] != tokens[:-2]


def test_the_silence_prefix_is_state_a_capsule_continues_it(make_runtime, tmp_path):
    _save_checkpoint(tmp_path / 'stt', prefix=0.2)
    rt = make_runtime(str(tmp_path / 'stt'), max_seq_len=512, rollback_depth=8)
    audio = _audio(0.6, seed=4)

    def silence_left():
        return json.loads(rt.codec.live_meta_json())['adapter']['silence_left']

    assert silence_left() == 4800  # a fresh utterance: the prefix still to feed
    rt.snapshot('fresh', 'host')
    whole = [e.token_id for e in rt.feed_audio(audio)]
    assert silence_left() == 0
    rt.restore('fresh')
    calls = iter([False, True])  # a frame of the prefix, then cut
    cut = rt.feed_audio(audio, should_stop=lambda: next(calls, True))
    assert cut.cut and silence_left() == 4800 - FRAME
    rt.snapshot('mid_prefix', 'disk')
    rest = [e.token_id for e in rt.feed_audio(audio)]
    assert [e.token_id for e in cut] + rest == whole
    rt.reset()
    assert silence_left() == 4800
    rt.restore('mid_prefix')
    assert [e.token_id for e in rt.feed_audio(audio)] == rest


def test_preprocessor_config_is_read_too_and_bad_settings_refused(tmp_path):
    from flashrt_ros.runtime import ConfigError
    from flashrt_ros.runtime.models.speech import processor_settings

    (tmp_path / 'preprocessor_config.json').write_text(json.dumps(
        {'audio_delay_seconds': 2.0, 'audio_silence_prefix_seconds': 1.0,
         'sampling_rate': 24000}))
    assert processor_settings(tmp_path) == {
        'text_delay_s': 2.0, 'silence_prefix_s': 1.0, 'sample_rate': 24000,
        'source': 'preprocessor_config.json'}
    (tmp_path / 'processor_config.json').write_text(json.dumps(
        {'feature_extractor': {'audio_delay_seconds': 0.5}}))  # the newer file wins
    assert processor_settings(tmp_path)['text_delay_s'] == 0.5
    (tmp_path / 'processor_config.json').write_text('{"feature_extractor": '
                                                    '{"audio_delay_seconds": -1}}')
    with pytest.raises(ConfigError, match='negative'):
        processor_settings(tmp_path)
    assert 'no processor file' in processor_settings(tmp_path / 'none')['source']
