"""The value machinery every component is built on: descriptors, per-call records, errors, dimension names."""
