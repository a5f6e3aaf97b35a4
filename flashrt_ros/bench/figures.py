"""
Figures 1-4 and 6: runtime-level measurements, each side by side with its baseline.

Every function takes the Runtime, the Plan and a progress Log, leaves the runtime reset
with no capsules of its own behind, and returns a JSON-ready dict.
"""

import dataclasses
import os

from flashrt_ros.runtime import Runtime
from flashrt_ros.runtime.config import TIERS
from flashrt_ros.runtime.state.arena import copy_into
import numpy as np
import torch

from .common import PAPER, ratio, summarize
from .measure import (
    arena_decode_tps,
    cpu_info,
    dynamic_cache_decode_tps,
    first_token_s,
    hf_generate_decode_tps,
    paired_decode_rounds,
    prefill_layer_times,
    raw_copy,
    restored_first_token_s,
    sample_after_idle_s,
    sample_interleaved_s,
    token_ids,
)
from .peer import open_peer, peer_decode_tps, skip_reason

PREFILL_GROWTH = 1.25  # predicted cold-prefill time grows as length ** this (a bit superlinear)
ATTENTION_TYPES = ('full_attention', 'sliding_attention', 'attention')
IDLE_S, IDLE_REPEATS = 0.05, 10  # fig1's restores after a quiet moment
FIG5_NODES = ('waitset', 'waitset_rt', 'single_rt', 'shared')  # through_ros.CONTROLS' labels


@dataclasses.dataclass
class Plan:
    """How much to measure: lengths, sample counts, budgets (set by --quick and options)."""

    quick: bool
    lengths: list      # context lengths of figures 2 and 6
    sizes: list        # live positions (state sizes) of figure 1
    repeats: int       # samples of slow measurements (cold prefills, decode rounds)
    fast_repeats: int  # samples of fast ones (snapshot, restore, copies)
    budget_s: float    # seconds one context length may spend on slow samples
    decode_steps: int  # figure 4: tokens per decode round
    decode_rounds: int  # figure 4: rounds, each path once per round
    correctness_steps: int
    round_trips: int   # figure 5: service round-trips of each kind
    interrupts: int    # figure 5: interrupts while generating
    node_model: str    # figure 5: the model the node process runs
    workdir: str       # scratch directory (capsule files, raw-copy files)
    transfer_model: str = 'builtin:bench-hybrid'  # figure 7: the model of both node processes
    transfer_context: int = 8192  # figure 7: tokens of the hand-over vs cold prefill
    fig5_nodes: tuple = FIG5_NODES  # figure 5: the control configurations, a node each


def _mb_per_s(nbytes, seconds):
    return None if not seconds else nbytes / seconds / 1e6


def _stats_ms(samples):
    return summarize(samples, scale=1e3)


def _slow_samples(plan, length, last):
    """How many slow samples fit the budget at `length`, and why none when 0."""
    if last is None:
        return plan.repeats, ''
    last_len, last_s = last
    predicted = last_s * (length / last_len) ** PREFILL_GROWTH
    n = min(plan.repeats, int(plan.budget_s // predicted) - 1)  # one more builds the capsule
    if n >= 1:
        return n, ''
    return 0, (f'{length} tokens skipped: one cold prefill is predicted to take {predicted:.0f} s '
               f'({last_s:.1f} s at {last_len} tokens, scaled by length^{PREFILL_GROWTH}); '
               f'two of them exceed the {plan.budget_s:.0f} s budget per length (--budget-s)')


def _extend_prefix(rt, prefix, last_capsule, length, name):
    """Make capsule `name` hold the state after prefix[:length], from the previous capsule."""
    if last_capsule is None:
        rt.reset()
        start = 0
    else:
        start, previous = last_capsule
        rt.restore(previous)
    rt.prefill(prefix[start:length])
    rt.snapshot(name, 'device')


def _greedy(rt, steps):
    gen = rt.generate(max_new_tokens=steps, stop=(), eos=False)
    return [event.token_id for event in gen]


def _first_mismatch(ids, reference):
    for i, (a, b) in enumerate(zip(ids, reference)):
        if a != b:
            return i
    return None if len(ids) == len(reference) else min(len(ids), len(reference))


def _cleanup(rt, prefix):
    for info in rt.list_capsules():
        if info.name.startswith(prefix):
            rt.delete_capsule(info.name)
    rt.reset()


# ---- figure 1 -------------------------------------------------------------------------


def _raw_file_io(directory, nbytes, device):
    """Functions that write nbytes atomically (temp file, fsync, rename) and read them back."""
    data = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8).tobytes()
    path = os.path.join(directory, 'raw-copy.bin')

    def write():
        with open(path + '.tmp', 'wb') as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + '.tmp', path)
        fd = os.open(directory, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    def read():
        torch.from_numpy(np.fromfile(path, dtype=np.uint8)).to(device)

    write()
    return write, read


def _raw_copies(rt, tier, nbytes, plan):
    """Bare copies of nbytes in the snapshot and the restore direction, and what they are."""
    dev = rt.device
    if tier == 'device':
        copy = raw_copy(nbytes, dev, dev)
        return copy, copy, f'copy_ {dev.type} -> {dev.type}'
    if tier == 'host':
        return (raw_copy(nbytes, dev, 'cpu'), raw_copy(nbytes, 'cpu', dev),
                f'copy_ {dev.type} <-> host memory')
    write, read = _raw_file_io(plan.workdir, nbytes, dev)
    return write, read, 'file write+fsync+rename / file read (no checksum)'


def _restore_views(rt, name):
    """Return (arena, blob) views a full restore of memory capsule `name` copies between."""
    cap = rt.store.get(name)
    return rt.arena.copy_pair(cap.blob, cap.packing)


def fig1_snapshot_restore(rt, plan, log):
    """Snapshot and restore latency vs state size for each tier, against raw copies."""
    ids = token_ids(max(plan.sizes), seed=11)
    rows, position = [], 0
    rt.reset()
    for size in plan.sizes:
        rt.prefill(ids[position:size])
        position = size
        for tier in TIERS:
            name = f'bench-f1-{tier}'
            rt.snapshot(name, tier)
            # Bytes the tier holds: the blob in memory, the file (blob + header) on disk.
            nbytes = next(i.nbytes for i in rt.list_capsules(tier) if i.name == name)
            raw_snapshot, raw_restore, raw_what = _raw_copies(rt, tier, nbytes, plan)
            # Ours and the raw copies take turns, so a noisy neighbour hits both alike. Each
            # snapshot makes a new capsule, so each round has a first restore (which makes
            # the views it copies from) and a repeated one (the interrupt/reset path). Both
            # find the live state in the capsule's lineage and skip the sequence rows it
            # already holds. The full restores run after the lineage was forgotten (as after
            # a restore from another branch or from disk) and copy every byte; the second
            # one, with its views made, is the one compared with the raw copy.
            forget, restore = rt.arena.begin_epoch, lambda: rt.restore(name)
            fns = [lambda: rt.snapshot(name, tier), raw_snapshot, restore, restore, forget,
                   restore, forget, restore, raw_restore]
            if tier == 'device':
                # The copy a full restore makes, alone: the round's capsule into the arena
                # through the same views, after a restore and a forgotten lineage as the full
                # restore runs. The arena holds that capsule's bytes, so nothing changes.
                views = []
                fns += [lambda: views.__setitem__(slice(None), _restore_views(rt, name)),
                        restore, forget, lambda: copy_into(*views)]
            times = sample_interleaved_s(fns, plan.fast_repeats, rt.device)
            snap, raw_snap, first, rest, _, _, _, full, raw_rest = times[:9]
            if tier == 'device':
                # After a quiet moment, as an interrupt comes: a full restore and the raw copy.
                idle = sample_after_idle_s([restore, raw_restore], IDLE_REPEATS, rt.device,
                                           IDLE_S, before=forget)
            rt.delete_capsule(name)
            row = {'position': size, 'tier': tier, 'bytes': nbytes, 'raw_copy': raw_what,
                   'snapshot_ms': _stats_ms(snap), 'restore_ms': _stats_ms(full),
                   'restore_same_lineage_ms': _stats_ms(rest),
                   'first_restore_ms': _stats_ms(first),
                   'raw_snapshot_ms': _stats_ms(raw_snap), 'raw_restore_ms': _stats_ms(raw_rest)}
            for op in ('snapshot', 'restore'):
                ours, raw = row[f'{op}_ms']['median'], row[f'raw_{op}_ms']['median']
                row[f'{op}_vs_raw'] = ratio(ours, raw)
                row[f'{op}_mb_per_s'] = _mb_per_s(nbytes, ours / 1e3)
                row[f'raw_{op}_mb_per_s'] = _mb_per_s(nbytes, raw / 1e3)
            row['restore_same_lineage_vs_raw'] = ratio(
                row['restore_same_lineage_ms']['median'], row['raw_restore_ms']['median'])
            if tier == 'device':
                row['restore_copy_ms'] = _stats_ms(times[12])
                row['restore_copy_vs_raw'] = ratio(row['restore_copy_ms']['median'],
                                                   row['raw_restore_ms']['median'])
                # What the restore spends beside its copy: checks, lineage, meta, ring.
                row['restore_rest_us'] = 1e3 * (row['restore_ms']['median']
                                                - row['restore_copy_ms']['median'])
                row['idle_s'] = IDLE_S
                row['idle_restore_ms'], row['idle_raw_restore_ms'] = map(_stats_ms, idle)
            rows.append(row)
            log(f'fig1 position {size} {tier}: {nbytes / 2**20:.2f} MiB, restore '
                f'{row["restore_ms"]["median"]:.3f} ms (same lineage '
                f'{row["restore_same_lineage_ms"]["median"]:.3f}) vs raw '
                f'{row["raw_restore_ms"]["median"]:.3f} ms')
    _cleanup(rt, 'bench-f1-')
    device_rows = [r for r in rows if r['tier'] == 'device']
    return {
        'title': 'Snapshot / restore latency vs state size, per tier, vs a raw copy of the '
                 'same bytes',
        'rows': rows,
        'target': 'device-tier full restore (every byte copied) within 1.3x of a raw copy_ '
                  'of the same bytes',
        'target_holds': all(r['restore_vs_raw'] <= 1.3 for r in device_rows),
        'target_holds_at': [r['position'] for r in device_rows if r['restore_vs_raw'] <= 1.3],
    }


# ---- figure 2 -------------------------------------------------------------------------


def fig2_ttft(rt, plan, log):
    """Restore a capsule + first token vs cold prefill + first token, per context length."""
    prefix, new = token_ids(max(plan.lengths), seed=2), token_ids(1, seed=3)
    rows, skipped, last, capsule = [], [], None, None
    for length in plan.lengths:
        n_cold, reason = _slow_samples(plan, length, last)
        if not n_cold:
            skipped.append(reason)
            log(f'fig2 {reason}')
            continue
        name = f'bench-ttft-{length}'
        _extend_prefix(rt, prefix, capsule, length, name)
        capsule = (length, name)
        cold, warm, tokens = [], [], set()
        for i in range(n_cold):
            rt.reset()
            seconds, token = first_token_s(rt, prefix[:length] + new)
            cold.append(seconds)
            tokens.add(('cold', token))
            log(f'fig2 {length} tokens: cold prefill {i + 1}/{n_cold} {seconds:.2f} s')
        for _ in range(plan.fast_repeats):
            rt.reset()
            seconds, token = restored_first_token_s(rt, name, new)
            warm.append(seconds)
            tokens.add(('warm', token))
        row = {'tokens': length, 'cold_prefill_ms': _stats_ms(cold),
               'restore_first_token_ms': _stats_ms(warm),
               'same_first_token': len({t for _, t in tokens}) == 1,
               'paper_speedup': PAPER['ttft_speedup'].get(length)}
        row['speedup'] = ratio(row['cold_prefill_ms']['median'],
                               row['restore_first_token_ms']['median'])
        rows.append(row)
        last = (length, row['cold_prefill_ms']['median'] / 1e3)
        log(f'fig2 {length} tokens: cold {row["cold_prefill_ms"]["median"]:.1f} ms, restore + '
            f'first token {row["restore_first_token_ms"]["median"]:.2f} ms, '
            f'{row["speedup"]:.1f}x')
    _cleanup(rt, 'bench-ttft-')
    at = {r['tokens']: r['speedup'] for r in rows}
    return {
        'title': 'Time to first token: restore capsule + first token vs cold prefill',
        'rows': rows,
        'skipped': skipped,
        'paper': {str(k): v for k, v in PAPER['ttft_speedup'].items()},
        'target': 'speedup >= 3.9x (paper) at 2k tokens, far more at 8k',
        'target_holds': (at[2048] >= PAPER['ttft_speedup'][2048]) if 2048 in at else None,
    }


# ---- figure 3 -------------------------------------------------------------------------


def fig3_correctness(rt, plan, log):
    """Byte-exact restore, token-identical greedy decode, and the KV-only ablation diverging."""
    steps = plan.correctness_steps
    rt.reset()
    rt.prefill(token_ids(128, seed=5))
    for tier in TIERS:
        rt.snapshot(f'bench-exact-{tier}', tier)
    digest = rt.state_digest()
    reference = _greedy(rt, steps)
    advanced = rt.state_digest() != digest
    tiers = {}
    for tier in TIERS:
        rt.restore(f'bench-exact-{tier}')
        exact = rt.state_digest() == digest
        ids = _greedy(rt, steps)
        tiers[tier] = {'byte_exact': exact, 'token_identical': ids == reference,
                       'first_mismatch': _first_mismatch(ids, reference),
                       'match': [a == b for a, b in zip(ids, reference)]}
        log(f'fig3 {tier}: byte-exact {exact}, {steps} tokens identical {ids == reference}')
    # The live state is now 64 tokens past the capsule: a KV-only restore brings back the
    # attention KV and the metadata but leaves that later recurrent and conv state in place.
    rt.restore('bench-exact-device', mode='kv_only')
    kv_exact = rt.state_digest() == digest
    ablation = _greedy(rt, steps)
    first = _first_mismatch(ablation, reference)
    log(f'fig3 kv_only: first diverging step {first}')
    _cleanup(rt, 'bench-exact-')
    passed = (all(t['byte_exact'] and t['token_identical'] for t in tiers.values())
              and first is not None)
    return {
        'title': 'Correctness: byte-exact restore, token-identical decode, KV-only ablation',
        'steps': steps,
        'state_advanced_by_decode': advanced,
        'tiers': tiers,
        'kv_only': {'byte_exact': kv_exact, 'diverged': first is not None,
                    'first_diverging_step': first,
                    'match': [a == b for a, b in zip(ablation, reference)]},
        'passed': passed,
    }


# ---- figure 4 -------------------------------------------------------------------------


def _without_fastpath(rt, fn):
    """Run fn() with the adapter's decode fast path off (every step through transformers)."""
    saved, rt.adapter.fastpath = rt.adapter.fastpath, None
    try:
        return fn()
    finally:
        rt.adapter.fastpath = saved


def _float32_beside(rt):
    """Return the same model in float32 with the compiled step, beside a bf16 one (or None)."""
    if rt.device.type != 'cpu' or rt.adapter.dtype != torch.bfloat16 or getattr(
            rt.adapter, 'cpu_step', None) is None:
        return None
    wide = Runtime(dataclasses.replace(rt.config, dtype='float32'))
    if wide.adapter.cpu_step is None:
        wide.close()
        return None
    wide.warmup()
    return wide


def fig4_decode(rt, plan, log, peer_python=None):
    """Greedy decode tokens/s: arena engine vs DynamicCache, generate() and llama.cpp, paired."""
    ids, steps, model, dev = token_ids(64, seed=1), plan.decode_steps, rt.adapter.model, rt.device
    eager = peer = None
    peer_skipped = skip_reason(rt, peer_python)
    if peer_skipped is None:
        peer, about = open_peer(rt, plan, peer_python, len(ids) + steps + 16, log)
    if dev.type == 'cuda':
        eager = Runtime(dataclasses.replace(rt.config, cuda_graphs=False))
        eager.warmup()
    rt.reset()
    rt.warmup()
    paths = {
        'arena': lambda: arena_decode_tps(rt, ids, steps),
        'dynamic_cache_loop': lambda: dynamic_cache_decode_tps(model, ids, steps, dev),
        'dynamic_cache_loop_inference_mode':
            lambda: dynamic_cache_decode_tps(model, ids, steps, dev, inference_mode=True),
        'hf_generate': lambda: hf_generate_decode_tps(model, ids, steps, dev),
    }
    if eager is not None:
        paths['arena_no_cuda_graph'] = lambda: arena_decode_tps(eager, ids, steps)
    if getattr(rt.adapter, 'fastpath', None) is not None:
        paths['arena_no_fastpath'] = lambda: _without_fastpath(
            rt, lambda: arena_decode_tps(rt, ids, steps))
    wide = _float32_beside(rt)  # a bf16 model's compiled step against its float32 one
    if wide is not None:
        paths['arena_float32'] = lambda: arena_decode_tps(wide, ids, steps)
    if peer is not None:
        paths['llama_cpp'] = peer_decode_tps(peer, ids, steps)
    rounds = plan.decode_rounds
    try:
        runs = paired_decode_rounds(paths, rounds)
    finally:
        if peer is not None:
            peer.close()
    for other in (eager, wide):
        if other is not None:
            other.close()
    rt.reset()
    for i in range(rounds):
        log(f'fig4 round {i + 1}/{rounds}: ' + ', '.join(
            f'{k} {v[i]:.1f} tok/s' for k, v in runs.items()))
    # Round by round: each round's paths ran back to back, so drift cancels.
    over = {k: summarize([a / b for a, b in zip(runs['arena'], v)])
            for k, v in runs.items() if k != 'arena'}
    result = {
        'title': 'Decode tokens/s: arena-bound engine vs transformers DynamicCache',
        'steps': steps,
        'rounds': rounds,
        'prompt_tokens': len(ids),
        'cuda_graph': rt.stats().cuda_graph,
        'fastpath': getattr(rt.adapter, 'fastpath', None) is not None,
        'fastpath_note': getattr(rt.adapter, 'fastpath_note', None),
        'dtype': str(rt.adapter.dtype).removeprefix('torch.'),
        'cpu_info': cpu_info(rt) if dev.type == 'cpu' else None,
        'tokens_per_s': {k: summarize(v) for k, v in runs.items()},
        'arena_over': over,
        'ratio_vs_dynamic_cache_loop': over['dynamic_cache_loop']['median'],
        'ratio_vs_hf_generate': over['hf_generate']['median'],
        'target': 'arena tokens/s >= DynamicCache tokens/s (ratio >= 1.0; median of the '
                  'per-round ratios)',
    }
    if eager is not None:
        result['cuda_graph_speedup'] = over['arena_no_cuda_graph']['median']
    if 'arena_no_fastpath' in over:
        result['fastpath_speedup'] = over['arena_no_fastpath']['median']
    if wide is not None:
        result['bf16_over_float32'] = over['arena_float32']['median']
    if peer is not None:
        result['ratio_vs_llama_cpp'] = over['llama_cpp']['median']
        result['llama_cpp'] = about
    else:
        result['llama_cpp_skipped'] = peer_skipped
    result['target_holds'] = result['ratio_vs_dynamic_cache_loop'] >= 1.0
    return result


# ---- figure 6 -------------------------------------------------------------------------


def fig6_kv_only_prefix(rt, plan, log):
    """KV-only prefix caching (then rebuild the non-KV state) vs restoring a capsule."""
    prefix = token_ids(max(plan.lengths), seed=2)
    rows, skipped, last, capsule = [], [], None, None
    for length in plan.lengths:
        n_slow, reason = _slow_samples(plan, length, last)
        if not n_slow:
            skipped.append(reason)
            log(f'fig6 {reason}')
            continue
        name = f'bench-kvp-{length}'
        _extend_prefix(rt, prefix, capsule, length, name)
        capsule = (length, name)
        # Both restores copy every byte they restore: the live state's lineage is forgotten
        # first (a prefix cache serves states the live one does not descend from).
        _, full, _, kv_only = sample_interleaved_s(
            [rt.arena.begin_epoch, lambda: rt.restore(name), rt.arena.begin_epoch,
             lambda: rt.restore(name, mode='kv_only')], plan.fast_repeats, rt.device)
        needed, recurrent, total = [], [], []
        for _ in range(n_slow):
            times = prefill_layer_times(rt, prefix[:length])
            is_recurrent = [t not in ATTENTION_TYPES for t in times['layer_types']]
            if not any(is_recurrent) or 'unknown' in times['layer_types']:
                _cleanup(rt, 'bench-kvp-')
                return {'title': 'KV-only prefix caching vs capsule restore',
                        'skipped': ['the model config names no recurrent layers']}
            last_rec = max(i for i, r in enumerate(is_recurrent) if r)
            # Every recurrent layer's input depends on all layers below it: a KV-only cache
            # must recompute layers 0..last recurrent over the whole prefix.
            needed.append(sum(times['layer_s'][:last_rec + 1]))
            recurrent.append(sum(s for s, r in zip(times['layer_s'], is_recurrent) if r))
            total.append(times['total_s'])
        row = {'tokens': length, 'restore_ms': _stats_ms(full),
               'kv_only_restore_ms': _stats_ms(kv_only),
               'rebuild_needed_ms': _stats_ms(needed),
               'rebuild_recurrent_only_ms': _stats_ms(recurrent),
               'cold_prefill_ms': _stats_ms(total)}
        kv = row['kv_only_restore_ms']['median']
        row['kv_prefix_path_ms'] = kv + row['rebuild_needed_ms']['median']
        row['kv_prefix_oracle_ms'] = kv + row['rebuild_recurrent_only_ms']['median']
        row['kv_prefix_vs_capsule'] = ratio(row['kv_prefix_path_ms'], row['restore_ms']['median'])
        row['oracle_vs_capsule'] = ratio(row['kv_prefix_oracle_ms'],
                                         row['restore_ms']['median'])
        rows.append(row)
        last = (length, row['cold_prefill_ms']['median'] / 1e3)
        log(f'fig6 {length} tokens: capsule restore {row["restore_ms"]["median"]:.3f} ms, '
            f'KV-only + rebuild {row["kv_prefix_path_ms"]:.1f} ms '
            f'({row["kv_prefix_vs_capsule"]:.0f}x)')
    _cleanup(rt, 'bench-kvp-')
    return {
        'title': 'KV-only prefix caching (restore KV, re-prefill the recurrent layers) vs '
                 'capsule restore',
        'rows': rows,
        'skipped': skipped,
    }
