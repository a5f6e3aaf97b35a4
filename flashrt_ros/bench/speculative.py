"""
Speculative greedy decoding vs plain greedy decoding, side by side in one run.

python -m flashrt_ros.bench.speculative [--model M] [--tokens N] [--repeats R]

Every configuration decodes the same greedy turn from the same prompt capsule, the
repeats interleaved (plain, k=1, k=2, k=3, the brackets, then again), so machine load hits
them alike. Rows:
  plain              speculation off (no head state in the arena)
  k=1..3             batched verify, drafts from the model's MTP head: the measured figure
  sequential k=2     one step per token (bit-exact reference; never faster)
  always-right k=3   scripted drafts from the plain run's tokens: the ceiling, not a speedup
  always-wrong k=3   scripted wrong drafts: the floor (every round rejects every draft)
Every speculative row must decode the plain row's tokens; the run says where not.
Also reported: the arena and capsule size with the head state, and restore latency.
"""

import argparse
import json
import os
import sys
import tempfile
import time

from flashrt_ros.runtime import Runtime, RuntimeConfig

from .common import Log, ratio, summarize

PROMPT = 'The robot arm picks up the red cube and places it on the shelf. Then it'
RESTORES = 60  # restores per runtime for the latency figure


def _config(model, device, dtype, max_seq_len, capsule_dir, **kw):
    return RuntimeConfig(model=model, device=device, dtype=dtype, max_seq_len=max_seq_len,
                         capsule_dir=capsule_dir, rollback_depth=2, prompt_format='raw', **kw)


def _rows(model, k_max):
    rows = [('plain', {}, None)]
    for k in range(1, k_max + 1):
        rows.append((f'k={k}', {'speculative_tokens': k}, None))
    rows.append(('sequential k=2', {'speculative_tokens': 2,
                                    'speculative_verify': 'sequential'}, None))
    rows.append((f'always-right k={k_max}', {'speculative_tokens': k_max}, 'right'))
    rows.append((f'always-wrong k={k_max}', {'speculative_tokens': k_max}, 'wrong'))
    return rows


def _script(ids, kind, vocab):
    def script(position, pending, k):
        true = ids[position + 1:position + 1 + k]
        return true if kind == 'right' else [(t + 1) % vocab for t in true]
    return script


def _turn(rt, tokens):
    """Restore the prompt capsule and time one greedy turn; return (ids, seconds)."""
    rt.restore('prompt')
    t0 = time.perf_counter()
    gen = rt.generate(max_new_tokens=tokens, stop=(), eos=False)
    ids = [e.token_id for e in gen]
    return ids, time.perf_counter() - t0


def _restore_s(rt, n):
    """Median seconds of a full restore of the prompt capsule (another lineage each time)."""
    samples = []
    for _ in range(n):
        rt.reset()
        t0 = time.perf_counter()
        rt.restore('prompt')
        samples.append(time.perf_counter() - t0)
    return summarize(samples, 1e3)


def run(model, tokens, repeats, k_max, log, device='cpu', dtype='float32'):
    with tempfile.TemporaryDirectory() as capsules:
        max_seq_len = 1024
        runtimes = {}
        for name, kw, script in _rows(model, k_max):
            spec = name != 'plain'
            rt = Runtime(_config(model, device, dtype, max_seq_len, capsules, speculation=spec,
                                 **kw))
            rt.warmup()  # on CUDA: the decode step's graph, and the rounds' beside it
            runtimes[name] = (rt, script)
        plain = runtimes['plain'][0]
        note = runtimes['k=1'][0].stats().speculation
        if not note.get('enabled'):
            raise SystemExit(f'{model}: speculation is {note.get("note")}')
        for name, (rt, _) in runtimes.items():
            rt.prefill(PROMPT)
            rt.snapshot('prompt')
        reference, _ = _turn(plain, tokens)
        ids = plain.arena.views['tokens'][:plain.position].tolist() + [plain.cursor.pending]
        vocab = plain.adapter.vocab_size
        for name, (rt, script) in runtimes.items():
            if script is not None:
                rt.speculator.script = _script(ids, script, vocab)
            _turn(rt, tokens)  # warm-up, and the acceptance counters start after it
            if rt.speculator is not None:
                rt.speculator.reset_stats()
        samples = {name: [] for name in runtimes}
        identical = dict.fromkeys(runtimes, True)
        for r in range(repeats):
            for name, (rt, _) in runtimes.items():
                out, seconds = _turn(rt, tokens)
                samples[name].append(tokens / seconds)
                identical[name] &= out == reference
            log(f'repeat {r + 1}/{repeats} done')
        result = {'model': model, 'device': device, 'dtype': dtype, 'tokens': tokens,
                  'repeats': repeats, 'rows': {}}
        plain_tps = summarize(samples['plain'])['median']
        for name, (rt, _) in runtimes.items():
            tps = summarize(samples[name])
            row = {'tokens_per_s': tps, 'ratio_to_plain': ratio(tps['median'], plain_tps),
                   'token_identical': identical[name],
                   'state_nbytes': rt.state_nbytes,
                   'capsule_nbytes': rt.store.get('prompt').nbytes,
                   'restore_ms': _restore_s(rt, RESTORES)}
            if rt.speculator is not None:
                row['speculation'] = rt.speculator.stats()
            result['rows'][name] = row
            log(f'{name}: {tps["median"]:.1f} tok/s')
        for rt, _ in runtimes.values():
            rt.close()
        return result


def to_markdown(result):
    rows = result['rows']
    plain = rows['plain']
    lines = [f"Model `{result['model']}`, {result['tokens']} greedy tokens per turn, "
             f"median of {result['repeats']} interleaved repeats "
             f"({result.get('device', 'cpu')}, {result.get('dtype', 'float32')}).", '',
             '| row | tokens/s (p10-p90) | vs plain | tokens per round | acceptance by depth '
             '| same tokens | capsule bytes | restore ms |',
             '|---|---|---|---|---|---|---|---|']
    for name, row in rows.items():
        t = row['tokens_per_s']
        spec = row.get('speculation')
        per_round = f"{spec['mean_accepted_length']:.2f}" if spec else '1'
        by_depth = ', '.join(f'{a:.2f}' for a in spec['acceptance_by_depth']) if spec else '-'
        r = row['restore_ms']
        lines.append(
            f"| {name} | {t['median']:.1f} ({t['p10']:.1f}-{t['p90']:.1f}) | "
            f"{row['ratio_to_plain']:.2f}x | {per_round} | {by_depth} | "
            f"{'yes' if row['token_identical'] else 'NO'} | {row['capsule_nbytes']} "
            f"({row['capsule_nbytes'] / plain['capsule_nbytes']:.3f}x) | {r['median']:.3f} "
            f"({r['median'] / plain['restore_ms']['median']:.2f}x) |")
    lines += ['', 'always-right is the ceiling of a perfect drafter and always-wrong the floor; '
              'neither is a measured speedup.']
    if result.get('device', 'cpu') != 'cpu':
        lines += [''] + [
            f"- {name}: round graphs {'captured' if spec['cuda_graphs'] else 'off'}"
            f"{'' if spec['cuda_graphs'] else ' (' + str(spec['cuda_graph_note']) + ')'}, "
            f"{spec['cuda_graph_replays']} replays"
            for name, spec in ((n, r.get('speculation')) for n, r in rows.items())
            if spec and spec['verify'] == 'batched']
    return '\n'.join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(prog='python -m flashrt_ros.bench.speculative',
                                description=__doc__.strip().split('\n')[0])
    p.add_argument('--model', default='builtin:tiny-hybrid',
                   help='built-in id or local checkpoint directory with mtp.* weights')
    p.add_argument('--tokens', type=int, default=96)
    p.add_argument('--repeats', type=int, default=5)
    p.add_argument('--k-max', type=int, default=3)
    p.add_argument('--threads', type=int, help='torch threads (default: what torch picks)')
    p.add_argument('--device', default='cpu', help="'cpu' or 'cuda[:N]' (CUDA: graphs on)")
    p.add_argument('--dtype', default='float32',
                   help='float32 (the rows must decode the same tokens) or bfloat16')
    p.add_argument('--out', default='build/bench-results', help='directory of the JSON')
    args = p.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    result = run(args.model, args.tokens, args.repeats, args.k_max, Log(), args.device,
                 args.dtype)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, 'speculative.json'), 'w') as f:
        json.dump(result, f, indent=2)
    text = to_markdown(result)
    with open(os.path.join(args.out, 'speculative.md'), 'w') as f:
        f.write(text + '\n')
    print(text)
    differ = [name for name, row in result['rows'].items() if not row['token_identical']]
    if differ:
        print(f'rows that decode other tokens than plain decoding: {", ".join(differ)}')
        return 1
    return 0


if __name__ == '__main__':
    sys.exit(main())
