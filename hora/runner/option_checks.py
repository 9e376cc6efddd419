"""What ``horarun`` checks and says of the flags' values before it builds a job's options.

:func:`check_values` holds the rules the values must follow: every number within the range its
flag declares, ``--output-filename``'s directory made, ``--ssh-option`` as ``Key=Value``, and the
elastic flags together (``-np`` between ``--min-np`` and ``--max-np``, the cooldown range, an
executable discovery script). :func:`is_elastic` says whether the flags ask for an elastic job;
:func:`refusals` says why the flags asking for what hora cannot do are refused, and
:func:`notes` names the accepted flags that have no effect here.

This module reads the flags' values by name and the flag table; it does not parse, read the
config file or build the options (:mod:`hora.runner.options` does).
"""

from __future__ import annotations

import os
from pathlib import Path

from hora.common.vocabulary import safe_files
from hora.runner.flags import BY_DEST, OPTIONS
from hora.runner.launch_options import OptionError, Values


def _check_bounds(values: Values) -> None:
    """Every number within its declared range (a pair is checked by :func:`_check_elastic`)."""
    for option in OPTIONS:
        value = values[option.dest]
        limits = option.limits
        if value is None or limits is None or option.shape == "pair":
            continue
        if not limits.allows(value):
            raise OptionError(option.bounds_error(value))


def check_values(values: Values) -> None:
    """Check the values against every rule; the first one broken is raised.

    Raises:
        OptionError: a value is out of range, or flags that go together disagree.
    """
    _check_bounds(values)
    if values["output_filename"]:
        _check_output_directory(values["output_filename"])
    for option in values["ssh_option"] or []:
        if "=" not in option or option.startswith("-"):
            raise OptionError(f"--ssh-option {option!r} must look like Key=Value.")
    if is_elastic(values):
        _check_elastic(values)


_ELASTIC_TRIGGERS = tuple(option for option in OPTIONS if option.makes_elastic)
_TRIGGER_FLAGS = ", ".join(option.flag for option in _ELASTIC_TRIGGERS[:-1])
_TRIGGER_TEXT = f"{_TRIGGER_FLAGS} or {_ELASTIC_TRIGGERS[-1].flag}"


def is_elastic(values: Values) -> bool:
    """Whether the flags ask for an elastic job (``--min-np``, ``--max-np`` or
    ``--host-discovery-script``)."""
    return any(values[option.dest] is not None for option in _ELASTIC_TRIGGERS)


def _check_elastic(values: Values) -> None:
    """Check the elastic flags together, ``-np`` defaulting to ``--min-np`` and the reverse."""
    np, min_np, max_np = values["np"], values["min_np"], values["max_np"]
    if np is None:
        np = min_np
    if min_np is None:
        min_np = np
    if np is not None:
        if np < min_np:
            raise OptionError(
                f"-np {np} is less than --min-np {min_np}: the job starts with -np workers, at "
                "least --min-np."
            )
        if max_np is not None and np > max_np:
            raise OptionError(f"-np {np} is more than --max-np {max_np}.")
    if min_np is not None and max_np is not None and min_np > max_np:
        raise OptionError(f"--min-np {min_np} is more than --max-np {max_np}.")
    if values["blacklist_cooldown_range"] is not None:
        _check_cooldown(*values["blacklist_cooldown_range"])
    if values["host_discovery_script"] is not None:
        _check_script(values["host_discovery_script"])


def _check_output_directory(directory: str) -> None:
    """Create ``--output-filename``'s directory now, so that a problem stops the job before any
    worker starts (files in it are created by :mod:`hora.common.vocabulary.safe_files`)."""
    try:
        safe_files.make_directories(directory)
    except OSError as exc:
        raise OptionError(f"--output-filename {directory}: {exc}") from None


def _check_script(script: str) -> None:
    path = Path(script)
    if not path.is_file():
        raise OptionError(f"--host-discovery-script {script!r}: no such file.")
    if not os.access(path, os.X_OK):
        raise OptionError(
            f"--host-discovery-script {script!r} is not executable; run `chmod +x {script}`."
        )


def _check_cooldown(low: float, high: float) -> None:
    option = BY_DEST["blacklist_cooldown_range"]
    limits = option.limits
    assert limits is not None and limits.low is not None and limits.high is not None
    if not limits.low <= low <= high <= limits.high:
        raise OptionError(
            f"{option.flag} {low:g} {high:g}: need {limits.low:g} <= MIN <= MAX <= "
            f"{limits.high:g} (seconds)."
        )


def notes(values: Values) -> list[str]:
    """One line per accepted flag that has no effect in hora (printed under ``--verbose``)."""
    found = []
    for option in OPTIONS:
        value = values[option.dest]
        if option.inert and value is not None and value is not False:
            found.append(f"{option.flag} has no effect: {option.inert}")
    if not is_elastic(values):
        for option in OPTIONS:
            if option.elastic_only and values[option.dest] is not None:
                found.append(
                    f"{option.flag} has no effect: the job is not elastic (give {_TRIGGER_TEXT})."
                )
    elif values["slots"] is not None and values["host_discovery_script"] is None:
        found.append(
            "--slots-per-host has no effect: it applies to hosts a --host-discovery-script names."
        )
    return found


def refusals(values: Values) -> list[str]:
    """Why the flags asking for what hora cannot do are refused (empty when none are given)."""
    return [option.refused for option in OPTIONS if option.refused and values[option.dest]]
