"""``reservoir bench``: :mod:`.runner` (a run, in order), :mod:`.node_host` (the node-agent
processes it starts) and :mod:`.limits` (what bounds the throughput on this machine).
"""
