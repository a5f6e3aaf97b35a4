"""Parameters as a user sets them: the command line, a parameter file, a set at run time."""

import json
import subprocess
import sys

from flashrt_ros.node import FlashRTNode, parameters
import pytest
import rclpy
from rclpy.parameter import Parameter
from rclpy.signals import SignalHandlerOptions
import yaml

STRINGS = ['ab', 'c d', "it's"]


def _other(p):
    """Return a valid value of parameter `p` other than its default."""
    if p.string_array:
        return list(STRINGS)
    if p.choices:
        return next(c for c in p.choices if c != p.default)
    if isinstance(p.default, bool):
        return not p.default
    if p.integer is not None:
        low, high = p.integer
        return p.default + 1 if p.default + 1 <= high else low
    if p.floating is not None:
        low, high = p.floating
        return (p.default + high) / 2 if high > p.default else (low + p.default) / 2
    if isinstance(p.default, float):
        return p.default + 0.5
    return {'model': 'builtin:tiny-llama', 'device': 'cuda:1'}.get(p.name, p.default + '_x')


def _node(args):
    """Return (context, node) of a node declared from command-line `args` (not configured)."""
    context = rclpy.Context()
    rclpy.init(context=context, args=['flashrt_node', '--ros-args', *args],
               signal_handler_options=SignalHandlerOptions.NO)
    return context, FlashRTNode(context=context)


def test_every_parameter_takes_a_value_every_way(tmp_path):
    """The whole table from the command line and a parameter file; writable ones at run time."""
    values = {p.name: _other(p) for p in parameters.PARAMETERS if p.name != 'autostart'}
    path = tmp_path / 'params.yaml'
    path.write_text(yaml.safe_dump({'/**': {'ros__parameters': dict(values, autostart=False)}}))
    command_line = ['-p', 'autostart:=false'] + [  # a JSON value is a YAML one
        a for name, v in values.items() for a in ('-p', f'{name}:={json.dumps(v)}')]
    for args in (command_line, ['--params-file', str(path)]):
        context, node = _node(args)
        try:
            got = {name: node.get_parameter(name).value for name in values}
            assert {k: list(v) if isinstance(v, (list, tuple)) else v
                    for k, v in got.items()} == values, args[:2]
        finally:
            node.destroy_node()
            rclpy.try_shutdown(context=context)
    context, node = _node(['-p', 'autostart:=false'])
    try:
        for p in parameters.PARAMETERS:
            if p.name == 'autostart':
                continue
            result = node.set_parameters([Parameter(p.name, value=values[p.name])])[0]
            assert result.successful == (p.name not in parameters.READ_ONLY), (p.name,
                                                                               result.reason)
    finally:
        node.destroy_node()
        rclpy.try_shutdown(context=context)


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
            after = list(node.get_parameter('stop_strings').value)
            # An empty list is typed as another array kind (a byte array here; `ros2 param
            # set` sends its own guess): it empties the string array all the same.
            emptied = node.set_parameters([Parameter('stop_strings', value=[])])[0]
            stored = node.get_parameter('stop_strings')
            assert emptied.successful, emptied.reason
            assert stored.type_ == Parameter.Type.STRING_ARRAY and list(stored.value) == []
            return value.type_, list(value.value), result.successful, after
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
