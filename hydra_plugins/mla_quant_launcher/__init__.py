"""Hydra launcher plugin of mla-quant: submitit (SLURM or local) with per-model resources (see launcher.py)."""

from hydra_plugins.mla_quant_launcher.launcher import LocalLauncher, SlurmLauncher

__all__ = ["LocalLauncher", "SlurmLauncher"]
