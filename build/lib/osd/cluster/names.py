"""Where the actors are found: by name in one Ray namespace, so a restarted replica, learner or HTTP front finds the
others again (ray.get_actor) without being told."""
NAMESPACE = "osd"
LEARNER = "osd-learner"


def replica_name(index: int) -> str:
    return f"osd-replica-{index}"
