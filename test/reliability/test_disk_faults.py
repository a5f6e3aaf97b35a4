"""SIGKILL during disk writes, and a full filesystem (RLIMIT_FSIZE: writes fail with EFBIG)."""

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

from flashrt_ros.runtime import Runtime, RuntimeConfig
from flashrt_ros.runtime.state import disk
import pytest
from test_soak import report

KILLS = 5
PROMPT = [5 + i % 250 for i in range(3000)]  # tiny-llama: 1.5 KB of KV a token, ~4.6 MB
CONFIG = {'model': 'builtin:tiny-llama', 'max_seq_len': 4096, 'rollback_depth': 0}

# The writer: restore the newest capsule, then forever decode one token and snapshot the
# state to disk under one name, saying which digest it writes before and after each write.
WRITER = textwrap.dedent("""
    import sys
    from flashrt_ros.runtime import Runtime, RuntimeConfig
    rt = Runtime(RuntimeConfig(capsule_dir=sys.argv[1], **eval(sys.argv[2])))
    names = {c.name for c in rt.list_capsules()}
    rt.restore('big' if 'big' in names else 'seed')
    while True:
        list(rt.generate(max_new_tokens=1, stop=(), eos=False))
        digest = rt.state_digest()
        print('writing', digest, flush=True)
        rt.snapshot('big', 'disk')
        print('done', digest, flush=True)
""")


def temps(directory):
    return [n for n in os.listdir(directory) if n.endswith('.tmp')]


def kill_mid_write(capsule_dir, rng):
    """Start the writer, SIGKILL it while a temp file is being written; return its lines."""
    proc = subprocess.Popen([sys.executable, '-c', WRITER, str(capsule_dir), repr(CONFIG)],
                            stdout=subprocess.PIPE, text=True)
    try:
        lines, wanted = [], rng.randint(1, 3)  # let 0..2 writes complete first
        while len(lines) < 2 * wanted - 1:
            line = proc.stdout.readline()
            assert line, 'the writer exited early'
            lines.append(line.split())
        before = set(temps(capsule_dir))
        deadline = time.monotonic() + 30.0
        while not set(temps(capsule_dir)) - before:  # the write's temp file exists
            assert time.monotonic() < deadline, 'no disk write started within 30 s'
            time.sleep(0.0005)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        lines += [line.split() for line in proc.stdout.read().splitlines()]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    return lines


# Each writer is a fresh process that loads torch and the model: a loaded machine needs
# minutes for the five kills, more than the suite's default limit.
@pytest.mark.timeout(1200)
def test_sigkill_during_disk_writes(surroundings):
    capsule_dir = surroundings.capsule_dir
    rt = Runtime(RuntimeConfig(capsule_dir=str(capsule_dir), **CONFIG))
    rt.prefill(PROMPT)
    seed = rt.snapshot('seed', 'disk')
    rt.close()
    rng, t0 = random.Random(17), time.monotonic()
    complete, in_flight = None, None
    for _ in range(KILLS):
        for word, digest in kill_mid_write(capsule_dir, rng):
            if word == 'done':
                complete = digest
            else:
                in_flight = digest
    wall = time.monotonic() - t0

    rt = Runtime(RuntimeConfig(capsule_dir=str(capsule_dir), **CONFIG))
    try:
        listed = {c.name for c in rt.list_capsules()}
        assert listed == {'seed', 'big'}, listed
        for name in listed:
            rt.verify_capsule(name)
        rt.restore('big')
        # The kill may land after the rename and before 'done' was printed: then the file
        # holds the write in flight, complete and checksummed.
        assert rt.state_digest() in (complete, in_flight)
        left = temps(capsule_dir)
        # The store's rule: a temp file younger than STALE_TEMP_S may be another process's
        # write in progress and is left alone (never listed); an older one is removed.
        for name in left:
            old = time.time() - disk.STALE_TEMP_S - 60
            os.utime(capsule_dir / name, (old, old))
    finally:
        rt.close()
    Runtime(RuntimeConfig(capsule_dir=str(capsule_dir), **CONFIG)).close()
    assert temps(capsule_dir) == []
    report('sigkill', kills=KILLS, capsule_bytes=seed.nbytes, temp_files_left=len(left),
           wall_s=round(wall, 1))


FULL_DISK = textwrap.dedent("""
    import json, resource, sys
    from flashrt_ros.runtime import FlashRTError, Runtime, RuntimeConfig
    rt = Runtime(RuntimeConfig(capsule_dir=sys.argv[1], **eval(sys.argv[2])))
    rt.prefill([5 + i % 250 for i in range(50)])
    small = rt.snapshot('cap', 'disk')
    small_digest = rt.state_digest()
    rt.prefill([5 + i % 250 for i in range(400)])
    live = rt.state_digest()
    resource.setrlimit(resource.RLIMIT_FSIZE, (small.nbytes * 2, small.nbytes * 2))
    out = {}
    for name in ('cap', 'new'):
        try:
            rt.snapshot(name, 'disk')
            out[name] = 'written'
        except FlashRTError as exc:
            out[name] = str(exc)
        out[name + '_state_kept'] = rt.state_digest() == live
    out['listed'] = sorted(c.name for c in rt.list_capsules())
    rt.verify_capsule('cap')
    rt.restore('cap')
    out['cap_intact'] = rt.state_digest() == small_digest
    print(json.dumps(out))
""")


def test_full_filesystem(surroundings):
    capsule_dir = surroundings.capsule_dir
    done = subprocess.run([sys.executable, '-c', FULL_DISK, str(capsule_dir), repr(CONFIG)],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    for name in ('cap', 'new'):
        assert 'could not be written' in out[name] and 'File too large' in out[name], out
        assert out[name + '_state_kept'], f'a failed snapshot of {name!r} changed the state'
    assert out['listed'] == ['cap'] and out['cap_intact'], out
    assert os.listdir(capsule_dir) == ['cap.safetensors']  # no temp file left behind
    report('full_filesystem', refused=2, rlimit_fsize='2x the existing capsule')
