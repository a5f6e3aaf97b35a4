"""
audio_common_msgs audio in speech mode: both ROS 2 flavours, told apart by their fields.

Neither package is on the Python package index, so these tests build messages with the
fields of their .msg files (mgonzs13/audio_common: AudioStamped{header, audio: Audio{audio:
AudioData of typed arrays, info: AudioInfo{format, channels, rate, chunk}}};
ros-drivers/audio_common: AudioData{uint8[] data}). The node subscribes to whichever one
is importable (~/audio_stamped or ~/audio_data) and feeds what these functions return.
"""

from types import SimpleNamespace

from flashrt_ros.node import messages
import numpy as np
import pytest


class _Type:
    def __init__(self, fields):
        self.fields = fields

    def get_fields_and_field_types(self):
        return dict.fromkeys(self.fields, 'x')


TYPED = SimpleNamespace(AudioStamped=_Type(['header', 'audio']),
                        AudioData=_Type(['float32_data', 'int32_data', 'int24_data',
                                         'int16_data', 'int8_data', 'uint8_data']))
BYTES = SimpleNamespace(AudioData=_Type(['data']), AudioDataStamped=_Type(['header', 'audio']))


def _typed(field, values, fmt, channels=1, rate=16000):
    data = dict.fromkeys(['float32_data', 'int32_data', 'int24_data', 'int16_data',
                          'int8_data', 'uint8_data'], [])
    data[field] = values
    info = SimpleNamespace(format=fmt, channels=channels, rate=rate, chunk=len(values))
    return SimpleNamespace(audio=SimpleNamespace(audio=SimpleNamespace(**data), info=info))


def test_the_flavours_are_told_apart():
    assert messages.audio_common_flavour(TYPED) == 'typed'
    assert messages.audio_common_flavour(BYTES) == 'bytes'
    assert messages.audio_common_flavour(SimpleNamespace()) == ''


@pytest.mark.parametrize('field,values,fmt', [
    ('int16_data', [16384, -32768], 8), ('float32_data', [0.5, -1.0], 1),
    ('int32_data', [2 ** 30, -2 ** 31], 2), ('int24_data', [2 ** 22, -2 ** 23], 4),
    ('int8_data', [64, -128], 16), ('uint8_data', [192, 0], 32)])
def test_typed_samples_are_scaled_to_full_scale_one(field, values, fmt):
    samples, rate = messages.audio_common_samples(_typed(field, values, fmt), 'typed')
    assert samples.dtype == np.float32 and rate == 16000
    assert samples.tolist() == [0.5, -1.0]


def test_typed_channels_are_averaged_and_bad_formats_refused():
    samples, _ = messages.audio_common_samples(
        _typed('int16_data', [16384, 0, -16384, -16384], 8, channels=2), 'typed')
    assert samples.tolist() == [0.25, -0.5]
    with pytest.raises(ValueError, match='PortAudio'):
        messages.audio_common_samples(_typed('int16_data', [1], 99), 'typed')
    with pytest.raises(ValueError, match='channels'):
        messages.audio_common_samples(_typed('int16_data', [1, 2, 3], 8, channels=2), 'typed')


def test_bytes_are_s16le_at_the_models_rate():
    raw = np.array([16384, -32768], dtype='<i2').tobytes()
    samples, rate = messages.audio_common_samples(SimpleNamespace(data=list(raw)), 'bytes')
    assert samples.tolist() == [0.5, -1.0] and rate is None
    with pytest.raises(ValueError, match='S16LE'):
        messages.audio_common_samples(SimpleNamespace(data=[1, 2, 3]), 'bytes')
