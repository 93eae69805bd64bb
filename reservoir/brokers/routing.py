"""Topic routing as a pure lookup, with RabbitMQ topic-exchange semantics.

This module owns the matching rule and the binding table; it knows nothing of endpoints,
threads or time, so the in-process broker and the simulator route exactly alike and the
rule can be tested as a table.

The rule, as RabbitMQ implements it (``rabbit_exchange_type_topic``):

- A routing key and a binding pattern are split on ``.`` into words. The empty string is
  *zero* words; every other string is ``str.split(".")``, so empty words are real words
  (``"a..b"`` is ``a``, ``""``, ``b``).
- ``*`` as a whole word matches exactly one word (which may be empty).
- ``#`` as a whole word matches zero or more words.
- Any other word, including ``a*`` or ``#b``, matches only itself.
"""

from __future__ import annotations

__all__ = ["BindingTable", "split_words", "topic_matches"]

_ONE = "*"
_ANY = "#"


def split_words(key: str) -> tuple[str, ...]:
    """Split a routing key or binding pattern into words; ``""`` is zero words."""
    return () if key == "" else tuple(key.split("."))


def _words_match(pattern: tuple[str, ...], topic: tuple[str, ...]) -> bool:
    # Simulate the pattern as an NFA over the topic's words: ``reachable`` holds every
    # topic position the pattern prefix read so far can have consumed up to. O(P x T),
    # with none of the exponential backtracking a naive ``#`` recursion has on "#.#.#...".
    size = len(topic)
    reachable = {0}
    for word in pattern:
        if word == _ANY:
            reachable = set(range(min(reachable), size + 1))
        elif word == _ONE:
            reachable = {i + 1 for i in reachable if i < size}
        else:
            reachable = {i + 1 for i in reachable if i < size and topic[i] == word}
        if not reachable:
            return False
    return size in reachable


def _is_wildcard(pattern: str) -> bool:
    return any(word in (_ONE, _ANY) for word in split_words(pattern))


def topic_matches(pattern: str, topic: str) -> bool:
    """Whether a publish with routing key ``topic`` reaches a binding with ``pattern``."""
    return _words_match(split_words(pattern), split_words(topic))


class BindingTable:
    """Which endpoints a topic reaches: bindings of ``(endpoint id, pattern)`` and a lookup.

    A pattern without wildcards matches exactly the topic spelled the same, so those are
    looked up by key: binding and unbinding them (nodes do it for every reservation, see
    ``reservoir.protocol.messages.lookup_topic``) costs O(1) and leaves the cache alone.
    Wildcard patterns are scanned once per topic and the answer cached; a change to them
    empties the cache. The cache is per table (kombu keeps its
    compiled patterns in process-global state, which leaks between brokers) and bounded,
    since topics can come from the network. Not thread-safe: the owner holds its own lock.
    """

    def __init__(self, *, max_cached_topics: int = 4096) -> None:
        if max_cached_topics < 0:
            raise ValueError("max_cached_topics must be >= 0")
        self._max_cached = max_cached_topics
        self._by_pattern: dict[str, set[str]] = {}
        self._by_endpoint: dict[str, set[str]] = {}
        #: words of the wildcard patterns only; literal ones are found by key
        self._pattern_words: dict[str, tuple[str, ...]] = {}
        self._cache: dict[str, frozenset[str]] = {}
        #: routing lookups answered from the cache / computed, for tests and metrics
        self.cache_hits = 0
        self.cache_misses = 0

    def bind(self, endpoint_id: str, pattern: str) -> bool:
        """Add a binding. Returns False if it already existed (binding twice is one binding)."""
        endpoints = self._by_pattern.setdefault(pattern, set())
        if endpoint_id in endpoints:
            return False
        endpoints.add(endpoint_id)
        self._by_endpoint.setdefault(endpoint_id, set()).add(pattern)
        if _is_wildcard(pattern):
            self._pattern_words.setdefault(pattern, split_words(pattern))
            self._cache.clear()
        return True

    def unbind(self, endpoint_id: str, pattern: str) -> bool:
        """Remove a binding. Returns False if there was none."""
        endpoints = self._by_pattern.get(pattern)
        if endpoints is None or endpoint_id not in endpoints:
            return False
        endpoints.discard(endpoint_id)
        if not endpoints:
            del self._by_pattern[pattern]
            self._pattern_words.pop(pattern, None)
        patterns = self._by_endpoint[endpoint_id]
        patterns.discard(pattern)
        if not patterns:
            del self._by_endpoint[endpoint_id]
        if _is_wildcard(pattern):
            self._cache.clear()
        return True

    def unbind_all(self, endpoint_id: str) -> int:
        """Remove every binding of one endpoint. Returns how many there were."""
        patterns = list(self._by_endpoint.get(endpoint_id, ()))
        for pattern in patterns:
            self.unbind(endpoint_id, pattern)
        return len(patterns)

    def patterns(self, endpoint_id: str) -> frozenset[str]:
        """The patterns one endpoint is bound with."""
        return frozenset(self._by_endpoint.get(endpoint_id, ()))

    def endpoints(self) -> frozenset[str]:
        """Every endpoint with at least one binding."""
        return frozenset(self._by_endpoint)

    def route(self, topic: str) -> frozenset[str]:
        """The endpoints a publish on ``topic`` reaches: each once, however many of its
        patterns match."""
        literal = self._by_pattern.get(topic) if topic not in self._pattern_words else None
        wildcard = self._cache.get(topic)
        if wildcard is not None:
            self.cache_hits += 1
        else:
            self.cache_misses += 1
            wildcard = self._route_wildcards(topic)
        if not literal:
            return wildcard
        return frozenset(literal) if not wildcard else wildcard | literal

    def _route_wildcards(self, topic: str) -> frozenset[str]:
        words = split_words(topic)
        matched: set[str] = set()
        for pattern, pattern_words in self._pattern_words.items():
            endpoints = self._by_pattern[pattern]
            if not endpoints <= matched and _words_match(pattern_words, words):
                matched |= endpoints
        result = frozenset(matched)
        if self._max_cached:
            if len(self._cache) >= self._max_cached:
                # Evict the oldest entry (dicts keep insertion order): cheap and enough to
                # bound memory against a stream of one-off topics.
                del self._cache[next(iter(self._cache))]
            self._cache[topic] = result
        return result

    def __len__(self) -> int:
        """The number of bindings."""
        return sum(len(endpoints) for endpoints in self._by_pattern.values())

    def __contains__(self, binding: object) -> bool:
        if not isinstance(binding, tuple) or len(binding) != 2:
            return False
        endpoint_id, pattern = binding
        if not isinstance(endpoint_id, str) or not isinstance(pattern, str):
            return False
        return endpoint_id in self._by_pattern.get(pattern, ())
