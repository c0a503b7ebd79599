"""Shared test helpers, by domain: shards, reading, processes, servers (and fault_server, the loopback HTTP range server)."""
