"""The names of a run's metrics in one place: how the stages name what they measure, and how the pipeline's summary
and the analysis read them back (`parse_eval`, `parse_bytes`, `parse_sensitivity`), so nobody slices a name by hand.

    eval/<task>/<metric>                          a task's score (exact_match, pass@1, ...), <metric>_stderr beside it
    eval/<task>/em_<length>, eval/<task>/<length>  a toy needle task's / RULER's score at one context length
    eval/<task>/needle_<region>/<metric>          over the examples whose asked needle sat in <region> (and
                                                  .../examples: how many)
    eval/control_no_rope/<task>/<metric>          the same task rerun with every RoPE key zeroed
    eval/seconds, eval/<task>/cache_calls         bookkeeping, not scores
    bytes/<option>/ctx<N>/<field>                 experiment=cache_bytes: one option at one context
    sensitivity/layer<i>/<...>                    the fixed-NMSE study, per layer
    sensitivity/sweep/nmse_<x>/<path>/<site>      the study's sweep over injected NMSE

Standard library only, so any layer (and analysis/) may use it.
"""

from __future__ import annotations

from dataclasses import dataclass

EVAL = "eval"
CONTROL_NO_ROPE = "control_no_rope"  # eval/control_no_rope/...: the needle tasks rerun with the RoPE keys zeroed
SETTINGS = {"model": "", "rope=0": CONTROL_NO_ROPE}  # how a task was run -> the name's segment for it
HEADLINE_METRICS = ("exact_match", "pass@1", "acc")  # a task's headline: the first of these it reports
BOOKKEEPING = ("seconds", "cache_calls")  # eval/... values that are not scores
NEEDLE = "needle_"  # eval/<task>/needle_<region>/...
LENGTH = "em_"  # eval/<task>/em_<length>: a toy needle task's score at one length
EXAMPLES = "examples"
SWEEP = "nmse_"  # sensitivity/sweep/nmse_<x>/...


@dataclass(frozen=True)
class EvalKey:
    """One eval/... metric's name, read."""

    task: str
    metric: str  # exact_match, pass@1, em_512, 4096, exact_match_stderr, examples, ...
    setting: str = "model"  # "model" | "rope=0" (eval/control_no_rope/...)
    region: str | None = None  # the needle region of eval/<task>/needle_<region>/<metric>

    @property
    def stderr(self) -> bool:
        return self.metric.endswith("_stderr")

    @property
    def score(self) -> bool:
        """A task's score (not its standard error, nor bookkeeping)."""
        return not self.stderr and self.metric not in BOOKKEEPING

    @property
    def headline(self) -> bool:
        """One of the metrics a task's headline is read from, over all its examples."""
        return self.region is None and self.metric in HEADLINE_METRICS

    @property
    def length(self) -> int | None:
        """The context length of a per-length score (em_<length>, or RULER's <length>), else None."""
        if self.region is not None:
            return None
        length = self.metric[len(LENGTH):] if self.metric.startswith(LENGTH) else self.metric
        return int(length) if length.isdigit() else None

    def stderr_key(self) -> str:
        return eval_key(self.task, f"{self.metric}_stderr", self.setting, self.region)


def eval_prefix(setting: str = "model") -> str:
    """What every metric of the tasks run as `setting` starts with (eval, eval/control_no_rope)."""
    if setting not in SETTINGS:
        raise ValueError(f"setting={setting!r}; allowed: {list(SETTINGS)}")
    return "/".join(p for p in (EVAL, SETTINGS[setting]) if p)


def needle_metric(region: str, metric: str) -> str:
    """A task's <metric> over the examples whose asked needle sat in `region` (below the task's name)."""
    return f"{NEEDLE}{region}/{metric}"


def eval_key(task: str, metric: str, setting: str = "model", region: str | None = None) -> str:
    """The name of a task's metric (`parse_eval` reads it back)."""
    return f"{eval_prefix(setting)}/{task}/{needle_metric(region, metric) if region is not None else metric}"


def parse_eval(key: str) -> EvalKey | None:
    """An eval/... metric's task, metric, setting and needle region; None for any other name (bookkeeping of the
    whole run, other stages' metrics)."""
    parts = key.split("/")
    if parts[0] != EVAL:
        return None
    rest, setting = parts[1:], "model"
    if rest and rest[0] == CONTROL_NO_ROPE:
        rest, setting = rest[1:], "rope=0"
    if len(rest) == 2:
        return EvalKey(rest[0], rest[1], setting)
    if len(rest) == 3 and rest[1].startswith(NEEDLE):
        return EvalKey(rest[0], rest[2], setting, rest[1][len(NEEDLE):])
    return None


def bytes_key(option: str, context: int, field: str) -> str:
    return f"bytes/{option}/ctx{context}/{field}"


def parse_bytes(key: str) -> tuple[str, int, str] | None:
    """bytes/<option>/ctx<N>/<field> -> (option, N, field); None for any other name."""
    parts = key.split("/")
    if len(parts) == 4 and parts[0] == "bytes" and parts[2].startswith("ctx") and parts[2][3:].isdigit():
        return parts[1], int(parts[2][3:]), parts[3]
    return None


def sweep_key(nmse: float, path: str, site: str) -> str:
    """The fixed-NMSE study's output error at `site` with NMSE `nmse` injected into `path` (or the sweep's
    amplification: path "amplification")."""
    return f"sensitivity/sweep/{SWEEP}{nmse:g}/{path}/{site}"


def layer_key(layer: int, rest: str) -> str:
    """The fixed-NMSE study's `rest` (amplification/attn_output, ...) at cache layer `layer`."""
    return f"sensitivity/layer{layer}/{rest}"


def parse_sensitivity(key: str) -> dict | None:
    """sensitivity/layer<i>/... -> {"layer": i, "rest": ...}; sensitivity/sweep/nmse_<x>/<path>/<site> ->
    {"nmse": x, "path": path, "site": site}; None for any other name."""
    parts = key.split("/")
    if parts[0] != "sensitivity" or len(parts) < 2:
        return None
    if parts[1].startswith("layer") and parts[1][5:].isdigit():
        return {"layer": int(parts[1][5:]), "rest": "/".join(parts[2:])}
    if len(parts) == 5 and parts[1] == "sweep" and parts[2].startswith(SWEEP):
        return {"nmse": float(parts[2][len(SWEEP):]), "path": parts[3], "site": parts[4]}
    return None
