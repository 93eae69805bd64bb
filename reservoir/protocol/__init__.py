"""The protocol core: messages, tiers, the node's ledger, and the node and requestor state
machines. Pure: events and the current time in, effects out. Nothing in this package opens
a socket, starts a thread, sleeps, reads a clock or imports a broker library (a test
enforces it), so the live runtime, the in-process broker and the simulator all drive the
very same code.
"""
