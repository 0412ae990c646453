"""Evaluate drafters against plain decoding and HF peers: python evaluate.py drafters=[path/to/drafter,...]
Sweeps: python evaluate.py -m drafters=[...] sampler.gamma=1,2,4,8"""

import hydra
from omegaconf import DictConfig

from specdec.evaluation import evaluate
from specdec.sweeps import keep_sweep_going


@hydra.main(version_base="1.3", config_path="configs", config_name="evaluate")
@keep_sweep_going
def main(cfg: DictConfig) -> None:
    evaluate(cfg)


if __name__ == "__main__":
    main()
