"""Helpers of the reliability suite: process figures, untouched-surroundings checks, nodes."""

import contextlib
import importlib.util
import os
from pathlib import Path
import shutil
import time

import pytest

HOME = 'home'
NODE_PARAMS = {
    'model': 'builtin:tiny-hybrid',
    'max_seq_len': 256,             # bounds a goal with a huge max_new_tokens
    'interrupt_policy': 'restore_home',
    'max_new_tokens': 8,
    'token_chunk': 1,
    'diagnostics_period': 1.0,
    'system_prompt': 'You are a helpful robot.',
}
POLICY_PARAMS = {'mode': 'policy', 'model': 'builtin:tiny-policy', 'max_seq_len': 256,
                 'diagnostics_period': 1.0}


def proc_figures(pid='self'):
    """Return {'rss_kb', 'fds', 'threads'} of process `pid` from /proc."""
    status = {}
    with open(f'/proc/{pid}/status') as f:
        for line in f:
            key, _, value = line.partition(':')
            status[key] = value.split()
    return {'rss_kb': int(status['VmRSS'][0]), 'fds': len(os.listdir(f'/proc/{pid}/fd')),
            'threads': int(status['Threads'][0])}


def tree(path, recursive=True):
    """Return {relative path: (size, mtime_ns)} of everything under `path`."""
    out = {}
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            full = os.path.join(root, name)
            st = os.lstat(full)
            out[os.path.relpath(full, path)] = (st.st_size, st.st_mtime_ns)
        if not recursive:
            break
    return out


class Surroundings:
    """
    A capsule dir with a sibling folder and files beside it in the parent.

    The sibling holds a planted model.safetensors and the parent a stray capsule-like file:
    the store must not count, move or delete either. assert_untouched compares
    (path, size, mtime) of the sibling (recursive) and of the parent's other entries.
    """

    def __init__(self, root: Path):
        self.root = root
        self.capsule_dir = root / 'capsules'
        self.sibling = root / 'sibling'
        self.sibling.mkdir(parents=True)
        self.capsule_dir.mkdir()
        (self.sibling / 'model.safetensors').write_bytes(os.urandom(4096))
        (self.sibling / 'notes.txt').write_text('not a capsule\n')
        (root / 'stray.safetensors').write_bytes(os.urandom(1024))
        self.before = self._take()

    def _take(self):
        parent = tree(self.root, recursive=False)
        parent.pop('capsules')  # its own mtime changes with every capsule written
        return parent, tree(self.sibling)

    def assert_untouched(self):
        """Fail if anything outside the capsule dir was added, removed or changed."""
        parent, sibling = self._take()
        assert parent == self.before[0], 'the capsule dir parent changed'
        assert sibling == self.before[1], 'the sibling directory changed'


def ros_ready():
    """Return True when rclpy, the generated interfaces and the installed node are there."""
    return (importlib.util.find_spec('rclpy') is not None
            and importlib.util.find_spec('flashrt_ros.msg') is not None
            and shutil.which('flashrt_node') is not None)


@contextlib.contextmanager
def running_node(workdir, capsule_dir, params=None, name='flashrt'):
    """Start flashrt_node `name` with `params` (NODE_PARAMS); yield (process, client)."""
    if not ros_ready():
        pytest.skip('rclpy, the generated interfaces or the installed flashrt_node are '
                    'missing; run through `make reliability`')
    from flashrt_ros.client import FlashRTClient
    from flashrt_ros.node_process import NodeProcess
    proc = NodeProcess(str(workdir), dict(params or NODE_PARAMS, capsule_dir=str(capsule_dir)),
                       name=name)
    client = None
    try:
        client = FlashRTClient(name, timeout=20.0)
        if not client.wait_until_active(timeout=120.0):
            pytest.fail(f'the node did not become active; log:\n{proc.log()[-4000:]}')
        yield proc, client
        assert proc.proc.poll() is None, f'the node exited; log:\n{proc.log()[-4000:]}'
    finally:
        if client is not None:
            client.close()
        proc.stop()


def wait_restore_home(client, timeout=10.0):
    """Restore home (retrying while a leftover turn ends); return the live digest."""
    deadline = time.monotonic() + timeout
    while not (response := client.restore(HOME)).success and time.monotonic() < deadline:
        time.sleep(0.1)
    assert response.success, response.message
    return client.state_digest()


def growth(samples, key, warmup=1):
    """Return the growth of `key` from the first sample after warm-up to the last."""
    return samples[-1][key] - samples[warmup][key]
