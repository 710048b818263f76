"""Schedules: when each layer's group is offloaded, released and reloaded (one module each)."""

from .auto import ScheduleAuto
from .base import DEFAULT_GROUP_BYTES, ManualSchedule, Schedule
from .v1 import ScheduleV1, window_layers
from .v2 import ScheduleV2

__all__ = ["DEFAULT_GROUP_BYTES", "ManualSchedule", "Schedule", "ScheduleAuto", "ScheduleV1", "ScheduleV2", "window_layers"]
