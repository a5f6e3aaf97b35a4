"""
Launch several flashrt nodes, one per namespace (e.g. one model per arm or per robot).

    ros2 launch flashrt_ros flashrt_multi.launch.py namespaces:=left_arm,right_arm
    ros2 launch flashrt_ros flashrt_multi.launch.py enclave:=/flashrt_ros/{namespace}/flashrt

Each instance is /<namespace>/flashrt with its own topics, services and capsule directory
(<capsule_root>/<namespace>), so capsule names never collide between instances.
"""

import os

from ament_index_python.packages import get_package_share_directory
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, OpaqueFunction
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import LifecycleNode
from launch_ros.parameter_descriptions import ParameterValue


def _instances(context):
    namespaces = [ns.strip() for ns in
                  LaunchConfiguration('namespaces').perform(context).split(',') if ns.strip()]
    params_file = LaunchConfiguration('params_file').perform(context)
    capsule_root = LaunchConfiguration('capsule_root').perform(context)
    enclave = LaunchConfiguration('enclave').perform(context)
    # value_type=str: a model path or id must never be parsed as YAML (e.g. as a number)
    overrides = {key: ParameterValue(LaunchConfiguration(key).perform(context), value_type=str)
                 for key in ('model', 'mode', 'device', 'dtype')}
    autostart = LaunchConfiguration('autostart').perform(context).strip().lower()
    overrides['autostart'] = autostart in ('true', '1', 'yes', 'on')
    return [
        LifecycleNode(
            package='flashrt_ros',
            executable='flashrt_node',
            name='flashrt',
            namespace=ns,
            output='screen',
            parameters=[params_file,
                        dict(overrides, capsule_dir=os.path.join(capsule_root, ns))],
            arguments=['--ros-args', '--log-level',
                       LaunchConfiguration('log_level').perform(context)]
            + (['--enclave', enclave.replace('{namespace}', ns)] if enclave else []),
        )
        for ns in namespaces
    ]


def generate_launch_description():
    """Start one flashrt node per namespace in `namespaces`."""
    default_params = os.path.join(get_package_share_directory('flashrt_ros'), 'config',
                                  'flashrt.yaml')
    arguments = [DeclareLaunchArgument(name, default_value=default, description=description)
                 for name, default, description in (
                     ('namespaces', 'left_arm,right_arm',
                      'comma-separated namespaces, one node each'),
                     ('model', 'default',
                      'default (the trained embedded model), builtin:<id> or a local '
                      'checkpoint directory'),
                     ('mode', 'lm', 'lm | policy (must match the model)'),
                     ('device', 'cpu', 'cpu | cuda | cuda:N'),
                     ('dtype', 'float32', 'float32 | bfloat16 | float16'),
                     ('params_file', default_params, 'parameter file shared by the instances'),
                     ('capsule_root', '~/.cache/flashrt_ros/capsules',
                      'parent of the per-instance capsule directories'),
                     ('log_level', 'info', 'debug | info | warn | error'),
                     ('autostart', 'true', 'configure and activate each node at startup'),
                     ('enclave', '', 'SROS2 enclave of each node; {namespace} is its namespace, '
                      'e.g. /flashrt_ros/{namespace}/flashrt (empty: unsecured)'))]
    return LaunchDescription(arguments + [OpaqueFunction(function=_instances)])
