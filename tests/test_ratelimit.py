"""mesh/ratelimit.py: a token bucket per key, on a clock the test moves."""

from mesh.ratelimit import PerKey, Said, more


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_key_has_its_burst_at_once_then_one_each_interval() -> None:
    clock = Clock()
    limit = PerKey[str](burst=3, every=10.0, clock=clock)
    assert [limit.take("a") for _ in range(4)] == [True, True, True, False]
    assert limit.take("b")  # each key has its own
    clock.now += 9.9
    assert not limit.take("a")
    clock.now += 0.1
    assert limit.take("a")
    assert not limit.take("a")
    clock.now += 1000  # a long silence gives back the burst, never more
    assert [limit.take("a") for _ in range(4)] == [True, True, True, False]


def test_allows_spends_nothing_and_spend_counts_work_already_under_way() -> None:
    clock = Clock()
    limit = PerKey[str](burst=1, every=10.0, clock=clock)
    assert limit.allows("a") and limit.allows("a")
    limit.spend("a")
    limit.spend("a")  # two writes that were both allowed before either was done
    assert not limit.allows("a")
    clock.now += 10
    assert not limit.allows("a")  # the overdraft is paid back first
    clock.now += 10
    assert limit.allows("a")


def test_what_is_held_back_is_said_once_per_interval_with_counts() -> None:
    clock = Clock()
    limit = PerKey[str](burst=1, every=10.0, clock=clock)
    for _ in range(5):
        limit.hold("a")
    limit.hold("b")
    assert limit.held() is None  # not a whole interval yet
    clock.now += 10
    assert limit.held() == {"a": 5, "b": 1}
    assert limit.held() is None
    clock.now += 10
    assert limit.held() == {}
    limit.hold("a")
    limit.hold("a")
    assert limit.held_for("a") == 2
    assert limit.held_for("a") == 0


def test_keys_whose_bucket_is_full_again_are_forgotten() -> None:
    clock = Clock()
    limit = PerKey[str](burst=2, every=1.0, clock=clock)
    for i in range(1000):
        limit.spend(f"m{i}")
    clock.now += 5
    limit.spend("last")  # tidies, at most once an interval
    assert set(limit._buckets) == {"last"}


def test_refund_gives_back_work_done_up_to_the_burst() -> None:
    # Requests in flight (services/controller/fleet/noisy.py): one answered frees its place at once.
    clock = Clock()
    limit = PerKey[str](burst=2, every=10.0, clock=clock)
    assert [limit.take("a") for _ in range(3)] == [True, True, False]
    limit.refund("a")
    assert limit.take("a") and not limit.take("a")
    limit.refund("a")
    limit.refund("a")
    limit.refund("a")  # never above the burst
    assert [limit.take("a") for _ in range(3)] == [True, True, False]
    limit.refund("b")  # a key with its whole burst: nothing to give back
    assert [limit.take("b") for _ in range(3)] == [True, True, False]


def test_a_line_that_could_repeat_per_message_is_said_once_per_window_with_a_count() -> None:
    clock = Clock()
    said = Said[str](burst=2, every=10.0, clock=clock)
    assert [said.unsaid("e") for _ in range(5)] == [0, 0, None, None, None]
    assert said.unsaid("f") == 0  # each kind its own
    clock.now += 10
    assert said.unsaid("e") == 3  # said again, with the three not said
    assert said.unsaid("e") is None
    assert more(3) == " (and 3 more not logged since the last said)" and more(0) == ""
