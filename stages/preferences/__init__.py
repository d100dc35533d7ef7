"""The preferences stage: a preference set for reward-model training built locally
(`python -m rlpipe.stages.preferences`): pairs from a prompts artifact's reference answers, or a
synthetic set whose chosen and rejected responses differ by a learnable property."""
