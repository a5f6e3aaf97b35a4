"""
PNG plots of the figures (matplotlib, Agg backend: no display needed).

    python -m flashrt_ros.bench.plots RESULT.json [--out DIR]

redraws the plots of a bench run from its JSON (e.g. one taken where matplotlib was missing).
"""

import argparse
import json
import os

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # noqa: E402 (the backend must be chosen first)
from matplotlib.ticker import FuncFormatter, LogLocator  # noqa: E402

TIER_COLORS = {'device': 'tab:blue', 'host': 'tab:orange', 'disk': 'tab:green'}
OURS, BASELINE, PAPER, PEER = 'tab:blue', 'tab:gray', 'tab:red', 'tab:purple'


def _err(stats):
    """Return (medians, [lower errors, upper errors]) for p10-p90 error bars."""
    med = [s['median'] for s in stats]
    return med, [[m - s['p10'] for m, s in zip(med, stats)],
                 [s['p90'] - m for m, s in zip(med, stats)]]


def _plain(ax, x=True, y=True):
    """Label log axes 0.5, 2, 300 rather than 5x10^-1, 2x10^0, 3x10^2."""
    fmt = FuncFormatter(lambda v, _: f'{v:g}')
    for on, axis in ((x, ax.xaxis), (y, ax.yaxis)):
        if on:
            axis.set_major_formatter(fmt)
            axis.set_minor_formatter(FuncFormatter(lambda v, _: ''))


def _save(fig, path, subtitle):
    fig.suptitle(subtitle, fontsize=9, color='dimgray', y=0.01, va='bottom')
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def fig1(f, path, subtitle):
    """Latency vs state size: snapshot and restore per tier, raw copies dashed."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4), sharey=True)
    for ax, op in zip(axes, ('snapshot', 'restore')):
        for tier, color in TIER_COLORS.items():
            rows = [r for r in f['rows'] if r['tier'] == tier]
            if not rows:
                continue
            mib = [r['bytes'] / 2**20 for r in rows]
            med, err = _err([r[f'{op}_ms'] for r in rows])
            ax.errorbar(mib, med, yerr=err, color=color, marker='o', capsize=3,
                        label=f'{op} ({tier})')
            if op == 'restore' and tier != 'disk':
                ax.plot(mib, [r['restore_same_lineage_ms']['median'] for r in rows],
                        color=color, linestyle=':', marker='^', alpha=0.8,
                        label=f'same-lineage restore ({tier})')
            ax.plot(mib, [r[f'raw_{op}_ms']['median'] for r in rows], color=color,
                    linestyle='--', marker='x', alpha=0.8, label=f'raw copy ({tier})')
        ax.set_xscale('log')
        ax.set_yscale('log')
        ax.set_xlabel('state size (MiB)')
        ax.set_title(f'{op}: ours (solid) vs raw copy of the same bytes (dashed)', fontsize=10)
        ax.grid(True, which='both', alpha=0.3)
        _plain(ax)
    axes[0].set_ylabel('latency (ms, median; bars p10-p90)')
    axes[1].set_title('restore: full copy (solid), same lineage (dotted), raw copy (dashed)',
                      fontsize=10)
    axes[1].legend(fontsize=7, ncol=2)
    return _save(fig, path, subtitle)


def fig2(f, path, subtitle):
    """TTFT curves (cold prefill vs restore + first token) and the speedup, like the paper."""
    rows = f['rows']
    tokens = [r['tokens'] for r in rows]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.4))
    for key, label, color in (('cold_prefill_ms', 'cold prefill + first token', BASELINE),
                              ('restore_first_token_ms', 'restore capsule + first token',
                               OURS)):
        med, err = _err([r[key] for r in rows])
        ax.errorbar(tokens, med, yerr=err, marker='o', capsize=3, color=color, label=label)
    ax.set_xscale('log', base=2)
    ax.set_yscale('log')
    ax.set_xticks(tokens, [f'{t // 1024}k' if t >= 1024 else str(t) for t in tokens])
    ax.set_xlabel('context length (tokens)')
    ax.set_ylabel('time to first token (ms)')
    ax.set_title('Time to first token', fontsize=10)
    ax.grid(True, which='both', alpha=0.3)
    _plain(ax, x=False)
    ax.legend(fontsize=8)
    bx.plot(tokens, [r['speedup'] for r in rows], marker='o', color=OURS, label='ours')
    for t, s in zip(tokens, [r['speedup'] for r in rows]):
        bx.annotate(f'{s:.0f}x', (t, s), textcoords='offset points', xytext=(0, 6),
                    ha='center', fontsize=8, color=OURS)
    paper = sorted((int(k), v) for k, v in f.get('paper', {}).items())
    bx.plot([p[0] for p in paper], [p[1] for p in paper], marker='s', linestyle=':',
            color=PAPER, label='paper (RTX 5090)')
    for t, s in paper:
        bx.annotate(f'{s:g}x', (t, s), textcoords='offset points', xytext=(0, -14),
                    ha='center', fontsize=8, color=PAPER)
    bx.set_xscale('log', base=2)
    bx.set_yscale('log')
    ticks = sorted(set(tokens) | {p[0] for p in paper})
    bx.set_xticks(ticks, [f'{t // 1024}k' if t >= 1024 else str(t) for t in ticks])
    bx.set_xlabel('context length (tokens)')
    bx.set_ylabel('speedup (cold / restore)')
    low = min([r['speedup'] for r in rows] + [p[1] for p in paper])
    high = max([r['speedup'] for r in rows] + [p[1] for p in paper])
    bx.set_ylim(low / 2, high * 2)  # room for the labels above and below the points
    bx.set_title('TTFT speedup of restoring a capsule', fontsize=10)
    bx.grid(True, which='both', alpha=0.3)
    _plain(bx, x=False)
    bx.legend(fontsize=8)
    return _save(fig, path, subtitle)


def fig3(f, path, subtitle):
    """Per decode step: does the token match the reference after each kind of restore."""
    fig, ax = plt.subplots(figsize=(11, 3.2))
    lines = [(f'full restore ({t})', v['match']) for t, v in f['tiers'].items()]
    lines.append(('KV-only restore (ablation)', f['kv_only']['match']))
    for y, (label, match) in enumerate(lines):
        colors = ['tab:green' if m else 'tab:red' for m in match]
        ax.scatter(range(len(match)), [y] * len(match), c=colors, marker='s', s=30)
    ax.set_yticks(range(len(lines)), [label for label, _ in lines])
    ax.set_ylim(-0.7, len(lines) - 0.3)
    ax.set_xlabel('greedy decode step after restore (green: same token as before, red: not)')
    first = f['kv_only']['first_diverging_step']
    ax.set_title(f'Token identity over {f["steps"]} steps; KV-only diverges at step {first}',
                 fontsize=10)
    return _save(fig, path, subtitle)


def fig4(f, path, subtitle):
    """Decode tokens/s per path, with p10-p90 bars."""
    names = list(f['tokens_per_s'])
    med, err = _err([f['tokens_per_s'][k] for k in names])
    fig, ax = plt.subplots(figsize=(7, 4))
    colors = [OURS if k.startswith('arena') else PEER if k == 'llama_cpp' else BASELINE
              for k in names]
    ax.bar(names, med, yerr=err, capsize=4, color=colors)
    ax.tick_params(axis='x', labelsize=7, rotation=20)
    for i, m in enumerate(med):
        ax.text(i, m / 2, f'{m:.1f}', ha='center', color='white', fontsize=10)
    ax.set_ylabel('decode tokens/s (median; bars p10-p90)')
    ax.set_title(f'Greedy decode, {f["steps"]} steps: arena engine vs transformers'
                 + (' and llama.cpp' if 'llama_cpp' in names else ''),
                 fontsize=10)
    ax.grid(True, axis='y', alpha=0.3)
    return _save(fig, path, subtitle)


def fig5(f, path, subtitle):
    """Service round-trips (bars) and the interrupt -> restored latency distribution."""
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2))
    keys = [('trigger_round_trip_ms', 'bare Trigger\n(baseline)'),
            ('trigger_mt_round_trip_ms', 'Trigger,\n6-thread exec.'),
            ('restore_round_trip_ms', '~/restore\nround-trip'),
            ('restore_minus_runtime_ms', '~/restore minus\nruntime restore'),
            ('runtime_restore_ms', 'runtime\nrestore')]
    med, err = _err([f[k] for k, _ in keys])
    ax.bar([label for _, label in keys], med, yerr=err, capsize=4,
           color=[BASELINE, BASELINE, OURS, OURS, 'tab:cyan'])
    ax.set_ylabel('ms (median; bars p10-p90)')
    paired = f.get('node_added_paired_ms')
    paired = '' if paired is None else f' ({paired:.3f} call by call)'
    ax.set_title(f'Service round-trips ({f["node_model"]}): node adds '
                 f'{f["node_added_ms"]:.3f} ms{paired}', fontsize=10)
    ax.tick_params(axis='x', labelsize=8)
    ax.grid(True, axis='y', alpha=0.3)
    curves = [(label, f'{end}_to_restored_samples_ms', f'{label}: {end}', color, style)
              for label, color in (('waitset_rt', 'tab:green'), ('waitset', OURS),
                                   ('single_rt', 'tab:olive'), ('shared', BASELINE))
              for end, style in (('published', '-'), ('received', ':'))]
    for control, key, label, color, style in curves:
        values = sorted(f['controls'].get(control, {}).get(key, []))
        if values:
            bx.plot(values, [(i + 1) / len(values) for i in range(len(values))], color=color,
                    linestyle=style, label=f'{label} -> restored')
    bx.axvline(1.0, color=PAPER, linestyle='--', label='target: p99 1 ms after receipt')
    bx.axhline(0.99, color='dimgray', linestyle=':', linewidth=1, label='p99')
    bx.set_xscale('log')
    bx.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))  # less than a decade shown
    _plain(bx, y=False)
    bx.set_xlabel('interrupt -> restored (ms, log scale)')
    bx.set_ylabel('fraction of interrupts (CDF)')
    bx.set_title(f'{f["interrupts"]} interrupts during generation, per executor', fontsize=10)
    bx.grid(True, alpha=0.3)
    bx.legend(fontsize=8, loc='lower right')
    return _save(fig, path, subtitle)


def fig5disk(f, path, subtitle):
    """Interrupt -> event latency per mode, quiet and during a disk snapshot's write."""
    rows = f['rows']
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for j, (key, label, color) in enumerate((('quiet', 'no disk write', BASELINE),
                                             ('during_disk_write', 'during a disk write',
                                              OURS))):
        med, err = _err([r[key]['e2e_ms'] for r in rows])
        xs = [i + (j - 0.5) * 0.4 for i in range(len(rows))]
        ax.bar(xs, med, 0.4, yerr=err, capsize=4, color=color, label=label)
    for i, r in enumerate(rows):
        if r['ratio_median'] is not None:
            top = r['during_disk_write']['e2e_ms']['median']
            ax.annotate(f'{r["ratio_median"]:.2f}x', (i + 0.2, top), textcoords='offset points',
                        xytext=(0, 3), ha='center', fontsize=8)
    ax.set_xticks(range(len(rows)), [r['mode'].replace('_', ' ') for r in rows])
    ax.set_ylabel('interrupt -> event at the client, ms (median; bars p10-p90)')
    ax.set_title(f'Interrupts while a {f["disk_snapshot_bytes"] / 1e6:.0f} MB disk snapshot is '
                 'written, and without', fontsize=10)
    ax.grid(True, axis='y', alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path, subtitle)


def fig6(f, path, subtitle):
    """Capsule restore vs the KV-only prefix-cache path, per context length (log scale)."""
    rows = f['rows']
    tokens = [r['tokens'] for r in rows]
    bars = [('capsule restore', [r['restore_ms']['median'] for r in rows], OURS),
            ('KV-only restore', [r['kv_only_restore_ms']['median'] for r in rows], 'tab:cyan'),
            ('+ rebuild: recurrent layers only (oracle)', [r['kv_prefix_oracle_ms'] for r in rows],
             'tab:orange'),
            ('+ rebuild: layers 0..last recurrent (needed)',
             [r['kv_prefix_path_ms'] for r in rows], BASELINE)]
    fig, ax = plt.subplots(figsize=(12, 4.4))
    width = 0.8 / len(bars)
    for j, (label, values, color) in enumerate(bars):
        xs = [i + (j - (len(bars) - 1) / 2) * width for i in range(len(tokens))]
        ax.bar(xs, values, width, label=label, color=color)
    for i, r in enumerate(rows):  # over the 'needed' bar: how much slower than a capsule
        ax.annotate(f'{r["kv_prefix_vs_capsule"]:.0f}x', (i + 1.5 * width, r['kv_prefix_path_ms']),
                    textcoords='offset points', xytext=(0, 3), ha='center', fontsize=8)
    ax.set_xticks(range(len(tokens)), [str(t) for t in tokens])
    ax.set_yscale('log')
    _plain(ax, x=False)
    ax.set_xlabel('context length (tokens)')
    ax.set_ylabel('ms to a correct state (median)')
    ax.set_title('KV-only prefix caching must re-prefill the recurrent layers; a capsule '
                 'restores them', fontsize=10)
    ax.grid(True, axis='y', which='both', alpha=0.3)
    ax.legend(fontsize=8, loc='upper left', bbox_to_anchor=(1.01, 1.0))
    return _save(fig, path, subtitle)


def fig8(f, path, subtitle):
    """Throughput: ROS import (client, receiver) vs file copy; hand-over vs cold prefill."""
    rows = f['rows']
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2))
    x = [r['mib'] for r in rows]
    for key, label, color, style in (
            ('shm_mib_s', 'import via shared memory (client: goal -> result)', OURS, '-'),
            ('ros_mib_s', 'import via DDS chunks (client)', OURS, '-.'),
            ('node_mib_s', 'import via DDS chunks (receiver: manifest -> stored)', OURS, ':'),
            ('copy_mib_s', 'file copy on disk (page cache)', BASELINE, '--')):
        med, err = _err([r[key] for r in rows])
        ax.errorbar(x, med, yerr=err, marker='o', capsize=3, color=color, ls=style,
                    label=label)
    ax.set(xscale='log', yscale='log', xlabel='capsule MiB', ylabel='MiB/s',
           title='transfer throughput between two node processes')
    _plain(ax)
    ax.legend(fontsize=8)
    h = f['handover']
    bars = [h['request_to_restored_ms']['median'], h['cold_prefill_ms']['median']]
    bx.bar(['import + restore', 'cold prefill'], bars, color=[OURS, BASELINE])
    bx.set(yscale='log', ylabel='ms', title=f'{h["tokens"]} tokens on the receiver: '
           f'{h["speedup"]:.0f}x')
    _plain(bx, x=False)
    return _save(fig, path, subtitle)


def fig7(f, path, subtitle):
    """Against llama.cpp per context length: decode tokens/s, restore and restore + 1st token."""
    x = [r['tokens'] for r in f['rows']]
    panels = [('decode tokens/s', 'decode_tokens_per_s', 'peer_decode_tokens_per_s'),
              ('full-state restore ms', 'restore_ms', 'peer_seq_restore_ms'),
              ('restore + first token ms', 'restore_first_token_ms',
               'peer_restore_first_token_ms')]
    fig, axes = plt.subplots(1, 3, figsize=(12, 4))
    for ax, (label, ours, peer) in zip(axes, panels):
        for key, name, color in ((ours, 'flashrt_ros', OURS), (peer, 'llama.cpp', PEER)):
            med, err = _err([r[key] for r in f['rows']])
            ax.errorbar(x, med, yerr=err, marker='o', capsize=3, color=color, label=name)
        if ours == 'restore_ms':
            med, _ = _err([r['restore_same_lineage_ms'] for r in f['rows']])
            ax.plot(x, med, marker='.', ls='--', color=OURS, label='flashrt_ros same lineage')
            med, _ = _err([r['peer_whole_restore_ms'] for r in f['rows']])
            ax.plot(x, med, marker='.', ls='--', color=PEER, label='llama.cpp whole context')
        ax.set_xscale('log', base=2)
        ax.set_yscale('log')
        _plain(ax)
        ax.set_xlabel('context tokens')
        ax.set_title(label, fontsize=10)
        ax.grid(True, which='both', alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, path, subtitle + f'; {f.get("threads")} threads each')


PLOTS = {'fig1': fig1, 'fig2': fig2, 'fig3': fig3, 'fig4': fig4, 'fig5': fig5,
         'fig5disk': fig5disk, 'fig6': fig6, 'fig7': fig7, 'fig8': fig8}


def lerobot_parity(result, path):
    """ACT ms per chunk, LeRobot beside this runtime (p10-p90 bars), per timed case."""
    rows = [r for r in result['rows'] if 'lerobot_chunk_ms' in r]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    x = range(len(rows))
    for offset, key, label, colour in ((-0.2, 'lerobot_chunk_ms', 'LeRobot', BASELINE),
                                       (0.2, 'ours_chunk_ms', 'flashrt_ros', OURS)):
        med, err = _err([r[key] for r in rows])
        ax.bar([i + offset for i in x], med, 0.4, yerr=err, label=label, color=colour,
               capsize=3)
    ax.set_xticks(list(x), [f"{r['case']}\n{r['chunk_speedup']:.2f}x" for r in rows])
    ax.set_ylabel('ms per chunk (median)')
    ax.set_title(f"ACT {rows[0]['parameters'] / 1e6:.1f} M parameters, "
                 f"{result['threads']} threads; max abs difference "
                 f"{max(r['chunk_max_abs'] for r in result['rows']):g}", fontsize=10)
    ax.legend()
    return _save(fig, path, f"LeRobot {result['lerobot']} (torch {result['torch_lerobot']}) "
                 f"vs torch {result['torch_ours']}; load average "
                 f"{result['load_average_before'][0]:.1f}")


def plot_all(results, directory, name):
    """Write one PNG per figure that has results; return {figure: path}."""
    os.makedirs(directory, exist_ok=True)
    paths = {}
    for key, fig in results['figures'].items():
        has_data = fig.get('rows') or fig.get('tiers') or fig.get('tokens_per_s') \
            or 'node_added_ms' in fig
        if key in PLOTS and has_data:
            model = fig.get('node_model', results['model']['id'])
            subtitle = (f'{model} ({results["model"]["dtype"]}) on {results["device"]["name"]}; '
                        f'flashrt_ros bench "{name}"')
            paths[key] = PLOTS[key](fig, os.path.join(directory, f'{name}-{key}.png'), subtitle)
    return paths


def main(argv=None):
    p = argparse.ArgumentParser(description='Redraw the plots of a bench run from its JSON.')
    p.add_argument('result', help='a NAME.json written by python -m flashrt_ros.bench')
    p.add_argument('--out', help='where the PNGs go (default: beside the JSON)')
    args = p.parse_args(argv)
    with open(args.result) as f:
        results = json.load(f)
    out = args.out or os.path.dirname(os.path.abspath(args.result))
    for key, path in plot_all(results, out, results['name']).items():
        print(f'{key}: {path}')


if __name__ == '__main__':
    main()
