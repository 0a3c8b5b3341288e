"""Transform passes: rewrite the graph and recompile it; each states the contract a test checks."""
