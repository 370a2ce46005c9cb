"""Shared checks of settings, so that every refusal has one shape: the setting, its value, and what is allowed.

    n = int_setting(task.repeats, "task.repeats", allowed="a number of timed rounds per path >= 1")
"""

from __future__ import annotations


def int_setting(value, where: str, least: int = 1, allowed: str | None = None, why: str | None = None) -> int:
    """`value` when it is an integer >= `least` (a bool is not an integer here), else ValueError:
    "<where>=<value>[: <why>]; allowed: <allowed, by default 'an integer >= least'>"."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{where}={value!r}{': ' + why if why else ''}; allowed: "
                         f"{allowed or f'an integer >= {least}'}")
    return value
