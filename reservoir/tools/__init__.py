"""Tools that exercise reservoir rather than serve it: :mod:`.demo` (a cloud in one
process), :mod:`.bench` (throughput and latency on a broker), :mod:`.chaos` (faults on a
real RabbitMQ) and :mod:`.simulator` (the protocol at 100,000 nodes on a virtual clock).
"""
