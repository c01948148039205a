"""The one exception type for mistakes a user can make.

Every layer raises :class:`PipeloomError` (a ``ValueError``) for bad input;
the command line prints its message on one line and exits non-zero.
"""


class PipeloomError(ValueError):
    """Bad input: the message names the bad value and what would fit."""


class ScheduleError(PipeloomError):
    """A schedule that breaks the rules of the schedule language."""


def first_line(err: BaseException) -> str:
    """The first line of ``err``'s message (its type's name if it has none): for one-line reports."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
