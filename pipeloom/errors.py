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


def whole(flag: str, value) -> None:
    """Refuse ``value`` of ``--flag`` (underscores read as dashes) unless it is a whole number >= 1."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PipeloomError(f"--{flag.replace('_', '-')} must be a whole number >= 1, got {value!r}")


def one_of(flag: str, value, choices) -> None:
    """Refuse ``value`` of ``--flag`` unless it is one of ``choices``."""
    if value not in choices:
        raise PipeloomError(f"--{flag.replace('_', '-')} {value!r}: choose one of {', '.join(choices)}")


def comma_list(flag: str, text: str) -> list[str]:
    """The names of the comma list ``text`` given to ``flag``: at least one, none twice."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise PipeloomError(f"{flag} {text!r}: give at least one name")
    twice = next((name for name in names if names.count(name) > 1), None)
    if twice:
        raise PipeloomError(f"{flag} {text!r}: {twice} is named twice")
    return names
