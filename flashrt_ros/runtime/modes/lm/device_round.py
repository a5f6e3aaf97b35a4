"""
The torch path of a batched speculative round, with one host sync per round.

Drafting and verifying stay on the device: the drafts are written into a token buffer by
argmax on the device, the verify's greedy tokens and a NaN flag into an int64 buffer. On
CUDA, once the decode step is captured (Engine.capture), each of those phases is a CUDA
graph over the same static buffers: draft k tokens, verify k + 1, feed u tokens again after
a rejection. The graphs' shapes are the whole arena (no window) and their positions come
from the state's own counters, so one graph serves every position. The host reads one
small buffer per round (the tokens and the verify's greedy choices) and decides the round
from it: which drafts are accepted, where a stop condition cuts, whether the accepted
tokens must be fed again.

Everywhere else (CPU, eager CUDA) the same functions run eagerly, with the attention window
of the live prefix (models/binding.py); `static=True` runs them in the captured shapes
instead, which is how the CPU tests check what a graph computes.

Buffers (allocated once, never re-bound):
  ids     [1, k + 1]  the pending token x, then the drafts d_1..d_k
  logits  [k + 1, V]  the main model's float32 logits after each token of the verify
  out     [2k + 3]    best_0..best_k, a NaN flag, then ids again: all the host needs to
                      decide the round, in one read
  head    bytes       the arena's head (recurrent, conv, counters, hidden) before a verify
"""

from __future__ import annotations

from typing import Callable

import torch

from ...engine import replay_mismatch, WARMUP_STEPS

CHECK_POSITION = 3  # where a captured phase's first replay is compared with an eager run


class DeviceRound:
    """Static buffers and device-side phases of the batched torch round (see module doc)."""

    def __init__(self, rt, draft_tokens: int, static: bool = False):
        a, arena = rt.adapter, rt.arena
        self.rt, self.adapter, self.k = rt, a, draft_tokens
        self.static = static  # run eagerly in the captured shapes (tests)
        device, k = rt.device, draft_tokens
        self.ids = torch.zeros((1, k + 1), dtype=torch.long, device=device)
        self.logits = torch.zeros((k + 1, rt.engine.logits.shape[0]), dtype=torch.float32,
                                  device=device)
        self.out = torch.zeros(2 * k + 3, dtype=torch.long, device=device)
        self.head = torch.zeros(arena.head_nbytes, dtype=torch.uint8, device=device)
        self.graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        self.graph_error: str | None = None
        self.replays = 0

    # ---- the phases (no host sync inside; position None: the captured shapes) ----------

    def _window(self, position: int | None, rows: int) -> int | None:
        return None if position is None or self.static else position + rows

    def draft(self, k: int, position: int | None) -> None:
        """Write k drafts into ids[0, 1:k + 1], chaining the head from ids[0, 0]."""
        a, limit = self.adapter, self.rt.engine.vocab_limit
        hidden = a.hidden.view(1, 1, -1)  # [1, 1, H]
        for j in range(k):
            # The draft of the token at arena row position + j leaves that many head rows.
            hidden = a.draft_step(self.ids[:, j:j + 1], hidden, self._window(position, j))
            logits = a.lm_head(hidden)[0, -1, :limit]  # [limit]
            self.ids[0, j + 1].copy_(logits.argmax())  # first maximum, as plain decoding

    def verify(self, n: int, position: int | None) -> None:
        """Consume ids[0, :n]; leave the greedy tokens, the NaN flag and the tokens in out."""
        a, arena, k = self.adapter, self.rt.arena, self.k
        self.head.copy_(arena.storage[:arena.head_nbytes])
        hidden = a.forward_hidden(self.ids[:, :n], self._window(position, n))  # [1, n, H]
        logits = self.logits[:n]
        logits.copy_(a.lm_head(hidden)[0])  # [n, V], cast to float32 as Engine.logits
        sampled = logits[:, :self.rt.engine.vocab_limit]
        self.out[:n].copy_(sampled.argmax(-1))  # first maximum, as plain decoding
        self.out[k + 1].copy_(sampled.isnan().any())
        self.out[k + 2:k + 2 + n].copy_(self.ids[0, :n])

    def feed(self, u: int, position: int | None) -> None:
        """Consume ids[0, :u] again (after a rejection); its last logits into Engine.logits."""
        a = self.adapter
        hidden = a.forward_hidden(self.ids[:, :u], self._window(position, u))  # [1, u, H]
        self.rt.engine.logits.copy_(a.lm_head(hidden[:, -1:])[0, -1])

    def read(self, n: int) -> tuple[list[int], list[int], bool]:
        """Read the round's outcome, its one host sync: (tokens, greedy tokens, NaN seen)."""
        k = self.k
        out = self.out.tolist()
        return out[k + 2:k + 2 + n], out[:n], bool(out[k + 1])

    # ---- graphs ------------------------------------------------------------------------

    def phases(self) -> list[tuple[str, int]]:
        """(phase, token count) of every graph: rounds of 1..k drafts."""
        return [(phase, count) for k in range(1, self.k + 1)
                for phase, count in (('draft', k), ('verify', k + 1), ('feed', k))]

    def run(self, phase: str, count: int, position: int) -> None:
        """Run a phase: its captured graph when it applies, else eagerly."""
        graph = self.graphs.get((phase, count))
        # Captured beside the decode graph, in its state: linear layers past their prefill.
        if graph is not None and self.rt.engine.graph is not None and self.adapter.decode_ready():
            graph.replay()
            self.replays += 1
            return
        getattr(self, phase)(count, position)

    def capture(self, views: dict[str, torch.Tensor], prepare: Callable[..., None]) -> bool:
        """
        Capture every phase of rounds of 1..k drafts as CUDA graphs; check each replay once.

        prepare(position=0) puts a capturable state in place: the arena zeroed and past its
        prefill, its counters at `position` (the caller restores the live state afterwards).
        Each graph is captured at position 0 and checked against an eager run of its phase
        at another position, so a position baked into a graph shows. A phase that fails to
        capture or to replay like its eager run leaves every phase eager, and says why.
        """
        device = self.rt.device
        # What a phase writes: the state and the round's own buffers.
        written = dict(views, **{'round.ids': self.ids, 'round.logits': self.logits,
                                 'round.out': self.out, 'round.head': self.head})
        check_at = CHECK_POSITION if self.rt.config.max_seq_len > 2 * (
            CHECK_POSITION + self.k + 1) else 0
        with torch.cuda.device(device):
            prev = torch.cuda.current_stream(device)
            try:
                stream = torch.cuda.Stream(device)
                # One memory pool: the phases replay one after another on one stream and
                # leave what they hand on in the static buffers.
                pool = torch.cuda.graph_pool_handle()
                for phase, count in self.phases():
                    def run(fn=getattr(self, phase), count=count):
                        fn(count, None)
                    for _ in range(WARMUP_STEPS):  # on a side stream, as torch asks
                        prepare()
                        stream.wait_stream(prev)
                        with torch.cuda.stream(stream):
                            run()
                        prev.wait_stream(stream)
                    prepare()
                    stream.wait_stream(prev)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream,
                                          capture_error_mode='thread_local'):
                        run()
                    torch.cuda.synchronize(device)
                    prepare(check_at)
                    mismatch = replay_mismatch(graph.replay, run, written)
                    if mismatch is not None:
                        raise RuntimeError(f'{phase} of {count}: one replay does not match an '
                                           f'eager run ({mismatch})')
                    self.graphs[phase, count] = graph
                self.graph_error = None
            except Exception as exc:  # a host sync inside the model, a mismatch: stay eager
                self.graphs.clear()
                self.graph_error = f'speculative rounds run eager: {exc!r}'[:500]
                try:
                    torch.cuda.synchronize(device)
                except Exception:
                    pass
            finally:
                torch.cuda.set_stream(prev)  # a failed capture_end leaves its stream current
        return bool(self.graphs)
