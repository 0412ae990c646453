"""Evaluate drafters against plain decoding and HF peers: python evaluate.py drafters=[path/to/drafter,...]"""

import hydra
from omegaconf import DictConfig

from specdec.evaluation import evaluate


@hydra.main(version_base="1.3", config_path="configs", config_name="evaluate")
def main(cfg: DictConfig) -> None:
    evaluate(cfg)


if __name__ == "__main__":
    main()
