"""Train a drafter on a frozen base: python train.py drafter=medusa [key=value ...]
Sweeps: python train.py -m drafter=medusa,hydra module.optimizer.lr=1e-3,3e-3 [hparams_search=medusa_optuna]"""

import hydra
from omegaconf import DictConfig

from specdec.sweeps import keep_sweep_going
from specdec.training import train


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
@keep_sweep_going
def main(cfg: DictConfig) -> float | None:
    metrics = train(cfg)
    return metrics.get(cfg.get("optimized_metric")) if cfg.get("optimized_metric") else None


if __name__ == "__main__":
    main()
