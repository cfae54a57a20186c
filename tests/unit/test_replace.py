from slurm_resilience.supervisor.replace import SparePlan, choose_spare, choose_spares


def test_first_free_spare():
    assert choose_spare(["s1", "s2"], [], "n1").node == "s1"
    assert choose_spare(["s1", "s2"], ["s1"], "n1").node == "s2"
    assert choose_spare(["s1", "s2"], [], "s1").node == "s2"


def test_preferred_first():
    assert choose_spare(["s1", "s2", "s3"], [], "n1", preferred=["s3"]).node == "s3"
    assert choose_spare(["s1", "s2", "s3"], ["s3"], "n1", preferred=["s3"]).node == "s1"
    assert choose_spare(["s1"], [], "n1", preferred=["zz"]).node == "s1"  # not a spare: ignored


def test_none_left():
    plan = choose_spare(["n6"], ["n6"], "n2")
    assert plan == SparePlan(node=None, reason="no spare left: 1 spare(s) in the job, all used or excluded (n6)")
    assert choose_spare([], [], "n2").node is None


def test_choose_spares_distinct():
    assert choose_spares(["s1", "s2"], [], ["n1", "n2", "n3"]) == {"n1": "s1", "n2": "s2", "n3": None}
    assert choose_spares(["s1", "s2", "s3"], ["s1"], ["n1", "n2"]) == {"n1": "s2", "n2": "s3"}
    # a failed node that is also listed as a spare is never chosen
    assert choose_spares(["n2", "s1"], [], ["n1", "n2"]) == {"n1": "s1", "n2": None}
    assert choose_spares(["s1"], [], []) == {}
