"""Analysis passes: read the graph, write metadata or reports, never change what it computes."""
