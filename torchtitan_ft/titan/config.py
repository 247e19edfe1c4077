"""The job config of a TorchTitan FT run, in three parts (TorchTitan's own split: schema beside
parser), gathered here for the entry point and for users:

* :mod:`~torchtitan_ft.titan.config_schema`: the ``[fault_tolerance]`` section, the JobConfig
  that holds it and what its fields mean (docs/configuration.md is generated from it);
* :mod:`~torchtitan_ft.titan.config_cli`: reading TOML and the command line, with one clear
  error line per mistake;
* :mod:`~torchtitan_ft.titan.preflight`: checking the values and this machine, and the values
  the plugin derives for TorchTitan's Trainer (the user's config keeps what the user wrote).
"""

from torchtitan_ft.titan.config_cli import (
    ParsedJob,
    check_cli_args,
    check_toml_values,
    config_file_from_args,
    last_config_file_only,
    load_toml,
    parse_job,
    parse_job_config,
)
from torchtitan_ft.titan.config_schema import (
    SECTION,
    ConfigError,
    FaultTolerance,
    JobConfig,
    fragment_fqns,
    num_fragments,
    quorum_mode,
    sync_config,
    sync_method,
    uses_semi_sync,
)
from torchtitan_ft.titan.preflight import (
    MAX_TIMEOUT_MS,
    Derived,
    check_heal_interfaces,
    check_lighthouse_addr,
    check_local_address,
    check_local_paths,
    check_manager_env,
    check_model_fragments,
    check_process_group_kind,
    check_profiler_schedule,
    check_timeout_order,
    trainer_job_config,
    validate_fault_tolerance,
    validate_job_config,
)

__all__ = [
    "MAX_TIMEOUT_MS",
    "SECTION",
    "ConfigError",
    "Derived",
    "FaultTolerance",
    "JobConfig",
    "ParsedJob",
    "check_cli_args",
    "check_heal_interfaces",
    "check_lighthouse_addr",
    "check_local_address",
    "check_local_paths",
    "check_manager_env",
    "check_model_fragments",
    "check_process_group_kind",
    "check_profiler_schedule",
    "check_timeout_order",
    "check_toml_values",
    "config_file_from_args",
    "fragment_fqns",
    "last_config_file_only",
    "load_toml",
    "num_fragments",
    "parse_job",
    "parse_job_config",
    "quorum_mode",
    "sync_config",
    "sync_method",
    "trainer_job_config",
    "uses_semi_sync",
    "validate_fault_tolerance",
    "validate_job_config",
]
