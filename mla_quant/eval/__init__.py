"""lm-eval glue: offline task files for the toy suites (`task_files`), their scoring (`task_utils`), and an HFLM
that runs every forward/generate call over a fresh latent cache (`harness`)."""

# lm-eval's filters whose score is a task's headline score (reported under the bare metric name; per example in
# samples/<task>.jsonl)
HEADLINE_FILTERS = ("none", "strict-match")
