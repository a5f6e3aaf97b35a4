"""
Side-by-side measurements of the performance claims (docs/benchmarks.md); not a unit test.

    python -m flashrt_ros.bench.measure [--model builtin:bench-hybrid] [--device cpu]
                                        [--lengths 2048 8192] [--dtype float32]

1. restore vs raw copy : a full restore of a device capsule against `dst.copy_(src)` of
                         the same number of bytes on the same device, same run (best of
                         N and median: on a shared machine noise only ever adds time).
2. decode tok/s        : the arena-bound decode step (StaticCache views, CUDA graph on
                         CUDA) against the same model decoding with transformers'
                         DynamicCache.
3. time to first token : restore a capsule of an L-token prefix + feed one new token +
                         sample, against a cold prefill of the same L+1 tokens + sample.
Each function returns a dict so the figures (figures.py) can reuse it.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

from flashrt_ros.runtime import Runtime, RuntimeConfig
import torch


BENCH_MODEL = 'builtin:bench-hybrid'  # the default model of every benchmark


# The vector features a CPU figure depends on (x86 flags, Arm Features), as /proc/cpuinfo names
VECTOR_FEATURES = ('avx2', 'fma', 'avx512f', 'avx512bw', 'avx512vl', 'avx512_bf16',
                   'avx512_vnni', 'amx_tile', 'amx_bf16', 'asimd', 'asimddp', 'bf16', 'i8mm',
                   'sve', 'sve2', 'svebf16')


def cpu_info(rt: Runtime | None = None) -> dict:
    """Describe the CPU a figure ran on: model, vector features, load, the compiled step."""
    fields = {}
    try:
        with open('/proc/cpuinfo') as f:
            for line in f:
                key, _, value = line.partition(':')
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    flags = set((fields.get('flags') or fields.get('Features') or '').split())
    model = fields.get('model name') or (
        f'Arm implementer {fields["CPU implementer"]} part {fields["CPU part"]}'
        if 'CPU part' in fields else platform.processor() or 'unknown')
    step = getattr(getattr(rt, 'adapter', None), 'cpu_step', None)
    return {
        'model': model,
        'machine': platform.machine(),
        'cores': os.cpu_count(),
        'vector_features': [f for f in VECTOR_FEATURES if f in flags],
        'compiled_step_lanes': step.lib.fr_lanes() if step is not None else None,
        'threads': torch.get_num_threads(),
        'load_average': [round(x, 2) for x in os.getloadavg()],
    }


def sync(device: torch.device) -> None:
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


def sample_s(fn, repeats: int, device: torch.device) -> list[float]:
    """Wall seconds of each of `repeats` calls of fn(), synchronized with the device."""
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return times


def sample_interleaved_s(fns, repeats: int, device: torch.device) -> list[list[float]]:
    """
    Like sample_s for several functions, called in turn, so that all of them see the same noise.

    Returns one list of seconds per function.
    """
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times):
            out += sample_s(fn, 1, device)
    return times


def sample_after_idle_s(fns, repeats: int, device: torch.device, idle_s: float,
                        before=None) -> list[list[float]]:
    """
    Like sample_interleaved_s, each call after `idle_s` of sleep (then before(), untimed).

    What a call costs when it comes after a quiet moment, as an interrupt does: thread
    pools have parked their workers and caches hold other things.
    """
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times):
            time.sleep(idle_s)
            if before is not None:
                before()
            out += sample_s(fn, 1, device)
    return times


def token_ids(n: int, seed: int = 0) -> list[int]:
    """Return n seeded pseudo-random token ids in the byte range (valid for every vocab here)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def restore_vs_copy(rt: Runtime, prefix_tokens: int, repeats: int = 30) -> dict:
    """
    Full-restore time of a device capsule vs a raw copy_ of as many bytes (best, median).

    Each timed restore follows a forgotten lineage (untimed), so it copies the whole capsule:
    a restore into the capsule's own lineage would copy its head only.
    """
    rt.reset()
    rt.prefill(token_ids(prefix_tokens))
    info = rt.snapshot('measure-restore', tier='device')
    rt.restore('measure-restore')  # warm
    src = torch.empty(info.nbytes, dtype=torch.uint8, device=rt.device).random_(0, 255)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _, restores, copies = sample_interleaved_s(
        [rt.arena.begin_epoch, lambda: rt.restore('measure-restore'), lambda: dst.copy_(src)],
        repeats, rt.device)
    if rt.stats().last_restore_copied_bytes != info.nbytes:
        raise RuntimeError('the timed restores did not copy the whole capsule')
    restore_s, restore_med = min(restores), statistics.median(restores)
    copy_s, copy_med = min(copies), statistics.median(copies)
    rt.delete_capsule('measure-restore')
    return {'bytes': info.nbytes, 'restore_s': restore_s, 'copy_s': copy_s,
            'ratio': restore_s / copy_s, 'restore_median_s': restore_med,
            'copy_median_s': copy_med}


def arena_decode_tps(rt: Runtime, ids: list[int], steps: int) -> float:
    """Greedy decode tokens/s of the arena-bound engine through Runtime.generate."""
    rt.reset()
    gen = rt.generate(prompt=ids, max_new_tokens=steps + 1, stop=(), eos=False)
    for _ in gen:
        pass
    rt.reset()
    return gen.result.tokens_per_s


@torch.no_grad()
def dynamic_cache_decode_tps(model, ids: list[int], steps: int, device: torch.device,
                             inference_mode: bool = False) -> float:
    """
    Greedy decode tokens/s of the same model in a plain loop over a DynamicCache.

    Under no_grad, as transformers' generate() runs it; inference_mode=True runs the loop
    under torch.inference_mode as the engine does, which isolates what the binding costs.
    """
    from transformers import DynamicCache

    with torch.inference_mode(inference_mode):
        cache = DynamicCache(config=model.config)
        x = torch.tensor([ids], device=device)  # [1, T]
        tok = model(input_ids=x, cache=cache, use_cache=True, logits_to_keep=1).logits[
            :, -1
        ].argmax(-1, keepdim=True)  # [1, 1]
        sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            out = model(input_ids=tok, cache=cache, use_cache=True, logits_to_keep=1)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]
            int(tok)  # the runtime also brings every token to the host (streaming)
        sync(device)
        return steps / (time.perf_counter() - t0)


@torch.no_grad()
def hf_generate_decode_tps(model, ids: list[int], steps: int, device: torch.device) -> float:
    """Greedy decode tokens/s of transformers' model.generate() with a DynamicCache."""
    from transformers import DynamicCache
    from transformers.generation.streamers import BaseStreamer

    class Stamps(BaseStreamer):
        def __init__(self):
            self.times = []

        def put(self, value):
            self.times.append(time.perf_counter())  # first put() is the prompt

        def end(self):
            pass

    stamps = Stamps()
    x = torch.tensor([ids], device=device)  # [1, T]
    model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                   max_new_tokens=steps + 1, min_new_tokens=steps + 1,
                   cache=DynamicCache(config=model.config), streamer=stamps,
                   pad_token_id=model.config.pad_token_id)
    tokens = stamps.times[1:]  # one stamp per generated token, the first after prefill
    return (len(tokens) - 1) / (tokens[-1] - tokens[0])


def paired_decode_rounds(paths: dict, rounds: int) -> dict:
    """
    Call every tokens/s function of `paths` once per round, in a rotating order.

    Returns {name: [tokens/s per round]}. A ratio of two paths is best taken round by round
    (paired_ratio): the machine's speed drifts, and a round's paths ran seconds apart.
    """
    names = list(paths)
    out = {name: [] for name in names}
    for i in range(rounds):
        for name in names[i % len(names):] + names[:i % len(names)]:
            out[name].append(paths[name]())
    return out


def paired_ratio(a: list[float], b: list[float]) -> float:
    """Median over rounds of a[i] / b[i]."""
    return statistics.median(x / y for x, y in zip(a, b))


def decode_vs_dynamic_cache(
    rt: Runtime, prompt_tokens: int = 64, steps: int = 32, rounds: int = 8
) -> dict:
    """Greedy decode tokens/s: arena engine vs the same model with a DynamicCache, paired."""
    ids, model = token_ids(prompt_tokens, seed=1), rt.adapter.model
    rt.reset()
    rt.warmup()
    tps = paired_decode_rounds({
        'arena': lambda: arena_decode_tps(rt, ids, steps),
        'dynamic': lambda: dynamic_cache_decode_tps(model, ids, steps, rt.device),
    }, rounds)
    rt.reset()
    return {
        'arena_tokens_per_s': statistics.median(tps['arena']),
        'dynamic_cache_tokens_per_s': statistics.median(tps['dynamic']),
        'ratio': paired_ratio(tps['arena'], tps['dynamic']),
        'cuda_graph': rt.stats().cuda_graph,
    }


def first_token_s(rt: Runtime, prompt: list[int]) -> tuple[float, int]:
    """Seconds to consume `prompt` and sample one greedy token; returns (seconds, token)."""
    sync(rt.device)
    t0 = time.perf_counter()
    gen = rt.generate(prompt=prompt, max_new_tokens=1, stop=(), eos=False)
    token = next(gen).token_id
    sync(rt.device)
    return time.perf_counter() - t0, token


def restored_first_token_s(rt: Runtime, name: str, new: list[int]) -> tuple[float, int]:
    """Seconds to restore capsule `name`, consume `new` and sample; returns (seconds, token)."""
    sync(rt.device)
    t0 = time.perf_counter()
    rt.restore(name)
    _, token = first_token_s(rt, new)
    return time.perf_counter() - t0, token


def ttft_restore_vs_prefill(rt: Runtime, prefix_tokens: int) -> dict:
    """Time restore(L-token prefix) + 1 new token + sample vs cold prefill of L+1 + sample."""
    prefix, new = token_ids(prefix_tokens, seed=2), token_ids(1, seed=3)
    rt.reset()
    rt.prefill(prefix)
    rt.snapshot('measure-ttft', tier='device')
    rt.reset()
    cold_s, cold_token = first_token_s(rt, prefix + new)
    rt.reset()
    warm_s, warm_token = restored_first_token_s(rt, 'measure-ttft', new)
    rt.delete_capsule('measure-ttft')
    rt.reset()
    return {
        'prefix_tokens': prefix_tokens,
        'cold_prefill_s': cold_s,
        'restore_first_token_s': warm_s,
        'speedup': cold_s / warm_s,
        'same_token': cold_token == warm_token,
    }


def raw_copy(nbytes: int, src, dst):
    """Return a function doing `b.copy_(a)` of nbytes from device src to dst (the raw copy)."""
    src, dst = torch.device(src), torch.device(dst)
    pin = 'cuda' in (src.type, dst.type)  # host side pinned, as the host tier is on CUDA
    a = torch.empty(nbytes, dtype=torch.uint8, device=src,
                    pin_memory=pin and src.type == 'cpu').random_(0, 255)
    b = torch.empty(nbytes, dtype=torch.uint8, device=dst, pin_memory=pin and dst.type == 'cpu')
    b.copy_(a)  # first touch / page faults before any timing
    return lambda: b.copy_(a)


def prefill_layer_times(rt: Runtime, ids: list[int]) -> dict:
    """
    Prefill `ids` from an empty state and time every decoder layer (forward hooks).

    Returns the total seconds, the seconds spent in each layer and each layer's type (from
    the model config's layer_types, 'unknown' when it has none). The state is reset after.
    """
    layers = rt.adapter.model.get_decoder().layers
    types = list(getattr(rt.adapter.config, 'layer_types', None) or ['unknown'] * len(layers))
    spent, started = [0.0] * len(layers), [0.0] * len(layers)

    def before(i):
        def hook(module, args):
            sync(rt.device)
            started[i] = time.perf_counter()
        return hook

    def after(i):
        def hook(module, args, output):
            sync(rt.device)
            spent[i] += time.perf_counter() - started[i]
        return hook

    handles = [h for i, layer in enumerate(layers)
               for h in (layer.register_forward_pre_hook(before(i)),
                         layer.register_forward_hook(after(i)))]
    try:
        rt.reset()
        total = sample_s(lambda: rt.prefill(ids), 1, rt.device)[0]
    finally:
        for h in handles:
            h.remove()
        rt.reset()
    return {'total_s': total, 'layer_s': spent, 'layer_types': types}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--model', default=BENCH_MODEL)
    p.add_argument('--device', default='cpu')
    p.add_argument('--dtype', default='float32')
    p.add_argument('--lengths', type=int, nargs='+', default=[2048, 8192])
    args = p.parse_args(argv)
    max_len = max(args.lengths) + 64
    rt = Runtime(
        RuntimeConfig(
            model=args.model,
            device=args.device,
            dtype=args.dtype,
            max_seq_len=max_len,
            device_budget_bytes=0,
            rollback_depth=2,
            capsule_dir='/tmp/flashrt_measure',
        )
    )
    rt.warmup()
    mib = 2.0**20
    print(f'model {args.model} on {args.device} ({args.dtype}), '
          f'arena {rt.state_nbytes / mib:.1f} MiB, max_seq_len {max_len}')
    for n in args.lengths:
        r = restore_vs_copy(rt, n)
        print(f'[restore vs copy_] prefix {n}: {r["bytes"] / mib:.2f} MiB, '
              f'best restore {r["restore_s"] * 1e3:.3f} ms | '
              f'raw copy_ {r["copy_s"] * 1e3:.3f} ms | '
              f'ratio {r["ratio"]:.2f}x (medians {r["restore_median_s"] * 1e3:.3f} / '
              f'{r["copy_median_s"] * 1e3:.3f} ms)')
    r = decode_vs_dynamic_cache(rt)
    print(f'[decode] arena {r["arena_tokens_per_s"]:.1f} tok/s | '
          f'DynamicCache {r["dynamic_cache_tokens_per_s"]:.1f} tok/s | '
          f'ratio {r["ratio"]:.2f} (cuda graph {r["cuda_graph"]})')
    for n in args.lengths:
        r = ttft_restore_vs_prefill(rt, n)
        print(f'[ttft] {n} tokens: cold prefill {r["cold_prefill_s"] * 1e3:.1f} ms | '
              f'restore + first token {r["restore_first_token_s"] * 1e3:.2f} ms | '
              f'{r["speedup"]:.0f}x (same token: {r["same_token"]})')
    rt.close()


if __name__ == '__main__':
    main()
