"""A worker's counts for its heartbeats (:class:`Activity`)."""

from akv.cluster.worker.activity import Activity


def test_pushes_and_pulls_count_keys_and_rounds_follow_the_most_pushed_key():
    activity = Activity()
    assert activity.report() == {"pushes": 0, "pulls": 0, "rounds": 0}
    activity.pushed(["a", "b"])
    activity.pushed(["a"])
    activity.pulled(3)
    assert activity.report() == {"pushes": 3, "pulls": 3, "rounds": 2}
    activity.pushed(iter(["b", "b"]))  # a key twice in one call counts twice
    assert activity.report() == {"pushes": 5, "pulls": 3, "rounds": 3}
