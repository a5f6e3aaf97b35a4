"""RuntimeConfig: everything a Runtime is built from, validated up front."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
import os
from pathlib import Path
import re
from typing import Any

from .errors import ConfigError

DTYPES = ('auto', 'float32', 'bfloat16', 'float16')  # auto: the checkpoint's own (models/hf.py)
PROMPT_FORMATS = ('auto', 'chat', 'raw')  # how a text prompt goes in (modes/lm/chat.py)
EVICTION_POLICIES = ('refuse', 'lru')
TIERS = ('device', 'host', 'disk')  # capsule tiers; each has a <tier>_budget_bytes field
KEY_FILE_ENV = 'FLASHRT_CAPSULE_KEY_FILE'  # names the capsule key file (RuntimeConfig.capsule_key)
MIN_KEY_BYTES = 16
VERIFY_STRATEGIES = ('sequential', 'batched')  # speculative_verify
MAX_DRAFT_TOKENS = 3
_DEVICE_RE = re.compile(r'^(cpu|cuda|cuda:\d+)$')
AUTO_BUDGET = -1  # a budget sized from the arena: see RuntimeConfig.sized_budgets
# (full-state capsules an auto budget holds, the least it is): the old fixed defaults stay
# the floor, so a small model's budgets are what they always were.
_AUTO_BUDGETS = {'device': (4, 256 << 20), 'host': (8, 1 << 30), 'disk': (16, 4 << 30),
                 'ring': (2, 256 << 20)}


@dataclass
class RuntimeConfig:
    model: str = 'default'  # 'default' (the trained checkpoint), builtin:<id> or a folder
    device: str = 'cpu'  # "cpu" | "cuda" | "cuda:N"
    # "auto" (a local checkpoint's torch_dtype from config.json; float32 for built-ins and
    # policies) | "float32" | "bfloat16" | "float16"
    dtype: str = 'auto'
    max_seq_len: int = 4096  # KV capacity in tokens (the arena is sized for it)
    # Capsule tier budgets in bytes: 0 = unlimited, -1 = sized from the arena (the state at
    # max_seq_len): device 4x, host 8x, disk 16x, at least 256 MiB / 1 GiB / 4 GiB.
    device_budget_bytes: int = AUTO_BUDGET
    host_budget_bytes: int = AUTO_BUDGET
    disk_budget_bytes: int = AUTO_BUDGET
    capsule_dir: str = '~/.cache/flashrt_ros/capsules'
    eviction: str = 'refuse'  # "refuse" | "lru" (lru never evicts pinned capsules)
    cuda_graphs: bool = True  # ignored on CPU
    rollback_depth: int = 8  # committed boundaries kept in the rollback ring
    # The ring's memory, oldest dropped first; 0 = unlimited, -1 = 2x the arena, >= 256 MiB.
    ring_budget_bytes: int = AUTO_BUDGET
    seed: int = 0  # initial sampler seed (and reset() seed)
    # How text prompts go in: "chat" renders them with the tokenizer's chat template as
    # conversation turns, "raw" appends the text as it is, "auto" is chat when the
    # tokenizer has a template and raw otherwise.
    prompt_format: str = 'auto'
    # Self-speculative greedy decoding with the checkpoint's MTP head (modes/lm/speculation.py)
    speculation: bool = False
    speculative_tokens: int = 2  # drafts per round, 1..3
    speculative_verify: str = 'batched'  # "batched" | "sequential" (bit-exact with plain)
    # Decode Qwen3-Next / Qwen3.5 float32 and bf16 models on a CPU with the compiled step
    # (models/cpu_step.c: needs a C compiler at first start); False: torch ops, bit-identical
    # with transformers' forward.
    cpu_step: bool = True

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ConfigError naming the first bad field and what it accepts."""
        if not isinstance(self.model, str) or not self.model.strip():
            raise ConfigError("model must be 'default', 'builtin:<id>' or a local checkpoint "
                              'directory')
        if not isinstance(self.device, str) or not _DEVICE_RE.match(self.device):
            raise ConfigError(
                f"device {self.device!r} is not valid; use 'cpu', 'cuda' or 'cuda:N'"
            )
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} is not valid; use one of {', '.join(DTYPES)}")
        if self.prompt_format not in PROMPT_FORMATS:
            raise ConfigError(f'prompt_format {self.prompt_format!r} is not valid; use one of '
                              f"{', '.join(PROMPT_FORMATS)}")
        if self.eviction not in EVICTION_POLICIES:
            raise ConfigError(f'eviction {self.eviction!r} is not valid; use one of '
                              f"{', '.join(EVICTION_POLICIES)}")
        if not isinstance(self.cuda_graphs, bool):
            raise ConfigError('cuda_graphs must be true or false')
        if not isinstance(self.capsule_dir, str) or not self.capsule_dir:
            raise ConfigError('capsule_dir must be a non-empty directory path')
        if not isinstance(self.cpu_step, bool):
            raise ConfigError('cpu_step must be true or false')
        if not isinstance(self.speculation, bool):
            raise ConfigError('speculation must be true or false')
        if self.speculative_verify not in VERIFY_STRATEGIES:
            raise ConfigError(f'speculative_verify {self.speculative_verify!r} is not valid; '
                              f"use one of {', '.join(VERIFY_STRATEGIES)}")
        _check_int('speculative_tokens', self.speculative_tokens, minimum=1)
        if self.speculative_tokens > MAX_DRAFT_TOKENS:
            raise ConfigError(f'speculative_tokens must be at most {MAX_DRAFT_TOKENS}, got '
                              f'{self.speculative_tokens}')
        _check_int('max_seq_len', self.max_seq_len, minimum=8)
        _check_int('rollback_depth', self.rollback_depth, minimum=0)
        _check_int('ring_budget_bytes', self.ring_budget_bytes, minimum=AUTO_BUDGET)
        _check_int('seed', self.seed, minimum=0)
        for tier in TIERS:
            _check_int(f'{tier}_budget_bytes', getattr(self, f'{tier}_budget_bytes'),
                       minimum=AUTO_BUDGET)

    @property
    def budgets(self) -> dict[str, int]:
        """Byte budget of each capsule tier as set (0 = unlimited, -1 = from the arena)."""
        return {tier: getattr(self, f'{tier}_budget_bytes') for tier in TIERS}

    def sized_budgets(self, arena_bytes: int) -> dict[str, int]:
        """Return the budget of each tier and of the ring ('ring'), -1 sized from the arena."""
        budgets = dict(self.budgets, ring=self.ring_budget_bytes)
        for name, value in budgets.items():
            if value == AUTO_BUDGET:
                capsules, floor = _AUTO_BUDGETS[name]
                budgets[name] = max(floor, capsules * arena_bytes)
        return budgets

    @property
    def capsule_path(self) -> Path:
        return Path(self.capsule_dir).expanduser()

    def capsule_key(self) -> bytes | None:
        """
        Return the capsule key from the file $FLASHRT_CAPSULE_KEY_FILE names, or None.

        With a key, disk capsules carry a MAC under it and files without a valid one are
        refused. (An environment variable, not a field: every field is a node parameter.)
        """
        path = os.environ.get(KEY_FILE_ENV, '')
        if not path:
            return None
        try:
            key = Path(path).expanduser().read_bytes()
        except OSError as exc:
            raise ConfigError(f'cannot read the capsule key file {path!r}: {exc}') from exc
        if len(key) < MIN_KEY_BYTES:
            raise ConfigError(
                f'capsule key file {path!r} holds {len(key)} bytes; use at least '
                f'{MIN_KEY_BYTES} random bytes (head -c 32 /dev/urandom > {path})')
        return key

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> 'RuntimeConfig':
        if not isinstance(values, dict):
            raise ConfigError('runtime config must be a mapping of field names to values')
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f'unknown config keys {unknown}; valid keys are {sorted(known)}')
        return cls(**values)

    @classmethod
    def from_yaml(cls, path: str | Path) -> 'RuntimeConfig':
        import yaml

        try:
            text = Path(path).expanduser().read_text()
        except OSError as exc:
            raise ConfigError(f'cannot read config file {str(path)!r}: {exc}') from exc
        try:
            values = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f'config file {str(path)!r} is not valid YAML: {exc}') from exc
        return cls.from_dict(values or {})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_int(name: str, value: Any, minimum: int) -> None:
    # bool is an int subclass; 'true' for a byte budget is a mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f'{name} must be an integer >= {minimum}, got {value!r}')
