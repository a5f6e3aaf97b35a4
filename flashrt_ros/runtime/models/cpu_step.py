"""
The CPU decode step: one token of a Qwen3-Next / Qwen3.5 hybrid through cpu_step.c.

The C file is compiled at first use with the system C compiler (`$CC`, else `cc`) for this
CPU (-O3 -march=native -fopenmp) into ~/.cache/flashrt_ros/kernels (or
$FLASHRT_KERNEL_CACHE), keyed by the source, the flags and the compiler, and loaded with
ctypes. It is built twice, with 8- and 16-float vectors in the weight products, and the one
whose products run faster here is kept: wide vectors pay only on CPUs that run them at full
rate, which a measurement tells and a feature flag does not. It links the same OpenMP
runtime as torch (one soname), so both share one thread pool. Each layer is one call over
pointers fixed at bind time: the model's own weight tensors (never copied) and the arena
views (written in place, as every step writes them).

It runs a step only while nothing observes the model: a module with a forward hook (a
probe, a test's fault injection) or a global pre-hook (a waiting preemption) sends the step
to the exact path (fastpath.py), which calls every module. A preemption that arrives
during a step is met between layers, as a module call would meet it. Results agree with
transformers' to float32 rounding (summation order differs); greedy decoding equals
transformers' generate() (test/runtime/test_cpu_step.py).

Weights are float32 or bfloat16 (and the conv window and KV rows, the arena's dtype);
activations and sums are float32. bf16 widens to float32 exactly, so a bf16 model's step is
the float32 step over its weights' values, with the state rounded to bf16 where the arena
stores bf16; it agrees with transformers' bf16 forward (which rounds every activation to
bf16) to bf16 rounding, not float32's.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
from pathlib import Path
import platform
import shutil
import subprocess
import tempfile
import threading
import time

import torch
from torch.nn.modules import module as torch_module

from ..inference import inference
from ..preemption import ARMED, meet
from ..state.memory import HUGE_PAGE, huge_page_memory

SOURCE = Path(__file__).with_name('cpu_step.c')
CACHE_ENV = 'FLASHRT_KERNEL_CACHE'
# Tried in order: the first that compiles is used (-march=native is not known everywhere).
FLAG_SETS = (['-march=native'], ['-mcpu=native'], [])
BASE_FLAGS = ['-O3', '-std=gnu11', '-fopenmp', '-fPIC', '-shared']
MAX_TOKENS = 4  # tokens one call takes: a speculative verify of up to 3 drafts
LANES = (8, 16)  # vector widths built and timed; the faster is kept
DTYPES = (torch.float32, torch.bfloat16)  # of the weights, the conv window and KV rows
SPAN = 64  # cache rows per attention work item (cpu_step.c SPAN)
_P = ctypes.c_void_p
_I = ctypes.c_int64
_F = ctypes.c_float


class FrLayer(ctypes.Structure):
    """Mirror of struct fr_layer in cpu_step.c (same order, same types)."""

    _fields_ = [
        ('kind', _I), ('hidden', _I), ('inter', _I), ('nthreads', _I),
        ('eps', _F), ('pad0', _F), ('w_bf16', _I), ('conv_bf16', _I), ('kv_bf16', _I),
        ('in_norm', _P), ('post_norm', _P), ('w_gate', _P), ('w_up', _P), ('w_down', _P),
        ('scratch', _P),
        ('w_proj', _P * 4), ('proj_rows', _I * 4), ('proj_perm', _P),
        ('conv_w', _P), ('conv_b', _P), ('conv_state', _P),
        ('conv_k', _I), ('hk', _I), ('hv', _I), ('dk', _I), ('dv', _I),
        ('neg_a', _P), ('dt_bias', _P), ('gate_norm', _P), ('recurrent', _P), ('w_out', _P),
        ('w_q', _P), ('w_k', _P), ('w_v', _P), ('w_o', _P), ('q_norm', _P), ('k_norm', _P),
        ('inv_freq', _P),
        ('hq', _I), ('hkv', _I), ('hd', _I), ('rot', _I), ('rope_offset', _I),
        ('scaling', _F), ('rope_scale', _F),
        ('keys', _P), ('values', _P), ('head_stride', _I), ('seq_stride', _I), ('length', _P),
    ]


_ARMED = ctypes.byref(ARMED)


class Unavailable(Exception):
    """The CPU step cannot run here; the message says why."""


_library = None
_library_error: str | None = None
_library_lock = threading.Lock()


def library() -> ctypes.CDLL:
    """Return the library built from cpu_step.c (compiled and cached on first use)."""
    global _library, _library_error
    with _library_lock:
        if _library is None and _library_error is None:
            try:
                _library = _load(_compile())
            except Unavailable as exc:
                _library_error = str(exc)
        if _library is None:
            raise Unavailable(_library_error)
        return _library


def _cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or '~/.cache/flashrt_ros/kernels').expanduser()


def _compile() -> Path:
    compiler = os.environ.get('CC') or 'cc'
    if shutil.which(compiler) is None:
        raise Unavailable(f'no C compiler ({compiler!r} is not on PATH; set CC or install gcc)')
    try:
        version = subprocess.run([compiler, '--version'], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise Unavailable(f'the C compiler {compiler!r} does not run: {exc}') from exc
    source = SOURCE.read_bytes()
    errors = []
    for arch in FLAG_SETS:
        flags = BASE_FLAGS + arch
        key = hashlib.sha256(b'\0'.join(
            [source, ' '.join(flags).encode(), version.encode(), platform.machine().encode()]))
        target = _cache_dir() / f'cpu_step-{key.hexdigest()[:20]}.so'
        if target.exists():
            return target
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise Unavailable(f'cannot write the kernel cache {str(target.parent)!r}: {exc}; '
                              f'set {CACHE_ENV} to a writable directory') from exc
        built = []
        try:
            for lanes in LANES:
                built.append(_build(compiler, flags + [f'-DLANES={lanes}'], target.parent))
            os.replace(min(built, key=product_seconds), target)  # atomic: racers agree
            return target
        except Unavailable as exc:
            errors.append(f'{" ".join(arch) or "no arch flag"}: {exc}')
        finally:
            for path in built:
                if path.exists():
                    path.unlink()
    raise Unavailable(f'cpu_step.c does not compile with {compiler}: {"; ".join(errors)}')


def _build(compiler: str, flags: list[str], directory: Path) -> Path:
    """Compile cpu_step.c with `flags` into a new file in `directory`; return its path."""
    try:
        fd, tmp = tempfile.mkstemp(suffix='.so', dir=directory)
        os.close(fd)
    except OSError as exc:
        raise Unavailable(f'cannot write the kernel cache {str(directory)!r}: {exc}; '
                          f'set {CACHE_ENV} to a writable directory') from exc
    try:
        out = subprocess.run([compiler, *flags, str(SOURCE), '-o', tmp, '-lm'],
                             capture_output=True, text=True, timeout=300)
        if out.returncode == 0:
            return Path(tmp)
        message = out.stderr.strip()[-300:]
    except (OSError, subprocess.SubprocessError) as exc:
        message = str(exc)
    os.unlink(tmp)
    raise Unavailable(message)


def product_seconds(path: Path) -> float:
    """
    Time a build's weight products: one thread, float32 and bf16, from L2 and from memory.

    The sum of the fastest of several runs of each: what a decode step spends its time on.
    """
    lib = _load(path)
    total = 0.0
    g = torch.Generator().manual_seed(0)
    for rows, k in ((64, 1024), (8192, 1024)):  # 256 KiB, 32 MiB of float32
        x = torch.randn(k, generator=g)
        y, normed, ones = torch.empty(rows), torch.empty(k), torch.ones(k)
        for dtype in DTYPES:
            w = torch.randn(rows, k, generator=g).to(dtype)
            reps = max(1, (1 << 24) // w.nbytes)
            best = float('inf')
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(reps):
                    lib.fr_head(x.data_ptr(), ones.data_ptr(), 1e-6, w.data_ptr(), y.data_ptr(),
                                normed.data_ptr(), k, rows, 1, 1, dtype == torch.bfloat16)
                best = min(best, (time.perf_counter() - start) / reps)
            total += best / w.nbytes
    return total


def _load(path: Path) -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise Unavailable(f'cannot load {str(path)!r}: {exc}') from exc
    ids = ctypes.POINTER(_I)
    signatures = {
        'fr_layers': [ctypes.POINTER(FrLayer), _I, _I, _P, _I, _I, _P, _I, _P],
        'fr_embed': [_P, ids, _I, _P, _I, _I],
        'fr_head': [_P, _P, _F, _P, _P, _P, _I, _I, _I, _I, _I],
        'fr_mtp_input': [_P, ids, _P, _P, _P, _F, _P, _P, _P, _I, _I, _I, _I],
        'fr_lanes': [],
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, (_I if name in ('fr_layers', 'fr_lanes') else None)
    return lib


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def refusal(model, config, views: dict[str, torch.Tensor]) -> str | None:
    """Say why the CPU step cannot run this model over these views (None: it can)."""
    p = next(model.parameters())
    if p.device.type != 'cpu':
        return f'the model is on {p.device.type}, not the CPU'
    if p.dtype not in DTYPES:
        return f'the CPU step runs float32 and bfloat16 models; this one is {p.dtype}'
    rope = getattr(config, 'rope_parameters', None) or {}
    if rope.get('rope_type', 'default') != 'default':
        return f"rope type {rope.get('rope_type')!r} is not the default"
    if getattr(model.lm_head, 'bias', None) is not None:
        return 'the output head has a bias'
    for name, t in model.named_parameters():
        if not t.is_contiguous():
            return f'parameter {name} is not contiguous'
    for name, v in views.items():
        if not v.dtype.is_floating_point or name == 'logits':
            continue
        if v.dtype not in DTYPES or ('recurrent' in name and v.dtype != torch.float32):
            return f'state view {name} is {v.dtype}, which the CPU step does not keep'
        if v.stride()[-1] != 1:
            return f'state view {name} is not contiguous in its last dimension'
    try:
        library()
    except Unavailable as exc:
        return str(exc)
    return None


class _Stack:
    """Layers of one decoder stack as fr_layer structs over the model's tensors and the arena."""

    def __init__(self, layers, keep: list, max_len: int, max_tokens: int):
        self.modules = list(layers)
        self.keep = keep  # tensors the structs point into that no module holds
        self.max_len, self.max_tokens = max_len, max_tokens
        self.structs: list[FrLayer] = []
        self.saves: list[torch.Tensor | None] = []  # per layer: states kept by a verify

    def folded(self, norm) -> int:
        """Pointer to 1 + w of a Qwen3-Next RMSNorm (the model's own scale convention)."""
        t = (1.0 + norm.weight.float()).contiguous()
        self.keep.append(t)
        return t.data_ptr()

    def floats(self, t: torch.Tensor | None) -> int | None:
        """Pointer to a float32 copy of a small parameter (the tensor itself if float32)."""
        if t is None:
            return None
        t = t.float().contiguous()
        self.keep.append(t)
        return t.data_ptr()

    def add(self, layer, state: tuple, rotary: tuple, rope_offset: int = 0) -> None:
        """Bind `layer` to its state views: (conv, recurrent) or (keys, values, length)."""
        mlp = layer.mlp
        s = FrLayer(hidden=mlp.gate_proj.weight.shape[1], inter=mlp.gate_proj.weight.shape[0],
                    eps=float(layer.input_layernorm.eps),
                    w_bf16=mlp.gate_proj.weight.dtype == torch.bfloat16)
        s.in_norm, s.post_norm = self.folded(layer.input_layernorm), self.folded(
            layer.post_attention_layernorm)
        s.w_gate, s.w_up, s.w_down = (_ptr(m.weight) for m in (mlp.gate_proj, mlp.up_proj,
                                                               mlp.down_proj))
        if len(state) == 2:
            self._gated_delta(s, layer.linear_attn, *state)
        else:
            self._attention(s, layer.self_attn, *state, rotary, rope_offset)
        self.structs.append(s)
        self.saves.append(None)

    def _gated_delta(self, s, m, conv_state, recurrent) -> None:
        s.kind = 0
        s.hk, s.hv, s.dk, s.dv = m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim
        if hasattr(m, 'in_proj_qkvz'):  # Qwen3-Next: [q, k, v, z] and [b, a] per key head
            projections = [m.in_proj_qkvz, m.in_proj_ba]
            perm = _qwen3_next_order(m)
            self.keep.append(perm)
            s.proj_perm = perm.data_ptr()
        else:  # Qwen3.5: q|k|v, z, b, a, each in canonical order already
            projections = [m.in_proj_qkv, m.in_proj_z, m.in_proj_b, m.in_proj_a]
        for j, p in enumerate(projections):
            s.w_proj[j], s.proj_rows[j] = p.weight.data_ptr(), p.weight.shape[0]
        s.conv_w, s.conv_b = self.floats(m.conv1d.weight), self.floats(m.conv1d.bias)
        s.conv_k = m.conv1d.weight.shape[-1]
        s.conv_state, s.recurrent = _ptr(conv_state), _ptr(recurrent)
        s.conv_bf16 = conv_state.dtype == torch.bfloat16
        s.neg_a = self.floats(-m.A_log.float().exp())
        s.dt_bias, s.gate_norm = self.floats(m.dt_bias), self.floats(m.norm.weight)
        s.w_out = _ptr(m.out_proj.weight)

    def _attention(self, s, m, keys, values, length, rotary, rope_offset) -> None:
        s.kind, s.hd, s.rope_offset = 1, m.head_dim, rope_offset
        s.hq = m.q_proj.weight.shape[0] // (2 * m.head_dim)
        s.hkv = m.k_proj.weight.shape[0] // m.head_dim
        projections = (m.q_proj, m.k_proj, m.v_proj, m.o_proj)
        s.w_q, s.w_k, s.w_v, s.w_o = (_ptr(p.weight) for p in projections)
        s.q_norm, s.k_norm = self.folded(m.q_norm), self.folded(m.k_norm)
        inv_freq, s.rope_scale = rotary
        s.inv_freq, s.rot, s.scaling = inv_freq.data_ptr(), 2 * inv_freq.numel(), m.scaling
        if keys.stride() != values.stride():
            raise ValueError('keys and values are laid out differently')
        s.keys, s.values = keys.data_ptr(), values.data_ptr()
        s.kv_bf16 = keys.dtype == torch.bfloat16
        s.head_stride, s.seq_stride = keys.stride(1), keys.stride(2)  # [1, Hkv, L, D]
        s.length = length.data_ptr()

    def scratch_floats(self) -> int:
        """Floats of scratch one fr_layer call of max_tokens tokens needs, at most."""
        most, t = 0, self.max_tokens
        for s in self.structs:
            if s.kind == 0:
                mixer = 3 * t * (2 * s.hk * s.dk + 2 * s.hv * s.dv + 2 * s.hv)
            else:  # cpu_step.c attention(): q|k|v rows, outputs, rotary, span work items
                spans = -(-self.max_len // SPAN)
                mixer = (t * (3 * s.hq * s.hd + 2 * s.hkv * s.hd) + 2 * s.rot
                         + spans * s.hq * (SPAN + s.hd + 2))
            most = max(most, t * (2 * s.hidden + 3 * s.inter) + mixer)
        return most

    def state_floats(self, s: FrLayer) -> int:
        """Floats of one token's kept state of a gated-DeltaNet layer (conv, recurrent)."""
        return (2 * s.hk * s.dk + s.hv * s.dv) * s.conv_k + s.hv * s.dk * s.dv

    def finish(self, scratch: torch.Tensor) -> None:
        """Lay the structs out as the array fr_layers takes, all sharing `scratch`."""
        for s in self.structs:
            s.scratch = scratch.data_ptr()
        self.array = (FrLayer * len(self.structs))(*self.structs)
        self._save_ptrs = None

    def save_pointers(self):
        """Return the per-layer save pointers of a kept run (allocated on first use)."""
        if self._save_ptrs is None:
            for i, s in enumerate(self.structs):
                if s.kind == 0:
                    self.saves[i] = torch.zeros((self.max_tokens - 1, self.state_floats(s)))
            self._save_ptrs = (_P * len(self.saves))(*(_ptr(t) for t in self.saves))
        return self._save_ptrs

    def run(self, lib, h: int, tokens: int, pos0: int, save: bool) -> None:
        """Run `tokens` rows of the [T, H] buffer at h through every layer, from row pos0."""
        nthreads, count = torch.get_num_threads(), len(self.modules)
        pre_hooks = torch_module._global_forward_pre_hooks
        saves = self.save_pointers() if save and tokens > 1 else None
        at = 0
        while at < count:
            if pre_hooks:  # a preemption is armed: meet it here, as a module call would
                for hook in list(pre_hooks.values()):
                    hook(self.modules[at], ())
            at = lib.fr_layers(self.array, at, count, h, tokens, pos0, saves, nthreads,
                               _ARMED)
        meet()  # armed during the last layer: the head and the rest of the step are not run

    def keep_prefix(self, views: list[tuple], used: int, tokens: int) -> None:
        """
        After a kept run of `tokens`, make the state that of its first `used` tokens.

        views: per layer, the state tensors add() was given. Gated-DeltaNet layers take the
        kept conv and recurrent state; attention layers count the dropped rows off their
        length (the caller zeroes those rows).
        """
        if used == tokens:
            return
        for s, save, state in zip(self.structs, self.saves, views):
            if s.kind == 0:
                conv, recurrent = state
                kept = save[used - 1]  # the conv window's bytes, then the recurrent state
                conv_bytes = kept.view(torch.uint8)[:conv.numel() * conv.element_size()]
                conv.view(-1).copy_(conv_bytes.view(conv.dtype))
                recurrent.view(-1).copy_(kept[conv.numel():])
            else:
                state[2].sub_(tokens - used)


def _qwen3_next_order(m) -> torch.Tensor:
    """Return the indices that take the [qkvz | ba] projection to q | k | v | z | b | a."""
    hk, dk, dv, r = m.num_k_heads, m.head_k_dim, m.head_v_dim, m.num_v_heads // m.num_k_heads
    group = 2 * dk + 2 * r * dv  # one key head's rows of in_proj_qkvz
    qkvz = torch.arange(hk * group).view(hk, group)
    q, k, v, z = torch.split(qkvz, [dk, dk, r * dv, r * dv], dim=1)
    ba = (hk * group + torch.arange(hk * 2 * r)).view(hk, 2 * r)
    b, a = torch.split(ba, [r, r], dim=1)
    return torch.cat([t.reshape(-1) for t in (q, k, v, z, b, a)]).to(torch.int32)


def _onto_huge_pages(model) -> None:
    """
    Move the model's parameters into one buffer Linux may back with 2 MiB pages.

    A decode step streams every weight once; on 4 KiB pages that is a TLB miss every 4 KiB.
    Each parameter is copied once into its own slice and points there (same values; the
    old memory is freed). Every slice is a storage of its own (numpy views of the buffer),
    so the model, its fingerprint, its save_pretrained() and transformers' paths see
    separate tensors as before.
    """
    params = [p for p in model.parameters() if p.dtype in DTYPES and p.is_contiguous()]
    sizes = [-(-p.numel() * p.element_size() // 64) * 64 for p in params]  # aligned slices
    if sum(sizes) < HUGE_PAGE:
        return
    memory = huge_page_memory(sum(sizes)).numpy()
    at = 0
    for p, size in zip(params, sizes):
        nbytes = p.numel() * p.element_size()
        p.data = torch.from_numpy(memory[at:at + nbytes]).view(p.dtype).view(p.shape).copy_(
            p.data)
        at += size


def _hook_dicts(modules) -> list:
    """Return the forward hook dicts of `modules` and torch's global ones (never replaced)."""
    return [torch_module._global_forward_hooks, torch_module._global_forward_pre_hooks] + [
        d for m in modules for d in (m._forward_hooks, m._forward_pre_hooks)]


class CpuDecode:
    """Tokens of a Qwen3-Next-style hybrid through the compiled CPU step, over the arena."""

    def __init__(self, model, layers: list[tuple], max_len: int, max_tokens: int = MAX_TOKENS):
        """layers: (decoder layer, its state views) in order, as DecodeFastPath.layers."""
        self.lib = library()
        _onto_huge_pages(model)  # before any pointer into the weights is taken
        self._hooks = _hook_dicts(model.modules())
        self.embed = model.model.embed_tokens.weight  # [V, H]
        self.head = model.lm_head.weight  # [V, H]
        self.dtype = self.head.dtype
        self.bf16 = int(self.dtype == torch.bfloat16)
        norm, rotary = model.model.norm, model.model.rotary_emb
        self.final_eps = float(norm.eps)
        self.keep: list[torch.Tensor] = []
        self.stack = _Stack(model.model.layers, self.keep, max_len, max_tokens)
        self.final_norm = self.stack.folded(norm)
        self.rotary = (rotary.inv_freq.float().contiguous(), float(rotary.attention_scaling))
        self.keep.append(self.rotary[0])
        self.views = [state for _, state in layers]
        for layer, state in layers:
            self.stack.add(layer, state, self.rotary)
        hidden, vocab = self.embed.shape[1], self.head.shape[0]
        self.scratch = torch.zeros(self.stack.scratch_floats())
        self.stack.finish(self.scratch)
        self.h = torch.zeros((max_tokens, hidden))  # [T, H] the residual stream
        self.hidden = torch.zeros((max_tokens, hidden))  # [T, H] post-final-norm
        self.logits = torch.zeros((max_tokens, vocab))  # [T, V]
        # What every call passes, taken once: the buffers never move.
        self._args = (self.embed.data_ptr(), self.h.data_ptr(), self.head.data_ptr(),
                      self.logits.data_ptr(), self.hidden.data_ptr(), hidden, vocab)
        self._outputs = [None] + [(self.logits[:n], self.hidden[:n])
                                  for n in range(1, max_tokens + 1)]
        self._ids = (ctypes.c_int64 * max_tokens)()

    def observed(self) -> bool:
        """Whether a hook watches the model (then the exact path runs the step)."""
        return any(self._hooks)

    @inference
    def forward(self, tokens, pos0: int, save: bool = False):
        """
        Consume tokens (a list of ids) at positions pos0...; return (logits [T, V], hidden [T, H]).

        Both are views of buffers the next call overwrites. save: keep the state after each
        token so keep_prefix() can commit a prefix (a speculative verify).
        """
        n, lib = len(tokens), self.lib
        embed, h, head, logits, hidden, width, vocab = self._args
        ids = self._ids
        ids[:n] = tokens
        lib.fr_embed(embed, ids, n, h, width, self.bf16)
        self.stack.run(lib, h, n, pos0, save)
        lib.fr_head(h, self.final_norm, self.final_eps, head, logits, hidden, width, vocab, n,
                    torch.get_num_threads(), self.bf16)
        return self._outputs[n]

    def step(self, token: int, kv_len: int) -> torch.Tensor:
        """Consume one token at position kv_len - 1; return its logits [1, V]."""
        return self.forward((token,), kv_len - 1)[0]

    def keep_prefix(self, used: int, tokens: int) -> None:
        """After forward(..., save=True) of `tokens`, keep the state of the first `used`."""
        self.stack.keep_prefix(self.views, used, tokens)


class CpuHead:
    """
    The MTP head (its input fc and one attention decoder layer) through the compiled step.

    Its attention rows are the arena's head rows seen from row 1 (models/speculative.py): the
    token of arena row p sits at the layer's row p - 1 and at rotary position p.
    """

    def __init__(self, head, main: CpuDecode, keys, values, length, max_len: int):
        self.lib, self.main = main.lib, main
        self._hooks = _hook_dicts(head.modules())
        self.keep: list[torch.Tensor] = []
        self.stack = _Stack(head.layers, self.keep, max_len, MAX_TOKENS)
        self.stack.add(head.layers[0], (keys, values, length), main.rotary, rope_offset=1)
        self.norm_e = self.stack.folded(head.pre_fc_norm_embedding)
        self.norm_h = self.stack.folded(head.pre_fc_norm_hidden)
        self.eps = float(head.pre_fc_norm_embedding.eps)
        self.fc = head.fc.weight  # [H, 2H]
        self.final_norm, self.final_eps = self.stack.folded(head.norm), float(head.norm.eps)
        self.scratch = torch.zeros(self.stack.scratch_floats())
        self.stack.finish(self.scratch)
        hidden, vocab = main.embed.shape[1], main.head.shape[0]
        self.cat = torch.zeros((MAX_TOKENS, 2 * hidden))  # [T, 2H]
        self.h = torch.zeros((MAX_TOKENS, hidden))  # [T, H]
        self.hidden = torch.zeros((MAX_TOKENS, hidden))  # [T, H] post-norm
        self.logits = torch.zeros((MAX_TOKENS, vocab))  # [T, V]
        self._ids = (ctypes.c_int64 * MAX_TOKENS)()

    @staticmethod
    def refusal(head) -> str | None:
        """Say why this head cannot run compiled (None: it can)."""
        if not hasattr(head.layers[0].mlp, 'gate_proj'):
            return 'the MTP layer has a mixture-of-experts block'
        if head.fc.bias is not None:
            return 'the MTP fc has a bias'
        return None

    def observed(self) -> bool:
        return any(self._hooks)

    @inference
    def forward(self, tokens, prev: torch.Tensor, row: int, logits: bool = True):
        """
        Consume tokens at arena rows row... after main hiddens prev [T, H] (contiguous).

        Returns (logits [T, V] or None, post-norm hidden [T, H]), views of buffers the next
        call overwrites.
        """
        n, main, lib = len(tokens), self.main, self.lib
        ids = self._ids
        ids[:n] = tokens
        hidden = self.h.shape[1]
        nthreads = torch.get_num_threads()
        # The head reads the main's hidden as the arena keeps it (in the model's dtype),
        # whichever path handed it over, so a verify and single steps give the same bits.
        prev = prev.to(main.dtype).float().contiguous()
        lib.fr_mtp_input(main.embed.data_ptr(), ids, prev.data_ptr(), self.norm_e, self.norm_h,
                         self.eps, self.fc.data_ptr(), self.h.data_ptr(), self.cat.data_ptr(),
                         hidden, n, nthreads, main.bf16)
        self.stack.run(lib, self.h.data_ptr(), n, row - 1, save=False)
        lib.fr_head(self.h.data_ptr(), self.final_norm, self.final_eps,
                    main.head.data_ptr() if logits else None, self.logits.data_ptr(),
                    self.hidden.data_ptr(), hidden, main.head.shape[0], n, nthreads, main.bf16)
        return (self.logits[:n] if logits else None), self.hidden[:n]
