"""The pipeline's stages; each a package with config.py, pure core, run.py and __main__.py.

`STAGES` maps a stage name to the module whose `main(argv)` is its command line.
"""

STAGES: dict[str, str] = {
    "rollout": "rlpipe.stages.rollout.__main__",
    "score": "rlpipe.stages.score.__main__",
    "reward_model": "rlpipe.stages.reward_model.__main__",
    "reference": "rlpipe.stages.advantage.reference_main",
    "advantage": "rlpipe.stages.advantage.__main__",
    "optimize": "rlpipe.stages.optimize.__main__",
    "sft": "rlpipe.stages.sft.__main__",
    "evaluate": "rlpipe.stages.evaluate.__main__",
}
