"""Result tables (printed, and as Markdown for docs/benchmarks.md) and the target checks."""


def _ms(stat, digits=3):
    """Format a summary dict as 'median (p10-p90)'."""
    if not stat or stat.get('median') is None:
        return '-'
    return (f'{stat["median"]:.{digits}f} ({stat["p10"]:.{digits}f}-'
            f'{stat["p90"]:.{digits}f})')


def _num(x, fmt='.2f', suffix=''):
    return '-' if x is None else f'{x:{fmt}}{suffix}'


def _yes(flag):
    return '-' if flag is None else ('yes' if flag else 'NO')


def _fig1(f):
    header = ['position', 'tier', 'MiB', 'snapshot ms', 'raw ms', 'x raw', 'restore ms',
              'raw ms', 'x raw', 'its copy x raw', 'rest us', 'restore GB/s',
              'same-lineage restore ms', 'x raw', '1st restore ms', 'n',
              'after idle: restore / raw ms']
    rows = [[r['position'], r['tier'], f'{r["bytes"] / 2**20:.2f}',
             _num(r['snapshot_ms']['median'], '.3f'), _num(r['raw_snapshot_ms']['median'], '.3f'),
             _num(r['snapshot_vs_raw']), _num(r['restore_ms']['median'], '.3f'),
             _num(r['raw_restore_ms']['median'], '.3f'), _num(r['restore_vs_raw']),
             _num(r.get('restore_copy_vs_raw')), _num(r.get('restore_rest_us'), '.1f'),
             _num(r['restore_mb_per_s'] / 1e3),
             _num(r['restore_same_lineage_ms']['median'], '.3f'),
             _num(r['restore_same_lineage_vs_raw']),
             _num(r['first_restore_ms']['median'], '.3f'), r['restore_ms']['n'],
             f"{r['idle_restore_ms']['median']:.3f} / {r['idle_raw_restore_ms']['median']:.3f}"
             if 'idle_restore_ms' in r else '-']
            for r in f['rows']]
    return header, rows


def _fig2(f):
    header = ['tokens', 'cold prefill ms', 'restore + 1st token ms', 'speedup', 'paper',
              'same token', 'n cold/warm']
    rows = [[r['tokens'], _ms(r['cold_prefill_ms'], 1), _ms(r['restore_first_token_ms'], 2),
             _num(r['speedup'], '.1f', 'x'), _num(r['paper_speedup'], '.1f', 'x'),
             _yes(r['same_first_token']),
             f'{r["cold_prefill_ms"]["n"]}/{r["restore_first_token_ms"]["n"]}']
            for r in f['rows']]
    return header, rows


def _fig3(f):
    tiers = f['tiers']
    header = ['check'] + list(tiers)
    rows = [['restored state byte-exact'] + [_yes(t['byte_exact']) for t in tiers.values()],
            [f'greedy decode token-identical ({f["steps"]} tokens)']
            + [_yes(t['token_identical']) for t in tiers.values()]]
    kv = f['kv_only']
    rows.append(['KV-only restore (ablation) diverges', _yes(kv['diverged'])
                 + f' (first diverging step {kv["first_diverging_step"]})']
                + [''] * (len(tiers) - 1))
    return header, rows


def _fig4(f):
    tps, over = f['tokens_per_s'], f.get('arena_over', {})
    header = ['decode path', 'tokens/s median (p10-p90)', 'arena / this, per round: median '
              '(p10-p90)', 'n']
    rows = [[k, _ms(v, 1), _ms(over[k], 2) if k in over else '', v['n']]
            for k, v in tps.items()]
    return header, rows


def _fig7(f):
    header = ['tokens', 'cold prefill ms (ours / llama.cpp)', 'state MiB (ours / seq)',
              'full restore ms', 'same-lineage ms', 'llama.cpp seq set ms', 'whole set ms',
              'seq / full', 'seq / same-lineage', 'restore + 1st token ms (ours / llama.cpp)',
              'decode tok/s (ours / llama.cpp)', 'decode ratio', 'same tokens']
    rows = []
    for r in f['rows']:
        m = {k: v['median'] for k, v in r.items() if isinstance(v, dict)}
        rows.append([
            r['tokens'], f'{m["cold_prefill_ms"]:.0f} / {m["peer_cold_prefill_ms"]:.0f}',
            f'{r["state_bytes"] / 2**20:.1f} / {r["peer_seq_bytes"] / 2**20:.1f}',
            _num(m['restore_ms'], '.3f'), _num(m['restore_same_lineage_ms'], '.3f'),
            _num(m['peer_seq_restore_ms'], '.3f'), _num(m['peer_whole_restore_ms'], '.3f'),
            _num(r['peer_seq_restore_over_ours'], '.1f', 'x'),
            _num(r['peer_seq_restore_over_same_lineage'], '.1f', 'x'),
            f'{m["restore_first_token_ms"]:.2f} / {m["peer_restore_first_token_ms"]:.2f}',
            f'{m["decode_tokens_per_s"]:.1f} / {m["peer_decode_tokens_per_s"]:.1f}',
            _num(r['decode_vs_peer'], '.2f', 'x'),
            _yes(r['same_greedy_tokens'] and r['same_first_token'])])
    return header, rows


def _fig5(f):
    header = ['measure', 'ms median (p10-p90)', 'p99', 'n']
    rows = [
        ['~/restore round-trip', _ms(f['restore_round_trip_ms']), '',
         f['restore_round_trip_ms']['n']],
        ['  runtime restore (latency_ms)', _ms(f['runtime_restore_ms']), '', ''],
        ['  round-trip minus runtime', _ms(f['restore_minus_runtime_ms']), '', ''],
        ['bare Trigger round-trip (baseline)', _ms(f['trigger_round_trip_ms']), '',
         f['trigger_round_trip_ms']['n']],
        ['Trigger on a 6-thread executor', _ms(f['trigger_mt_round_trip_ms']), '', ''],
        ['node adds (difference of the medians)', _num(f['node_added_ms'], '.3f'), '', ''],
        ['node adds (median of call-by-call differences)',
         _num(f.get('node_added_paired_ms'), '.3f'), '', ''],
    ]
    return header, rows


FIG5_STAGES = ('published_to_received', 'callback', 'checked', 'armed', 'step_left', 'copied',
               'restored', 'published', 'received_to_restored', 'published_to_restored',
               'client_event')


def _fig5_stages(f):
    """Per stage, ms after the middleware's receipt, for each control executor and kind."""
    header = ['stage (ms after receipt)', 'executor', 'kind', 'median', 'p90', 'p99', 'max',
              'n']
    rows = []
    for key in FIG5_STAGES:
        for control, per_kind in f['controls'].items():
            for kind in ('interrupt', 'reset'):
                d = per_kind[kind].get(key)
                if d and d['n']:
                    rows.append([key.replace('_', ' '), control, kind] + [
                        _num(d[q], '.3f') for q in ('median', 'p90', 'p99', 'max')] + [d['n']])
    return header, rows


def _fig5_tail(f):
    """Per control executor and kind: each stage's median share, slowest 1% / all."""
    shares = FIG5_STAGES[:FIG5_STAGES.index('restored') + 1]  # through_ros.SHARES
    header = ['executor', 'kind', 'n', 'from ms'] + [s.replace('_', ' ') for s in shares] + [
        'largest share (times)']
    rows = []
    for control, per_kind in f['controls'].items():
        for kind, tail in per_kind.get('tail', {}).items():
            if not tail.get('n'):
                continue
            slow, every = tail['slowest'], tail['all']
            rows.append([control, kind, tail['n'], _num(tail['threshold_ms'], '.3f')] + [
                f"{_num(slow.get(s), '.3f')} / {_num(every.get(s), '.3f')}" for s in shares]
                + [', '.join(f'{s.replace("_", " ")} {n}' for s, n in tail['largest'].items())])
    return header, rows


def _fig5disk(f):
    header = ['interrupt', 'client ms: quiet', 'during the write', 'ratio (median / p99)',
              'node ms: quiet', 'during the write', 'n']
    rows = [[r['mode'].replace('_', ' '), _ms(r['quiet']['e2e_ms']),
             _ms(r['during_disk_write']['e2e_ms']),
             f"{_num(r['ratio_median'])} / {_num(r['ratio_p99'])}",
             _ms(r['quiet']['node_ms']), _ms(r['during_disk_write']['node_ms']),
             f"{r['quiet']['e2e_ms']['n']} / {r['during_disk_write']['e2e_ms']['n']}"]
            for r in f['rows']]
    return header, rows


MODE_STAGES = ('callback', 'checked', 'armed', 'step_left', 'copied', 'restored',
               'received_to_restored', 'published_to_restored')


def _fig5modes(f):
    """Per mode and stage, ms after the middleware's receipt; the step or frame beside it."""
    header = ['mode', 'stage (ms after receipt)', 'median', 'p90', 'p99', 'max', 'n']
    rows = []
    for r in f['rows']:
        step = r['step_ms']
        what = ('time to the first token (client)' if r['mode'] == 'prompt'
                else 'control step / frame (diagnostics)')
        rows.append([r['mode'], what, _num(step['median'], '.3f'),
                     _num(step['p90'], '.3f'), _num(step['p99'], '.3f'), _num(step['max'], '.3f'),
                     step['n']])
        for key in MODE_STAGES:
            d = r.get(key)
            if d and d['n']:
                rows.append([r['mode'], key.replace('_', ' ')] + [
                    _num(d[q], '.3f') for q in ('median', 'p90', 'p99', 'max')] + [d['n']])
    return header, rows


def _fig6(f):
    header = ['tokens', 'capsule restore ms', 'KV-only restore ms', 'rebuild needed ms',
              'recurrent layers only ms', 'KV path / capsule', 'oracle / capsule']
    rows = [[r['tokens'], _ms(r['restore_ms']), _ms(r['kv_only_restore_ms']),
             _ms(r['rebuild_needed_ms'], 1), _ms(r['rebuild_recurrent_only_ms'], 1),
             _num(r['kv_prefix_vs_capsule'], '.0f', 'x'), _num(r['oracle_vs_capsule'], '.0f', 'x')]
            for r in f['rows']]
    return header, rows


def _fig8(f):
    header = ['capsule', 'import ms (client): shared memory / DDS chunks',
              'MiB/s (client / receiver): shared memory', 'MiB/s: DDS chunks', 'file copy ms',
              'file copy MiB/s', 'shared memory / copy', 'DDS / copy']
    rows = [[f'{r["mib"]:.1f} MiB (position {r["position"]})',
             f'{_ms(r["shm_ms"], 1)} / {_ms(r["ros_ms"], 1)}',
             f'{_ms(r["shm_mib_s"], 0)} / {_num(r["shm_node_mib_s"]["median"], ".0f")}',
             f'{_ms(r["ros_mib_s"], 0)} / {_num(r["node_mib_s"]["median"], ".0f")}',
             _ms(r['copy_ms'], 2), _ms(r['copy_mib_s'], 0),
             _num(r['shm_vs_copy'], '.2f', 'x'), _num(r['ros_vs_copy'], '.2f', 'x')]
            for r in f['rows']]
    h = f.get('handover')
    if h:
        rows.append([f'{h["tokens"]} tokens: request -> restored on the receiver',
                     _ms(h['request_to_restored_ms'], 1), '', '', 'cold prefill there',
                     _ms(h['cold_prefill_ms'], 0), _num(h['speedup'], '.0f', 'x faster'), ''])
    for r in f.get('chunk_sweep', []):
        rows.append([f'  DDS chunk {r["chunk_bytes"] >> 10} KiB (largest capsule)', '', '',
                     _ms(r['node_mib_s'], 0), '', '', '', ''])
    return header, rows


TABLES = {'fig1': _fig1, 'fig2': _fig2, 'fig3': _fig3, 'fig4': _fig4, 'fig5': _fig5,
          'fig5disk': _fig5disk, 'fig5modes': _fig5modes,
          'fig6': _fig6, 'fig7': _fig7, 'fig8': _fig8}


def targets(results):
    """Return [figure, target, measured, holds] rows for the performance targets."""
    figs, rows = results['figures'], []
    f = figs.get('fig1', {})
    if f.get('rows'):
        worst = max((r for r in f['rows'] if r['tier'] == 'device'),
                    key=lambda r: r['restore_vs_raw'])
        rows.append(['fig1', 'device restore <= 1.3x raw copy_ (every size)',
                     f'worst {worst["restore_vs_raw"]:.2f}x at position {worst["position"]} '
                     f'(its copy {_num(worst.get("restore_copy_vs_raw"))}x, the rest '
                     f'{_num(worst.get("restore_rest_us"), ".1f")} us); holds at '
                     f'{f["target_holds_at"]}', _yes(f['target_holds'])])
    f = figs.get('fig2', {})
    for r in f.get('rows', []):
        if r['paper_speedup'] or r['tokens'] == 8192:
            goal = r['paper_speedup'] or figs['fig2'].get('paper', {}).get('2048', 3.9)
            rows.append(['fig2', f'TTFT speedup at {r["tokens"]} >= {goal}x',
                         f'{r["speedup"]:.1f}x', _yes(r['speedup'] >= goal)])
    f = figs.get('fig3', {})
    if 'passed' in f:
        rows.append(['fig3', 'byte-exact + token-identical; KV-only diverges',
                     f'first KV-only divergence at step {f["kv_only"]["first_diverging_step"]}',
                     _yes(f['passed'])])
    f = figs.get('fig4', {})
    if 'ratio_vs_dynamic_cache_loop' in f:
        rows.append(['fig4', 'arena / DynamicCache decode tokens/s >= 1.0',
                     f'{f["ratio_vs_dynamic_cache_loop"]:.2f} (loop), '
                     f'{f["ratio_vs_hf_generate"]:.2f} (generate())', _yes(f['target_holds'])])
    f = figs.get('fig7', {})
    for r in f.get('rows', []):
        rows.append(['fig7', f'decode tokens/s >= llama.cpp at {r["tokens"]}',
                     f'{r["decode_vs_peer"]:.2f}x', _yes(r['decode_vs_peer'] >= 1.0)])
        goal = 3.0 if r['tokens'] > 8192 else 5.0
        rows.append(['fig7', f'full restore >= {goal:.0f}x faster than state_seq_set_data at '
                     f'{r["tokens"]}', f'{r["peer_seq_restore_over_ours"]:.1f}x',
                     _yes(r['peer_seq_restore_over_ours'] >= goal)])
        rows.append(['fig7', f'restore + first token <= llama.cpp at {r["tokens"]}',
                     f'{r["peer_first_token_over_ours"]:.2f}x',
                     _yes(r['peer_first_token_over_ours'] >= 1.0)])
    f = figs.get('fig5', {})
    if 'targets' in f:
        t = f['targets']
        rows.append(['fig5', 'node adds <= 0.5 ms over a bare Trigger (median; of the medians '
                     '/ call by call)', f'{f["node_added_ms"]:.3f} / '
                     f'{_num(f.get("node_added_paired_ms"), ".3f")} ms',
                     f'{_yes(f["node_added_ms"] <= 0.5)} / '
                     f'{_yes(f["node_added_paired_ms"] <= 0.5)}'])
        for label, held in t.items():
            ours = f['controls'][label]
            for kind in ('interrupt', 'reset'):
                for key, quantiles in (('received', (('median', 0.5), ('p99', 1.0),
                                                     ('max', 3.0))),
                                       ('published', (('median', 0.8), ('p99', 1.5)))):
                    d = ours[kind][f'{key}_to_restored']
                    for q, limit in quantiles:
                        rows.append(['fig5', f'{kind} {key} -> restored {q} <= {limit} ms '
                                     f'({label})', f'{_num(d[q], ".3f")} ms',
                                     _yes(held[f'{kind}_{key}_to_restored_{q}_le_{limit}_ms'])])
    for r in figs.get('fig5modes', {}).get('rows', []):
        during = {'policy': 'during a control step', 'speech': 'during a long audio chunk',
                  'prompt': "during a long prompt's prefill"}[r['mode']]
        for q, limit in r['bounds_ms'].items():
            d = r.get('received_to_restored', {})
            rows.append(['fig5modes', f'{r["mode"]}: interrupt received -> restored {q} <= '
                         f'{limit:.3f} ms ({during})', f'{_num(d.get(q), ".3f")} ms',
                         _yes(r['holds'][q])])
    f = figs.get('fig8', {})
    if 'targets' in f:
        t, big, h = f['targets'], f['rows'][-1], f['handover']
        rows.append(['fig8', 'same-host import of the largest capsule >= 1/4 of a file copy',
                     f'{_num(big["shm_vs_copy"])}x at {big["mib"]:.0f} MiB (shared memory); '
                     f'{_num(big["ros_vs_copy"])}x (DDS chunks)',
                     f'{_yes(t["shm_ge_quarter_of_file_copy_at_32mib"])} / '
                     f'{_yes(t["ros_ge_quarter_of_file_copy_at_32mib"])}'])
        rows.append(['fig8', f'request -> restored >= 10x faster than cold prefill at '
                     f'{h["tokens"]} tokens', f'{_num(h["speedup"], ".0f")}x',
                     _yes(t['handover_ge_10x_cold_prefill'])])
    return rows


def sections(results):
    """Yield (title, header, rows, notes) for every figure that has results, then targets."""
    for key, fig in results['figures'].items():
        notes = list(fig.get('skipped', [])) + ([fig['error']] if 'error' in fig else [])
        if fig.get('note'):
            notes.append(fig['note'])
        if fig.get('llama_cpp_skipped'):
            notes.append(f'llama.cpp not measured: {fig["llama_cpp_skipped"]}')
        cpu = fig.get('cpu', {})
        if 'machine_busy_pct' in cpu:
            notes.append(f'{fig["elapsed_s"]:.0f} s; CPU meanwhile: machine '
                         f'{cpu["machine_busy_pct"]}% busy, this run {cpu["this_run_pct"]}%, '
                         f'others {cpu["others_pct"]}%, steal {cpu["steal_pct"]}%')
        if results.get('busy_cores'):
            notes.append(f'{results["busy_cores"]} core(s) kept busy by unrelated processes '
                         '(--busy-cores), counted in "others"')
        if fig.get('missed'):
            what = ', no '.join(f'{w.replace("_", " ")} x{n}'
                                for w, n in sorted(fig['missed_by_what'].items()))
            notes.append(f'{fig["missed"]} of {fig["interrupts"]} interrupt turns missed (no '
                         f'{what} within the timeout); the latencies leave them out')
        if key in TABLES and (fig.get('rows') or fig.get('tiers') or fig.get('tokens_per_s')
                              or 'node_added_ms' in fig):
            header, rows = TABLES[key](fig)
        else:
            header, rows = [], []
        for control, c in fig.get('controls', {}).items():
            if c['missed']:
                what = ', no '.join(f'{w.replace("_", " ")} x{n}'
                                    for w, n in sorted(c['missed_by_what'].items()))
                notes.append(f'{control}: {c["missed"]} of {fig["interrupts"] + fig["resets"]} '
                             f'turns missed (no {what} within the timeout); left out')
        yield f'{key}: {fig.get("title", "")}', header, rows, notes
        if 'controls' in fig:
            header, rows = _fig5_stages(fig)
            yield f'{key}: where the time went, stage by stage', header, rows, []
            header, rows = _fig5_tail(fig)
            if rows:
                yield (f'{key}: the slowest 1% (received -> restored from its p99 on): each '
                       "stage's own time, median of the slowest / of all"), header, rows, []
    yield 'targets', ['figure', 'target', 'measured', 'holds'], targets(results), []


def to_text(results):
    """Render every section as aligned plain-text columns."""
    out = []
    for title, header, rows, notes in sections(results):
        out.append(f'\n== {title}')
        if header:
            cells = [header] + [[str(c) for c in row] for row in rows]
            widths = [max(len(str(r[i])) for r in cells) for i in range(len(header))]
            for row in cells:
                out.append('  '.join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
        out += [f'  note: {n}' for n in notes]
    return '\n'.join(out)


def to_markdown(results):
    """Render every section as a Markdown table."""
    out = []
    for title, header, rows, notes in sections(results):
        out.append(f'\n#### {title}\n')
        if header:
            out.append('| ' + ' | '.join(header) + ' |')
            out.append('|' + '---|' * len(header))
            out += ['| ' + ' | '.join(str(c) for c in row) + ' |' for row in rows]
        out += [f'\n_Note: {n}_' for n in notes]
    return '\n'.join(out) + '\n'
