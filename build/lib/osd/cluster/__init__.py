"""Past one machine, on Ray: N serving replicas, one learner fed by all, draft versions broadcast (`osd serve
--replicas N`). Only `osd serve --replicas` imports this package (and Ray, the optional extra `osd[ray]`).

    HTTP front (serve/app.py, the same routes)  --ReplicaPool (pool.py): least-loaded replica, retry if nothing
        |                                          was streamed yet, cancel when the client goes
    Replica actors (replica.py): each a whole engine + scheduler; ship compact verification samples (samples.py)
        |                        to the learner; swap to a published draft version between scheduler steps
    Learner actor (learner.py): the same OnlineLearner (triggers, trainer, guard, drift guard, checkpoints); each
                                accepted version put once in Ray's object store (weights.py) and pushed to every replica

launch.py starts (or finds again, by name) the actors; metrics.py merges their Prometheus text under a `replica` label.
"""
