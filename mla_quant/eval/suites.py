"""Which lm-eval tasks a run asks for, and loading them before any model work.

Task names are either the toy suites (`toy_*`, task files generated into the run dir) or lm-eval's own tasks
(`gsm8k`, `humaneval`, RULER's `niah_single_1` ... `ruler_qa_hotpot`), found in lm-eval's task registry. A stock task
whose dataset cannot be had (offline, no cache) fails here, before the model loads, with an error naming the task
and its dataset. `eval.data_files.<task>` points a stock task at local JSON/JSONL files instead of the Hub: a task file
is written that includes lm-eval's own YAML (same prompts, filters and metrics) with `dataset_path: json`.

    tasks = plan_tasks(cfg.eval, toy_tasks=TOY_TASKS)              # StockTasks(toy=[...], stock=[...], ruler=[...])
    loaded = load_stock_tasks(plan, cfg.eval, tokenizer, run_dir)   # {name: lm_eval Task}, datasets fetched
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from mla_quant.checks import int_setting
from mla_quant.tasks.split import HELD_OUT

RULER_PREFIXES = ("niah_", "ruler_")
CODE_STOCK_TASKS = ("humaneval",)  # stock tasks that execute model-written code
# Datasets stock tasks read through their own code rather than `dataset_path` (named in the offline error).
HIDDEN_DATASETS = {
    "niah_single_2": "baber/paul_graham_essays", "niah_single_3": "baber/paul_graham_essays",
    "niah_multikey_1": "baber/paul_graham_essays", "niah_multiquery": "baber/paul_graham_essays",
    "niah_multivalue": "baber/paul_graham_essays", "ruler_qa_squad": "rajpurkar/squad_v2",
    "ruler_qa_hotpot": "hotpotqa/hotpot_qa", "humaneval": "openai/openai_humaneval and the `code_eval` metric",
}


class DatasetUnavailable(RuntimeError):
    """A stock task's data cannot be loaded (offline, not cached, bad local file)."""


def is_ruler(task: str) -> bool:
    return task.startswith(RULER_PREFIXES)


@dataclass
class TaskPlan:
    toy: list[str] = field(default_factory=list)
    stock: list[str] = field(default_factory=list)

    @property
    def ruler(self) -> list[str]:
        return [t for t in self.stock if is_ruler(t)]


@functools.lru_cache(maxsize=1)
def registry():
    """lm-eval's task registry (a TaskManager over its own YAMLs: indexes them, downloads nothing)."""
    from lm_eval.tasks import TaskManager

    return TaskManager()


def stock_yaml(task: str) -> Path | None:
    entry = registry().task_index.get(task)
    return None if entry is None or entry.yaml_path is None else Path(entry.yaml_path)


def plan_tasks(ev, toy_tasks: list[str]) -> TaskPlan:
    """Split eval.tasks into toy and stock tasks; refuse unknown names and settings no task reads."""
    tasks = list(ev.tasks)
    plan = TaskPlan(toy=[t for t in tasks if t in toy_tasks], stock=[t for t in tasks if t not in toy_tasks])
    if plan.stock:
        unknown = sorted(t for t in plan.stock if t not in registry().all_tasks)
        if unknown:
            raise ValueError(f"eval.tasks has unknown tasks {unknown}: neither a toy suite ({toy_tasks}) nor a task "
                             f"in lm-eval's registry (e.g. gsm8k, humaneval, niah_single_1 ... ruler_qa_hotpot)")
    if plan.toy and ev.get("data") is None:
        raise ValueError(f"eval.tasks has toy suites {plan.toy} but eval={ev.name} has no `data` settings to "
                         f"generate them; use eval=toy")
    lengths = (ev.get("ruler") or {}).get("lengths")
    if plan.ruler and not lengths:
        raise ValueError(f"eval.tasks has RULER tasks {plan.ruler} but eval.ruler.lengths is not set; give the "
                         f"context lengths, e.g. eval.ruler.lengths=[4096,8192]")
    data_files = dict(ev.get("data_files") or {})
    idle = sorted(set(data_files) - set(plan.stock))
    if idle:
        raise ValueError(f"eval.data_files names {idle}, which are not stock tasks of this run ({plan.stock}); "
                         f"drop them")
    return plan


def check_eval(ev) -> None:
    """Every eval.* value, before any model work: each refused by name with what is allowed (lm-eval would take a
    limit of 0 or -1, a batch of 0, a negative shot count, and fail only after the model is prepared)."""
    from omegaconf import DictConfig, ListConfig

    tasks = ev.get("tasks")
    if not isinstance(tasks, (list, ListConfig)) or not tasks or not all(isinstance(t, str) for t in tasks):
        raise ValueError(f"eval.tasks={tasks!r}; allowed: a non-empty list of task names")
    limit = ev.get("limit")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float)) or limit <= 0
                              or (isinstance(limit, float) and limit > 1)):
        raise ValueError(f"eval.limit={limit!r}; allowed: null (every example), an integer >= 1 (examples per task) "
                         f"or a fraction in (0, 1] of each task's examples")
    int_setting(ev.get("batch_size"), "eval.batch_size", allowed="an integer >= 1 (sequences per forward)")
    int_setting(ev.get("threads"), "eval.threads", allowed="an integer >= 1 (CPU threads)")
    if ev.get("num_fewshot") is not None:
        int_setting(ev.num_fewshot, "eval.num_fewshot", 0, "null (each task's own count) or an integer >= 0")
    gen = ev.get("gen_kwargs")
    if gen is not None and not isinstance(gen, (dict, DictConfig)):
        raise ValueError(f"eval.gen_kwargs={gen!r}; allowed: null or a mapping of generation settings, e.g. "
                         f"{{max_gen_toks: 32}}")
    if gen is not None and gen.get("max_gen_toks") is not None:
        int_setting(gen.max_gen_toks, "eval.gen_kwargs.max_gen_toks", allowed="an integer >= 1 (tokens generated "
                                                                               "per answer)")
    for key in ("allow_code_execution", "log_samples"):
        if not isinstance(ev.get(key, False), bool):
            raise ValueError(f"eval.{key}={ev.get(key)!r}; allowed: true, false")
    lengths = (ev.get("ruler") or {}).get("lengths")
    if lengths is not None and (not isinstance(lengths, (list, ListConfig)) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in lengths)):
        raise ValueError(f"eval.ruler.lengths={lengths!r}; allowed: a list of context lengths >= 1 in tokens, e.g. "
                         f"[4096,8192]")
    data = ev.get("data")
    if data is not None:
        for key in ("niah_per_length", "arithmetic_n", "code_n", "gsm8k_max_gen_toks", "code_max_gen_toks"):
            int_setting(data.get(key), f"eval.data.{key}")
        int_setting(data.get("seed"), "eval.data.seed", 0)
        n = data.get("niah_lengths")
        if not isinstance(n, (list, ListConfig)) or not n or not all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in n):
            raise ValueError(f"eval.data.niah_lengths={n!r}; allowed: a non-empty list of context lengths >= 1 in "
                             f"model tokens")
        if data.get("split", "test") not in HELD_OUT:
            raise ValueError(f"eval.data.split={data.get('split')!r}; allowed: {list(HELD_OUT)} (dev: where sweeps "
                             f"choose; test: what the tables report)")
        outside = data.get("needle_outside")
        if outside is not None and (not isinstance(outside, (list, ListConfig)) or len(outside) != 2 or not all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in outside)):
            raise ValueError(f"eval.data.needle_outside={outside!r}; allowed: null (needles anywhere) or [n_sink, "
                             f"recent], two integers >= 0, e.g. [4,128]: every needle where a cache protecting the "
                             f"first n_sink and last recent tokens quantizes it")
    control = ev.get("control_no_rope")
    if control is not None:
        if not isinstance(control.get("enabled"), bool):
            raise ValueError(f"eval.control_no_rope.enabled={control.get('enabled')!r}; allowed: true, false")


def ruler_metadata(ev, tokenizer) -> dict:
    name = getattr(tokenizer, "name_or_path", None)
    if not name:
        raise ValueError("RULER tasks need the model's tokenizer by name or path (tokenizer.name_or_path is empty)")
    return {"tokenizer": str(name), "max_seq_lengths": [int(n) for n in ev.ruler.lengths]}


def local_task_file(task: str, splits: dict, folder: Path) -> Path:
    """A task file `task` = lm-eval's own `task` YAML read from local JSON/JSONL files (one per split)."""
    yaml_path = stock_yaml(task)
    if yaml_path is None:
        raise ValueError(f"eval.data_files.{task}: lm-eval has no YAML for task {task!r} to read local data into")
    files = {}
    for split, path in dict(splits).items():
        p = Path(str(path)).expanduser().resolve()
        if not p.is_file():
            raise DatasetUnavailable(f"eval.data_files.{task}.{split}: no file at {p}")
        files[str(split)] = str(p)
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"{task}.yaml"
    spec = {"include": str(yaml_path.resolve()), "task": task, "dataset_path": "json", "dataset_name": None,
            "dataset_kwargs": {"data_files": files}}
    out.write_text(yaml.safe_dump(spec, sort_keys=False))
    return out


def load_stock_tasks(plan: TaskPlan, ev, tokenizer, folder: Path) -> dict:
    """lm-eval Task objects for the plan's stock tasks, their datasets loaded (downloaded on first use). Raises
    DatasetUnavailable naming the task and its dataset when they cannot be had."""
    from lm_eval.tasks import TaskManager

    if not plan.stock:
        return {}
    metadata = ruler_metadata(ev, tokenizer) if plan.ruler else None
    data_files = dict(ev.get("data_files") or {})
    local = [local_task_file(t, data_files[t], folder) for t in plan.stock if t in data_files]
    stock = [t for t in plan.stock if t not in data_files]
    managers = {"stock": registry() if metadata is None or not stock else with_metadata(stock, metadata)}
    if local:
        managers["local"] = TaskManager(include_path=str(folder), include_defaults=False, metadata=metadata)
    loaded = {}
    for task in plan.stock:
        tm = managers["local" if task in data_files else "stock"]
        try:
            loaded.update(tm.load([task])["tasks"])
        except Exception as exc:  # lm-eval / datasets raise ConnectionError, FileNotFoundError, ValueError, ...
            where = (f"the local files {dict(data_files[task])}" if task in data_files
                     else f"its dataset {dataset_of(task)!r}")
            local_hint = ("" if task in HIDDEN_DATASETS else
                          f", or point eval.data_files.{task} at local JSON/JSONL files ({{split: path}})")
            raise DatasetUnavailable(
                f"eval task {task!r} cannot load {where}: {type(exc).__name__}: {exc}. Without network, download it "
                f"into the Hugging Face cache first{local_hint}") from exc
    return loaded


def with_metadata(tasks: list[str], metadata: dict):
    """A TaskManager that builds `tasks` with `metadata` (RULER's lengths and tokenizer), indexing only the folders
    of their YAMLs, which the registry's index (`registry()`) already names: a manager over all of lm-eval's tasks
    reads every task YAML it ships (about 15 s on 2 cores) each time it is built. Over all of lm-eval's tasks where
    a task has no YAML."""
    from lm_eval.tasks import TaskManager

    paths = [stock_yaml(t) for t in tasks]
    if None in paths:
        return TaskManager(metadata=metadata)
    return TaskManager(include_path=sorted({str(p.parent) for p in paths}), include_defaults=False, metadata=metadata)


def dataset_of(task: str) -> str:
    if task in HIDDEN_DATASETS:
        return HIDDEN_DATASETS[task]
    path = stock_yaml(task)
    try:
        spec = yaml.load(path.read_text(), Loader=_Lenient) if path else {}
    except (OSError, yaml.YAMLError):
        spec = {}
    return str((spec or {}).get("dataset_path") or "(see the task's YAML)")


class _Lenient(yaml.SafeLoader):
    """Reads lm-eval task YAMLs without resolving their `!function` tags."""


_Lenient.add_multi_constructor("!", lambda loader, suffix, node: None)
