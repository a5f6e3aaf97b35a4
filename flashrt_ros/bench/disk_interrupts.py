"""
Figure fig5disk: interrupt latency over ROS while a 30 MB disk snapshot is written, and without.

A flashrt node process runs `builtin:bench-big-state` (a state of about 30 MB). Every round
publishes one Interrupt, RESTORE of the device capsule `home`, RESTORE of the disk capsule
`home_disk` or STOP (nothing generates, so a STOP is the interrupt path alone), and
records the time until the node's `interrupt` event arrives on ~/events (client side) and
the node's own received -> done latency_ms from the event. In a loaded round a ~/snapshot
of the live state to the disk tier is requested first and the interrupt is published once
that write's temp file is in capsule_dir, i.e. while the file is written. Quiet and loaded
rounds alternate in one run; the ratio of their medians (and p99s) is reported per mode.
"""

import os
import random
import threading
import time

from .common import ratio, summarize
from .through_ros import _BareClient, _Inbox, _isolate, _p99_ms, _wait_ready, CALL_TIMEOUT_S
from ..node_process import NodeProcess

NODE = 'flashrt'
MODEL = 'builtin:bench-big-state'
LOAD = 'disk_load'  # the capsule the loaded rounds write
MODES = ('restore_device', 'restore_disk', 'stop')


def _params(device, capsule_dir):
    return {'model': MODEL, 'device': device, 'max_seq_len': 256, 'home_capsule': 'home',
            'system_prompt': 'You are a helpful robot.', 'capsule_dir': capsule_dir,
            'disk_budget_bytes': 0, 'diagnostics_period': 1.0}


def _call(service, request, timeout=CALL_TIMEOUT_S * 6):
    """Call a service while the executor spins on another thread; return the response."""
    done = threading.Event()
    future = service.call_async(request)
    future.add_done_callback(lambda _: done.set())
    if not done.wait(timeout):
        raise TimeoutError(f'{service.srv_name}: no answer within {timeout} s')
    return future.result()


def _writing(capsule_dir):
    """Whether a temp file of the load capsule's write is in capsule_dir now."""
    try:
        return any(n.startswith(f'.{LOAD}.w-') for n in os.listdir(capsule_dir))
    except OSError:
        return False


def _round(client, services, capsule_dir, mode, loaded):
    """One interrupt; return (e2e s, node s, overlapped) or the name of what was missed."""
    from flashrt_ros.msg import Interrupt
    from flashrt_ros.srv import Snapshot

    snapshot, interrupt, events = services
    saver = None
    if loaded:
        answers = []
        saver = threading.Thread(target=lambda: answers.append(
            _call(snapshot, Snapshot.Request(name=LOAD, tier='disk'))))
        saver.start()
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while not _writing(capsule_dir):
            if time.monotonic() > deadline or not saver.is_alive():
                saver.join()
                return 'write_not_seen'
            time.sleep(0.0002)
    msg = {'restore_device': Interrupt(mode=Interrupt.RESTORE, capsule='home', reason='bench'),
           'restore_disk': Interrupt(mode=Interrupt.RESTORE, capsule='home_disk',
                                     reason='bench'),
           'stop': Interrupt(mode=Interrupt.STOP, reason='bench')}[mode]
    mark = len(events.items)
    t0 = time.perf_counter()
    interrupt.publish(msg)
    event = events.wait(lambda m: m.operation == 'interrupt', mark, CALL_TIMEOUT_S)
    overlapped = loaded and _writing(capsule_dir)  # the write still ran when it answered
    if saver is not None:
        saver.join()
        if not (answers and answers[0].success):
            raise RuntimeError(f'the disk snapshot failed: {answers}')
    if event is None:
        return 'event'
    if not event[1].success:
        raise RuntimeError(f'interrupt {mode} failed: {event[1].message}')
    return event[0] - t0, event[1].latency_ms / 1e3, overlapped


def _cell(samples):
    e2e = [s[0] for s in samples]
    node = [s[1] for s in samples]
    return {'e2e_ms': dict(summarize(e2e, 1e3), p99=_p99_ms(e2e)),
            'node_ms': dict(summarize(node, 1e3), p99=_p99_ms(node))}


def fig5_disk_interrupts(plan, device, log):
    """Interrupts with and without a 30 MB disk snapshot being written, side by side."""
    from .through_ros import ros_missing

    missing = ros_missing()
    if missing:
        return {'title': 'Interrupts during a disk snapshot', 'skipped': [missing]}
    from flashrt_ros.msg import CapsuleEvent, Interrupt
    from flashrt_ros.client import INTERRUPT_QOS, STREAM_QOS
    from flashrt_ros.srv import Restore, Snapshot

    domain = _isolate(log)
    workdir = os.path.join(plan.workdir, 'ros-disk')
    capsule_dir = os.path.join(workdir, 'capsules')
    node_proc = NodeProcess(workdir, _params(device, capsule_dir))
    client, result = None, {'title': 'Interrupts over ROS while a 30 MB disk snapshot is written'}
    rounds = max(3, plan.interrupts // 4)
    try:
        client = _BareClient(domain)
        node = client.node
        restore = node.create_client(Restore, f'/{NODE}/restore')
        snapshot = node.create_client(Snapshot, f'/{NODE}/snapshot')
        log(f'fig5disk waiting for the node ({MODEL})')
        for _ in range(10):  # the node may not answer while it loads and activates
            try:
                _wait_ready(client, [restore, snapshot], node_proc)
                break
            except TimeoutError as exc:
                log(f'fig5disk {exc}; waiting on')
        _, home = client.call(snapshot, Snapshot.Request(name='home_disk', tier='disk'))
        if not home.success:
            raise RuntimeError(f'snapshot home_disk: {home.message}')
        events = _Inbox()
        node.create_subscription(CapsuleEvent, f'/{NODE}/events', events.put, STREAM_QOS)
        interrupt = node.create_publisher(Interrupt, f'/{NODE}/interrupt', INTERRUPT_QOS)
        client.spin_in_background()
        deadline = time.monotonic() + 10.0
        while interrupt.get_subscription_count() < 1:
            if time.monotonic() > deadline:
                raise RuntimeError('the node does not subscribe to ~/interrupt')
            time.sleep(0.05)
        time.sleep(0.5)  # let ~/events match too
        services = (snapshot, interrupt, events)
        cells = {(m, loaded): [] for m in MODES for loaded in (False, True)}
        missed, overlapped = {}, 0
        order = [(m, loaded) for m in MODES for loaded in (False, True)]
        for _ in range(2):  # warm-up: one of each, not recorded
            for m, loaded in order:
                _round(client, services, capsule_dir, m, loaded)
        for i in range(rounds):
            random.shuffle(order)
            for m, loaded in order:
                outcome = _round(client, services, capsule_dir, m, loaded)
                if isinstance(outcome, str):
                    missed[outcome] = missed.get(outcome, 0) + 1
                    continue
                cells[(m, loaded)].append(outcome)
                overlapped += outcome[2]
            log(f'fig5disk {i + 1}/{rounds} rounds')
        result.update({'node_model': MODEL, 'ros_domain_id': domain,
                       'disk_snapshot_bytes': home.capsule.size_bytes, 'rounds': rounds,
                       'missed_by_what': missed,
                       'loaded_answered_during_the_write': overlapped})
        result['rows'] = []  # one per mode (the report's table and plot)
        for m in MODES:
            quiet, loaded = _cell(cells[(m, False)]), _cell(cells[(m, True)])
            result['rows'].append({
                'mode': m, 'quiet': quiet, 'during_disk_write': loaded,
                'ratio_median': ratio(loaded['e2e_ms']['median'], quiet['e2e_ms']['median']),
                'ratio_p99': ratio(loaded['e2e_ms']['p99'], quiet['e2e_ms']['p99']),
                'node_ratio_median': ratio(loaded['node_ms']['median'],
                                           quiet['node_ms']['median'])})
    finally:
        if client is not None:
            client.close()
        result['exit_code'] = node_proc.stop()
    return result
