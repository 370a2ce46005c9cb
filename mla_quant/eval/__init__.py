"""lm-eval glue: offline task files for the toy suites (`task_files`), their scoring (`task_utils`), and an HFLM
that runs every forward/generate call over a fresh latent cache (`harness`)."""
