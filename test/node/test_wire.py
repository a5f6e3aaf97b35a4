"""node/wire.py reads an Interrupt's serialized bytes exactly as rclpy's deserialization does."""

import struct

from flashrt_ros.msg import Interrupt
from flashrt_ros.node.wire import _read, interrupt_fields
import pytest
from rclpy.serialization import deserialize_message, serialize_message

MESSAGES = [
    Interrupt(),
    Interrupt(mode=3, capsule='home'),
    Interrupt(mode=2, boundaries=4294967295, reason='tray dropped: ünïcode ✓'),
    Interrupt(mode=1, capsule='a' * 10_001, reason=''),
    Interrupt(mode=255, boundaries=7, capsule='abc', reason='d'),  # every padding length
    Interrupt(mode=3, capsule='abcd', reason='x' * 3),
]


def _fields(msg):
    return (msg.mode, msg.boundaries, msg.capsule, msg.reason)


def _cdr(order, mode, boundaries, *strings):
    """Serialize by hand: XCDR1 in either byte order (rclpy writes little-endian only)."""
    out = (b'\x00\x00' if order == '>' else b'\x00\x01') + b'\x00\x00'
    payload = bytes([mode, 0, 0, 0]) + struct.pack(order + 'I', boundaries)
    for raw in strings:
        payload += b'\x00' * (-len(payload) % 4)
        payload += struct.pack(order + 'I', len(raw) + 1) + raw + b'\x00'
    return out + payload


@pytest.mark.parametrize('msg', MESSAGES, ids=range(len(MESSAGES)))
def test_fields_equal_rclpy_deserialization(msg):
    data = serialize_message(msg)
    assert _read(data) == _fields(msg)  # the fast reading, not the fallback
    assert interrupt_fields(data) == _fields(deserialize_message(data, Interrupt))


def test_big_endian_bytes_are_read_too():
    data = _cdr('>', 3, 70_000, b'home', b'e-stop')
    assert _read(data) == (3, 70_000, 'home', 'e-stop')
    assert _read(_cdr('<', 3, 70_000, b'home', b'e-stop')) == (3, 70_000, 'home', 'e-stop')


@pytest.mark.parametrize('capsule', [b'\xff\xfehome', b'ho\x00me', b''])
def test_odd_strings_read_as_rclpy_reads_them(capsule):
    data = _cdr('<', 3, 1, capsule, b'r\xc3')
    assert _read(data) == _fields(deserialize_message(data, Interrupt))


def test_what_it_cannot_read_goes_to_rclpy():
    data = serialize_message(Interrupt(mode=3, capsule='home', reason='why'))
    xcdr2 = b'\x00\x07' + data[2:]
    assert _read(xcdr2) is None
    assert interrupt_fields(xcdr2) == (3, 0, 'home', 'why')  # rclpy reads it instead
    for cut in (len(data) - 1, 14, 3, 0):
        assert _read(data[:cut]) is None, cut
    too_long = bytearray(data)
    too_long[12:16] = struct.pack('<I', 1_000)  # the capsule's length past the end
    assert _read(bytes(too_long)) is None
    no_nul = bytearray(data)
    no_nul[16 + 4] = ord('x')  # 'home' then not its NUL
    assert _read(bytes(no_nul)) is None
    assert interrupt_fields(data) == (3, 0, 'home', 'why')
