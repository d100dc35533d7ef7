"""The filter stage (`python -m rlpipe.stages.filter`): scores -> the scores of the groups kept.

Dynamic sampling (DAPO): drop the groups a predicate names (all rewards equal by default: no
signal for a group-relative estimator), keep the first `keep_groups` others in group order.
- `predicates`: the group predicates and their registry; `run`: the stage.
"""
