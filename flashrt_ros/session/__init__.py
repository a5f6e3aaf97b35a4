"""
The session layer (no ROS): who may touch the runtime's state, and when.

Session composes one mode (lm.py, policy.py, speech.py; one module each behind
modes.Mode), the turn scheduler (turns.py) and the interrupt and cancel policy
(interrupts.py). The node maps ROS onto it; docs/architecture.md shows the layers and
the concurrency rules.
"""

from .interrupts import InterruptMode, POLICY_MODES
from .lm import BUSY_MESSAGE
from .modes import Mode
from .outputs import Outputs
from .session import MODES, Session
from .turns import Turn, TurnRequest, TurnResult, TurnScheduler, TurnState

__all__ = ['BUSY_MESSAGE', 'InterruptMode', 'MODES', 'Mode', 'Outputs', 'POLICY_MODES',
           'Session', 'Turn', 'TurnRequest', 'TurnResult', 'TurnScheduler', 'TurnState']
