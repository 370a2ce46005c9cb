"""Shared test set-up: offline Hugging Face, Triton's CPU interpreter, and Hydra composition of the real configs."""

import os

# Must be set before transformers/datasets/triton are imported by any test module.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))  # each pytest-xdist worker too (measured faster than 1)

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


def options(group: str) -> list[str]:
    """Every option of a config group (file stems in conf/<group>/)."""
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))
