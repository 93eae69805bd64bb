"""The live runtime: the protocol's machines driven with a broker, a clock and a store.

What is here runs in a node agent's or a requestor's process: :mod:`.driver` (one machine,
one endpoint, one lock), :mod:`.node_agent` and :mod:`.requestor` (the two participants),
:mod:`.asking`, :mod:`.auditor` and :mod:`.dry_run` (questions asked of every node),
:mod:`.store` (a node's durable allocations), :mod:`.wire` and :mod:`.keys` (bytes and
signatures), :mod:`.settings`, :mod:`.plugins` (filters and weighers by entry point) and
:mod:`.backoff` (waiting for a broker). It imports no front end and no tool.
"""
