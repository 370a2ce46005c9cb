"""The package as a user installs it (`pip install .`, not editable): its wheel holds the configs, and a quantized
cache is built from it outside the repository, its quant options read from the installed package."""

import os
import subprocess
import sys
import zipfile

import pytest

from conftest import REPO

BUILD = """
import torch, mla_quant
from mla_quant.cache import cache_layer_factory
from mla_quant.cache.bytes import load_quant_option
assert mla_quant.__file__.startswith({site!r}), mla_quant.__file__
layer = cache_layer_factory(load_quant_option("int4_joint", groups={{"wide": 32, "narrow": 16}}), 96, 16)()
g = torch.Generator().manual_seed(0)
content, rope = torch.randn(1, 300, 96, generator=g), torch.randn(1, 300, 16, generator=g)
layer.append(content, rope)
c_hat, r_hat = layer.read()
assert c_hat.shape == content.shape and 0 < float((c_hat.float() - content).abs().max()) < 1  # stored quantized
print(type(layer).__name__, layer.nbytes())
try:
    load_quant_option("int5_joint")
except ValueError as err:
    print(err)
"""


@pytest.mark.slow
def test_the_installed_package_builds_a_quantized_cache_outside_the_repository(tmp_path):
    wheels = tmp_path / "wheels"
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(REPO),
                          "-w", str(wheels)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    [wheel] = wheels.glob("mla_quant-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        assert "mla_quant/conf/quant/int4_joint.yaml" in z.namelist() and "mla_quant/conf/config.yaml" in z.namelist()
        z.extractall(site)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(site)}
    ran = subprocess.run([sys.executable, "-c", BUILD.format(site=str(site))], cwd=elsewhere, env=env,
                         capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "LatentCacheLayer" in ran.stdout and "unknown quant option 'int5_joint'; allowed: [" in ran.stdout
    assert "'int4_joint'" in ran.stdout.split("allowed:")[1], ran.stdout
