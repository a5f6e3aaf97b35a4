"""
CacheBinding: a transformers StaticCache whose every state tensor is a view into the arena.

transformers 5.x has no API to hand a cache your own buffers: cache layers allocate lazily
on their first update. So the binding
  1. runs one probe forward on a throwaway StaticCache to learn every state tensor's
     shape and dtype (the recurrent state of a bf16 model is fp32, for instance);
  2. builds the real StaticCache and RE-POINTS each layer's tensors at arena views
     (StaticLayer keys/values/cumulative_length, LinearAttentionLayer conv_states /
     recurrent_states), marking the layers initialized so they never allocate again.
From then on the model mutates only arena memory: StaticLayer writes with index_copy_
and add_, linear-attention layers with copy_.

Non-tensor state the layers keep in Python and that must travel with a capsule:
`has_previous_state` per linear-attention state (False means "next call is a prefill":
dropping it makes decode diverge) and `cumulative_length_int` of sliding-window layers.

Both the causal-LM adapter (models/hf.py) and the robot-policy adapter (models/policy.py)
run a transformers backbone over a CacheBinding and delegate the state contract to it
(BindingDelegate).
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import sys
from typing import Any, Callable

import torch

from ..errors import ConfigError
from ..state.arena import dtype_name, StateSpec

PROBE_TOKENS = 4  # length of the probe forward that discovers the state tensors
WINDOW_QUANTUM = 256  # eager attention windows grow in steps of this many tokens

MIN_TRANSFORMERS = (5, 24)  # oldest release whose cache layers this binding was tested with


def check_transformers_version(version: str) -> None:
    """Raise ConfigError when transformers `version` is older than MIN_TRANSFORMERS."""
    if tuple(int(n) for n in re.findall(r'\d+', version)[:2]) < MIN_TRANSFORMERS:
        least = '.'.join(map(str, MIN_TRANSFORMERS))
        raise ConfigError(
            f'transformers {version} is too old for the state binding (its cache layers '
            f'changed up to {least}); install transformers>={least},<6'
        )


@functools.lru_cache(maxsize=None)
def _cache_classes():
    """Return transformers.cache_utils, once its version is known to be recent enough."""
    import transformers
    from transformers import cache_utils as cu

    check_transformers_version(transformers.__version__)
    return cu


@functools.lru_cache(maxsize=None)
def _windowed_layer_class():
    """
    Build (once) a StaticLayer subclass whose attention can see a prefix of the buffer.

    A StaticLayer always hands attention its whole [B, H, max_len, D] buffer, so an eager
    step costs O(max_seq_len) — with GQA the whole buffer is even expanded per query head.
    When the live length is known on the host, `window` (rounded up to WINDOW_QUANTUM) makes
    attention read keys[:, :, :window] under a mask of the same size. Rows past the live
    length are zero and causally masked either way, so the result is the same. Captured CUDA
    graphs keep window=None: static shapes over the whole buffer.
    """
    cu = _cache_classes()

    class WindowedStaticLayer(cu.StaticLayer):
        window: int | None = None

        def update(self, key_states, value_states, *args, **kwargs):
            keys, values = super().update(key_states, value_states, *args, **kwargs)
            if self.window is None:
                return keys, values
            return keys[:, :, :self.window], values[:, :, :self.window]  # [B, H, W, D]

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            if self.window is None:
                return super().get_mask_sizes(query_length)
            return self.window, 0

    return WindowedStaticLayer


@functools.lru_cache(maxsize=None)
def _ring_window_class():
    """
    Build (once) a sliding-window layer that keeps its rows in a ring: a step writes its own.

    transformers' layer, once full, rolls the whole window by a row per token, so every row
    of the state changes at every step. Here step t's row lives at t mod window and attention
    gets the rows oldest first, the tensors transformers' layer hands it, so the outputs are
    the same bits; a step changes only its own rows (what a delta rollback boundary keeps:
    state/ring.py) and copies the window once instead of twice.
    """
    cu = _cache_classes()

    class RingWindowLayer(cu.StaticSlidingWindowLayer):
        def update(self, key_states, value_states, *args, **kwargs):
            done, n, window = self.cumulative_length_int, key_states.shape[-2], self.max_cache_len
            self.cumulative_length_int += n
            if done + n <= window:  # not full yet: rows sit in order, as transformers keeps them
                rows = torch.arange(done, done + n, device=self.device)
                self.keys.index_copy_(2, rows, key_states)
                self.values.index_copy_(2, rows, value_states)
                self.cumulative_length.add_(n)
                return self.keys, self.values
            if done >= window:  # full: every row but the oldest, then the new ones
                head = done % window
                keys = torch.cat((self.keys[:, :, head + 1:], self.keys[:, :, :head], key_states),
                                 dim=-2)
                values = torch.cat((self.values[:, :, head + 1:], self.values[:, :, :head],
                                    value_states), dim=-2)
            else:  # filling up in this step
                keys = torch.cat((self.keys[:, :, :done], key_states), dim=-2)
                values = torch.cat((self.values[:, :, :done], value_states), dim=-2)
            first = max(done, done + n - window)  # rows older than the window are not kept
            rows = torch.arange(first, done + n, device=self.device) % window
            self.keys.index_copy_(2, rows, key_states[:, :, first - done:])
            self.values.index_copy_(2, rows, value_states[:, :, first - done:])
            return keys, values

    return RingWindowLayer


class CacheBinding:
    """
    A transformers StaticCache whose every state tensor is a view into the arena.

    Shared by the causal-LM adapter (models/hf.py) and the policy adapter (models/policy.py):
    both run a transformers backbone over this cache and delegate the state contract to it.
    `probe(cache)` must run one short forward of the model over `cache`; it is called once,
    on a throwaway cache, to learn each state tensor's shape and dtype.
    """

    def __init__(self, config, max_len: int, family: str, probe: Callable[[Any], None],
                 ring_windows: bool = False):
        """
        Build the cache of `config` for `max_len` positions.

        ring_windows: sliding-window layers keep their rows in a ring (_ring_window_class):
        their state is declared as windows (StateSpec.window_dim) and their counters have no
        bound, so a model with only such layers steps for ever in bounded state.
        """
        cu = _cache_classes()
        self.family = family
        self.max_len = max_len
        self.ring_windows = ring_windows
        # The real cache: layers are created now, their tensors only when bind() hands views in.
        self.cache = cu.StaticCache(config=config, max_cache_len=max_len)
        self._check_layers()
        self.windowed = []
        for layer in self.cache.layers:
            if type(layer) is cu.StaticLayer:  # plain full attention (not sliding, not hybrid)
                layer.__class__ = _windowed_layer_class()
                self.windowed.append(layer)
        # The layers with state outside tensors, by index (restores touch only these).
        self._linear = [(str(i), layer) for i, layer in enumerate(self.cache.layers)
                        if isinstance(layer, cu.LinearAttentionLayer)]
        self._sliding = [(str(i), layer) for i, layer in enumerate(self.cache.layers)
                         if isinstance(layer, cu.StaticSlidingWindowLayer)]
        if ring_windows:
            for _, layer in self._sliding:
                layer.__class__ = _ring_window_class()
        self.specs = self._probe_specs(config, probe)
        self._imports: dict[int, tuple] = {}  # id(meta) -> (meta, plan): see import_meta

    # ---- discovery -------------------------------------------------------------------

    def _check_layers(self) -> None:
        cu = _cache_classes()
        supported = (cu.StaticLayer, cu.LinearAttentionLayer, cu.DummyLayer)
        for i, layer in enumerate(self.cache.layers):
            if isinstance(layer, cu.StaticIndexedLayer) or not isinstance(layer, supported):
                raise ConfigError(
                    f'model type {self.family!r} uses cache layer {type(layer).__name__} '
                    f'(layer {i}), which flashrt_ros cannot bind to its state arena yet'
                )

    @property
    def only_windows(self) -> bool:
        """Whether every layer keeps a bounded window (none grows with the positions)."""
        return len(self._sliding) == len(self.cache.layers)

    def window_writes(self, steps: int) -> dict[str, tuple[int, int]]:
        """Return the ring rows the next `steps` positions write (StateAdapter.window_writes)."""
        writes = {}
        for key, layer in self._sliding:
            window = layer.max_cache_len
            n = min(steps, window)
            first = (layer.cumulative_length_int + steps - n, n)
            writes[f'L{key}.key'] = writes[f'L{key}.value'] = first
        return writes

    @property
    def has_sliding_layers(self) -> bool:
        sliding = _cache_classes().StaticSlidingWindowLayer
        return any(isinstance(layer, sliding) for layer in self.cache.layers)

    @torch.inference_mode()
    def _probe_specs(self, config, probe: Callable[[Any], None]) -> list[StateSpec]:
        """One throwaway forward to learn each state tensor's shape and dtype."""
        cu = _cache_classes()
        cache = cu.StaticCache(config=config, max_cache_len=2 * PROBE_TOKENS)
        probe(cache)
        specs: list[StateSpec] = []
        for i, (layer, real) in enumerate(zip(cache.layers, self.cache.layers)):
            if isinstance(layer, cu.StaticLayer):
                if not layer.is_initialized:
                    raise ConfigError(
                        f'layer {i} of {self.family!r} kept no KV in a probe forward'
                    )
                # Sliding-window buffers roll: their used part is not a prefix; copy whole
                # (or, in a ring, as a window).
                sliding = isinstance(real, cu.StaticSlidingWindowLayer)
                seq_dim = None if sliding else 2
                window_dim = 2 if sliding and self.ring_windows else None
                for part, t in (('key', layer.keys), ('value', layer.values)):
                    shape = (t.shape[0], t.shape[1], real.max_cache_len, t.shape[3])  # [B,H,L,D]
                    specs.append(StateSpec(f'L{i}.{part}', 'kv', shape, t.dtype, seq_dim,
                                           window_dim))
                specs.append(StateSpec(f'L{i}.length', 'position', (), torch.int64))
            if isinstance(layer, cu.LinearAttentionLayer):
                for s in range(layer.number_of_states):
                    conv, rec = layer.conv_states[s], layer.recurrent_states[s]
                    if conv is not None:  # [B, C, K]
                        specs.append(StateSpec(f'L{i}.conv{s}', 'conv', conv.shape, conv.dtype))
                    if rec is not None:  # e.g. [B, H, Dk, Dv]; fp32 even in bf16 models
                        specs.append(StateSpec(f'L{i}.recurrent{s}', 'recurrent', rec.shape,
                                               rec.dtype))
        return specs

    # ---- binding ---------------------------------------------------------------------

    def bind(self, views: dict[str, torch.Tensor]) -> None:
        cu = _cache_classes()
        for i, layer in enumerate(self.cache.layers):
            if isinstance(layer, cu.StaticLayer):
                k, v = views[f'L{i}.key'], views[f'L{i}.value']  # [B, H, L, D] arena views
                layer.keys, layer.values = k, v
                layer.cumulative_length = views[f'L{i}.length']  # [] int64, advanced with add_
                layer.device = k.device
                layer.batch_size, layer.num_heads = k.shape[0], k.shape[1]
                layer.k_head_dim, layer.v_head_dim = k.shape[-1], v.shape[-1]
                layer.is_initialized = True
            if isinstance(layer, cu.LinearAttentionLayer):
                for s in range(layer.number_of_states):
                    conv = views.get(f'L{i}.conv{s}')
                    rec = views.get(f'L{i}.recurrent{s}')
                    if conv is not None:
                        layer.conv_states[s] = conv  # [B, C, K]
                        layer.conv_kernel_size[s] = conv.shape[-1]
                        layer.is_conv_states_initialized[s] = True
                        layer.dtype, layer.device = conv.dtype, conv.device
                    if rec is not None:
                        layer.recurrent_states[s] = rec  # e.g. [B, H, Dk, Dv], often fp32
                        layer.is_recurrent_states_initialized[s] = True
                        layer.device = rec.device

    def set_window(self, kv_len: int | None) -> None:
        """Let eager attention read only the live prefix (kv_len rows, rounded up)."""
        window = None
        if kv_len is not None:
            window = min(-(-kv_len // WINDOW_QUANTUM) * WINDOW_QUANTUM, self.max_len)
        for layer in self.windowed:
            layer.window = window

    # ---- non-tensor state ------------------------------------------------------------

    def export_meta(self) -> dict[str, Any]:
        layers: dict[str, dict] = {}
        for key, layer in self._linear:
            layers[key] = {'has_previous_state': [
                bool(layer.has_previous_state[s]) for s in range(layer.number_of_states)]}
        for key, layer in self._sliding:
            layers.setdefault(key, {})['cumulative_length_int'] = int(
                layer.cumulative_length_int)
        return {'layers': layers}

    def check_meta(self, meta: dict[str, Any]) -> None:
        self._import_plan(meta)

    def import_meta(self, meta: dict[str, Any]) -> None:
        for layer, flags, length in self._import_plan(meta):
            if flags is not None:
                layer.has_previous_state.update(flags)
            if length is not None:
                layer.cumulative_length_int = length

    def _import_plan(self, meta: dict[str, Any]) -> list[tuple]:
        """
        Return (layer, {state: flag} or None, cumulative length or None) per layer in meta.

        A capsule's meta is immutable and restored again and again (the interrupt path), so
        the plan is worked out once per meta object (kept alive here, so its id is not
        reused while cached). ValueError when meta does not fit this model.
        """
        cached = self._imports.get(id(meta))
        if cached is not None and cached[0] is meta:
            return cached[1]
        # Exactly what export_meta writes for this model (the fingerprint pins the layers).
        layers = meta.get('layers')
        expected = {key for key, _ in self._linear} | {key for key, _ in self._sliding}
        if not isinstance(layers, dict) or set(layers) != expected:
            raise ValueError(f'layer meta names layers {sorted(layers or ())}, this model has '
                             f'{sorted(expected)}')
        if not all(isinstance(d, dict) for d in layers.values()):
            raise ValueError('layer meta entries must be objects')
        plan = []
        for key, layer in self._linear:
            flags = layers[key].get('has_previous_state')
            if not (isinstance(flags, list) and len(flags) == layer.number_of_states
                    and all(isinstance(f, bool) for f in flags)):
                raise ValueError(f'layer {key} needs {layer.number_of_states} state flags')
            plan.append((layer, dict(enumerate(flags)), None))
        for key, layer in self._sliding:
            length = layers[key].get('cumulative_length_int')
            bound = sys.maxsize if self.ring_windows else self.max_len
            if type(length) is not int or not 0 <= length <= bound:
                raise ValueError(f'layer {key} needs a length in [0, {bound}]')
            plan.append((layer, None, length))
        if len(self._imports) >= 64:
            self._imports.clear()
        self._imports[id(meta)] = (meta, plan)
        return plan

    def _set_previous_state(self, flag: bool) -> None:
        """Mark every linear-attention state as (not) holding a previous step."""
        for _, layer in self._linear:
            for s in range(layer.number_of_states):
                layer.has_previous_state[s] = flag

    def reset_meta(self) -> None:
        self._set_previous_state(False)
        for _, layer in self._sliding:
            layer.cumulative_length_int = 0

    def prepare_capture(self) -> None:
        self._set_previous_state(True)

    def decode_ready(self) -> bool:
        return all(all(layer.has_previous_state.values()) for _, layer in self._linear)


def module_fingerprint(identity: dict[str, Any], module: torch.nn.Module,
                       dtype: torch.dtype) -> str:
    """
    Hash an identity dict (config), dtype, parameter shapes and a weight sample.

    Hashing every weight would cost seconds on a large model; the first 16 values of
    every parameter tell apart any two differently initialized or trained models.
    """
    named = list(module.named_parameters())
    params = [(n, list(p.shape)) for n, p in named]
    samples = [p.detach().reshape(-1)[:16].float() for _, p in named]
    sample = torch.cat(samples) if samples else torch.zeros(0)
    h = hashlib.sha256()
    h.update(
        json.dumps(
            {'config': identity, 'dtype': dtype_name(dtype), 'params': params},
            sort_keys=True,
            default=str,
        ).encode()
    )
    h.update(sample.cpu().numpy().tobytes())
    return h.hexdigest()


class BindingDelegate:
    """The state contract of an adapter whose state is a CacheBinding at `self.binding`."""

    binding: CacheBinding
    meta_trusted = True  # CacheBinding exports plain new dicts, reads a meta into a plan

    def bind(self, views: dict[str, torch.Tensor]) -> None:
        self.binding.bind(views)

    def export_meta(self) -> dict[str, Any]:
        return self.binding.export_meta()

    def import_meta(self, meta: dict[str, Any]) -> None:
        self.binding.import_meta(meta)

    def check_meta(self, meta: dict[str, Any]) -> None:
        self.binding.check_meta(meta)

    def reset_meta(self) -> None:
        self.binding.reset_meta()
