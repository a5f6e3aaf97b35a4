"""
Run the benchmark suite: python -m flashrt_ros.bench [options] (make bench, make bench-quick).

Writes <out>/<name>.json (environment, model, every figure's median, p10/p90 and n),
<out>/<name>.md (the tables) and <plots>/<name>-figN.png, and prints the tables.
"""

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
import warnings

from flashrt_ros.runtime.config import DTYPES
import torch

from .common import busy_processes, cpu_sample, cpu_usage, device_info, Log, machine_info
from .common import model_info
from .figures import (
    fig1_snapshot_restore,
    fig2_ttft,
    fig3_correctness,
    fig4_decode,
    FIG5_NODES,
    fig6_kv_only_prefix,
    Plan,
)
from .measure import BENCH_MODEL
from .peer import fig7_peer, PEER_ENV
from .report import to_markdown, to_text

FIGURES = ('fig1', 'fig2', 'fig3', 'fig4', 'fig5', 'fig5disk', 'fig5modes', 'fig6', 'fig7',
           'fig8')
# Node processes only: no runtime in this process.
ROS_FIGURES = {'fig5', 'fig5disk', 'fig5modes', 'fig8'}
FULL_LENGTHS = [512, 1024, 2048, 4096, 8192, 16384]
QUICK_LENGTHS = [256, 512]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog='python -m flashrt_ros.bench',
                                description=__doc__.strip().split('\n')[0])
    p.add_argument('--quick', action='store_true',
                   help='small lengths, few repeats: a CI smoke run (< 3 min on 2 cores)')
    p.add_argument('--smoke', action='store_true',
                   help='--quick with the fewest samples that still run every figure (a dry '
                        'run of the scripts; its numbers mean nothing)')
    p.add_argument('--model', default=BENCH_MODEL,
                   help='built-in id or local checkpoint directory (default %(default)s)')
    p.add_argument('--device', default='cpu', help='cpu, cuda or cuda:N')
    p.add_argument('--dtype', default='float32', choices=DTYPES)
    p.add_argument('--lengths', type=int, nargs='+',
                   help=f'context lengths of fig2/fig6 (default {FULL_LENGTHS}, '
                        f'--quick {QUICK_LENGTHS}); fig1 uses 64 plus these')
    p.add_argument('--repeats', type=int,
                   help='samples of slow measurements (default 5, --quick 2); fast ones take 6x')
    p.add_argument('--budget-s', type=float,
                   help='seconds one context length may spend on cold prefills; longer '
                        'lengths are skipped, saying so (default 150, --quick 20)')
    p.add_argument('--only', default=','.join(FIGURES),
                   help='comma-separated figures to run (default all: %(default)s)')
    p.add_argument('--threads', type=int,
                   help='torch threads of this process (default: what torch picks)')
    p.add_argument('--node-model', default='default',
                   help='model of the node process in fig5 (default %(default)s)')
    p.add_argument('--fig5-nodes', default=','.join(FIG5_NODES),
                   help='comma-separated control configurations of the nodes fig5 interrupts '
                        'side by side, one node each (default %(default)s; ratios need shared)')
    p.add_argument('--peer-python', default=os.environ.get(PEER_ENV),
                   help='Python of the llama.cpp environment (make bench-peer builds '
                        f'build/peer-venv); fig4 and fig7 run llama.cpp beside the runtime '
                        f'with it, and skip it, saying why, without it (default ${PEER_ENV})')
    p.add_argument('--out', default='build/bench-results',
                   help='directory of the JSON and tables (default %(default)s)')
    p.add_argument('--plots', help='directory of the PNG plots (default: --out)')
    p.add_argument('--name', help='result name (default: quick, or the device type)')
    p.add_argument('--busy-cores', type=int, default=0,
                   help='keep this many cores busy with unrelated processes (a Python loop '
                        'each, normal priority) for the whole run (default %(default)s)')
    args = p.parse_args(argv)
    only = [f.strip() for f in args.only.split(',') if f.strip()]
    unknown = sorted(set(only) - set(FIGURES))
    if unknown:
        p.error(f'unknown figures {unknown}; choose from {", ".join(FIGURES)}')
    args.only = [f for f in FIGURES if f in only]
    nodes = tuple(n.strip() for n in args.fig5_nodes.split(',') if n.strip())
    if not nodes or set(nodes) - set(FIG5_NODES):
        p.error(f'--fig5-nodes: choose one or more of {", ".join(FIG5_NODES)}')
    args.fig5_nodes = nodes
    return args


def make_plan(args, workdir):
    quick = args.quick or args.smoke
    lengths = sorted(set(args.lengths or (QUICK_LENGTHS if quick else FULL_LENGTHS)))
    repeats = args.repeats or (2 if quick else 5)
    plan = Plan(
        quick=quick, lengths=lengths, sizes=sorted({64} | set(lengths)), repeats=repeats,
        fast_repeats=6 * repeats, budget_s=args.budget_s or (20.0 if quick else 150.0),
        decode_steps=16 if quick else 32, decode_rounds=max(4, 4 * repeats),
        correctness_steps=64,
        round_trips=50 if quick else 500, interrupts=40 if quick else 2000,
        node_model=args.node_model, fig5_nodes=args.fig5_nodes, workdir=workdir,
        transfer_model=args.model,
        transfer_context=max(lengths) if args.lengths or quick else 8192)
    if args.smoke:
        plan = dataclasses.replace(plan, decode_steps=4, decode_rounds=2, correctness_steps=12,
                                   round_trips=5, interrupts=3)
    return plan


def build_runtime(args, plan):
    from flashrt_ros.runtime import Runtime, RuntimeConfig

    rt = Runtime(RuntimeConfig(
        model=args.model, device=args.device, dtype=args.dtype,
        max_seq_len=max(plan.lengths + [512]) + 128, device_budget_bytes=0,
        host_budget_bytes=0, disk_budget_bytes=0, prompt_format='raw',  # token ids as given
        capsule_dir=os.path.join(plan.workdir, 'capsules')))
    rt.warmup()
    return rt


def run_figure(key, rt, args, plan, log):
    """Run one figure; an exception is recorded in its result, never raised."""
    before = cpu_sample()
    log(f'{key} ...')
    try:
        if key == 'fig5':
            from .through_ros import fig5_through_ros  # imports rclpy: only fig5 needs ROS

            result = fig5_through_ros(plan, args.device, log)
        elif key == 'fig5disk':
            from .disk_interrupts import fig5_disk_interrupts

            result = fig5_disk_interrupts(plan, args.device, log)
        elif key == 'fig5modes':
            from .mode_interrupts import fig5_mode_interrupts

            result = fig5_mode_interrupts(plan, args.device, log)
        elif key == 'fig8':
            from .transfer import fig8_transfer  # node processes over DDS, as fig5

            result = fig8_transfer(plan, args.device, log)
        elif key in ('fig4', 'fig7'):
            fn = fig4_decode if key == 'fig4' else fig7_peer
            result = fn(rt, plan, log, args.peer_python)
        else:
            fn = {'fig1': fig1_snapshot_restore, 'fig2': fig2_ttft, 'fig3': fig3_correctness,
                  'fig6': fig6_kv_only_prefix}[key]
            result = fn(rt, plan, log)
    except Exception as exc:
        result = {'error': f'{type(exc).__name__}: {exc}', 'traceback': traceback.format_exc()}
        log(f'{key} FAILED: {result["error"]}')
        if rt is not None and not rt.generating:
            rt.reset()
    after = cpu_sample()
    result['elapsed_s'] = after[0] - before[0]
    result['cpu'] = cpu_usage(before, after)
    log(f'{key} done in {result["elapsed_s"]:.1f} s; CPU: {result["cpu"]}')
    return result


def write_plots(results, directory, name, log):
    """Draw the PNGs if matplotlib is installed (a GPU image may lack it); return their paths."""
    redraw = f'python -m flashrt_ros.bench.plots {name}.json'
    try:
        from .plots import plot_all
    except ImportError as exc:
        log(f'no plots: {exc} (pip install matplotlib, then: {redraw})')
        return {}
    try:
        return plot_all(results, directory, name)
    except Exception as exc:  # noqa: B902 - a plot must not cost the run its JSON
        log(f'the plots failed: {exc!r}; the JSON is written (redraw: {redraw})')
        return {}


def main(argv=None):
    args = parse_args(argv)
    warnings.filterwarnings('ignore', message='.*falling back to its reference PyTorch.*')
    if args.threads:
        torch.set_num_threads(args.threads)
    name = args.name or ('quick' if args.quick else args.device.split(':')[0])
    log = Log()
    workdir = tempfile.mkdtemp(prefix='flashrt_bench_')
    plan = make_plan(args, workdir)
    results = {'name': name, 'created': time.strftime('%Y-%m-%dT%H:%M:%S%z'),
               'argv': sys.argv[1:] if argv is None else list(argv), 'quick': plan.quick,
               'plan': {k: v for k, v in vars(plan).items() if k != 'workdir'},
               'machine': machine_info(), 'device': device_info(args.device)}
    rt = None
    busy = busy_processes(args.busy_cores)
    results['busy_cores'] = args.busy_cores
    try:
        if set(args.only) - ROS_FIGURES:
            log(f'building {args.model} on {args.device} ({args.dtype})')
            rt = build_runtime(args, plan)
            results['model'] = model_info(rt)
        else:
            results['model'] = {'id': args.node_model, 'dtype': args.dtype}
        results['figures'] = {}
        for key in args.only:
            try:
                results['figures'][key] = run_figure(key, rt, args, plan, log)
            except KeyboardInterrupt:  # Ctrl-C or a timeout: keep what is measured so far
                log(f'interrupted during {key}; writing the figures done so far')
                results['interrupted_during'] = key
                break
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
        if rt is not None:
            rt.close()
        shutil.rmtree(workdir, ignore_errors=True)
    results['machine']['loadavg_end'] = list(os.getloadavg())
    results['elapsed_s'] = log.elapsed()
    results['plots'] = write_plots(results, args.plots or args.out, name, log)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f'{name}.json')
    with open(path, 'w') as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(args.out, f'{name}.md'), 'w') as f:
        f.write(to_markdown(results))
    print(to_text(results))
    print(f'\nwrote {path}, {len(results["plots"])} plots; {results["elapsed_s"]:.0f} s in all')
    failed = [k for k, f in results['figures'].items() if 'error' in f]
    if failed:
        print(f'figures that failed: {", ".join(failed)} (see "error" in the JSON)')
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
