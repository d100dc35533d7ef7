"""The reference stage: per-token reference log-probs and critic values of saved rollouts, the
forward passes the advantage stage needs (`python -m rlpipe.stages.reference`)."""
