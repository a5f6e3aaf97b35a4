"""
Figure 7: capsules between two node processes over loopback DDS (~/import_capsule).

Part A: capsules of about 1, 8 and 32 MiB (state of the benchmark model at growing
positions) imported from a sender node into a receiver node's host tier, timed by the
client from goal to result, the two ways an import reads the bytes on one host (the
sender's export in shared memory, the default; DDS chunks, transfer_shared_memory false,
the way between hosts), side by side with copying the same capsule's file on disk
(shutil.copyfile, page cache to page cache: the fastest local copy); the receiver's own
duration (manifest request to capsule stored, without the action's goal and result
round-trips) is reported beside it. Part B: the time from "import requested" to "restored
on the receiver" at the long context, against a cold prefill of the same tokens on the
receiver. Part C: the 32 MiB import over DDS chunks at other chunk sizes (the
transfer_chunk_bytes parameter).
"""

import os
import shutil
import time

from flashrt_ros.runtime.state.transfer import DEFAULT_CHUNK_BYTES

from .common import ratio, summarize
from .through_ros import _isolate, ros_missing, START_TIMEOUT_S
from ..node_process import NodeProcess

SENDER, RECEIVER = '/bench_left/flashrt', '/bench_right/flashrt'
TARGET_MIB = (1, 8, 32)
QUICK_TARGET_MIB = (1, 2, 4)
CHUNK_SWEEP = (64 << 10, 256 << 10, 1 << 20, 4 << 20)
PROFILE_ENV = 'FASTDDS_DEFAULT_PROFILES_FILE'
CHUNK_WITH_PROFILE = 1 << 20  # what docs/transfer.md recommends with the large-data profile


def _params(plan, device, capsule_dir, max_seq_len):
    return {'model': plan.transfer_model, 'device': device, 'max_seq_len': max_seq_len,
            'system_prompt': '', 'capsule_dir': capsule_dir, 'host_budget_bytes': 0,
            'disk_budget_bytes': 0, 'device_budget_bytes': 0, 'transfer_timeout': 60.0,
            'diagnostics_period': 5.0,
            'transfer_chunk_bytes': CHUNK_WITH_PROFILE if os.environ.get(PROFILE_ENV)
            else DEFAULT_CHUNK_BYTES}


def _start(plan, device, fqn, max_seq_len):
    from flashrt_ros.client import FlashRTClient

    namespace, name = fqn.rsplit('/', 1)
    workdir = os.path.join(plan.workdir, 'transfer', namespace.strip('/'))
    proc = NodeProcess(workdir, _params(plan, device, os.path.join(workdir, 'capsules'),
                                        max_seq_len),
                       name=name, extra_args=['-r', f'__ns:={namespace}'])
    client = FlashRTClient(name, namespace=namespace, timeout=120.0)
    if not client.wait_until_active(START_TIMEOUT_S):
        raise RuntimeError(f'{fqn} did not become active; log:\n' + proc.log()[-3000:])
    return proc, client, os.path.join(workdir, 'capsules')


def _ok(response):
    if not response.success:
        raise RuntimeError(response.message)
    return response


def _positions(state_bytes_at, mib):
    """Positions whose capsule is about `mib` MiB, from two measured sizes (linear in rows)."""
    (p0, b0), (p1, b1) = state_bytes_at
    per_token = (b1 - b0) / (p1 - p0)
    return [max(1, int(round(p0 + ((m << 20) - b0) / per_token))) for m in mib]


def large_data_profile():
    """Return the path of config/fastdds_large_data.xml (installed share/ or source tree)."""
    here = os.path.dirname(os.path.abspath(__file__))
    for up in (('..', '..', '..', '..', '..', 'share', 'flashrt_ros'), ('..', '..')):
        path = os.path.normpath(os.path.join(here, *up, 'config', 'fastdds_large_data.xml'))
        if os.path.isfile(path):
            return path
    return ''


def fig8_transfer(plan, device, log):
    """Run figure 7 in node processes of their own; return its JSON-ready dict."""
    missing = ros_missing()
    if missing:
        return {'title': 'capsule transfer between nodes', 'skipped': [missing], 'rows': []}
    saved = os.environ.get(PROFILE_ENV)
    if saved is None and large_data_profile():  # the node processes inherit it
        os.environ[PROFILE_ENV] = large_data_profile()
    try:
        return _fig8(plan, device, log)
    finally:
        if saved is None:
            os.environ.pop(PROFILE_ENV, None)


def _fig8(plan, device, log):
    from flashrt_ros.bench.measure import token_ids

    domain = _isolate(log)
    long_ctx, started = plan.transfer_context, []
    try:
        # positions of ~1/8/32 MiB, from the state size at two positions
        probe = _start(plan, device, SENDER, 64)
        started.append(probe)
        sizes = [(0, _ok(probe[1].snapshot('p0', tier='host')).capsule.size_bytes)]
        _ok(probe[1].generate(token_ids=token_ids(31, seed=7), max_new_tokens=1).result)
        sizes.append((31, _ok(probe[1].snapshot('p31', tier='host')).capsule.size_bytes))
        probe[1].close()
        probe[0].stop()
        started.remove(probe)
        targets = _positions(sizes, QUICK_TARGET_MIB if plan.quick else TARGET_MIB)
        max_seq_len = max(targets + [long_ctx]) + 64
        sender = _start(plan, device, SENDER, max_seq_len)
        started.append(sender)
        receiver = _start(plan, device, RECEIVER, max_seq_len)
        started.append(receiver)
        log(f'fig8: sender and receiver active on DDS domain {domain}; capsule positions '
            f'{targets}, long context {long_ctx}')
        left, right = sender[1], receiver[1]
        context = token_ids(max(targets), seed=11)
        done = 0
        for pos in targets:  # one growing context, a capsule at each target
            _ok(left.generate(token_ids=context[done:pos], max_new_tokens=1,
                              timeout=1800.0).result)
            done = pos + 1  # the sampled token is fed with the next ids
            _ok(left.snapshot(f'ctx{pos}', tier='host'))
            _ok(left.fork(f'ctx{pos}', f'file{pos}', tier='disk'))
        rows = [_size_row(right, sender[2], receiver[2], pos, plan.repeats) for pos in targets]
        for row in rows:
            log(f'fig8: {row["mib"]:.1f} MiB: shared memory {row["shm_mib_s"]["median"]:.0f} '
                f'MiB/s, DDS chunks {row["ros_mib_s"]["median"]:.0f} MiB/s, file copy '
                f'{row["copy_mib_s"]["median"]:.0f} MiB/s')
        handover = _handover(left, right, token_ids(long_ctx - 1, seed=13), plan.repeats, log)
        sweep = _chunk_sweep(right, f'ctx{targets[-1]}', plan.repeats)
        biggest = rows[-1]
        return {
            'title': 'capsule transfer between two node processes (loopback DDS)',
            'node_model': plan.transfer_model,
            'rmw': os.environ.get('RMW_IMPLEMENTATION', 'default (rmw_fastrtps_cpp)'),
            'fastdds_profile': os.environ.get(PROFILE_ENV, ''),
            'rows': rows, 'handover': handover, 'chunk_sweep': sweep,
            'targets': {
                'shm_ge_quarter_of_file_copy_at_32mib':
                    biggest['shm_vs_copy'] is not None and biggest['shm_vs_copy'] >= 0.25,
                'ros_ge_quarter_of_file_copy_at_32mib':
                    biggest['ros_vs_copy'] is not None and biggest['ros_vs_copy'] >= 0.25,
                'handover_ge_10x_cold_prefill':
                    handover['speedup'] is not None and handover['speedup'] >= 10.0},
        }
    finally:
        for proc, client, _ in started:
            client.close()
            proc.stop()


def _import_s(right, name, shared):
    """Import `name` once into the host tier; return (client seconds, the result)."""
    _set_param(right, 'transfer_shared_memory', shared)
    t0 = time.perf_counter()
    result = _ok(right.import_capsule(SENDER, name, name='got', tier='host', timeout=600.0))
    seconds = time.perf_counter() - t0
    via = 'via shared memory' if shared else 'via DDS chunks'
    if via not in result.message:
        raise RuntimeError(f'the import did not go {via}: {result.message}')
    _ok(right.delete_capsule('got'))
    return seconds, result


def _size_row(right, sender_dir, receiver_dir, pos, repeats):
    """Import capsule ctx<pos> both ways and copy its file, `repeats` times, interleaved."""
    samples = {'shm': [], 'shm_node': [], 'ros': [], 'node': [], 'copy': []}
    src = os.path.join(sender_dir, f'file{pos}.safetensors')
    os.makedirs(receiver_dir, exist_ok=True)
    dst = os.path.join(receiver_dir, 'copied.part')
    try:
        for _ in range(repeats):
            for key, shared in (('shm', True), ('ros', False)):
                seconds, result = _import_s(right, f'ctx{pos}', shared)
                samples[key].append(seconds)
                # the receiver's own: manifest to stored
                samples['shm_node' if shared else 'node'].append(result.duration_s)
                moved = result.transferred_bytes
            t0 = time.perf_counter()
            shutil.copyfile(src, dst)
            samples['copy'].append(time.perf_counter() - t0)
            os.unlink(dst)
    finally:
        _set_param(right, 'transfer_shared_memory', True)
    file_bytes = os.path.getsize(src)
    rate = {k: summarize([(file_bytes if k == 'copy' else moved) / s / (1 << 20) for s in v])
            for k, v in samples.items()}
    row = {'position': pos, 'transferred_bytes': moved, 'file_bytes': file_bytes,
           'mib': moved / (1 << 20)}
    for key, mib_s in (('shm', 'shm_mib_s'), ('shm_node', 'shm_node_mib_s'),
                       ('ros', 'ros_mib_s'), ('node', 'node_mib_s'), ('copy', 'copy_mib_s')):
        row[f'{key}_ms'] = summarize(samples[key], scale=1e3)
        row[mib_s] = rate[key]
    row['shm_vs_copy'] = ratio(rate['shm']['median'], rate['copy']['median'])
    row['ros_vs_copy'] = ratio(rate['ros']['median'], rate['copy']['median'])
    return row


def _handover(left, right, ids, repeats, log):
    """Request -> restored on the receiver vs a cold prefill of the same ids there."""
    _ok(left.restore('home'))
    _ok(left.generate(token_ids=ids, max_new_tokens=1, timeout=1800.0).result)
    _ok(left.snapshot('long', tier='host'))
    expected = left.state_digest()
    handover_s, cold_s = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        info = _ok(right.import_capsule(SENDER, 'long', name='handover', tier='host',
                                        timeout=600.0)).capsule
        _ok(right.restore('handover'))
        handover_s.append(time.perf_counter() - t0)
        restored_identical = right.state_digest() == expected
        _ok(right.delete_capsule('handover'))
    for _ in range(max(1, repeats // 2)):
        _ok(right.restore('home'))
        t0 = time.perf_counter()
        _ok(right.generate(token_ids=ids, max_new_tokens=1, timeout=1800.0).result)
        cold_s.append(time.perf_counter() - t0)
    a, b = summarize(handover_s, scale=1e3), summarize(cold_s, scale=1e3)
    log(f'fig8: {len(ids) + 1} tokens: import + restore {a["median"]:.0f} ms, cold prefill '
        f'{b["median"]:.0f} ms')
    return {'tokens': len(ids) + 1, 'capsule_bytes': info.size_bytes,
            'request_to_restored_ms': a, 'cold_prefill_ms': b,
            'speedup': ratio(b['median'], a['median']),
            'restored_state_identical': restored_identical,
            'cold_state_identical': right.state_digest() == expected}


def _chunk_sweep(right, name, repeats):
    """Import `name` over DDS chunks at other transfer_chunk_bytes values (the receiver's)."""
    rows = []
    _set_param(right, 'transfer_shared_memory', False)
    try:
        for chunk in CHUNK_SWEEP:
            _set_param(right, 'transfer_chunk_bytes', chunk)
            samples = []
            for _ in range(repeats):
                result = _ok(right.import_capsule(SENDER, name, name='sweep', tier='host',
                                                  timeout=600.0))
                samples.append(result.throughput_mib_s)
                _ok(right.delete_capsule('sweep'))
            rows.append({'chunk_bytes': chunk, 'node_mib_s': summarize(samples)})
    finally:
        _set_param(right, 'transfer_chunk_bytes', CHUNK_WITH_PROFILE
                   if os.environ.get(PROFILE_ENV) else DEFAULT_CHUNK_BYTES)
        _set_param(right, 'transfer_shared_memory', True)
    return rows


def _set_param(client, name, value):
    """Set an integer or bool parameter of the client's node."""
    from rcl_interfaces.msg import Parameter, ParameterType, ParameterValue
    from rcl_interfaces.srv import SetParameters

    cli = client.node.create_client(SetParameters, f'{client.base}/set_parameters')
    try:
        value = (ParameterValue(type=ParameterType.PARAMETER_BOOL, bool_value=value)
                 if isinstance(value, bool) else
                 ParameterValue(type=ParameterType.PARAMETER_INTEGER, integer_value=value))
        request = SetParameters.Request(parameters=[Parameter(name=name, value=value)])
        if not client._call(cli, request).results[0].successful:
            raise RuntimeError(f'the receiver refused {name}')
    finally:
        client.node.destroy_client(cli)
