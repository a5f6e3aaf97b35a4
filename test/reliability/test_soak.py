"""Soak: 10,000 runtime and 2,000 ROS snapshot/restore cycles with RSS, fds and threads sampled."""

import json
import os
import time

from flashrt_ros.runtime import FlashRTError, Runtime, RuntimeConfig
import pytest
from reliability_harness import growth, HOME, proc_figures, running_node, wait_restore_home

RUNTIME_CYCLES = 10_000
ROS_CYCLES = 2_000
# Growth allowed from the sample after warm-up to the last one. Measured growth (see
# docs/benchmarks.md, Reliability) is under 2 MB: allocator and DDS buffers settling, not a
# leak (one 69 KB capsule leaked per cycle would be 680 MB over the runtime soak).
RSS_TOLERANCE_KB = 8 * 1024
ROS_RSS_TOLERANCE_KB = 16 * 1024  # rclpy/DDS buffers settle more slowly than the runtime
# The node's executor (6 workers, spin.PoolExecutor) starts its pool threads lazily, one more each
# time callbacks overlap: up to 6 may appear after warm-up; a thread leaked per call would
# be hundreds.
ROS_THREADS_TOLERANCE = 6
FIGURES = os.environ.get('FLASHRT_RELIABILITY_FIGURES')  # a JSON-lines file for the docs


def report(part, **figures):
    """Print the part's figures and append them to FLASHRT_RELIABILITY_FIGURES if set."""
    print(part, figures)
    if FIGURES:
        with open(FIGURES, 'a') as f:
            f.write(json.dumps({'part': part, **figures}) + '\n')


def check_refusal_keeps_state(call, digest_of):
    """Run a call that must be refused; assert the live state did not change."""
    before = digest_of()
    with pytest.raises(FlashRTError):
        call()
    assert digest_of() == before


def test_runtime_soak(surroundings):
    rt = Runtime(RuntimeConfig(model='builtin:tiny-hybrid', max_seq_len=128, rollback_depth=4,
                               capsule_dir=str(surroundings.capsule_dir)))
    try:
        rt.prefill('The robot arm picks up the red cube and')
        digest = rt.state_digest()
        samples, t0 = [proc_figures()], time.monotonic()
        for i in range(1, RUNTIME_CYCLES + 1):
            # device every cycle; host every 50th, disk every 500th (fsync: 40 ms each)
            tier = 'disk' if i % 500 == 0 else 'host' if i % 50 == 0 else 'device'
            rt.snapshot(f'soak-{tier}', tier)
            rt.restore(f'soak-{tier}')
            if i % 1000 == 0:
                assert rt.state_digest() == digest, f'cycle {i}: restore is not byte-exact'
                check_refusal_keeps_state(lambda: rt.restore('missing'), rt.state_digest)
                samples.append(proc_figures())
        wall = time.monotonic() - t0
        assert {c.name for c in rt.list_capsules()} == {'soak-device', 'soak-host', 'soak-disk'}
    finally:
        rt.close()
    report('runtime_soak', cycles=RUNTIME_CYCLES, wall_s=round(wall, 1), first=samples[0],
           after_warmup=samples[1], last=samples[-1])
    assert growth(samples, 'rss_kb') < RSS_TOLERANCE_KB, samples
    assert growth(samples, 'fds') <= 0, samples
    assert growth(samples, 'threads') <= 0, samples


def test_ros_soak(tmp_path, surroundings):
    with running_node(tmp_path / 'node', surroundings.capsule_dir) as (proc, client):
        digest = wait_restore_home(client)
        samples, t0 = [proc_figures(proc.pid)], time.monotonic()
        for i in range(1, ROS_CYCLES + 1):
            response = client.snapshot('soak', 'disk' if i % 250 == 0 else 'device')
            assert response.success, response.message
            response = client.restore('soak')
            assert response.success, response.message
            if i % 200 == 0:
                assert client.state_digest() == digest, f'cycle {i}: restore is not byte-exact'
                assert not client.restore('missing').success
                assert client.state_digest() == digest, 'a refused restore changed the state'
                samples.append(proc_figures(proc.pid))
        wall = time.monotonic() - t0
        assert client.restore(HOME).success  # still answering
    report('ros_soak', cycles=ROS_CYCLES, wall_s=round(wall, 1), first=samples[0],
           after_warmup=samples[1], last=samples[-1])
    assert growth(samples, 'rss_kb') < ROS_RSS_TOLERANCE_KB, samples
    assert growth(samples, 'fds') <= 0, samples
    assert growth(samples, 'threads') <= ROS_THREADS_TOLERANCE, samples
