"""
The `make demo` session: what execution-state capsules buy a robot stack, over ROS 2.

Starts the flashrt node as a process on the embedded model (a small tabletop robot
assistant, docs/default-model.md), then, as a client over DDS: prefill the scene as the
system prompt and snapshot `home` (the node does that at activation); stream the plan for an
instruction; interrupt plans mid-way and time interrupt -> restored state; fork a branch and
give each branch a different instruction; restore `home` and show the same instruction gives
the same plan, token for token; save the conversation to disk, restart the node, restore
from disk and continue it. Prints a short report, stops the node by PID and exits 0 when
every check holds.
"""

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time

from flashrt_ros.node_process import NodeProcess
from flashrt_ros.robot_corpus import plan_is_right, system_prompt

SCENE = {'red cup': 'table', 'blue block': 'table', 'green ball': 'left tray',
         'white bowl': 'shelf'}
SYSTEM_PROMPT = system_prompt(SCENE)
INSTRUCTION = ('pick up the red cup and put it on the right tray', 'red cup', 'right tray')
BRANCH_A = ('put the blue block in the bin', 'blue block', 'bin')
BRANCH_B = ('move the white bowl to the plate', 'white bowl', 'plate')  # held out in training
CORRECTION = ('no, put it in the box', 'red cup', 'box')  # "it": the red cup, said earlier
PLAN_TOKENS = 200  # a plan is about 150 bytes (one token each) and ends the turn itself
INTERRUPTS = 20  # barge-ins timed (each a turn interrupted mid-reply)
# The control path as a robot would run it (docs/setup.md): SCHED_FIFO for the control
# thread, a core left to it, idle cores kept out of sleep states (refused without rtprio or
# access to /dev/cpu_dma_latency: a warning, and it runs on without).
ROBOT_SETTINGS = {'control_priority': 50, 'compute_threads': max(1, (os.cpu_count() or 2) - 1),
                  'cpu_latency_us': 0}


class _Report:
    """Numbered report lines plus a tally of the checks."""

    def __init__(self):
        self.failures = []
        self.step = 0

    def section(self, title):
        self.step += 1
        print(f'\n[{self.step}] {title}', flush=True)

    def line(self, text):
        print(f'    {text}', flush=True)

    def check(self, ok, text):
        mark = 'ok ' if ok else 'FAIL'
        print(f'    [{mark}] {text}', flush=True)
        if not ok:
            self.failures.append(text)
        return ok


def _shown(text, limit=60):
    """Printable excerpt of model output (control characters and stray bytes escaped)."""
    shown = text.encode('unicode_escape').decode('ascii')
    return '"' + shown[:limit] + ('...' if len(shown) > limit else '') + '"'


def _start(workdir, params, report, label):
    from flashrt_ros.client import FlashRTClient
    t0 = time.monotonic()
    node = NodeProcess(workdir, params)
    client = FlashRTClient('flashrt', timeout=30.0)
    if not client.wait_until_active(timeout=180.0):
        client.close()
        code = node.stop()
        tail = node.log()[-3000:]
        raise RuntimeError(f'the node did not become active (exit code {code}); log:\n{tail}')
    # The mode's inputs too: a policy node's observations, a speech node's audio.
    client.wait_for_subscribers(10.0, {'policy': 'observation', 'speech': 'audio'}.get(
        params.get('mode'), ''))
    report.line(f'{label}: node pid {node.pid} active in {time.monotonic() - t0:.1f} s')
    return node, client


def _plan(client, report, label, task, trained, **kwargs):
    """Send an instruction, print the reply's lines, check it names the object and place."""
    text, obj, place = task
    outcome = client.generate(text, max_new_tokens=PLAN_TOKENS, **kwargs)
    report.line(f'{label}"{text}" ->')
    for line in outcome.result.text.splitlines():
        report.line(f'    {_shown(line, 70)[1:-1]}')
    report.check(outcome.result.success, 'reply complete')
    if trained:  # a random-weight built-in's text means nothing
        report.check(plan_is_right(outcome.result.text, obj, place),
                     f'the plan takes the {obj} to the {place}')
    return outcome


def _run_session(client, report, events, trained):
    from flashrt_ros.msg import Interrupt

    report.section('Prefill the scene as the system prompt and snapshot `home` (at activation)')
    home = {c.name: c for c in client.list_capsules().capsules}['home']
    report.line(f'scene: {_shown(SYSTEM_PROMPT, 200)}')
    report.line(f'home: {home.position} tokens of system prompt, {home.size_bytes} bytes on '
                f'{home.tier}, components {", ".join(home.components)}')
    home_digest = client.state_digest()

    report.section('An instruction: the reply streams as a numbered plan')
    streamed = []
    first = _plan(client, report, '', INSTRUCTION, trained,
                  feedback_callback=lambda c: streamed.append(c.text))
    r = first.result
    report.line(f'streamed in {len(first.chunks)} chunks; {len(r.token_ids)} tokens, time to '
                f'first token {r.time_to_first_token_ms:.1f} ms, {r.tokens_per_second:.0f} '
                'tokens/s')
    report.check(''.join(streamed) == r.text, 'the streamed chunks are the reply')

    report.section('Interrupt mid-plan (barge-in) and restore `home`')
    latencies, stages, stopped, event, reasons = [], [], None, None, []
    for _ in range(INTERRUPTS):
        assert client.restore('home').success
        start = len(events)
        run = client.start_generate(INSTRUCTION[0], max_new_tokens=400)
        deadline = time.monotonic() + 30.0
        while sum(len(c.token_ids) for c in run.chunks) < 60 and time.monotonic() < deadline:
            time.sleep(0.005)
        client.interrupt(mode=Interrupt.RESTORE, capsule='home', reason='barge-in')
        stopped = run.result(30.0)
        reasons.append('rejected' if stopped.result is None else stopped.result.stop_reason)
        event = _wait_event(events, start, 'interrupt')
        if event is None or not event.success:
            break
        latencies.append(event.latency_ms)
        stages.append(dict(zip(event.stage_names, event.stage_ms)))
    report.line(f'cut after {len(stopped.result.token_ids)} tokens (stop reason '
                f'{stopped.result.stop_reason}): {_shown(stopped.result.text, 90)}')
    if latencies:
        order = sorted(range(len(latencies)), key=latencies.__getitem__)
        middle = stages[order[len(order) // 2]]
        report.line(f'interrupt -> restored state, from message receipt, {len(latencies)} '
                    f'interrupts: median {latencies[order[len(order) // 2]]:.2f} ms, max '
                    f'{latencies[order[-1]]:.2f} ms (a capsule of {event.size_bytes} bytes; '
                    'the rows it shares with the live state are not copied)')
        report.line('  the median one, ms after receipt: ' + ', '.join(
            f'{name} {ms:.2f}' for name, ms in middle.items()))
    report.check(len(latencies) == INTERRUPTS, 'every interrupt event reports success')
    report.check(len(stopped.result.token_ids) < len(first.token_ids)
                 and reasons == ['interrupted'] * INTERRUPTS,
                 'every plan was cut before its end')
    report.check(client.state_digest() == home_digest,
                 'live state is byte-identical to `home` (state digest)')

    report.section('Fork a branch; each branch gets its own instruction')
    base = client.generate(INSTRUCTION[0], start_from='home', save_as='branch_a',
                           max_new_tokens=PLAN_TOKENS)
    report.line(f'branch_a: `home` + "{INSTRUCTION[0]}" + its plan '
                f'({len(base.token_ids)} tokens)')
    fork = client.fork('branch_a', 'branch_b')
    report.line(f'fork branch_a -> branch_b: {fork.latency_ms:.3f} ms, '
                f'{fork.capsule.size_bytes} bytes')
    a1 = _plan(client, report, 'branch_a: ', BRANCH_A, trained, start_from='branch_a')
    b1 = _plan(client, report, 'branch_b: ', BRANCH_B, trained, start_from='branch_b')
    a2 = client.generate(BRANCH_A[0], start_from='branch_a', max_new_tokens=PLAN_TOKENS)
    report.check(fork.success and a1.token_ids == a2.token_ids,
                 'branch_a answers identically after branch_b ran (independent)')
    report.check(a1.token_ids != b1.token_ids, 'the branches diverge on different input')

    report.section('Restore `home` and give the same instruction again')
    restore = client.restore('home')
    again = client.generate(INSTRUCTION[0], max_new_tokens=PLAN_TOKENS)
    report.line(f'restore home: {restore.latency_ms:.3f} ms')
    same = sum(x == y for x, y in zip(again.token_ids, first.token_ids))
    report.check(again.token_ids == first.token_ids,
                 f'the plan is token-identical to the first one ({same}/'
                 f'{len(first.token_ids)})')

    report.section('Save the conversation to disk')
    assert client.restore('home').success
    assert client.generate(INSTRUCTION[0], max_new_tokens=PLAN_TOKENS).result.success
    snap = client.snapshot('session', tier='disk')
    report.line(f'snapshot session -> disk: {snap.capsule.size_bytes} bytes, '
                f'{snap.latency_ms:.2f} ms (checksummed, written atomically)')
    report.check(snap.success, 'disk snapshot taken')
    session_digest = client.state_digest()
    reference = client.generate(CORRECTION[0], max_new_tokens=PLAN_TOKENS)
    return session_digest, reference.token_ids


def _wait_event(events, start, operation, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for event in events[start:]:
            if event.operation == operation:
                return event
        time.sleep(0.01)
    return None


def _restart_and_restore(node, client, workdir, params, report, session_digest, reference,
                         trained):
    report.section('Restart the node and restore from disk')
    client.close()
    code = node.stop()
    report.check(code == 0, f'node stopped with SIGINT, exit code {code}')
    node, client = _start(workdir, params, report, 'restarted')
    listed = {c.name: c for c in client.list_capsules().capsules}
    report.check('session' in listed and listed['session'].tier == 'disk',
                 'the new process finds `session` in the capsule directory')
    restore = client.restore('session')
    report.line(f'restore session from disk: {restore.latency_ms:.2f} ms '
                f'(read + checksum verify + copy)')
    report.check(restore.success and client.state_digest() == session_digest,
                 'restored state is byte-identical to the one saved before the restart')
    cont = _plan(client, report, 'the conversation continues: ', CORRECTION, trained)
    report.check(cont.token_ids == reference,
                 'the reply is token-identical to the one before the restart')
    return node, client


def run_demo(argv, *, doc, title, default_model, params, random_note, session):
    """
    Parse the common options, start the node, run `session`, stop everything; return 0/1.

    `session(node, client, workdir, params, report, events)` returns the (node, client) pair
    that is live when it ends (a session may restart the node).
    """
    parser = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    parser.add_argument('--model', default=default_model)
    parser.add_argument('--device', default='cpu')
    parser.add_argument('--keep', action='store_true', help='keep the work directory')
    args = parser.parse_args(argv)

    def terminate(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    workdir = tempfile.mkdtemp(prefix='flashrt_demo_')
    params = dict(params, model=args.model, device=args.device,
                  capsule_dir=os.path.join(workdir, 'capsules'))
    report = _Report()
    print(f'flashrt_ros {title}: model {args.model} on {args.device}'
          + (f' ({random_note})' if args.model.startswith('builtin:') else ''), flush=True)
    node = client = None
    try:
        node, client = _start(workdir, params, report, 'started')
        events = []
        client.wait_for_publishers(client.subscribe_events(events.append), timeout=5.0)
        node, client = session(node, client, workdir, params, report, events)
    except Exception as exc:
        report.failures.append(repr(exc))
        print(f'\nerror: {exc}', file=sys.stderr)
    finally:
        if client is not None:
            client.close()
        if node is not None:
            node.stop()
        if args.keep:
            print(f'work directory kept: {workdir}')
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    if report.failures:
        print(f'\n{len(report.failures)} check(s) failed: ' + '; '.join(report.failures))
        return 1
    print('\nall checks passed')
    return 0


def _lm_session(node, client, workdir, params, report, events):
    trained = not params['model'].startswith('builtin:')
    digest, reference = _run_session(client, report, events, trained)
    return _restart_and_restore(node, client, workdir, params, report, digest, reference,
                                trained)


def main(argv=None):
    """Run the demo; return 0 when every check passed."""
    return run_demo(argv, doc=__doc__, title='demo', default_model='default',
                    params={'max_seq_len': 1024, 'system_prompt': SYSTEM_PROMPT,
                            **ROBOT_SETTINGS,
                            'interrupt_policy': 'stop'},
                    random_note='random weights: the text is not meaningful; the state '
                                'handling is real',
                    session=_lm_session)


if __name__ == '__main__':
    sys.exit(main())
