"""What a schedule sees of the engine that drives it: the step in progress, the micro-batches in
flight, and the three copy actions. A protocol, so that the schedules (which the engine imports)
do not import the engine back; :class:`offload.engine.OffloadEngine` is the one implementation.
"""

from __future__ import annotations

from typing import Optional, Protocol

import torch

from ..group import Group
from ..step import InFlight, StepState
from ..transport import Transport


class EngineView(Protocol):
    """The engine's fields and methods a schedule reads and calls (see ``offload/engine/copies.py`` and
    ``offload/engine/lifecycle.py`` for what each does)."""

    transport: Transport
    step: Optional[StepState]
    in_flight: InFlight

    def start_offload(self, group: Group) -> None: ...

    def release(self, group: Group) -> None: ...

    def start_reload(self, group: Group, into: Optional[torch.Tensor] = None) -> None: ...

    def warn_once(self, key: str, message: str) -> None: ...

    def step_state(self, index: int) -> Optional[StepState]: ...

    def micro_batches(self) -> list[StepState]: ...
