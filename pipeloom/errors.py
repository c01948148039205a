"""The one exception type for mistakes a user can make.

Every layer raises :class:`PipeloomError` (a ``ValueError``) for bad input;
the command line prints its message on one line and exits non-zero.
"""


class PipeloomError(ValueError):
    """Bad input: the message names the bad value and what would fit."""


class ScheduleError(PipeloomError):
    """A schedule that breaks the rules of the schedule language."""
