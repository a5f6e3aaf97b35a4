"""
Engine: prefill and the decode step over arena-bound state, plus the sampler.

On CUDA the decode step is captured once in a CUDA graph: its inputs (the token buffer),
its state (the arena) and its output (the arena's logits view) all have fixed addresses,
so one `replay()` runs a whole step with a single launch. Restores copy INTO the arena,
never re-bind it, so the graph stays valid across snapshot/restore/rollback. On CPU the
same step runs eagerly over the same buffers (and a waiting preemption can abandon it at a
module call: preemption.py).
"""

from __future__ import annotations

import math
import re

import torch

from .errors import FlashRTError
from .inference import inference
from .models.base import CausalLMAdapter
from .models.pieces import preemptible
from .models.widen import widened
from .state.arena import StateSpec

PREFILL_CHUNK = 2048  # tokens per prefill forward: bounds activation memory for long prompts
WARMUP_STEPS = 3  # eager steps on a side stream before capture (lazy inits, allocator)
# Older torch releases leave the caching allocator broken after a failed capture (every
# later empty_cache() asserts), so a capture is only tried from this release on.
MIN_GRAPH_TORCH = (2, 12)
GRAPH_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-6}  # others (bf16, fp16): 1e-2


def graph_refusal(version: str) -> str | None:
    """Say why decode steps are not captured on torch `version` (None: they may be)."""
    release = tuple(int(n) for n in re.findall(r'\d+', version.split('+')[0])[:2])
    if release >= MIN_GRAPH_TORCH:
        return None
    least = '.'.join(map(str, MIN_GRAPH_TORCH))
    return (f'disabled: torch {version} is older than {least}, where a failed capture breaks '
            f'the caching allocator; running eager (install torch>={least} for CUDA graphs)')


def replay_mismatch(replay, step, views: dict[str, torch.Tensor]) -> str | None:
    """
    Run `replay` and `step` from the same state; say where their states differ (None: nowhere).

    Leaves the views as `step` left them; the caller puts the state back.
    """
    before = {name: v.clone() for name, v in views.items()}
    replay()
    replayed = {name: v.clone() for name, v in views.items()}
    for name, v in views.items():
        v.copy_(before[name])
    step()
    for name, v in views.items():
        a, b = replayed[name], v
        if not a.dtype.is_floating_point:
            if not torch.equal(a, b):
                return f'{name} differs'
            continue
        tol = GRAPH_TOLERANCE.get(a.dtype, 1e-2)
        if not torch.allclose(a.float(), b.float(), rtol=tol, atol=tol, equal_nan=True):
            return f'{name} differs by up to {float((a.float() - b.float()).abs().max()):.3g}'
    return None


class Engine:
    """Runs a causal-LM adapter over its bound state and writes last logits into the arena."""

    def __init__(self, adapter: CausalLMAdapter, logits: torch.Tensor, tokens: torch.Tensor,
                 cuda_graphs: bool):
        self.adapter = adapter
        self.logits = logits  # [V] fp32 arena view: the output of every step
        self._history = tokens  # [L] int32 arena view of the consumed ids
        # On CPU written through numpy: no torch op per token
        self._history_host = tokens.numpy() if tokens.device.type == 'cpu' else None
        self.limit_vocab(logits.shape[0])
        self.device = logits.device
        self.token = torch.zeros(
            (1, 1), dtype=torch.long, device=self.device
        )  # static decode input
        self.cuda_graphs = cuda_graphs and self.device.type == 'cuda'
        self.graph: torch.cuda.CUDAGraph | None = None
        self.graph_error: str | None = None
        self.replays = 0  # decode steps run by replaying the graph (stats: cuda_graph_replays)
        self.prefill_pieces = True  # False: a preemption waits for whole operations (an A/B)
        if self.cuda_graphs and getattr(adapter, 'has_sliding_layers', False):
            # Sliding-window layers branch in Python on a host-side counter; a graph would
            # freeze one branch. Run them eagerly rather than risk a wrong step.
            self.cuda_graphs = False
            self.graph_error = 'disabled: sliding-window layers branch on host state'
        if self.cuda_graphs and graph_refusal(torch.__version__):
            self.cuda_graphs = False
            self.graph_error = graph_refusal(torch.__version__)

    @staticmethod
    def state_specs(vocab_size: int, max_seq_len: int) -> list[StateSpec]:
        """Return the engine's own arena state: the last logits and the token history."""
        return [StateSpec('logits', 'logits', (vocab_size,), torch.float32),
                StateSpec('tokens', 'tokens', (max_seq_len,), torch.int32, seq_dim=0)]

    @torch.inference_mode()
    def prefill(self, ids: list[int], position: int, stop=None) -> int:
        """
        Consume ids at `position` in chunks; return how many were consumed.

        stop(): asked between chunks; when true the rest is left out, and the state is
        exactly that of a prefill of the chunks run (next-token logits included). A waiting
        preemption abandons a chunk at its next module call or, with `prefill_pieces`,
        within a piece of its long operations (models/pieces.py).
        """
        t = torch.tensor([ids], dtype=torch.long, device=self.device)  # [1, T]
        end = 0
        while end < t.shape[1] and not (end and stop is not None and stop()):
            chunk = t[:, end:end + PREFILL_CHUNK]  # [1, <=C]
            end += chunk.shape[1]
            with preemptible(self.prefill_pieces), widened():
                out = self.adapter.forward(chunk, kv_len=position + end)  # [1, V]
        self.logits.copy_(out[0])
        return end

    @inference
    def _step(self, kv_len: int | None = None) -> None:
        self.logits.copy_(self.adapter.forward(self.token, kv_len)[0])  # [V], cast to fp32

    def record(self, ids, position: int, on_device: torch.Tensor | None = None) -> None:
        """
        Write consumed ids (a sequence) into the arena's history from `position` on.

        on_device: the same ids as a tensor on the arena's device, copied from there (a
        copy from host memory would wait for the device). A history shorter than the
        positions (a window of the last ones: speech) keeps step t at t mod its length.
        """
        length = self._history.shape[0]
        if position + len(ids) > length:
            for i, token in enumerate(ids):
                self._history[(position + i) % length] = int(token)
            return
        end = position + len(ids)
        if on_device is not None:
            self._history[position:end].copy_(on_device)
        elif self._history_host is not None:
            self._history_host[position:end] = ids
        else:
            self._history[position:end].copy_(torch.tensor(ids, dtype=torch.int32))

    @inference
    def decode(self, token: int, position: int) -> None:
        """Consume one token at `position`; replays the captured graph when it applies."""
        self.token.fill_(token)
        if self.graph is not None and self.adapter.decode_ready():
            self.graph.replay()
            self.replays += 1
        else:
            self._step(kv_len=position + 1)

    @torch.inference_mode()
    def capture(self, views: dict[str, torch.Tensor]) -> bool:
        """
        Capture the decode step in a CUDA graph, then check one replay against an eager step.

        `views` is all the state the step touches. The caller saves and restores it around
        this call: warm-up, capture and the check all advance it.
        """
        if not self.cuda_graphs or self.graph is not None:
            return self.graph is not None
        self.adapter.prepare_capture()
        # On this GPU, not the current one: torch.cuda.graph syncs and captures on the current
        # device unless told otherwise.
        with torch.cuda.device(self.device):
            prev = torch.cuda.current_stream(self.device)
            try:
                stream = torch.cuda.Stream(self.device)
                stream.wait_stream(prev)
                with torch.cuda.stream(stream):
                    for _ in range(WARMUP_STEPS):
                        self._step()
                prev.wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                # thread_local: a blocking CUDA call on another thread (a checksum's .cpu())
                # does not spoil the capture.
                with torch.cuda.graph(graph, stream=stream, capture_error_mode='thread_local'):
                    self._step()
                torch.cuda.synchronize(self.device)
                # A wrong graph would decode wrong tokens silently: compare it once.
                mismatch = replay_mismatch(graph.replay, self._step, views)
                if mismatch is None:
                    self.graph, self.graph_error = graph, None
                else:
                    self.cuda_graphs = False
                    self.graph_error = (f'disabled: one replay of the captured step does not '
                                        f'match an eager step ({mismatch}); running eager')
            except Exception as exc:  # e.g. a host sync inside the model: stay eager, say why
                self.graph = None
                self.graph_error = f'capture failed, running eager: {exc!r}'[:500]
                self.cuda_graphs = False  # and do not try again on every warm-up
                try:
                    torch.cuda.synchronize(self.device)
                except Exception:
                    pass
            finally:
                # A capture that fails in capture_end leaves its stream current on this
                # thread, where later work (a snapshot's copy) would race the decode stream.
                # Set back inside the device block: set_stream also switches the device.
                torch.cuda.set_stream(prev)
        return self.graph is not None

    def drop_graph(self) -> None:
        self.graph = None

    def limit_vocab(self, n: int) -> None:
        """Sample from the first n logits only: the model's rows past the tokenizer's ids."""
        self.vocab_limit = n  # ids a token may be sampled from (speculation drafts and verifies)
        self._sampled = self.logits[:n]  # [n] view: a restore's copy shows through
        # What greedy decoding reads one logit from: on CPU a numpy view (no tensor built)
        self._logit_of = (self._sampled.numpy() if self._sampled.device.type == 'cpu'
                          else self._sampled)

    @inference
    def sample(
        self, temperature: float, top_k: int, top_p: float, generator: torch.Generator
    ) -> int:
        """Pick the next token: argmax when temperature <= 0, else top-k/top-p sampling."""
        if temperature <= 0.0:  # numpy's argmax, like torch's, takes the first maximum
            best = int(self._logit_of.argmax())
            if math.isnan(self._logit_of[best]):  # argmax lands on a NaN when there is one
                raise FlashRTError(
                    'the model produced NaN logits; no token was taken: check the model '
                    '(dtype, weights) and the capsule the state came from')
            return best
        x = self._sampled / temperature  # [n]
        if 0 < top_k < x.shape[0]:
            kth = torch.topk(x, top_k).values[-1]
            x = x.masked_fill(x < kth, float('-inf'))
        if top_p < 1.0:
            sorted_x, order = torch.sort(x, descending=True)  # [V]
            probs = torch.softmax(sorted_x, dim=-1)
            # Drop a token once the mass before it exceeds top_p (the best one always stays).
            drop = (torch.cumsum(probs, dim=-1) - probs) > top_p
            x = x.scatter(0, order[drop], float('-inf'))
        probs = torch.softmax(x, dim=-1)
        return int(torch.multinomial(probs, 1, generator=generator))
