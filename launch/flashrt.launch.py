"""
Launch one flashrt node with config/flashrt.yaml.

    ros2 launch flashrt_ros flashrt.launch.py
    ros2 launch flashrt_ros flashrt.launch.py model:=/models/qwen3.5-0.8b device:=cuda \
        dtype:=bfloat16 namespace:=arm log_level:=debug
    ros2 launch flashrt_ros flashrt.launch.py mode:=policy model:=builtin:tiny-policy
    ros2 launch flashrt_ros flashrt.launch.py enclave:=/flashrt_ros/flashrt   # docs/security.md
"""

import os

from ament_index_python.packages import get_package_share_directory
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, OpaqueFunction
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import LifecycleNode
from launch_ros.parameter_descriptions import ParameterValue


def generate_launch_description():
    """Start the flashrt lifecycle node; with autostart it walks itself to active."""
    default_params = os.path.join(get_package_share_directory('flashrt_ros'), 'config',
                                  'flashrt.yaml')
    arguments = [DeclareLaunchArgument(name, default_value=default, description=description)
                 for name, default, description in (
                     ('model', 'default',
                      'default (the trained embedded model), builtin:<id> or a local '
                      'checkpoint directory'),
                     ('mode', 'lm', 'lm | policy | speech (must match the model)'),
                     ('device', 'cpu', 'cpu | cuda | cuda:N'),
                     ('dtype', 'float32', 'float32 | bfloat16 | float16'),
                     ('params_file', default_params, 'parameter file (see config/flashrt.yaml)'),
                     ('namespace', '', 'namespace of the node (and of its topics)'),
                     ('log_level', 'info', 'debug | info | warn | error'),
                     ('autostart', 'true', 'configure and activate at startup'),
                     ('enclave', '', 'SROS2 enclave of the node (empty: unsecured)'))]
    return LaunchDescription(arguments + [OpaqueFunction(function=_node)])


def _node(context):
    enclave = LaunchConfiguration('enclave').perform(context)
    node = LifecycleNode(
        package='flashrt_ros',
        executable='flashrt_node',
        name='flashrt',
        namespace=LaunchConfiguration('namespace'),
        output='screen',
        parameters=[
            LaunchConfiguration('params_file'),
            {
                # value_type=str: a model path or id must never be parsed as YAML
                'model': ParameterValue(LaunchConfiguration('model'), value_type=str),
                'mode': ParameterValue(LaunchConfiguration('mode'), value_type=str),
                'device': ParameterValue(LaunchConfiguration('device'), value_type=str),
                'dtype': ParameterValue(LaunchConfiguration('dtype'), value_type=str),
                'autostart': ParameterValue(LaunchConfiguration('autostart'), value_type=bool),
            },
        ],
        arguments=['--ros-args', '--log-level', LaunchConfiguration('log_level')]
        + (['--enclave', enclave] if enclave else []),
    )
    return [node]
