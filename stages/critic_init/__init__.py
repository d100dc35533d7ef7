"""The critic_init stage: a critic (the policy's backbone with a scalar value head) built from a
policy checkpoint, the starting point of PPO's value model (`python -m rlpipe.stages.critic_init`)."""
