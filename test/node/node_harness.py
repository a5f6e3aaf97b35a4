"""Helpers of the node tests: the installed flashrt_node as a process, clients, events."""

import os
import shutil
import signal
import subprocess
import time

import pytest
import yaml

HOME = 'home'
NODE_A_PARAMS = {
    'model': 'builtin:tiny-hybrid',
    'max_seq_len': 1024,
    'host_budget_bytes': 400000,       # room for a few host capsules: the full-budget test
    'interrupt_policy': 'restore_home',
    'max_new_tokens': 16,
    'token_chunk': 1,
    'diagnostics_period': 0.5,
    'system_prompt': 'You are a helpful robot.',
}


class NodeProcess:
    """The installed flashrt_node executable running in its own process."""

    def __init__(self, workdir, params, name='flashrt'):
        self.name = name
        os.makedirs(workdir, exist_ok=True)
        params_file = os.path.join(workdir, f'{name}.yaml')
        with open(params_file, 'w') as f:
            # '/**' matches this process's node whatever its name: the file is passed to it alone.
            yaml.safe_dump({'/**': {'ros__parameters': params}}, f)
        self.log_path = os.path.join(workdir, f'{name}.log')
        cmd = [shutil.which('flashrt_node'), '--ros-args', '--params-file', params_file]
        if name != 'flashrt':
            cmd += ['-r', f'__node:={name}']
        self._log = open(self.log_path, 'w')
        # cwd outside the source tree, so `flashrt_ros` imports from the installed package.
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     cwd=workdir)

    def stop(self, sig=signal.SIGINT, timeout=30.0):
        """Send `sig`, wait for the exit and return the exit code (kill after timeout)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode

    def log(self):
        """Return what the node printed so far."""
        with open(self.log_path) as f:
            return f.read()


def start_client(node='flashrt', timeout=20.0):
    """Return a FlashRTClient with its own rclpy context."""
    from flashrt_ros.client import FlashRTClient
    return FlashRTClient(node, timeout=timeout)


def wait_active(client, proc, timeout=120.0):
    """Wait until the node is active; fail with its log otherwise."""
    if not client.wait_until_active(timeout=timeout):
        code = proc.proc.poll()
        pytest.fail(f'node {proc.name} did not become active (exit code {code}); log:\n'
                    + proc.log()[-4000:])


class EventLog:
    """Collect CapsuleEvent messages and wait for one that matches."""

    def __init__(self, client):
        self.events = []
        self._sub = client.subscribe_events(self.events.append)
        self._client = client
        time.sleep(0.3)  # let the subscription match the node's publisher

    def wait_for(self, predicate, timeout=10.0, start=0):
        """Return the first event from index `start` on that satisfies predicate, or None."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for event in self.events[start:]:
                if predicate(event):
                    return event
            time.sleep(0.02)
        return None

    def close(self):
        """Destroy the subscription."""
        self._client.node.destroy_subscription(self._sub)
