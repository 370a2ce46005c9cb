"""Shared test set-up: offline Hugging Face, Triton's CPU interpreter, and Hydra composition of the real configs."""

import os

# Must be set before transformers/datasets/triton are imported by any test module.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import functools  # noqa: E402
import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"

# The machine's cores shared among pytest-xdist's workers: one thread each on 2 cores (with two each, their OpenMP
# threads waited on one another's cores: test_sensitivity + test_quant_cache ran 1.4x slower, test_transforms +
# test_cpu_kernel 4x), and 2 in a single process.
TEST_THREADS = max(1, min(2, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
torch.set_num_threads(TEST_THREADS)


@pytest.fixture(autouse=True)
def worker_threads():
    """Each test starts with the worker's share of threads: a stage called directly sets its own (eval.threads), and
    two workers at 2 threads each on 2 cores ran tiny models 3-10x slower, their OpenMP threads waiting on each other."""
    torch.set_num_threads(TEST_THREADS)
    yield

# What quant.backend=auto decodes CPU tensors with: the C++ kernel wherever a C++ compiler can build it (a build that
# then fails fails the tests expecting it), PyTorch on a machine without a compiler.
HAS_CXX = shutil.which(os.environ.get("CXX", "c++")) is not None
CPU_DECODE = "cpu" if HAS_CXX else "torch"


def compose(overrides=()):
    """The project's real config, composed as `python run.py <overrides>` would."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return hydra_compose("config", overrides=list(overrides))


@pytest.fixture
def cfg_of():
    return compose


def run_cli(*args: str, cwd: Path = REPO):
    """`python run.py <args>` in this process: run.py's own Hydra entry point, with Hydra's error report and exit
    status, its output captured (a `subprocess.CompletedProcess`). It saves a new interpreter's imports (about 10 s on
    2 cores) per run. Tests of what only a process shows (signals, launchers, the environment, a clean interpreter)
    start run.py instead."""
    import contextlib
    import io
    import runpy
    import subprocess
    import sys

    from hydra.core.global_hydra import GlobalHydra

    out, err, code = io.StringIO(), io.StringIO(), 0
    argv, where = sys.argv, os.getcwd()
    GlobalHydra.instance().clear()
    sys.argv = [str(REPO / "run.py"), *args]
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(str(REPO / "run.py"), run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    finally:
        sys.argv = argv
        os.chdir(where)
        GlobalHydra.instance().clear()
    return subprocess.CompletedProcess(["run.py", *args], code, out.getvalue(), err.getvalue())


@pytest.fixture
def quanto_unpacks_in_python():
    """optimum-quanto builds a C++ extension the first time it unpacks codes on a CPU (about 100 s on 2 cores, in
    every fresh environment); under this fixture its CPU operator unpacks as quanto's own Python one does. Caches
    compared with each other both call that one operator, so they still meet bit for bit."""
    from types import SimpleNamespace

    from optimum.quanto.library.extensions import cpp

    def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:  # value i of each byte into block i, as quanto's
        return torch.cat([(packed >> (bits * i)) & ((1 << bits) - 1) for i in range(8 // bits)]).to(torch.uint8)

    built, cpp.ext._lib = cpp.ext._lib, SimpleNamespace(unpack=unpack)
    yield
    cpp.ext._lib = built


def options(group: str) -> list[str]:
    """Every option of a config group (file stems in conf/<group>/)."""
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@functools.cache
def model_option(option: str):
    """A model option's own node as its file writes it (no composition: `family`, `_target_`)."""
    from omegaconf import OmegaConf

    node = OmegaConf.load(CONF / "model" / f"{option}.yaml")
    return node.model if "model" in node else node  # a real checkpoint's option is in the global package


def real_option(tiny: str) -> str:
    """The real checkpoint's option (loaded by `pretrained_model`) of a tiny option's family."""
    family = model_option(tiny).family
    return next(o for o in options("model") if not o.startswith(("tiny_", "spec_"))
                and model_option(o).get("family") == family
                and str(model_option(o).get("_target_", "")).endswith("pretrained_model"))


# The families a per-family stage test (a study, an evaluation, a checkpoint load, the headline command's steps) runs
# on by default: one for each way the model adapter reads a model (mla_quant/models/families.py) -- the plain
# DeepSeek-V3 shape (and Kimi-K2, the same classes); DeepSeek-V2's interleaved cached RoPE key; Kimi Linear's
# unrotated key and linear-attention layers; LongCat's two attentions per layer; Mistral Large 4's multimodal wrapper,
# layer dims and query scale; HY v4 VL's attention sinks and output gate; dots3's normed RoPE key. The rest share
# these code paths; `pytest --every-family` runs these tests on every family. Transformers' own forward of every
# family is still checked by every run (test_equivalence, test_transforms).
REPRESENTATIVE_FAMILIES = {"deepseek_v2", "deepseek_v3", "kimi_linear", "longcat_flash", "mistral_large4",
                           "hy_v4_vl", "dots3_note"}


def pytest_addoption(parser):
    parser.addoption("--every-family", action="store_true",
                     help="run the tests marked every_family on every model family (default: the families of "
                          "tests/conftest.py's REPRESENTATIVE_FAMILIES)")


def greedy_alone_and_in_batch(model, alone, batch, mask, make_cache, steps: int) -> list[tuple]:
    """Greedy decoding of a prompt `alone` (1, T) and of row 0 of `batch` (B, S) under `mask` (the same prompt
    padded), each for `steps` tokens with a fresh cache from `make_cache()`: [(tokens (steps,), scores (steps, V))]
    for the prompt alone, then for its row in the batch."""
    from mla_quant.models.absorbed import cache_kwargs

    runs = []
    for ids, m in ((alone, torch.ones_like(alone)), (batch, mask)):
        with torch.no_grad():
            out = model.generate(ids, attention_mask=m, max_new_tokens=steps, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True, pad_token_id=0, eos_token_id=None,
                                 **cache_kwargs(make_cache()))
        runs.append((out.sequences[0, ids.shape[1]:], torch.stack(out.scores)[:, 0]))
    return runs


def prompt_ids(n: int = 40, seed: int = 0) -> torch.Tensor:
    """Two random prompts of `n` tokens (ids 5..499: no special ids of the tiny models)."""
    return torch.randint(5, 500, (2, n), generator=torch.Generator().manual_seed(seed))


def prefill_logits(model, cache, ids, mask=None) -> torch.Tensor:
    """The logits of one forward of `ids` into `cache`."""
    from mla_quant.models.absorbed import cache_kwargs

    with torch.no_grad():
        return model(ids, **({} if mask is None else {"attention_mask": mask}), **cache_kwargs(cache)).logits


def alone_and_padded(model, make_cache, steps: int = 12) -> list[tuple]:
    """`greedy_alone_and_in_batch` for a 31-token prompt alone and left-padded by 9 beside a 40-token one."""
    short, long = prompt_ids(31, 1)[0], prompt_ids(40, 2)[0]
    batch = torch.zeros(2, 40, dtype=torch.long)
    batch[0, 9:], batch[1] = short, long
    mask = torch.ones_like(batch)
    mask[0, :9] = 0
    return greedy_alone_and_in_batch(model, short[None], batch, mask, make_cache, steps)


def pytest_collection_modifyitems(config, items):
    """Tests marked `every_family("<argument>")` whose model option is of a family outside REPRESENTATIVE_FAMILIES
    are deselected unless `--every-family` is given. The longest tests (marked `slow`) first, so that pytest-xdist's
    workers start them early and finish together, instead of one worker running a long test at the end while the other
    waits."""
    if not config.getoption("--every-family"):
        kept, dropped = [], []
        for item in items:
            marker = item.get_closest_marker("every_family")
            option = item.callspec.params.get(marker.args[0]) if marker and hasattr(item, "callspec") else None
            family = None if option is None else model_option(option).get("family")
            (dropped if family is not None and family not in REPRESENTATIVE_FAMILIES else kept).append(item)
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = kept
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: the rest keep their order


def _interpret_helpers_under_their_kernels_patch():
    """Triton's interpreter patches `triton.language` for a kernel launch, then again (never undone) on every call of
    a `@triton.jit` helper inside it: its own `tl.sum`, `tl.max`, `tl.zeros_like`, thousands of times a launch, about a
    third of the kernel tests' time. Here a launch patches `triton.language` and `triton.language.core` (the module
    Triton's helpers call into) and restores both as Triton does; a helper inside it runs on that patch."""
    import types

    from triton.runtime import interpreter

    tl, patch, active = interpreter.tl, interpreter._patch_lang, []
    both = types.FunctionType((lambda: None).__code__, {"tl": tl, "core": tl.core})

    class Scopes:
        def __init__(self, *scopes):
            self.scopes = scopes

        def restore(self):
            for scope in reversed(self.scopes):
                scope.restore()

    def patch_lang(fn):
        if active and active[-1] is None:  # the launch's own
            active[-1] = True
            return Scopes(patch(fn), patch(both))
        if active:
            return None  # a helper's: its call discards what this returns
        return patch(fn)

    launch = interpreter.GridExecutor.__call__

    def call(self, *args, **kwargs):
        active.append(None)
        try:
            return launch(self, *args, **kwargs)
        finally:
            active.pop()

    interpreter._patch_lang, interpreter.GridExecutor.__call__ = patch_lang, call


def _interpreter_patches_in_scopes() -> bool:
    """Whether the installed Triton's interpreter patches `triton.language` in a restorable scope per launch (the
    form the change above is written for); an older one runs as it is."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    return all(hasattr(interpreter, name) for name in ("_LangPatchScope", "_patch_lang", "GridExecutor"))


if os.environ.get("TRITON_INTERPRET") == "1" and _interpreter_patches_in_scopes():
    _interpret_helpers_under_their_kernels_patch()
