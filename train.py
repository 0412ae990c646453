"""Train a drafter on a frozen base: python train.py drafter=medusa [key=value ...]"""

import hydra
from omegaconf import DictConfig

from specdec.training import train


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> float | None:
    metrics = train(cfg)
    return metrics.get(cfg.get("optimized_metric")) if cfg.get("optimized_metric") else None


if __name__ == "__main__":
    main()
