"""Model implementations over the flattened varlen batch."""
