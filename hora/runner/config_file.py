"""``horarun --config-file``: horovodrun's YAML config file, read into the flags' values.

A key of the file stands for one flag (``params.fusion_threshold_mb``: ``--fusion-threshold-mb``;
:data:`CONFIG_KEYS`), a section holding one value for a switch (``controller: gloo``); both are
declared with the flag in :mod:`hora.runner.flags`. :func:`read_config_file` checks each value
against its flag's shape; :func:`apply_config_file` fills what the command line left unset.

This module knows the file's layout and the flag table; it does not check ranges or build the
options (:mod:`hora.runner.options` does).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hora.common.vocabulary.settings_table import LOG_LEVELS
from hora.runner.flags import BY_DEST, GROUPS, OPTIONS, Option
from hora.runner.launch_options import OptionError, Values


def _config_sections(separator: str) -> dict[str, dict[str, str]]:
    """``{section: {key: dest}}`` for the config keys written ``section<separator>key``."""
    sections: dict[str, dict[str, str]] = {}
    for option in OPTIONS:
        if option.config_key is not None and separator in option.config_key:
            section, key = option.config_key.split(separator)
            sections.setdefault(section, {})[key] = option.dest
    return sections


# Config-file sections of keys (horovodrun's) and the flag (``dest``) each key stands for.
CONFIG_KEYS: dict[str, dict[str, str]] = _config_sections(".")
# Config-file sections holding one value (``controller: gloo``): value -> the switch it sets.
_CONFIG_CHOICES: dict[str, dict[str, str]] = _config_sections(": ")


def _config_text(where: str, option: Option, value: Any) -> str:
    if not isinstance(value, (str, int, float)) or isinstance(value, bool):
        raise OptionError(f"{where} must be a string.")
    text = str(value)
    if option.shape == "level":
        text = text.upper()
        if text not in LOG_LEVELS:
            raise OptionError(f"{where} must be one of {', '.join(LOG_LEVELS)}.")
    return text


def _config_value(where: str, option: Option, value: Any) -> Any:
    """``value`` of a config key, checked against the shape of the flag it stands for."""
    if option.shape == "switch":
        if not isinstance(value, bool):
            raise OptionError(f"{where} must be true or false.")
        return value
    if option.shape in ("text", "level"):
        return _config_text(where, option, value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise OptionError(f"{where} must be a number.")
    if option.shape == "int" and not float(value).is_integer():
        raise OptionError(f"{where} must be a whole number.")
    return int(value) if option.shape == "int" else float(value)


def _load_yaml(path: str) -> Any:
    import yaml

    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise OptionError(f"cannot read config file {path!r}: {exc.strerror}.") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise OptionError(f"config file {path!r} is not valid YAML: {exc}") from None


def _mapping(data: Any, problem: str) -> dict[Any, Any]:
    """``data``, a YAML mapping; an empty one for ``None`` (an empty file or section).

    Raises:
        OptionError: ``data`` is something else (``problem`` says what it must be).
    """
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise OptionError(problem)
    return data


def _read_section(path: str, section: str, body: Any) -> dict[str, Any]:
    """The flag values one section of a config file sets, by ``dest``."""
    if section in _CONFIG_CHOICES:
        choices = _CONFIG_CHOICES[section]
        if body not in choices:
            allowed = " or ".join(choices)
            raise OptionError(f"{path}: {section}={body!r} must be {allowed}.")
        return {choices[body]: True}
    if section not in CONFIG_KEYS:
        known = ", ".join([*_CONFIG_CHOICES, *CONFIG_KEYS])
        raise OptionError(f"{path}: unknown section {section!r}; the sections are {known}.")
    problem = f"{path}: section {section!r} must be a mapping of keys to values."
    values: dict[str, Any] = {}
    for key, value in _mapping(body, problem).items():
        dest = CONFIG_KEYS[section].get(str(key))
        if dest is None:
            known = ", ".join(CONFIG_KEYS[section])
            raise OptionError(
                f"{path}: unknown key {section}.{key}; the keys of {section!r} are {known}."
            )
        values[dest] = _config_value(f"{path}: {section}.{key}={value!r}", BY_DEST[dest], value)
    return values


def read_config_file(path: str) -> dict[str, Any]:
    """The flag values a horovodrun YAML config file sets, by flag (``dest``) name.

    Raises:
        OptionError: the file cannot be read, is not YAML, or holds an unknown key or a value of
            the wrong type.
    """
    data = _mapping(_load_yaml(path), f"config file {path!r} must hold a mapping of sections.")
    values: dict[str, Any] = {}
    for section, body in data.items():
        values.update(_read_section(path, str(section), body))
    return values


def _given_on_command_line(values: Values) -> set[str]:
    """The exclusive groups (by name) of which the command line gave a flag."""
    exclusive = {group.name for group in GROUPS if group.exclusive}
    return {
        option.group
        for option in OPTIONS
        if option.group in exclusive and values[option.dest] is not None
    }


def apply_config_file(values: dict[str, Any]) -> None:
    """Fill what the command line left unset from ``--config-file``. A flag of an exclusive group
    (``--gloo``) given on the command line also keeps the file from setting its rivals."""
    taken = _given_on_command_line(values)
    for dest, value in read_config_file(values["config_file"]).items():
        if BY_DEST[dest].group in taken:
            continue
        if values[dest] is None:
            values[dest] = value
