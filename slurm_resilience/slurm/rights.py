"""Pure: may this user change node states (``scontrol update nodename=… state=…``)?

Slurm lets only operators do that: root, the ``SlurmUser`` the controller runs as,
and — where accounting runs through slurmdbd — users whose ``AdminLevel`` is
Operator or Administrator. Everyone else gets "Invalid user id"; they can still
shrink their own running job and edit their own pending one (docs/unprivileged.md).

The test is what Slurm itself checks, read from ``scontrol show config`` (and
``sacctmgr`` only where slurmdbd holds the admin levels); the commands are run by
:func:`slurm_resilience.slurm.commands.operator_rights`.
"""

from __future__ import annotations

import re
from typing import Mapping

__all__ = ["parse_show_config", "slurm_user_id", "uses_slurmdbd", "operator_verdict"]

_CONFIG_LINE = re.compile(r"^([A-Za-z][A-Za-z0-9_]*)\s*=\s?(.*)$")
_USER = re.compile(r"^([^()\s]*)\((\d+)\)$")
OPERATOR_LEVELS = frozenset({"operator", "administrator"})


def parse_show_config(text: str) -> dict[str, str]:
    """``scontrol show config`` output as ``{Key: value}`` (lines of ``Key = value``)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        m = _CONFIG_LINE.match(line.strip())
        if m:
            out[m.group(1)] = m.group(2).strip()
    return out


def slurm_user_id(config: Mapping[str, str]) -> tuple[str, int | None]:
    """``SlurmUser = slurm(64030)`` → ``("slurm", 64030)``; the uid is None when absent."""
    value = config.get("SlurmUser", "")
    m = _USER.match(value)
    return (m.group(1), int(m.group(2))) if m else (value, None)


def uses_slurmdbd(config: Mapping[str, str]) -> bool:
    """Whether accounting runs through slurmdbd (``AccountingStorageType`` in ``scontrol show config``)."""
    return config.get("AccountingStorageType", "").endswith("slurmdbd")


def operator_verdict(*, uid: int, user: str, config: Mapping[str, str],
                     admin_level: str | None) -> tuple[bool, str]:
    """``(may set node states, why)``. ``admin_level``: this user's AdminLevel from
    sacctmgr (None when not asked: no slurmdbd, or sacctmgr failed)."""
    if uid == 0:
        return True, "running as root"
    name, slurm_uid = slurm_user_id(config)
    if (slurm_uid is not None and uid == slurm_uid) or (slurm_uid is None and name and name == user):
        return True, f"running as SlurmUser {name}"
    if admin_level is not None and admin_level.strip().lower() in OPERATOR_LEVELS:
        return True, f"AdminLevel {admin_level.strip()}"
    return False, (f"user {user} (uid {uid}) is neither root, SlurmUser {name or '?'} nor a Slurm "
                   "operator/administrator")
