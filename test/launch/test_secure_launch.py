"""
Launch test under SROS2 Enforce: an unauthenticated peer gets nothing, the client enclave does.

Needs launch_testing, the ros2 security CLI (sros2) and a Fast DDS with the security
plugins (a ROS 2 install's; the package index's has none): skipped, saying which is missing,
elsewhere. Run on a robot with: `launch_test test/launch/test_secure_launch.py`.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import pytest

launch_testing = pytest.importorskip(
    'launch_testing', reason='launch_testing is not installed (it is not on the package '
    'index; see docs/setup.md)')
if shutil.which('ros2') is None or subprocess.run(
        ['ros2', 'security', '--help'], capture_output=True).returncode != 0:
    pytest.skip('the ros2 security CLI (sros2) is not installed', allow_module_level=True)

from ament_index_python.packages import get_package_share_directory  # noqa: E402, I100
from launch import LaunchDescription  # noqa: E402
from launch.actions import IncludeLaunchDescription, SetEnvironmentVariable  # noqa: E402
from launch.launch_description_sources import PythonLaunchDescriptionSource  # noqa: E402
import launch_testing.actions  # noqa: E402

SHARE = get_package_share_directory('flashrt_ros')
POLICY = os.path.join(SHARE, 'config', 'security', 'flashrt.policy.xml')
NODE_ENCLAVE, CLIENT_ENCLAVE = '/flashrt_ros/flashrt', '/flashrt_ros/client'
KEYSTORE = tempfile.mkdtemp(prefix='flashrt_keystore_')
SECURE_ENV = {'ROS_SECURITY_KEYSTORE': KEYSTORE, 'ROS_SECURITY_ENABLE': 'true',
              'ROS_SECURITY_STRATEGY': 'Enforce'}


def _security(*args):
    subprocess.run(['ros2', 'security', *args], check=True, capture_output=True)


def _make_keystore():
    _security('create_keystore', KEYSTORE)
    for enclave in (NODE_ENCLAVE, CLIENT_ENCLAVE):
        _security('create_enclave', KEYSTORE, enclave)
        _security('create_permission', KEYSTORE, enclave, POLICY)


def _security_libraries_missing():
    """Return why a secured context cannot start here ('' when it can)."""
    code = ('import rclpy; rclpy.init(args=["--ros-args", "--enclave", "%s"]); '
            'n = rclpy.create_node("probe"); n.destroy_node(); rclpy.shutdown()' % CLIENT_ENCLAVE)
    done = subprocess.run([sys.executable, '-c', code], env=dict(os.environ, **SECURE_ENV),
                          capture_output=True, text=True, timeout=60)
    return '' if done.returncode == 0 else (done.stderr.strip().splitlines() or ['?'])[-1]


_make_keystore()
_MISSING = _security_libraries_missing()
if _MISSING:
    pytest.skip(f'a secured context does not start here ({_MISSING}); the security '
                'libraries are missing', allow_module_level=True)


@pytest.mark.launch_test
def generate_test_description():
    """Launch the node in its enclave under Enforce."""
    launch_file = os.path.join(SHARE, 'launch', 'flashrt.launch.py')
    flashrt = IncludeLaunchDescription(
        PythonLaunchDescriptionSource(launch_file),
        launch_arguments={'model': 'builtin:tiny-hybrid', 'enclave': NODE_ENCLAVE}.items())
    env = [SetEnvironmentVariable(k, v) for k, v in SECURE_ENV.items()]
    return LaunchDescription(env + [flashrt, launch_testing.actions.ReadyToTest()]), {}


class TestEnforced(unittest.TestCase):
    """Active tests: an outsider, then the client enclave."""

    def test_an_unauthenticated_peer_gets_nothing(self):
        from flashrt_ros.client import FlashRTClient
        saved = {k: os.environ.pop(k) for k in list(SECURE_ENV) if k in os.environ}
        try:
            outsider = FlashRTClient(timeout=5.0)
            try:
                self.assertFalse(outsider.wait_until_active(timeout=15.0),
                                 'an unauthenticated peer reached the node')
                with self.assertRaises(TimeoutError):
                    outsider.list_capsules()
            finally:
                outsider.close()
        finally:
            os.environ.update(saved)

    def test_the_client_enclave_is_answered(self):
        from flashrt_ros.client import FlashRTClient
        os.environ.update(SECURE_ENV)
        client = FlashRTClient(enclave=CLIENT_ENCLAVE, timeout=20.0)
        try:
            self.assertTrue(client.wait_until_active(timeout=120.0))
            self.assertTrue(client.list_capsules().success)
            self.assertTrue(client.restore('home').success)
        finally:
            client.close()
