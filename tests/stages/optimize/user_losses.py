"""User policy losses for the tests (imported by path `user_losses:<name>`)."""




def reinforce(logp, old_logp, advantages, mask, scale=1.0):
    """Vanilla policy gradient: l_t = -scale * A_t * logp_t."""
    return -scale * advantages * logp


def per_sequence(logp, old_logp, advantages, mask):
    return logp.sum(-1)


def detached(logp, old_logp, advantages, mask):
    return -(advantages * logp).detach()


def not_a_tensor(logp, old_logp, advantages, mask):
    return 0.0


