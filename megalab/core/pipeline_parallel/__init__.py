"""Pipeline parallelism: schedules and point-to-point communication (megatron/core/pipeline_parallel/)."""
