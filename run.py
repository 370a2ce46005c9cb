"""mla-quant entry point: compose the Hydra config and run the chosen experiment.

    python run.py                                   # the default experiment
    python run.py model=deepseek_v2_lite quant=int4_joint experiment=evaluate
    python run.py --multirun quant=int4_joint,int2_content_int4_rope hydra/launcher=slurm
    python run.py --help                            # every config group and its options
"""

import hydra
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path="mla_quant/conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from mla_quant.runner import main as run_experiment  # imported late so --help stays fast

    run_experiment(cfg)


if __name__ == "__main__":
    main()
