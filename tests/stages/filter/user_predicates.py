"""User group predicates imported by path in the filter tests."""


def mean_above(rewards, *, threshold):
    """Drop the groups whose mean reward exceeds `threshold` (too easy)."""
    return sum(rewards) / len(rewards) > threshold


def not_a_bool(rewards):
    return 1
