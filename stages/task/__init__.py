"""The task stage: a synthetic verifiable task (integer arithmetic) generated locally as `prompts`
artifacts: training, held-out and (optionally) a deliberately flawed SFT copy
(`python -m rlpipe.stages.task`). `arithmetic` holds the problems and their splits."""
