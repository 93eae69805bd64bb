"""Topic matching and the binding table, against RabbitMQ's own topic-exchange cases."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from reservoir.brokers.routing import BindingTable, split_words, topic_matches

# (pattern, topic, matches): the RabbitMQ rule, edge cases first.
CASES = [
    # the empty key is zero words
    ("#", "", True),
    ("", "", True),
    ("*", "", False),
    ("", "a", False),
    ("#.#", "", True),
    ("#.#.#", "", True),
    ("*.#", "", False),
    # '*' is exactly one word, and an empty word is a word
    ("*", "a", True),
    ("*", "a.b", False),
    ("*.10", "a.b.10", False),
    ("*.10", "a.10", True),
    ("a.*", "a.", True),
    ("*.*", ".", True),
    ("a.*.c", "a..c", True),
    ("*", ".", False),
    ("a.*", "a", False),
    # '#' is zero or more words
    ("#", "a", True),
    ("#", "a.b.c", True),
    ("#", ".", True),
    ("tier.#", "tier", True),
    ("tier.#", "tier.10", True),
    ("tier.#", "tier.10.x", True),
    ("tier.#", "tiers", False),
    ("tier.#", "other.tier", False),
    ("#.b", "b", True),
    ("#.b", "a.b", True),
    ("#.b", "a.b.c", False),
    ("a.#.b", "a.b", True),
    ("a.#.b", "a.x.b", True),
    ("a.#.b", "a.x.y.b", True),
    ("a.#.b", "a.x.y", False),
    ("a.#.b", "b.a.b", False),
    ("#.#", "a.b.c", True),
    ("#.*.#", "a", True),
    ("#.*.#", "", False),
    ("#.b.#", "b", True),
    ("#.b.#", "a.b.c", True),
    ("#.b.#", "a.c", False),
    ("*.#.*", "a", False),
    ("*.#.*", "a.b", True),
    # literal words, including wildcard characters that are not whole words
    ("a.b", "a.b", True),
    ("a.b", "a.b.c", False),
    ("a.b", "a", False),
    ("a*", "ab", False),
    ("a*", "a*", True),
    ("#a", "xa", False),
    ("#a", "#a", True),
    ("a", "A", False),
]


@pytest.mark.parametrize(("pattern", "topic", "expected"), CASES)
def test_topic_matches(pattern: str, topic: str, expected: bool) -> None:
    assert topic_matches(pattern, topic) is expected


# RabbitMQ's topic-exchange unit test (rabbit_exchange_type_topic): these bindings, and for
# each routing key the set of them it must reach.
RABBITMQ_BINDINGS = {
    "t1": "a.b.c",
    "t2": "a.*.c",
    "t3": "a.#.b",
    "t4": "a.b.b.c",
    "t5": "#",
    "t6": "#.#",
    "t7": "#.b",
    "t8": "*.*",
    "t9": "a.*",
    "t10": "*.b.c",
    "t11": "a.#",
    "t12": "a.#.#",
    "t13": "b.b.c",
    "t14": "a.b.b",
    "t15": "a.b",
    "t16": "b.c",
    "t17": "",
    "t18": "*.*.*",
    "t19": "vodka.martini",
    "t20": "a.b.c",
    "t21": "*.#",
    "t22": "#.*.#",
    "t23": "*.#.#",
    "t24": "#.#.#",
    "t25": "*",
    "t26": "#.b.#",
}
RABBITMQ_EXPECTED = {
    "a.b.c": "t1 t2 t5 t6 t10 t11 t12 t18 t20 t21 t22 t23 t24 t26",
    "a.b": "t3 t5 t6 t7 t8 t9 t11 t12 t15 t21 t22 t23 t24 t26",
    "a.b.b": "t3 t5 t6 t7 t11 t12 t14 t18 t21 t22 t23 t24 t26",
    "": "t5 t6 t17 t24",
    "b.c.c": "t5 t6 t18 t21 t22 t23 t24 t26",
    "a.a.a.a.a": "t5 t6 t11 t12 t21 t22 t23 t24",
    "vodka.gin": "t5 t6 t8 t21 t22 t23 t24",
    "vodka.martini": "t5 t6 t8 t19 t21 t22 t23 t24",
    "b.b.c": "t5 t6 t10 t13 t18 t21 t22 t23 t24 t26",
    "nothing.here.at.all": "t5 t6 t21 t22 t23 t24",
    "oneword": "t5 t6 t21 t22 t23 t24 t25",
}
RABBITMQ_REMOVED = ("t1", "t5", "t11", "t19", "t21")


def rabbitmq_table() -> BindingTable:
    table = BindingTable()
    for queue, pattern in RABBITMQ_BINDINGS.items():
        table.bind(queue, pattern)
    return table


@pytest.mark.parametrize("topic", list(RABBITMQ_EXPECTED))
def test_binding_table_routes_like_rabbitmq(topic: str) -> None:
    assert rabbitmq_table().route(topic) == frozenset(RABBITMQ_EXPECTED[topic].split())


@pytest.mark.parametrize("topic", list(RABBITMQ_EXPECTED))
def test_binding_table_routes_like_rabbitmq_after_removals(topic: str) -> None:
    table = rabbitmq_table()
    for topic_warm in RABBITMQ_EXPECTED:
        table.route(topic_warm)  # fill the cache so that removal must invalidate it
    for queue in RABBITMQ_REMOVED:
        assert table.unbind(queue, RABBITMQ_BINDINGS[queue])
    expected = frozenset(RABBITMQ_EXPECTED[topic].split()) - set(RABBITMQ_REMOVED)
    assert table.route(topic) == expected


def test_split_words_treats_the_empty_key_as_no_words() -> None:
    assert split_words("") == ()
    assert split_words(".") == ("", "")
    assert split_words("a..b") == ("a", "", "b")
    assert split_words("tier.10") == ("tier", "10")


def test_many_hashes_do_not_backtrack_exponentially() -> None:
    pattern = ".".join(["#"] * 40 + ["x"])
    topic = ".".join(["a"] * 200)
    assert not topic_matches(pattern, topic)
    assert topic_matches(pattern, topic + ".x")


# A reference implementation, written as the plainest possible recursion on words.
def _reference(pattern: list[str], topic: list[str]) -> bool:
    if not pattern:
        return not topic
    head, rest = pattern[0], pattern[1:]
    if head == "#":
        return any(_reference(rest, topic[i:]) for i in range(len(topic) + 1))
    if not topic:
        return False
    return (head == "*" or head == topic[0]) and _reference(rest, topic[1:])


_WORDS = st.sampled_from(["a", "b", "", "*", "#"])


@given(pattern=st.lists(_WORDS, max_size=6), topic=st.lists(_WORDS, max_size=6))
def test_topic_matches_agrees_with_a_plain_recursion(pattern: list[str], topic: list[str]) -> None:
    pattern_key, topic_key = ".".join(pattern), ".".join(topic)
    expected = _reference(list(split_words(pattern_key)), list(split_words(topic_key)))
    assert topic_matches(pattern_key, topic_key) is expected


# -- the table --------------------------------------------------------------------------------


def test_route_reaches_each_endpoint_once_however_many_patterns_match() -> None:
    table = BindingTable()
    for pattern in ("x.y", "x.*", "#"):
        table.bind("node-a", pattern)
    table.bind("node-b", "x.y")
    assert table.route("x.y") == {"node-a", "node-b"}
    assert len(table) == 4


def test_binding_twice_is_one_binding() -> None:
    table = BindingTable()
    assert table.bind("a", "t")
    assert not table.bind("a", "t")
    assert len(table) == 1
    assert ("a", "t") in table


def test_unbind_of_an_unknown_binding_is_a_no_op() -> None:
    table = BindingTable()
    table.bind("a", "t")
    assert not table.unbind("a", "other")
    assert not table.unbind("b", "t")
    assert table.route("t") == {"a"}


def test_unbind_all_removes_only_that_endpoints_bindings() -> None:
    table = BindingTable()
    table.bind("a", "t.#")
    table.bind("a", "u")
    table.bind("b", "t.#")
    assert table.unbind_all("a") == 2
    assert table.patterns("a") == frozenset()
    assert table.endpoints() == {"b"}
    assert table.route("t.1") == {"b"}
    assert table.route("u") == frozenset()


def test_route_is_cached_until_the_bindings_change() -> None:
    table = BindingTable()
    table.bind("a", "tier.#")
    assert table.route("tier.10") == {"a"}
    assert table.route("tier.10") == {"a"}
    assert (table.cache_hits, table.cache_misses) == (1, 1)

    table.bind("b", "tier.*")
    assert table.route("tier.10") == {"a", "b"}
    assert table.cache_misses == 2

    table.unbind("a", "tier.#")
    assert table.route("tier.10") == {"b"}
    assert table.cache_misses == 3


def test_a_binding_that_changes_nothing_keeps_the_cache() -> None:
    table = BindingTable()
    table.bind("a", "t")
    table.route("t")
    table.bind("a", "t")
    table.unbind("a", "never-bound")
    table.route("t")
    assert (table.cache_hits, table.cache_misses) == (1, 1)


def test_cache_is_bounded() -> None:
    table = BindingTable(max_cached_topics=3)
    table.bind("a", "#")
    for i in range(10):
        table.route(f"t.{i}")
    table.route("t.9")
    table.route("t.0")  # evicted long ago
    assert (table.cache_hits, table.cache_misses) == (1, 11)


def test_tables_share_nothing() -> None:
    first, second = BindingTable(), BindingTable()
    first.bind("a", "t")
    first.route("t")
    assert second.route("t") == frozenset()
    assert second.cache_hits == 0
