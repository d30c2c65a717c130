"""Training a DFlash drafter for a llama.cpp target: self-distilled data through our host, the
DFlash objective in PyTorch, evaluation by real speculative decoding (docs/training.md).

Modules: `prompts` (training and held-out prompts), `data` (generation and shards), `model`
(the drafter in PyTorch, the `dflash` package's class), `objective` (anchors, masks, loss),
`config` (TrainConfig: a run's recipe, either route), `train` (the loop on the host's data,
checkpoints), `gpu_run` (a whole run on one GPU), `evaluate` (offline acceptance and host runs), `__main__` (CLI).
Needs torch and llama-cpp-python (`pip install -e ".[torch,llama]"`).
"""
