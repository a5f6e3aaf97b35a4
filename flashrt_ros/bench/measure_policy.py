"""
Policy-mode latency figures (not a unit test): control step and restore vs the cold path.

    python -m flashrt_ros.bench.measure_policy [--model builtin:tiny-policy] [--device cpu]
                                               [--lengths 100 1000 10000]

At each episode length L (observations already folded into the state):
  * control step : one Runtime.act() at step ~L, the committed boundary (rollback-ring
                   capture) included; `ring_commit_s` is that capture alone;
  * restore      : Runtime.restore() of a device capsule taken at step L;
  * warm next    : restore + act(next observation) -> the next chunk;
  * cold next    : reset + re-run the L-step history from the episode start + act(next
                   observation). Batched = the history in one act([L, obs_dim]) call
                   (chunked prefill, the fastest cold path; its chunk is bit-identical to
                   the warm one); stepwise = one act() per observation, what replaying the
                   recorded messages costs (skipped above `stepwise_max`: ~L control steps).
`measure_policy()` returns a dict so a benchmark module can reuse it.
"""

from __future__ import annotations

import argparse
import statistics
import time

from flashrt_ros.runtime import Runtime, RuntimeConfig
import torch

from .measure import sample_s, sync


def _summary(times: list[float]) -> dict:
    ordered = sorted(times)
    return {'median_s': statistics.median(ordered), 'best_s': ordered[0],
            'p99_s': ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 'n': len(ordered)}


def _timed(rt: Runtime, fn):
    sync(rt.device)
    t0 = time.perf_counter()
    result = fn()
    sync(rt.device)
    return result, time.perf_counter() - t0


def measure_length(rt: Runtime, history: torch.Tensor, repeats: int, stepwise: bool,
                   cold_repeats: int = 3) -> dict:
    """Figures at episode length len(history) - 1 (see the module docstring); medians."""
    length, nxt = len(history) - 1, history[-1]

    def cold_batched():
        rt.reset()
        rt.act(history[:length])
        return rt.act(nxt)

    def warm():
        rt.restore('measure-policy')
        return rt.act(nxt)

    cold_chunk = cold_batched()
    cold_s = statistics.median(sample_s(cold_batched, cold_repeats, rt.device))
    rt.reset()
    rt.act(history[:length])
    info = rt.snapshot('measure-policy', tier='device')
    rt.restore('measure-policy')  # warm the copy path
    restore = sample_s(lambda: rt.restore('measure-policy'), repeats, rt.device)
    warm_chunk = warm()
    warm_s = statistics.median(sample_s(warm, repeats, rt.device))
    rt.restore('measure-policy')
    steps = [rt.act(history[i % length]).latency_s for i in range(repeats)]
    rt.restore('measure-policy')
    commit = sample_s(rt.writer.commit, repeats, rt.device)  # capture + ring push, as act() does
    result = {
        'length': length,
        'capsule_bytes': info.nbytes,
        'control_step': _summary(steps),
        'ring_commit': _summary(commit),
        'restore': _summary(restore),
        'warm_next_chunk_s': warm_s,
        'cold_batched_next_chunk_s': cold_s,
        'batched_speedup': cold_s / warm_s,
        'same_actions': torch.equal(cold_chunk.actions, warm_chunk.actions),
        'cold_stepwise_next_chunk_s': None,
        'stepwise_speedup': None,
    }
    if stepwise:
        def cold_stepwise():
            rt.reset()
            for obs in history[:length]:
                rt.act(obs)
            return rt.act(nxt)

        _, stepwise_s = _timed(rt, cold_stepwise)
        result.update(cold_stepwise_next_chunk_s=stepwise_s,
                      stepwise_speedup=stepwise_s / warm_s)
    rt.delete_capsule('measure-policy')
    rt.reset()
    return result


def measure_policy(model: str = 'builtin:tiny-policy', device: str = 'cpu',
                   dtype: str = 'float32', lengths=(100, 1000, 10000), repeats: int = 30,
                   stepwise_max: int = 1000, seed: int = 0,
                   capsule_dir: str = '/tmp/flashrt_measure_policy') -> dict:
    """Return control-step and restore latency vs the cold re-run at each episode length."""
    rt = Runtime(RuntimeConfig(model=model, device=device, dtype=dtype,
                               max_seq_len=max(lengths) + repeats + 8, device_budget_bytes=0,
                               rollback_depth=8, capsule_dir=capsule_dir))
    try:
        rt.warmup()
        g = torch.Generator().manual_seed(seed)
        history = torch.randn(max(lengths) + 1, rt.policy_spec.obs_dim, generator=g)
        rt.act(history[:min(max(lengths), 2048)])  # the first long batched call pays a
        rt.reset()  # one-time setup on CPU; keep it out of the first length's figure
        figures = [measure_length(rt, torch.cat([history[:n], history[-1:]]), repeats,
                                  stepwise=n <= stepwise_max)
                   for n in lengths]
        return {'model': model, 'device': device, 'dtype': dtype,
                'state_nbytes': rt.state_nbytes, 'stepwise_max': stepwise_max,
                'lengths': figures}
    finally:
        rt.close()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument('--model', default='builtin:tiny-policy')
    p.add_argument('--device', default='cpu')
    p.add_argument('--dtype', default='float32')
    p.add_argument('--lengths', type=int, nargs='+', default=[100, 1000, 10000])
    p.add_argument('--stepwise-max', type=int, default=1000,
                   help='longest episode re-run one observation at a time')
    args = p.parse_args(argv)
    r = measure_policy(args.model, args.device, args.dtype, args.lengths,
                       stepwise_max=args.stepwise_max)
    ms = 1e3
    print(f'model {r["model"]} on {r["device"]} ({r["dtype"]}), arena {r["state_nbytes"]} '
          'bytes')
    for f in r['lengths']:
        stepwise = ('skipped (> --stepwise-max)' if f['cold_stepwise_next_chunk_s'] is None
                    else f'{f["cold_stepwise_next_chunk_s"] * ms:.1f} ms '
                    f'({f["stepwise_speedup"]:.0f}x)')
        print(f'[L={f["length"]}] control step {f["control_step"]["median_s"] * ms:.2f} ms '
              f'(p99 {f["control_step"]["p99_s"] * ms:.2f}, ring commit '
              f'{f["ring_commit"]["median_s"] * ms:.3f}) | restore '
              f'{f["restore"]["median_s"] * ms:.3f} ms ({f["capsule_bytes"]} bytes) | next chunk: '
              f'warm {f["warm_next_chunk_s"] * ms:.2f} ms, cold batched '
              f'{f["cold_batched_next_chunk_s"] * ms:.1f} ms ({f["batched_speedup"]:.0f}x, same '
              f'actions {f["same_actions"]}), cold stepwise {stepwise}')


if __name__ == '__main__':
    main()
