"""What Runtime.stats() reports: typed, immutable records (to_dict() gives the JSON form)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class TierStats:
    count: int  # capsules in the tier
    # Their blob bytes (disk: the capsule files' sizes and the temp files of writes:
    # RuntimeStats.disk_temp_bytes)
    bytes_used: int
    budget: int  # bytes; 0 = unlimited


@dataclass(frozen=True)
class RingStats:
    count: int  # committed boundaries on the rollback ring
    bytes_used: int
    depth: int  # rollback_depth
    # Entries that left the ring, held until the next capture frees them (state/ring.py);
    # some may still be named capsules or ring entries too.
    retired_count: int
    retired_bytes: int  # bytes only the retired entries keep
    budget: int = 0  # ring_budget_bytes; 0 = unlimited
    last_commit_bytes: int = 0  # what the last commit copied: the state's head (state/ring.py)
    lineage_drops: int = 0  # boundaries dropped since start because the live rows moved on


@dataclass(frozen=True)
class RuntimeStats:
    model: str
    family: str  # the adapter's model family ('' once closed)
    device: str
    dtype: str
    state_nbytes: int  # the arena's size (0 once closed)
    position: int
    tiers: dict[str, TierStats]  # tier name -> its capsules
    rollback_ring: RingStats
    last_restore_s: float
    # Bytes the last restore/rollback copied: less than the capsule when the live state
    # already held its sequence rows (same lineage).
    last_restore_copied_bytes: int
    # Memory of dropped capsules kept for new ones (CPU runtimes). Not in the tier
    # accounting, which counts capsule bytes (a pooled blob's buffer may be up to 1/8
    # larger than the capsule).
    blob_pool_idle_bytes: int
    p99_restore_s: float  # over the last 1000 restores
    decode_tokens_per_s: float  # of the last turn that decoded more than one token
    cuda_graph: bool  # whether a captured graph runs the decode step
    cuda_graph_note: str | None  # why not, when it does not
    cuda_graph_replays: int
    # 'function:package' per fast-kernel binding of the model's transformers code
    # ('function:reference' where its torch code runs: every one on CPU), and
    # 'bf16_linear:float32' where a bf16 prefill's products are widened (models/widen.py)
    kernels: tuple[str, ...]
    control_step_s: float | None = None  # the last act() (policy mode; None for an LM)
    # Temp files in capsule_dir: disk writes in progress, or left by a killed process until
    # a sweep removes them (counted in the disk tier's bytes_used)
    disk_temp_bytes: int = 0
    # Why single-token steps do not take the decode fast path (models/fastpath.py); None
    # when they do
    decode_fastpath_note: str | None = None
    # Why single-token steps do not run the compiled CPU step (models/cpu_step.py); None
    # when they do
    cpu_step_note: str | None = None
    # Speculative decoding: {'enabled': False, 'note': why} or its rounds, mean tokens per
    # round (mean_accepted_length) and acceptance_by_depth (modes/lm/speculation.py)
    speculation: dict | None = None

    def to_dict(self) -> dict:
        """Return the nested dict of JSON values (an LM's has no control_step_s)."""
        out = dataclasses.asdict(self)
        out['kernels'] = list(self.kernels)
        if self.control_step_s is None:
            del out['control_step_s']
        return out
