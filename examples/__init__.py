"""Examples of using the conformance suite from outside the project (not packaged)."""
