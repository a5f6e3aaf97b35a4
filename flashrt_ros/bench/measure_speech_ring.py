"""
Speech mode's rollback ring and long utterances (not a unit test).

    python -m flashrt_ros.bench.measure_speech_ring [--shapes tiny 1b] [--frames 40]
                                                    [--minutes 30] [--threads 1]
                                                    [--device cpu] [--out build/bench-results]

  * bytes per frame : what one committed 80 ms frame puts on the rollback ring: a delta
                      entry (the window rows the next frame overwrites and the rest of the
                      state) and a whole copy of the state (what every entry was before);
  * frames held     : how many such entries the default ring budget (256 MiB) holds;
  * rollback        : Runtime.rollback(N) of N = 1, 5 and 25 frames (25: 2 s), median, with
                      delta entries and with whole copies; the two land on the same bytes;
  * long utterance  : tiny-stt fed --minutes of synthetic audio frame by frame: the capsule's
                      and the ring's bytes and the frame step along the way.

The 1B shape (2048 wide, 16 layers, vocabulary 8001, 32 codebooks, window 375, Mimi's
default codec; random weights, the decoder in bfloat16) is written by this script as a
checkpoint folder in a temporary directory, loaded like any local checkpoint and deleted.
Writes <out>/speech_ring.json and, with matplotlib, <out>/speech_ring.png.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
import statistics
import tempfile
import time

from flashrt_ros.runtime import Runtime, RuntimeConfig
import numpy as np
import torch

from .measure import sample_s
from .measure_speech import FRAME_S, pyplot, save, synthetic_audio

BACK = (1, 5, 25)  # frames rolled back; 25 frames = 2 s
ONE_B = {'vocab_size': 8001, 'hidden_size': 2048, 'num_hidden_layers': 16,
         'num_attention_heads': 16, 'num_key_value_heads': 16, 'num_codebooks': 32,
         'sliding_window': 375}


def write_1b(directory: Path) -> str:
    """Write a random-weight Kyutai STT checkpoint of the 1B shape into `directory`."""
    from transformers import (KyutaiSpeechToTextConfig,
                              KyutaiSpeechToTextForConditionalGeneration)

    from ..runtime.models.speech import calibrate_codebooks
    from ..runtime.models.tokenizer import ByteTokenizer

    config = KyutaiSpeechToTextConfig(**ONE_B)
    torch.manual_seed(0)
    model = KyutaiSpeechToTextForConditionalGeneration(config).eval()
    calibrate_codebooks(model.codec_model, torch.Generator().manual_seed(0))
    model.model.to(torch.bfloat16)
    model.lm_head.to(torch.bfloat16)
    model.save_pretrained(str(directory))
    ByteTokenizer().save(directory)
    (directory / 'preprocessor_config.json').write_text(json.dumps(
        {'sampling_rate': 24000, 'audio_delay_seconds': 2.0}))
    return str(directory)


def _runtime(model: str, dtype: str, capsule_dir: str, device: str = 'cpu',
             **overrides) -> Runtime:
    values = {'model': model, 'device': device, 'dtype': dtype, 'max_seq_len': 64,
              'rollback_depth': 64, 'capsule_dir': capsule_dir}
    return Runtime(RuntimeConfig(**dict(values, **overrides)))


def measure_ring(model: str, dtype: str, frames: int, repeats: int, capsule_dir: str,
                 device: str = 'cpu') -> dict:
    """Return the ring's bytes per frame and rollback times, delta entries against copies."""
    out = {'model': model, 'dtype': dtype, 'device': device}
    rt = _runtime(model, dtype, capsule_dir, device, ring_budget_bytes=0)
    try:
        rt.warmup()
        spec = rt.speech_spec
        audio = synthetic_audio(2 * frames * FRAME_S + 1, spec.sample_rate)
        frame = spec.frame_size
        out['arena_bytes'] = rt.state_nbytes
        out['default_ring_budget'] = RuntimeConfig(model=model).sized_budgets(
            rt.state_nbytes)['ring']
        t0 = time.perf_counter()
        for kind, head_only in (('delta', True), ('whole', False)):
            rt.reset()
            rt.ring.head_only = head_only
            steps, digests = [], []
            for f in range(frames):
                t = sample_s(lambda: rt.feed_audio(audio[f * frame:(f + 1) * frame]), 1,
                             rt.device)
                steps.append(t[0])
                digests.append(rt.state_digest())
            commit = rt.stats().rollback_ring.last_commit_bytes
            back = {}
            for n in BACK:
                times = []
                for _ in range(repeats):
                    times += sample_s(lambda: rt.rollback(n), 1, rt.device)
                    assert rt.state_digest() == digests[-1 - n]
                    for f in range(frames - n, frames):  # forward again, the same frames
                        rt.feed_audio(audio[f * frame:(f + 1) * frame])
                back[n] = statistics.median(times) * 1e3
            out[kind] = {'bytes_per_frame': commit,
                         'frames_held': out['default_ring_budget'] // commit,
                         'rollback_ms': back,
                         'frame_ms': statistics.median(steps) * 1e3}
        out['seconds'] = time.perf_counter() - t0
    finally:
        rt.close()
    return out


def long_utterance(minutes: float, capsule_dir: str, every_s: float = 30.0) -> dict:
    """Feed tiny-stt `minutes` of audio frame by frame; sample sizes and the frame step."""
    rt = _runtime('builtin:tiny-stt', 'float32', capsule_dir)
    try:
        rt.warmup()
        spec = rt.speech_spec
        chunk = synthetic_audio(every_s, spec.sample_rate)  # repeated: the same 30 s
        frame = spec.frame_size
        samples = []
        t0 = time.perf_counter()
        for i in range(round(minutes * 60 / every_s)):
            steps = []
            for f in range(len(chunk) // frame):
                steps += sample_s(lambda: rt.feed_audio(chunk[f * frame:(f + 1) * frame]), 1,
                                  rt.device)
            capsule = rt.snapshot('now')
            samples.append({'audio_s': (i + 1) * every_s, 'position': rt.position,
                            'capsule_bytes': capsule.nbytes,
                            'ring_bytes': rt.stats().rollback_ring.bytes_used,
                            'arena_bytes': rt.state_nbytes,
                            'frame_ms': statistics.median(steps) * 1e3})
        return {'minutes': minutes, 'samples': samples, 'seconds': time.perf_counter() - t0}
    finally:
        rt.close()


def plot(result: dict, path: str) -> str | None:
    """Draw bytes per frame, rollback times and the long utterance as a PNG (None: no plt)."""
    plt = pyplot()
    if plt is None:
        return None
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4))
    shapes = result['shapes']
    x = np.arange(len(shapes))
    for dx, kind in ((-0.2, 'whole'), (0.2, 'delta')):
        a.bar(x + dx, [s[kind]['bytes_per_frame'] for s in shapes], 0.4,
              label={'whole': 'whole copy (before)', 'delta': 'delta entry'}[kind])
    a.set(xticks=x, xticklabels=[s['label'] for s in shapes], yscale='log',
          ylabel='bytes on the ring per 80 ms frame', title='ring entry per committed frame')
    a.legend()
    for s in shapes:
        for kind, style in (('whole', '--'), ('delta', '-')):
            ms = s[kind]['rollback_ms']
            b.plot(list(BACK), [ms[n] for n in BACK], style, marker='o',
                   label=f'{s["label"]}, {kind}')
    b.set(xlabel='frames rolled back (25 = 2 s)', ylabel='ms', yscale='log',
          title='Runtime.rollback(N)')
    b.legend(fontsize=8)
    long = result.get('long')
    if long:
        t = [p['audio_s'] / 60 for p in long['samples']]
        c.plot(t, [p['capsule_bytes'] / 1024 for p in long['samples']], label='capsule')
        c.plot(t, [p['ring_bytes'] / 1024 for p in long['samples']], label='rollback ring')
        c.set(xlabel='minutes of audio in one utterance', ylabel='KiB', ylim=(0, None),
              title=f'tiny-stt, {long["minutes"]:g} min utterance')
        c.legend()
    path = save(fig, path)
    plt.close(fig)
    return path


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument('--shapes', nargs='+', default=['tiny', '1b'], choices=['tiny', '1b'])
    p.add_argument('--frames', type=int, default=40, help='frames fed before rolling back')
    p.add_argument('--repeats', type=int, default=3)
    p.add_argument('--minutes', type=float, default=30.0, help='long utterance (0: skip)')
    p.add_argument('--threads', type=int, help='torch threads (default: what torch picks)')
    p.add_argument('--device', default='cpu', help='for the ring (the long utterance: cpu)')
    p.add_argument('--out', default='build/bench-results')
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = {'threads': torch.get_num_threads(), 'shapes': []}
    with tempfile.TemporaryDirectory(prefix='flashrt_speech_ring_') as tmp:
        for shape in args.shapes:
            if shape == 'tiny':
                r = measure_ring('builtin:tiny-stt', 'float32', args.frames, args.repeats, tmp,
                                 args.device)
            else:
                t0 = time.perf_counter()
                folder = write_1b(Path(tmp) / '1b')
                built = time.perf_counter() - t0
                r = measure_ring(folder, 'bfloat16', args.frames, args.repeats, tmp, args.device)
                r['build_seconds'] = built
            r['label'] = shape
            result['shapes'].append(r)
            print(json.dumps(r, indent=1), flush=True)
        if args.minutes:
            result['long'] = long_utterance(args.minutes, tmp)
    result['loadavg'] = os.getloadavg()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, 'speech_ring.json'), 'w') as f:
        json.dump(result, f, indent=1)
    png = plot(result, os.path.join(args.out, 'speech_ring.png'))
    print(f'{result["threads"]} threads, load average {result["loadavg"]}')
    print('| shape | arena bytes | bytes per frame: whole / delta | frames held (256 MiB) | '
          'rollback 1 / 5 / 25 frames, ms: whole | delta |')
    print('|---|---|---|---|---|---|')
    for s in result['shapes']:
        w, d = s['whole'], s['delta']
        print(f'| {s["label"]} | {s["arena_bytes"]} | {w["bytes_per_frame"]} / '
              f'{d["bytes_per_frame"]} | {w["frames_held"]} / {d["frames_held"]} | '
              + ' / '.join(f'{w["rollback_ms"][n]:.2f}' for n in BACK) + ' | '
              + ' / '.join(f'{d["rollback_ms"][n]:.2f}' for n in BACK) + ' |')
    long = result.get('long')
    if long:
        first, last = long['samples'][0], long['samples'][-1]
        print(f'long utterance: {long["minutes"]:g} min, position {last["position"]}, capsule '
              f'{first["capsule_bytes"]} -> {last["capsule_bytes"]} bytes, ring '
              f'{first["ring_bytes"]} -> {last["ring_bytes"]} bytes, frame step '
              f'{first["frame_ms"]:.2f} -> {last["frame_ms"]:.2f} ms, {long["seconds"]:.0f} s')
    if png:
        print(f'figure: {png}')


if __name__ == '__main__':
    main()
