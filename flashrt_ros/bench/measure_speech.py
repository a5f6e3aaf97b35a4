"""
Speech-mode figures (not a unit test): frame step vs real time, restore vs re-encoding.

    python -m flashrt_ros.bench.measure_speech [--model builtin:tiny-stt] [--device cpu]
                                               [--seconds 5 30 120] [--threads 1]
                                               [--out build/bench-results]

  * frame step : one Runtime.feed_audio() of one 80 ms frame (codec encoder, decoder step,
                 the rollback-ring commit), at every frame of a 120 s utterance; the real-time
                 factor is its time over 80 ms;
  * restore    : Runtime.restore() of a device capsule taken after L seconds of audio;
  * re-encode  : reset + feed the L seconds again from the utterance start (the cold path
                 of a voice stack that keeps only text), in one feed_audio call; the state
                 it reaches is checked to be the capsule's, byte for byte.

Writes <out>/speech.json and, with matplotlib, <out>/speech.png; prints the table.
`measure_speech()` returns the dict.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

from flashrt_ros.runtime import Runtime, RuntimeConfig
import numpy as np
import torch

from .measure import sample_s

FRAME_S = 0.08


def synthetic_audio(seconds: float, rate: int, seed: int = 0) -> np.ndarray:
    """Speech-like float32 audio: syllable-rate bursts of a gliding tone over noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    glide = 180 * (1 + 0.2 * np.sin(2 * np.pi * 1.5 * t))
    tone = 0.3 * np.sin(2 * np.pi * np.cumsum(glide) / rate) * (np.sin(2 * np.pi * 4 * t) > 0)
    return (tone + 0.02 * rng.standard_normal(t.size)).astype(np.float32)


def _median_ms(times) -> float:
    return statistics.median(times) * 1e3


def measure_speech(model: str = 'builtin:tiny-stt', device: str = 'cpu',
                   seconds=(5, 30, 120), repeats: int = 50, cold_repeats: int = 2,
                   capsule_dir: str | None = None) -> dict:
    """Return the per-frame latency curve and restore vs re-encode at each length."""
    capsule_dir = capsule_dir or tempfile.mkdtemp(prefix='flashrt_speech_')
    longest = max(seconds)
    rt = Runtime(RuntimeConfig(model=model, device=device, device_budget_bytes=0,
                               max_seq_len=int(longest / FRAME_S) + 16, rollback_depth=8,
                               capsule_dir=capsule_dir))
    try:
        rt.warmup()
        spec = rt.speech_spec
        audio = synthetic_audio(longest, spec.sample_rate)
        frame = spec.frame_size
        frame_s = []  # per-frame wall time, frame by frame through the whole utterance
        marks = {round(s / FRAME_S): s for s in seconds}
        digests = {}
        for f in range(len(audio) // frame):
            t = sample_s(lambda: rt.feed_audio(audio[f * frame:(f + 1) * frame]), 1, rt.device)
            frame_s.append(t[0])
            if f + 1 in marks:
                rt.snapshot(f'speech-{marks[f + 1]}s')
                digests[marks[f + 1]] = rt.state_digest()
        rows = []
        for s in seconds:
            name = f'speech-{s}s'
            rt.restore(name)  # warm the copy path
            restore = sample_s(lambda: rt.restore(name), repeats, rt.device)
            history = audio[:round(s / FRAME_S) * frame]

            def cold():
                rt.reset()
                rt.feed_audio(history)

            cold_s = sample_s(cold, cold_repeats, rt.device)
            rows.append({'seconds': s, 'capsule_bytes': rt.store.get(name).packing.nbytes,
                         'restore_ms': _median_ms(restore),
                         'restore_p99_ms': sorted(restore)[int(0.99 * (len(restore) - 1))] * 1e3,
                         're_encode_ms': _median_ms(cold_s),
                         'speedup': statistics.median(cold_s) / statistics.median(restore),
                         'same_state': rt.state_digest() == digests[s]})
        steps = np.array(frame_s)
        return {'model': model, 'device': device, 'threads': torch.get_num_threads(),
                'state_nbytes': rt.state_nbytes, 'frame_ms': (steps * 1e3).tolist(),
                'frame_median_ms': float(np.median(steps) * 1e3),
                'frame_p99_ms': float(np.percentile(steps, 99) * 1e3),
                'rtf': float(np.median(steps) / FRAME_S), 'lengths': rows}
    finally:
        rt.close()


def pyplot():
    """Return matplotlib.pyplot on the Agg backend (no display needed); None without it."""
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save(fig, path: str) -> str:
    """Write `fig` as a PNG at `path`; return the path."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def plot(result: dict, path: str) -> str | None:
    """Draw the two panels as a PNG; None without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    ms = np.array(result['frame_ms'])
    a.plot(np.arange(len(ms)) * FRAME_S, ms, lw=0.6, label='frame step (feed_audio)')
    a.axhline(FRAME_S * 1e3, color='r', ls='--', label='real time (80 ms)')
    a.set(xlabel='audio in the utterance (s)', ylabel='ms per 80 ms frame', yscale='log',
          title=f'frame step: RTF {result["rtf"]:.3f} ({result["threads"]} threads)')
    a.legend()
    rows = result['lengths']
    x = np.arange(len(rows))
    b.bar(x - 0.2, [r['restore_ms'] for r in rows], 0.4, label='restore capsule')
    b.bar(x + 0.2, [r['re_encode_ms'] for r in rows], 0.4, label='re-encode the audio')
    for i, r in enumerate(rows):
        b.text(i, r['re_encode_ms'], f'{r["speedup"]:.0f}x', ha='center', va='bottom')
    b.set(xticks=x, xticklabels=[f'{r["seconds"]} s' for r in rows], yscale='log',
          ylabel='ms', title='back to the state after L seconds of audio')
    b.legend()
    path = save(fig, path)
    plt.close(fig)
    return path


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument('--model', default='builtin:tiny-stt')
    p.add_argument('--device', default='cpu')
    p.add_argument('--seconds', type=int, nargs='+', default=[5, 30, 120])
    p.add_argument('--threads', type=int, help='torch threads (default: what torch picks)')
    p.add_argument('--out', default='build/bench-results')
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    r = measure_speech(args.model, args.device, sorted(args.seconds))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, 'speech.json'), 'w') as f:
        json.dump(r, f, indent=1)
    png = plot(r, os.path.join(args.out, 'speech.png'))
    print(f'model {r["model"]} on {r["device"]} ({r["threads"]} threads), arena '
          f'{r["state_nbytes"]} bytes')
    print(f'frame step: median {r["frame_median_ms"]:.2f} ms, p99 {r["frame_p99_ms"]:.2f} ms '
          f'per 80 ms frame (RTF {r["rtf"]:.3f})')
    print('| audio | capsule bytes | restore ms (p99) | re-encode ms | speedup | same state |')
    print('|---|---|---|---|---|---|')
    for row in r['lengths']:
        print(f'| {row["seconds"]} s | {row["capsule_bytes"]} | {row["restore_ms"]:.3f} '
              f'({row["restore_p99_ms"]:.3f}) | {row["re_encode_ms"]:.0f} | '
              f'{row["speedup"]:.0f}x | {row["same_state"]} |')
    if png:
        print(f'figure: {png}')


if __name__ == '__main__':
    main()
