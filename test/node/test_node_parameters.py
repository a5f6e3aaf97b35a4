"""Parameters as a user sets them: the command line, a parameter file, a set at run time."""

import subprocess
import sys

from flashrt_ros.node import FlashRTNode
import pytest
import rclpy
from rclpy.parameter import Parameter
from rclpy.signals import SignalHandlerOptions
import yaml

STRINGS = ['ab', 'c d', "it's"]


def _declared(tmp_path, args):
    """Return the node's stop_strings as declared from `args` (not configured)."""
    context = rclpy.Context()
    rclpy.init(context=context, args=['flashrt_node', '--ros-args', *args],
               signal_handler_options=SignalHandlerOptions.NO)
    try:
        node = FlashRTNode(context=context, cli_args=['--ros-args', '-p', 'autostart:=false'])
        try:
            value = node.get_parameter('stop_strings')
            result = node.set_parameters([Parameter('stop_strings', value=['x', 'y'])])[0]
            return value.type_, list(value.value), result.successful, list(
                node.get_parameter('stop_strings').value)
        finally:
            node.destroy_node()
    finally:
        rclpy.try_shutdown(context=context)


@pytest.mark.parametrize('how', ['default', 'command line', 'parameter file'])
def test_string_arrays_can_be_set_every_way(tmp_path, how):
    if how == 'command line':
        args = ['-p', 'stop_strings:=' + str(STRINGS)]
    elif how == 'parameter file':
        path = tmp_path / 'params.yaml'
        path.write_text(yaml.safe_dump({'/**': {'ros__parameters': {'stop_strings': STRINGS}}}))
        args = ['--params-file', str(path)]
    else:
        args = []
    kind, value, set_ok, after = _declared(tmp_path, args)
    assert kind == Parameter.Type.STRING_ARRAY
    assert value == (STRINGS if args else [])
    assert set_ok and after == ['x', 'y']  # and at run time (what `ros2 param set` sends)


def test_a_failed_start_says_why_in_one_line(tmp_path):
    done = subprocess.run(
        [sys.executable, '-m', 'flashrt_ros', '--ros-args', '-p', 'max_seq_len:=many',
         '-p', 'autostart:=false'], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 1
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith('flashrt_node:'), done.stderr
    assert 'max_seq_len' in lines[0]
