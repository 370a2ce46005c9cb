"""Scoring functions the generated lm-eval task files point at (`!function toy_utils.<name>`).

- needle tasks: `niah_process_results` -> exact_match (the first answer token run equals the value), string_match
  (RULER's: the value occurs in the output) and em_<length> per context length (-1 elsewhere, ignored by
  `mean_ignoring_missing`).
- code tasks: `humaneval_process_results` -> pass@1, by running prompt + completion + the hidden tests in a
  separate Python process with a timeout. It refuses unless the evaluate stage (or the caller) opted in by
  setting MLA_QUANT_ALLOW_CODE_EXECUTION=1; lm-eval itself also refuses the task (unsafe_code) without
  confirm_run_unsafe_code=True.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

ALLOW_ENV = "MLA_QUANT_ALLOW_CODE_EXECUTION"
OPT_IN_HINT = "opt in with eval.allow_code_execution=true (python run.py ... experiment=evaluate eval.allow_code_execution=true)"
TIMEOUT_S = 5.0
LENGTHS = (256, 512, 768, 1024, 2048)  # needle context lengths that get their own em_<length> metric


class CodeExecutionRefused(PermissionError):
    pass


def _answer(prediction: str) -> str:
    """The generated answer: the first whitespace-separated word, without a trailing period."""
    words = prediction.strip().split()
    return words[0].rstrip(".") if words else ""


def niah_process_results(doc: dict, results: list[str]) -> dict[str, float]:
    pred, value = results[0], doc["outputs"][0]
    em = float(_answer(pred) == value)
    metrics = {"exact_match": em, "string_match": float(value.lower() in pred.lower())}
    metrics.update({f"em_{n}": (em if doc["max_length"] == n else -1.0) for n in LENGTHS})
    return metrics


def mean_ignoring_missing(values: list[float]) -> float:
    kept = [v for v in values if v != -1.0]
    return sum(kept) / len(kept) if kept else -1.0


def run_program(source: str, timeout: float = TIMEOUT_S) -> tuple[bool, str]:
    """Run `source` in a fresh `python -I` process (own temp dir, no user site, timeout). (passed, reason)."""
    if os.environ.get(ALLOW_ENV) != "1":
        raise CodeExecutionRefused(f"refusing to execute model-written code: {OPT_IN_HINT}")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "program.py")
        with open(path, "w") as f:
            f.write(source)
        try:
            proc = subprocess.run([sys.executable, "-I", path], cwd=tmp, capture_output=True, timeout=timeout,
                                  text=True, env={"PATH": os.environ.get("PATH", "")})
        except subprocess.TimeoutExpired:
            return False, "timeout"
    return proc.returncode == 0, (proc.stderr.strip().splitlines() or ["ok"])[-1]


def humaneval_program(doc: dict, completion: str) -> str:
    return f"{doc['prompt']}{completion}\n\n{doc['test']}\n\ncheck({doc['entry_point']})\n"


def humaneval_process_results(doc: dict, results: list[str]) -> dict[str, float]:
    completion = results[0]
    completion = re.split(r"\n(?:class|def|#|if|print)", completion)[0]  # lm-eval's stop sequences, as HumanEval
    passed, _ = run_program(humaneval_program(doc, completion))
    return {"pass@1": float(passed)}
