"""
An Interrupt read straight from its serialized bytes, for the control path.

rclpy's take converts a message through its generated Python class (every field's setter
and check, in code that is cold when an interrupt wakes the control thread); taken
serialized and read here, the same fields cost about half as much. Only the classic CDR
encodings (XCDR1, either byte order) are read; anything else goes through rclpy's
deserialization, as does a message this reader finds malformed.
"""

import collections
import struct

from flashrt_ros.msg import Interrupt
from rclpy.serialization import deserialize_message

# The fields of flashrt_ros/msg/Interrupt, as the node's callback reads them.
InterruptFields = collections.namedtuple('InterruptFields', 'mode boundaries capsule reason')
_BYTE_ORDER = {b'\x00\x00': '>', b'\x00\x01': '<'}  # CDR_BE, CDR_LE (encapsulation id)
_HEADER = 4  # encapsulation id and options; offsets below align from the payload's start


def interrupt_fields(data: bytes) -> InterruptFields:
    """Return the fields of a serialized Interrupt (rclpy's reading where this has none)."""
    fields = _read(data)
    if fields is None:
        msg = deserialize_message(data, Interrupt)
        fields = InterruptFields(msg.mode, msg.boundaries, msg.capsule, msg.reason)
    return fields


def _read(data: bytes) -> InterruptFields | None:
    """Fields of XCDR1 bytes: uint8 mode, uint32 boundaries, string capsule, string reason."""
    order = _BYTE_ORDER.get(bytes(data[:2]))
    if order is None or len(data) < _HEADER + 12:
        return None
    mode = data[_HEADER]
    boundaries, = struct.unpack_from(order + 'I', data, _HEADER + 4)
    strings, offset = [], 8
    for _ in range(2):
        offset = (offset + 3) & ~3
        start = _HEADER + offset + 4
        if start > len(data):
            return None
        size, = struct.unpack_from(order + 'I', data, start - 4)  # with its NUL
        if size == 0 or start + size > len(data) or data[start + size - 1] != 0:
            return None
        raw = bytes(data[start:start + size - 1])
        # As rclpy converts a string: up to its first NUL, invalid UTF-8 replaced.
        strings.append(raw.split(b'\x00', 1)[0].decode('utf-8', 'replace'))
        offset += 4 + size
    return InterruptFields(mode, boundaries, *strings)
