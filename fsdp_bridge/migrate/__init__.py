"""FSDP1 -> FSDP2 migration: configurations (``migrate config``) and Python code (``migrate code``).

    fsdp-bridge migrate config accelerate_fsdp1.yaml -o fsdp2.yaml
    fsdp-bridge migrate code train.py --diff
    fsdp-bridge migrate code train.py --fix

Every per-option outcome comes from :data:`fsdp_bridge.mapping.TABLE`.
"""

from fsdp_bridge.migrate._config import Migration, migrate_config, write_outputs
from fsdp_bridge.migrate._report import ConfigReport, OptionRow, Status

__all__ = [
    "ConfigReport",
    "Migration",
    "OptionRow",
    "Status",
    "migrate_config",
    "write_outputs",
]
