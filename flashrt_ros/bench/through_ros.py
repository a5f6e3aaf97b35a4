"""
Figure 5: the flashrt node as a separate process, measured with bare rclpy clients.

Part A: ~/restore round-trip minus the runtime's own restore time (the response's
latency_ms), against the round-trip of a bare std_srvs/Trigger server in its own process,
calls interleaved. Part B: a turn streams tokens, an Interrupt(RESTORE home) is published
at a random point in a decode step, and the time until the node's `interrupt` event
arrives on ~/events is recorded (client side, and the node's own receipt -> restored
latency_ms from the event).

Not FlashRTClient: its background executor and futures would add their own overhead.
"""

import collections
import importlib.util
import os
import random
import shutil
import signal
import sys
import threading
import time

import numpy as np

from .common import ratio, summarize
from .trigger_server import NODE_NAME as TRIGGER_NODE
from ..node_process import ManagedProcess, NodeProcess

NODE = 'flashrt'
HOME = 'home'
START_TIMEOUT_S = 180.0
CALL_TIMEOUT_S = 10.0
WARMUP_CALLS = 20
WARMUP_TOKENS = 16
DISCOVERY_S = 1.0  # enough for localhost discovery to list the nodes of a domain


def ros_missing():
    """Return why figure 5 cannot run here ('' when it can)."""
    if importlib.util.find_spec('rclpy') is None:
        return 'rclpy is not importable; run `make setup` and `. ./env.sh`'
    try:
        import flashrt_ros.msg  # noqa: F401
    except ImportError:
        return ('the generated flashrt_ros interfaces are not importable (the source tree '
                'shadows the installed package): run `make bench`, or '
                '`python -P -m flashrt_ros.bench` after `. ./env.sh`')
    if shutil.which('flashrt_node') is None:
        return 'flashrt_node is not on PATH; run `make setup` and `. ./env.sh`'
    return ''


class _Inbox:
    """Messages with their arrival time, and a wait for the first one that matches."""

    def __init__(self):
        self.items = []
        self._cv = threading.Condition()

    def put(self, msg):
        """Record msg with the time it arrived (subscription callback)."""
        now = time.perf_counter()
        with self._cv:
            self.items.append((now, msg))
            self._cv.notify_all()

    def wait(self, predicate, start, timeout):
        """Return the first (time, msg) from index start on with predicate(msg), or None."""
        found = []

        def match():
            found[:] = [item for item in self.items[start:] if predicate(item[1])][:1]
            return bool(found)

        with self._cv:
            self._cv.wait_for(match, timeout)
        return found[0] if found else None


def _node_params(plan, device, capsule_dir):
    return {
        'model': plan.node_model, 'device': device, 'max_seq_len': 1024,
        'token_chunk': 1, 'max_new_tokens': 512, 'interrupt_policy': 'restore_home',
        'home_capsule': HOME, 'system_prompt': 'You are a helpful robot.',
        'capsule_dir': capsule_dir, 'diagnostics_period': 1.0,
    }


def _start_processes(plan, device):
    workdir = os.path.join(plan.workdir, 'ros')
    os.makedirs(workdir, exist_ok=True)
    node = NodeProcess(workdir, _node_params(plan, device, os.path.join(workdir, 'capsules')))
    server = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'trigger_server.py')
    triggers = [ManagedProcess([sys.executable, server] + flags,
                               os.path.join(workdir, f'trigger{suffix}.log'), workdir)
                for flags, suffix in (([], ''), (['--multi-threaded'], '_mt'))]
    return node, triggers


def _domain_has_node(domain, name):
    import rclpy
    from rclpy.context import Context

    context = Context()
    rclpy.init(context=context, domain_id=domain)
    try:
        probe = rclpy.create_node(f'flashrt_bench_probe_{os.getpid()}', context=context)
        time.sleep(DISCOVERY_S)
        return name in probe.get_node_names()
    finally:
        rclpy.try_shutdown(context=context)


def _isolate(log):
    """Pick a localhost DDS domain where no other flashrt node runs (children inherit it)."""
    os.environ.setdefault('ROS_AUTOMATIC_DISCOVERY_RANGE', 'LOCALHOST')
    first = int(os.environ.get('ROS_DOMAIN_ID', os.getpid() % 100 + 1))
    for k in range(10):
        domain = (first - 1 + k) % 100 + 1
        if not _domain_has_node(domain, NODE):
            break
        log(f'fig5 DDS domain {domain} already has a /{NODE} node; trying the next one')
    os.environ['ROS_DOMAIN_ID'] = str(domain)
    return domain


class _BareClient:
    """One rclpy node with plain service clients, publishers and subscriptions."""

    def __init__(self, domain_id):
        import rclpy
        from rclpy.context import Context
        from rclpy.executors import SingleThreadedExecutor

        self.context = Context()
        rclpy.init(context=self.context, domain_id=domain_id)
        self.node = rclpy.create_node(f'flashrt_bench_{os.getpid()}', context=self.context)
        self.executor = SingleThreadedExecutor(context=self.context)
        self.executor.add_node(self.node)
        self._spinner = None

    def call(self, client, request):
        """Return (round-trip seconds, response) of one call, spinning in this thread."""
        t0 = time.perf_counter()
        future = client.call_async(request)
        self.executor.spin_until_future_complete(future, timeout_sec=CALL_TIMEOUT_S)
        elapsed = time.perf_counter() - t0
        if not future.done():
            client.remove_pending_request(future)
            raise TimeoutError(f'{client.srv_name}: no answer within {CALL_TIMEOUT_S} s')
        return elapsed, future.result()

    def spin_in_background(self):
        """Process subscriptions on a thread from now on (no more call())."""
        from rclpy.executors import ExternalShutdownException

        def spin():
            try:
                self.executor.spin()
            except ExternalShutdownException:
                pass

        self._spinner = threading.Thread(target=spin, daemon=True)
        self._spinner.start()

    def close(self):
        """Stop spinning, destroy the node, shut the context down."""
        import rclpy

        self.executor.shutdown(timeout_sec=2.0)
        if self._spinner is not None:
            self._spinner.join(timeout=2.0)
        self.node.destroy_node()
        rclpy.try_shutdown(context=self.context)


def _wait_ready(client, services, node_proc):
    """Wait for every server and for the node to be active (its home capsule restores)."""
    from flashrt_ros.srv import Restore

    restore = services[0]
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and node_proc.proc.poll() is None:
        if not all(s.wait_for_service(timeout_sec=0.2) for s in services):
            continue
        _, response = client.call(restore, Restore.Request(name=HOME))
        if response.success:
            return
        time.sleep(0.2)
    raise RuntimeError(f'the node did not become active (exit code {node_proc.proc.poll()}); '
                       'node log:\n' + node_proc.log()[-3000:])


def _round_trips(client, restore, trigger, trigger_mt, n, log):
    """Interleaved calls: bare Trigger, Trigger on a multi-threaded executor, ~/restore."""
    from flashrt_ros.srv import Restore
    from std_srvs.srv import Trigger

    restore_rt, runtime, trigger_rt, trigger_mt_rt = [], [], [], []
    for i in range(WARMUP_CALLS + n):
        t_trigger, _ = client.call(trigger, Trigger.Request())
        t_trigger_mt, _ = client.call(trigger_mt, Trigger.Request())
        t_restore, response = client.call(restore, Restore.Request(name=HOME))
        if not response.success:
            raise RuntimeError(f'~/restore failed: {response.message}')
        if i >= WARMUP_CALLS:
            trigger_rt.append(t_trigger)
            trigger_mt_rt.append(t_trigger_mt)
            restore_rt.append(t_restore)
            runtime.append(response.latency_ms / 1e3)
    log(f'fig5 {n} round-trips of each service done')
    overhead = [r - s for r, s in zip(restore_rt, runtime)]
    result = {
        'restore_round_trip_ms': summarize(restore_rt, 1e3),
        'runtime_restore_ms': summarize(runtime, 1e3),
        'restore_minus_runtime_ms': summarize(overhead, 1e3),
        'trigger_round_trip_ms': summarize(trigger_rt, 1e3),
        'trigger_mt_round_trip_ms': summarize(trigger_mt_rt, 1e3),
        'trigger_server': 'bare rclpy node, SingleThreadedExecutor, in its own process',
        'trigger_mt_server': 'the same on a MultiThreadedExecutor(num_threads=6), like the '
                             'flashrt node (not the target baseline; shows the executor cost)',
    }
    result['node_added_ms'] = (result['restore_minus_runtime_ms']['median']
                               - result['trigger_round_trip_ms']['median'])
    # The same quantity paired call by call: each ~/restore call against the Trigger call
    # made just before it, so that a burst of steal time or load that hits both drops out.
    paired = [o - t for o, t in zip(overhead, trigger_rt)]
    result['node_added_paired_ms'] = float(np.median(paired)) * 1e3
    result['restore_vs_trigger'] = ratio(result['restore_round_trip_ms']['median'],
                                         result['trigger_round_trip_ms']['median'])
    return result


def _step_seconds(chunks):
    """Decode-step times from consecutive TokenChunk stamps of the same turn (node clock)."""
    by_turn = {}
    for _, chunk in chunks:
        if not chunk.final and len(chunk.token_ids) == 1:
            stamp = chunk.header.stamp.sec + chunk.header.stamp.nanosec * 1e-9
            by_turn.setdefault(chunk.turn_id, {})[chunk.index] = stamp
    steps = []
    for stamps in by_turn.values():
        steps += [stamps[i] - stamps[i - 1] for i in stamps if i - 1 in stamps]
    return steps


def _interrupts(client, n, log):
    from flashrt_ros.msg import CapsuleEvent, Interrupt, TokenChunk
    from flashrt_ros.client import COMMAND_QOS, INTERRUPT_QOS, STREAM_QOS
    from std_msgs.msg import String

    node, base = client.node, f'/{NODE}'
    tokens, events = _Inbox(), _Inbox()
    node.create_subscription(TokenChunk, f'{base}/tokens', tokens.put, STREAM_QOS)
    node.create_subscription(CapsuleEvent, f'{base}/events', events.put, STREAM_QOS)
    prompt = node.create_publisher(String, f'{base}/prompt', COMMAND_QOS)
    interrupt = node.create_publisher(Interrupt, f'{base}/interrupt', INTERRUPT_QOS)
    client.spin_in_background()
    deadline = time.monotonic() + 10.0
    while min(prompt.get_subscription_count(), interrupt.get_subscription_count()) < 1:
        if time.monotonic() > deadline:
            raise RuntimeError('the node does not subscribe to ~/prompt and ~/interrupt')
        time.sleep(0.05)
    time.sleep(0.5)  # let ~/tokens and ~/events match too

    def one_turn(i, wait_tokens):
        """Start a turn, interrupt it; return (e2e s, event, running) or what was missed."""
        t_mark, e_mark = len(tokens.items), len(events.items)
        prompt.publish(String(data=f'Interrupt me, please ({i}).'))
        first = tokens.wait(lambda m: m.index >= wait_tokens or m.final, t_mark, CALL_TIMEOUT_S)
        if first is None:
            return 'first_token'
        turn = first[1].turn_id
        time.sleep(random.uniform(0.0, step_s))  # land anywhere inside a decode step
        running = tokens.wait(lambda m: m.turn_id == turn and m.final, t_mark, 0.0) is None
        t0, published = time.perf_counter(), time.time()
        interrupt.publish(Interrupt(mode=Interrupt.RESTORE, capsule=HOME, reason='bench'))
        event = events.wait(lambda m: m.operation == 'interrupt', e_mark, CALL_TIMEOUT_S)
        final = tokens.wait(lambda m: m.turn_id == turn and m.final, t_mark, CALL_TIMEOUT_S)
        if event is None:
            return 'event'
        if final is None:  # the next prompt would queue behind this turn
            return 'final_chunk'
        # The event is stamped when the state is restored; both clocks are this host's.
        stamp = event[1].header.stamp
        restored = stamp.sec + stamp.nanosec * 1e-9 - published
        return event[0] - t0, restored, event[1], running

    step_s = 0.01
    one_turn(-1, WARMUP_TOKENS)  # warm-up turn: learn the decode-step time
    step_s = float(np.median(_step_seconds(tokens.items) or [step_s]))
    e2e, pub_to_restored, node_side, idle, failed = [], [], [], 0, 0
    missed = collections.Counter()
    for i in range(n):
        outcome = one_turn(i, 0)
        if isinstance(outcome, str):
            missed[outcome] += 1
            log(f'fig5 interrupt {i}: no {outcome.replace("_", " ")} within {CALL_TIMEOUT_S} s')
            continue
        seconds, restored, event, running = outcome
        e2e.append(seconds)
        pub_to_restored.append(restored)
        node_side.append(event.latency_ms / 1e3)
        idle += not running
        failed += not event.success
        if (i + 1) % 50 == 0:
            log(f'fig5 {i + 1}/{n} interrupts')
    if not e2e:
        raise RuntimeError(f'none of {n} interrupts got an answer on ~/events')
    steps = _step_seconds(tokens.items)
    return {
        'interrupts': n,
        'interrupt_e2e_ms': dict(summarize(e2e, 1e3), p99=_p99_ms(e2e)),
        'interrupt_published_to_restored_ms': dict(summarize(pub_to_restored, 1e3),
                                                   p99=_p99_ms(pub_to_restored)),
        'interrupt_node_ms': dict(summarize(node_side, 1e3), p99=_p99_ms(node_side)),
        'decode_step_ms': summarize(steps, 1e3),
        'interrupt_e2e_samples_ms': [s * 1e3 for s in e2e],
        'interrupt_published_to_restored_samples_ms': [s * 1e3 for s in pub_to_restored],
        'interrupt_node_samples_ms': [s * 1e3 for s in node_side],
        'missed': sum(missed.values()),
        'missed_by_what': dict(missed),
        'not_generating_when_interrupted': idle,
        'failed': failed,
    }


def _p99_ms(samples):
    return float(np.percentile(np.asarray(samples) * 1e3, 99)) if samples else None


def fig5_through_ros(plan, device, log):
    """Restore vs Trigger round-trips, and interrupt -> restored latency, over real DDS."""
    missing = ros_missing()
    if missing:
        return {'title': 'Through ROS', 'skipped': [missing]}
    from flashrt_ros.srv import Restore
    from std_srvs.srv import Trigger

    domain = _isolate(log)
    node_proc, trigger_procs = _start_processes(plan, device)
    client = None
    try:
        client = _BareClient(domain)
        services = [client.node.create_client(Restore, f'/{NODE}/restore'),
                    client.node.create_client(Trigger, f'/{TRIGGER_NODE}/trigger'),
                    client.node.create_client(Trigger, f'/{TRIGGER_NODE}_mt/trigger')]
        log(f'fig5 waiting for the node ({plan.node_model}) and the Trigger servers')
        _wait_ready(client, services, node_proc)
        result = {'title': 'Through ROS: service round-trips and interrupt -> restored',
                  'node_model': plan.node_model, 'ros_domain_id': domain}
        result.update(_round_trips(client, *services, plan.round_trips, log))
        result.update(_interrupts(client, plan.interrupts, log))
    finally:
        if client is not None:
            client.close()
        codes = [node_proc.stop()] + [p.stop(signal.SIGTERM) for p in trigger_procs]
    result['exit_codes'] = codes
    bound = (result['decode_step_ms']['median'] + result['runtime_restore_ms']['median'] + 1.0)
    result['interrupt_bound_ms'] = bound
    result['targets'] = {
        'node_added_le_0_5_ms': result['node_added_ms'] <= 0.5,
        'node_added_paired_le_0_5_ms': result['node_added_paired_ms'] <= 0.5,
        'interrupt_p99_le_bound': result['interrupt_published_to_restored_ms']['p99'] <= bound,
        'interrupt_node_p99_le_bound': result['interrupt_node_ms']['p99'] <= bound,
        'interrupt_e2e_p99_le_bound': result['interrupt_e2e_ms']['p99'] <= bound,
    }
    result['target'] = ('node adds <= 0.5 ms to a bare Trigger round-trip (median); interrupt '
                        '-> restored p99 <= one decode step + restore + 1 ms')
    return result
